"""Transient Prefect API errors during the mn worker's own calls never crash a user's run.

A real Prefect server, a real ``mn`` worker process whose PREFECT_API_URL is a loopback proxy (flaky_proxy)
that fails a chosen request of the worker: its Pending proposal, labelling the run, reading the run's flow.
The flow runs themselves talk to the server directly (their job variables name it), so every fault hits a
call the worker makes.
"""

from __future__ import annotations

import subprocess
import uuid

import prefect_env
import pytest
import servers
from flaky_proxy import FlakyProxy
from lab import FLOWS, TERMINAL, RetryingClient

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab

POOL = "mn-flaky"
BARE_POOL = "mn-flaky-bare"
SET_STATE = r"/api/flow_runs/[^/]+/set_state"
PENDING = r'"type":\s*"PENDING"'
NODE = {"name": "flaky-cpu", "cpu_cores": 4, "memory_mb": 8192}


class Env:
    def __init__(self, home):
        self.home = home
        self.out = home / "out"
        self.out.mkdir()
        # A private server, not the test process's shared one: the workers reach it through a proxy that fails
        # their calls, and the tests count what reaches it.
        self.server = prefect_env.PrefectServer(home / "prefect")
        self.proxy = FlakyProxy(self.server.api_url)
        self.http = RetryingClient(base_url=self.server.api_url, timeout=60)
        self.workers = []
        self.deployments = {}

    def pool(self, name: str, node: dict, extra_env: dict | None = None) -> None:
        """A pool with one worker that reaches the server only through the proxy."""
        created = subprocess.run([str(prefect_env.BIN / "prefect"), "work-pool", "create", name, "--type", "mn"],
                                 env=self.server.env, capture_output=True, text=True)
        assert created.returncode == 0, created.stdout[-2000:] + created.stderr[-3000:]
        self.workers.append(prefect_env.start_worker(self.server, name, node, f"sqlite:///{self.home / (name + '.db')}",
                                                     self.home, extra_env=extra_env, api_url=self.proxy.api_url))
        from prefect.flows import Flow
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.server.api_url}):
            flow = Flow.from_source(source=str(FLOWS), entrypoint="probe.py:probe")
            self.deployments[name] = str(flow.deploy(
                name=f"d-{name}", work_pool_name=name, print_next_steps=False,
                job_variables={"resources": {"cpu": 1, "memory_mb": 128},
                               "env": {"PREFECT_API_URL": self.server.api_url}}))
        servers.wait_for(lambda: (name, "POST") in self._polled(), timeout=90, what=f"the {name} worker to poll")

    def _polled(self) -> set:
        return {(path.split("/")[3], method) for method, path in list(self.proxy.seen)
                if path.startswith("/api/work_pools/") and path.endswith("/get_scheduled_flow_runs")}

    def run(self, pool: str) -> str:
        response = self.http.post(f"/deployments/{self.deployments[pool]}/create_flow_run",
                                  json={"parameters": {"out_dir": str(self.out)}, "idempotency_key": uuid.uuid4().hex})
        response.raise_for_status()
        return response.json()["id"]

    def wait(self, run_id: str) -> dict:
        return servers.wait_for(lambda: (r := self.http.get(f"/flow_runs/{run_id}").json())["state"]["type"] in TERMINAL
                                and r, timeout=180, interval=0.5, what=f"run {run_id} to end")

    def states(self, run_id: str) -> list[str]:
        return [s["name"] for s in self.http.get("/flow_run_states/", params={"flow_run_id": run_id}).json()]

    def stop(self) -> None:
        prefect_env.stop_processes(self.workers, timeout=15)  # all at once, a second SIGINT for an idle one
        self.proxy.stop()
        self.server.stop()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    env = Env(tmp_path_factory.mktemp("flaky"))
    try:
        env.pool(POOL, NODE)
        yield env
    finally:
        env.stop()


@pytest.fixture
def proxy(env):
    yield env.proxy
    env.proxy.faults.clear()


# Prefect's client retries 503 (and a reset connection) itself, not 504: both layers are covered.
@pytest.mark.parametrize("method, path, status, times, body", [
    pytest.param("POST", SET_STATE, 503, 1, PENDING, id="pending-proposal-503-once"),
    pytest.param("POST", SET_STATE, 504, 2, PENDING, id="pending-proposal-504-twice"),
    pytest.param("PATCH", r"/api/flow_runs/[^/]+/labels", 504, 2, None, id="labels-504-twice"),
    pytest.param("GET", r"/api/flows/[^/]+", 504, 1, None, id="read-flow-504"),
])
def test_a_transient_api_error_of_the_worker_is_retried_and_the_run_completes(env, proxy, method, path, status,
                                                                            times, body):
    fault = proxy.fail(method, path, status=status, times=times, body=body)

    run_id = env.run(POOL)
    run = env.wait(run_id)

    assert len(fault.hits) == times, (fault.hits, [s for s in proxy.seen if s[0] == method][-20:])
    assert all(run_id in hit for hit in fault.hits) or path.startswith(r"/api/flows/"), fault.hits
    assert run["state"]["type"] == "COMPLETED", run["state"]
    states = env.states(run_id)
    assert "Crashed" not in states and states.count("Pending") == 1, states  # the retried Pending applied once
    assert (env.out / f"{run_id}.json").exists()  # the flow itself ran, once


def test_an_artifact_whose_answer_is_lost_is_not_created_twice(env, proxy):
    """The server writes the placement artifact but the worker hears 503: Prefect's client alone would send it
    again (a second artifact); the worker reads before it resends."""
    fault = proxy.fail("POST", r"/api/artifacts/?", status=503, delivered=True)

    run_id = env.run(POOL)
    run = env.wait(run_id)

    assert len(fault.hits) == 1, fault.hits
    assert run["state"]["type"] == "COMPLETED", run["state"]
    artifacts = env.http.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run_id]}}}).json()
    assert [a["key"] for a in artifacts] == ["placement"], artifacts


def test_without_the_workers_retries_the_same_fault_crashes_the_run(env, proxy):
    """The control: the fault above is one that matters (the base worker marks the run Crashed)."""
    env.pool(BARE_POOL, {**NODE, "name": "flaky-bare"}, extra_env={"MN_API_ATTEMPTS": "1"})
    fault = proxy.fail("GET", r"/api/flows/[^/]+", status=504)

    run = env.wait(env.run(BARE_POOL))

    assert len(fault.hits) == 1
    assert run["state"]["type"] == "CRASHED" and "504" in run["state"]["message"], run["state"]
