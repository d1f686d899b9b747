"""``mn-prefect plan`` for what Prefect users have: a bare resource request, a deployment's job variables, or a
blueprint; against a nodes file or the live store. The console script's entry point (tests/cli_runner.py; a real
subprocess where a Prefect server is named), a real SQLite store, a real Prefect server."""

import json
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
from builders import gpu, node
from lab import RetryingClient
from prefect_env import PrefectServer
from test_cli import NODES, bp, run, write

from mn_prefect.local_lab import BIN
from mn_prefect.model.placement import Placement
from mn_prefect.store import open_store


@pytest.fixture
def nodes(tmp_path):
    return write(tmp_path, "nodes.json", NODES)


def test_a_bare_request_is_planned_as_one_run(nodes):
    result = run("plan", "--request", '{"gpu": 1, "memory_gb": 2}', "--nodes", nodes)
    doc = json.loads(result.stdout)
    assert result.returncode == 0 and doc["status"] == "runnable_now"
    [placement] = doc["placements"]
    assert placement["node"] == "gpu-a" and placement["resources"]["memory_mb"] == 2048
    assert [d["id"] for d in placement["allocation"]["devices"]] == ["GPU-a0"]
    assert doc["agents"]["request"]["cpu-a"].startswith("insufficient gpu")


def test_a_request_can_come_from_a_file(tmp_path, nodes):
    request = write(tmp_path, "request.json", {"devices": [{"kind": "gpu", "min_memory_mb": 20000}]})
    doc = json.loads(run("plan", "--request", f"@{request}", "--nodes", nodes).stdout)
    assert [d["id"] for d in doc["placements"][0]["allocation"]["devices"]] == ["GPU-a1"]


def test_a_request_that_cannot_fit_yet_exits_1_with_each_nodes_reason(nodes):
    result = run("plan", "--request", '{"gpu": 3}', "--nodes", nodes, "--table")
    assert result.returncode == 1 and "not_runnable" in result.stdout
    assert "insufficient gpu: asks 3, 2 of 2 free" in result.stdout


@pytest.mark.parametrize("request_json, path", [('{"cpu": "lots"}', "--request.cpu"),
                                                ('{"memory_mb": "x"}', "--request.memory_mb")])
def test_a_word_where_a_number_belongs_is_refused_naming_the_path(nodes, request_json, path):
    result = run("plan", "--request", request_json, "--nodes", nodes)
    doc = json.loads(result.stdout)
    assert result.returncode == 2 and doc["status"] == "invalid"
    [error] = doc["errors"]
    assert error["path"] == path and error["message"].startswith("must be a number")
    table = run("plan", "--request", request_json, "--nodes", nodes, "--table")
    assert table.returncode == 2 and path in table.stdout and "must be a number" in table.stdout


def test_malformed_request_json_is_an_input_error(nodes):
    result = run("plan", "--request", '{"gpu": ', "--nodes", nodes)
    assert result.returncode == 2 and json.loads(result.stdout)["errors"][0]["path"] == "--request"


@pytest.mark.parametrize("sources", [[], ["FILE", "--request"], ["--request", "--deployment"]])
def test_plan_needs_exactly_one_of_file_request_or_deployment(tmp_path, nodes, sources):
    args = {"FILE": [write(tmp_path, "b.json", bp({}))], "--request": ["--request", "{}"],
            "--deployment": ["--deployment", "f/d"]}
    result = run("plan", *[a for s in sources for a in args[s]], "--nodes", nodes)
    message = " ".join(result.stderr.replace("│", " ").split())  # unwrapped from the error panel
    assert result.returncode == 2 and "give exactly one of FILE, --request or --deployment" in message
    assert f"got {' and '.join(sources) or 'none'}" in message and "Traceback" not in result.stderr


