"""The workers' secrets stay with the workers (mn_prefect/credentials.py): a user's flow run, host process or
container, gets neither the store's URL (its password in it) nor the API token, though the worker's own environment
has both; mn-prefect's own flows get the worker's store. Through real workers: test_worker.py (a Redis store's
password in no run's environment) and test_docker_driver.py (a container's)."""

from __future__ import annotations

import logging
import uuid
from types import SimpleNamespace

import anyio
import pytest
from prefect.client.schemas.objects import FlowRun
from prefect.client.schemas.responses import DeploymentResponse

from mn_prefect.bundles.flows import BUNDLE_ENTRYPOINT, STEP_ENTRYPOINT
from mn_prefect.credentials import GRPC_TOKEN_VAR, OWN_FLOWS, is_own_flow
from mn_prefect.jobs.command import agent_environment
from mn_prefect.jobs.deploy import AGENT_ENTRYPOINT, JOB_ENTRYPOINT
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Allocation, PlacedResources, Placement
from mn_prefect.ops.flows import DRAIN_ENTRYPOINT, RECONCILE_ENTRYPOINT
from mn_prefect.worker.launching import Launching, run_environment
from mn_prefect.worker.variables import MNJobConfiguration

SECRET_URL = "redis://:s3cret-password@10.0.0.5:6379/0"
STORE_ENV = {"MN_STORE_URL": SECRET_URL}
PLACEMENT = Placement(agent_id="a", node="n1", resources=PlacedResources(cpu_cores=1), allocation=Allocation())


@pytest.fixture(autouse=True)
def _worker_environment(monkeypatch):
    """The worker's own environment, as a lab's worker has it: the store's URL and the API token."""
    monkeypatch.setenv("MN_STORE_URL", SECRET_URL)
    monkeypatch.setenv(GRPC_TOKEN_VAR, "api-token-1")


def prepared(entrypoint: str | None, env: dict | None = None) -> MNJobConfiguration:
    configuration = MNJobConfiguration.model_validate({"env": env or {}})
    deployment = None if entrypoint is None else DeploymentResponse(id=uuid.uuid4(), name="d", flow_id=uuid.uuid4(),
                                                                    entrypoint=entrypoint)
    configuration.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="run"), deployment)
    return configuration


def test_the_own_flows_are_exactly_the_entrypoints_mn_prefect_deploys_and_not_an_agents():
    assert OWN_FLOWS == {BUNDLE_ENTRYPOINT, STEP_ENTRYPOINT, JOB_ENTRYPOINT, RECONCILE_ENTRYPOINT, DRAIN_ENTRYPOINT}
    assert not is_own_flow(AGENT_ENTRYPOINT)  # a blueprint agent runs the blueprint's command


@pytest.mark.parametrize("entrypoint", [
    "flows/train.py:train",
    "mn_prefect/ops/flows.py:reconcile_cluster",  # a file of that name in someone's repository is theirs
    "flows/ops.py:reconcile_cluster",
    AGENT_ENTRYPOINT,
    None,  # a run with no deployment
])
def test_a_user_runs_host_environment_has_no_secret_of_the_workers(entrypoint):
    configuration = prepared(entrypoint)
    assert configuration.env["MN_STORE_URL"] == SECRET_URL  # Prefect's process worker hands on its own environment
    env = run_environment(configuration, PLACEMENT, STORE_ENV)
    # None: Prefect's launch leaves the name out of what the process inherits from the worker's own environment
    assert env["MN_STORE_URL"] is None and env[GRPC_TOKEN_VAR] is None
    assert not [name for name, value in env.items() if value and "s3cret" in value]
    assert env["MN_NODE"] == "n1" and env["MN_ALLOCATION_JSON"]  # what the run needs to know stays


@pytest.mark.parametrize("entrypoint", sorted(OWN_FLOWS) + ["mn_prefect.ops.flows:reconcile_cluster"])
def test_mn_prefects_own_flows_get_the_workers_store(entrypoint):
    env = run_environment(prepared(entrypoint), PLACEMENT, {"MN_STORE_URL": "sqlite:///worker.db"})
    assert env["MN_STORE_URL"] == "sqlite:///worker.db"  # the worker's store, even one it read from a block


def test_a_user_run_keeps_a_store_url_its_own_deployment_sets():
    env = run_environment(prepared("flows/mine.py:mine", {"MN_STORE_URL": "sqlite:///mine.db"}), PLACEMENT, STORE_ENV)
    assert env["MN_STORE_URL"] == "sqlite:///mine.db" and env[GRPC_TOKEN_VAR] is None


class _Recording:
    name = "docker"

    def __init__(self):
        self.launches = []

    async def launch(self, launch, task_status):
        self.launches.append(launch)
        return "ended"


def launched_env(entrypoint: str) -> dict:
    launcher = _Recording()
    logger = logging.getLogger("test")
    launching = Launching(launchers={"docker": launcher}, store_env=STORE_ENV,
                          node=lambda: NodeRecord(name="n1", cpu_cores=4, memory_mb=4096),
                          client=lambda: None, work_pool=lambda: None, logger=logger, run_logger=lambda run: logger)
    configuration = prepared(entrypoint)
    placement = PLACEMENT.model_copy(update={"allocation": Allocation(runtime_driver="docker")})
    run = SimpleNamespace(id=uuid.uuid4(), name="brave-fox")
    anyio.run(lambda: launching.launch(run, configuration, placement, None, run_process=None))
    [launch] = launcher.launches
    return launch.run_env


def test_a_user_runs_container_gets_no_secret_and_an_own_flows_gets_the_store():
    user = launched_env("flows/train.py:train")
    assert "MN_STORE_URL" not in user and GRPC_TOKEN_VAR not in user
    assert not [name for name, value in user.items() if value and "s3cret" in value]
    assert launched_env(JOB_ENTRYPOINT)["MN_STORE_URL"] == SECRET_URL


def test_pass_env_never_copies_a_workers_secret_into_an_agents_command():
    env = agent_environment({"MN_STORE_URL": SECRET_URL, GRPC_TOKEN_VAR: "t", "HOME": "/root"},
                            ["MN_STORE_URL", GRPC_TOKEN_VAR, "HOME"], {})
    assert env == {"HOME": "/root"}