def test_without_nodes_the_plan_is_made_against_the_store(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    store.register_node(node("cpu-1"))
    store.register_node(node("gpu-1", devices=[gpu("GPU-1a", 0), gpu("GPU-1b", 1)]))
    held = Placement.model_validate({"agent_id": "other", "node": "gpu-1", "resources": {"gpu_count": 1},
                                     "allocation": {"devices": [gpu("GPU-1a", 0)]}})
    assert store.commit_plan("other-run", [held]).ok
    doc = json.loads(run("plan", "--request", '{"gpu": 1}', "--store-url", url).stdout)
    assert doc["status"] == "runnable_now"
    assert doc["placements"][0]["node"] == "gpu-1" and doc["placements"][0]["allocation"]["devices"][0]["id"] == "GPU-1b"
    full = run("plan", "--request", '{"gpu": 2}', "--store-url", url)
    assert full.returncode == 1 and json.loads(full.stdout)["status"] == "runnable_later"


def test_a_blueprint_is_planned_against_the_store_too(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    open_store(url).register_node(node("cpu-1", cpu=4))
    doc = json.loads(run("plan", write(tmp_path, "b.json", bp({"cpu": 2})), "--store-url", url).stdout)
    assert doc["status"] == "runnable_now" and doc["placements"][0]["node"] == "cpu-1"


# -- a deployment's job variables, read from a real Prefect server ------------------------------------------

POOL = f"mn-plan-{uuid.uuid4().hex[:6]}"  # a pool of this module's own on the shared server


@pytest.fixture(scope="module")
def prefect(prefect_server):
    """The test process's shared Prefect server, with this module's pool."""
    subprocess.run([str(BIN / "prefect"), "work-pool", "create", POOL, "--type", "mn"], env=prefect_server.env,
                   check=True, capture_output=True, timeout=120)
    yield prefect_server
    httpx.delete(f"{prefect_server.api_url}/work_pools/{POOL}", timeout=30)


def deploy(server: PrefectServer, name: str, job_variables: dict) -> None:
    with RetryingClient(base_url=server.api_url, timeout=30) as http:  # a busy shared server may answer 503
        flow = http.post("/flows/", json={"name": "probe"})
        flow.raise_for_status()
        response = http.post("/deployments/", json={"name": name, "flow_id": flow.json()["id"],
                                                     "work_pool_name": POOL, "job_variables": job_variables})
        response.raise_for_status()


@pytest.mark.lab
def test_a_deployment_is_planned_with_its_job_variables(prefect, nodes):
    deploy(prefect, "big-gpu", {"resources": {"devices": [{"kind": "gpu", "min_memory_mb": 20000}], "memory_gb": 4},
                                "strategy": "spread", "constraints": ["cuda"]})
    result = run("plan", "--deployment", "probe/big-gpu", "--nodes", nodes, env=prefect.env)
    doc = json.loads(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    [placement] = doc["placements"]
    assert placement["agent_id"] == "probe/big-gpu" and placement["resources"]["memory_mb"] == 4096
    assert [d["id"] for d in placement["allocation"]["devices"]] == ["GPU-a1"]
    assert doc["strategy"] == "spread" and doc["agents"]["probe/big-gpu"]["cpu-a"].startswith("constraint not met")


def declared_deployment(monkeypatch, **runtime):
    """``--deployment`` answered in-process with a deployment whose job variables carry ``runtime``."""
    async def variables(name):
        return {"resources": {"gpu": 1}, "constraints": [], "preferred_node": None, "strategy": "binpack",
                "pool": None, **runtime}

    monkeypatch.setattr("mn_prefect.cli.inputs._deployment_variables", variables)


def test_a_deployment_that_declares_its_runtime_is_planned_with_an_estimate(monkeypatch, nodes):
    declared_deployment(monkeypatch, max_runtime_seconds=7200, max_runtime_is_limit=True)
    doc = json.loads(run("plan", "--deployment", "probe/declared", "--nodes", nodes).stdout)
    assert doc["estimate"] == {"seconds": 7200.0, "source": "declared", "samples": 0, "is_limit": True}


def test_the_plan_table_says_the_estimate_in_words(monkeypatch, nodes):
    declared_deployment(monkeypatch, max_runtime_seconds=7200)
    result = run("plan", "--deployment", "probe/declared", "--nodes", nodes, "--table")
    assert "runtime estimate: declared 2 h" in result.stdout


def test_a_deployment_that_declares_no_runtime_has_no_estimate_in_its_plan(monkeypatch, nodes):
    declared_deployment(monkeypatch)
    assert "estimate" not in json.loads(run("plan", "--deployment", "probe/plain", "--nodes", nodes).stdout)


def test_a_bad_declared_runtime_is_an_input_error_naming_the_field(monkeypatch, nodes):
    declared_deployment(monkeypatch, max_runtime_seconds=-5)
    result = run("plan", "--deployment", "probe/bad", "--nodes", nodes)
    [error] = json.loads(result.stdout)["errors"]
    assert result.returncode == 2 and error["path"] == "job_variables.max_runtime_seconds"


@pytest.mark.lab
def test_an_unknown_deployment_is_an_input_error_naming_it(prefect, nodes):
    result = run("plan", "--deployment", "probe/nope", "--nodes", nodes, env=prefect.env)
    [error] = json.loads(result.stdout)["errors"]
    assert result.returncode == 2 and error["path"] == "--deployment" and "probe/nope" in error["message"]


def test_limits_take_per_node_overrides(tmp_path):
    two = write(tmp_path, "two.json", [node("node-a", cpu=8).model_dump(), node("node-b", cpu=8).model_dump()])
    ask = '{"cpu_cores": 6}'
    capped = json.loads(run("plan", "--request", ask, "--nodes", two, "--limits", "cpu=50").stdout)
    assert capped["status"] == "not_runnable" and "asks 6 cores, 4 of 4 free" in capped["agents"]["request"]["node-a"]
    result = run("plan", "--request", ask, "--nodes", two, "--limits", "cpu=50,gpu=50", "--limits", "node-b:cpu=100")
    doc = json.loads(result.stdout)
    assert result.returncode == 0 and doc["placements"][0]["node"] == "node-b"
    bad = run("plan", "--request", ask, "--nodes", two, "--limits", "node-b:cpu=200")
    errors = json.loads(bad.stdout)["errors"]
    assert bad.returncode == 2 and errors == [{"path": "--limits.node-b.cpu", "message": "must be between 1 and 100, got 200"}]
    bad = run("plan", "--request", ask, "--nodes", two, "--limits", ":cpu=20")
    assert bad.returncode == 2 and "names its node before ':'" in bad.stdout + bad.stderr


def test_a_fraction_and_slices_plan_against_the_mig_example_fleet(tmp_path):
    fleet = str(Path(__file__).resolve().parents[1] / "deployments" / "mock-nodes-mig.json")
    doc = json.loads(run("plan", "--nodes", fleet, "--request",
                         '{"devices": [{"kind": "gpu", "mig_profile": "1g.10gb", "count": 3}]}').stdout)
    devices = doc["placements"][0]["allocation"]["devices"]
    assert doc["status"] == "runnable_now" and len({d["parent"] for d in devices}) == 1 and len(devices) == 3
    doc = json.loads(run("plan", "--nodes", fleet, "--request",
                         '{"devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": 12000}]}').stdout)
    assert doc["placements"][0]["allocation"]["shares"][0]["memory_mb"] == 12000
    bad = run("plan", "--nodes", fleet, "--request", '{"devices": [{"kind": "gpu", "shares": 2}]}')
    assert bad.returncode == 2 and "devices[0].shares" in bad.stdout + bad.stderr
