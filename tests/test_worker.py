"""The mn worker type against a real Prefect server, with three real worker processes (mock inventories)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import prefect_env
import pytest
import servers
from builders import gpu
from lab import FLOWS, ROOT, Lab

from mn_prefect.store import open_store


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("lab"), pools_with_prefect_command=True)
    yield lab
    lab.stop()


@pytest.mark.lab
def test_the_pool_is_of_type_mn_with_typed_variables(lab):
    """The pool made by `prefect work-pool create --type mn` (this module's lab) has the mn template."""
    pool = lab.http.get(f"/work_pools/{lab.pool}").json()
    assert pool["type"] == "mn"
    variables = pool["base_job_template"]["variables"]
    assert {"resources", "strategy", "constraints", "preferred_node", "job_type", "recovery_mode", "command", "env",
            "working_dir", "stream_output"} <= set(variables["properties"])
    resources = variables["definitions"]["Resources"]
    assert resources["unevaluatedProperties"] is False and "devices" in resources["properties"]
    assert resources["properties"]["devices"]["items"]["properties"]["min_memory_mb"]["title"]


@pytest.mark.lab
def test_a_gpu_run_lands_where_the_matching_gpu_is_and_sees_its_hints(lab):
    deployment = lab.deploy({"resources": {"cpu": 2, "memory_gb": 4, "devices": [
        {"kind": "gpu", "driver": "cuda", "min_memory_mb": 30000, "capabilities": ["bf16"]}],
        "ports": [{"label": "web-ui"}], "volumes": [{"name": "scratch", "source": str(lab.scratch), "target": "/scratch"}]},
        "env": {"MY_SETTING": "kept", "CUDA_VISIBLE_DEVICES": "1,2"}})
    run_id = lab.run(deployment)
    run = lab.wait(run_id)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    env = lab.record(run_id)["env"]
    assert env["MN_NODE"] == "gpu-2" and env["MN_ALLOCATED_DEVICE_IDS"] == "GPU-2a"
    assert "MN_STORE_URL" not in env  # the worker's store stays with the worker (mn_prefect/credentials.py)
    assert env["MN_GPU_DRIVER"] == "cuda" and env["MY_SETTING"] == "kept"
    assert env["CUDA_VISIBLE_DEVICES"] == "0"  # the booked GPU only: the deployment's "1,2" would show others
    assert 22000 <= int(env["MN_PORT_WEB_UI"]) <= 22999
    assert env["MN_VOLUME_SCRATCH"] == str(lab.scratch) and env["MN_VOLUME_SCRATCH_TARGET"] == "/scratch"
    allocation = json.loads(env["MN_ALLOCATION_JSON"])
    assert allocation["devices"][0]["memory_total_mb"] == 40960 and allocation["job_id"] == run_id
    # Visible on the run: the Pending state's message, the placement artifact, events; released afterwards.
    states = lab.http.get("/flow_run_states/", params={"flow_run_id": run_id}).json()
    pending = next(s for s in states if s["type"] == "PENDING")
    assert pending["message"] == "mn: placed on gpu-2; devices GPU-2a; ports web-ui=" + env["MN_PORT_WEB_UI"] + "; volumes scratch"
    artifacts = lab.http.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run_id]}}}).json()
    assert any(a["key"] == "placement" and a["type"] == "table" for a in artifacts)
    servers.wait_for(lambda: not lab.booked(run_id), what="release")
    released = servers.wait_for(lambda: _events(lab, run_id, "mn.placement.released"), timeout=30, interval=0.5, what="events")
    committed = _events(lab, run_id, "mn.placement.created")
    assert not _events(lab, run_id, "mn.placement.committed")  # one event per placement, not two
    # Said once each, about the node that held the run.
    assert [e["resource"]["prefect.resource.id"] for e in committed] == ["mn.node.gpu-2"], committed
    assert [e["resource"]["prefect.resource.id"] for e in released] == ["mn.node.gpu-2"], released


def _events(lab: Lab, run_id: str, prefix: str) -> list:
    body = {"filter": {"related": {"id": [f"prefect.flow-run.{run_id}"]}, "event": {"prefix": [prefix]},
                       "occurred": {"since": lab.since}}, "limit": 50}
    return lab.http.post("/events/filter", json=body).json().get("events", [])


@pytest.mark.lab
def test_cpu_work_goes_to_the_cpu_node(lab):
    run_id = lab.run(lab.deploy({"resources": {"cpu": 1, "memory_mb": 256}}))
    assert lab.wait(run_id)["state"]["type"] == "COMPLETED"
    assert lab.record(run_id)["env"]["MN_NODE"] == "cpu-1"


@pytest.mark.lab
def test_concurrent_gpu_runs_beyond_the_gpus_never_share_a_device_or_port(lab):
    """Eight runs of one GPU each on a fleet of three GPUs: three waves, each on distinct GPUs and ports."""
    deployment = lab.deploy({"resources": {"gpu": 1, "cpu": 1, "ports": [{"label": "api"}]}})
    barrier = lab.out / "concurrent.barrier"
    runs = [lab.run(deployment, seconds=0.5, hold_until=str(barrier)) for _ in range(8)]
    # The fleet has three GPUs: three runs start and hold at the barrier, the other five must wait.

    servers.wait_for(lambda: len(lab.started(runs)) >= 3, timeout=400, what="three runs holding the three GPUs")
    lab.told_to_wait([r for r in runs if r not in lab.started(runs)])
    assert len(lab.started(runs)) == 3, "a fourth GPU run started while all three GPUs were held"
    barrier.write_text("go")
    for run_id in runs:
        assert lab.wait(run_id, timeout=400)["state"]["type"] == "COMPLETED"
    records = [lab.record(r) for r in runs]  # what each flow itself saw in its environment
    assert len({r["env"]["MN_NODE"] for r in records}) == 2  # both GPU nodes worked
    same_node_overlaps = 0
    for i, a in enumerate(records):
        for b in records[i + 1:]:
            if a["end"] <= b["start"] or b["end"] <= a["start"]:
                continue  # not running at the same time
            if a["env"]["MN_NODE"] != b["env"]["MN_NODE"]:
                continue
            same_node_overlaps += 1
            assert a["env"]["MN_ALLOCATED_DEVICE_IDS"] != b["env"]["MN_ALLOCATED_DEVICE_IDS"]
            assert a["env"]["CUDA_VISIBLE_DEVICES"] != b["env"]["CUDA_VISIBLE_DEVICES"]
            assert a["env"]["MN_PORT_API"] != b["env"]["MN_PORT_API"]
    assert same_node_overlaps > 0  # the two runs held on gpu-1's two GPUs overlapped by construction
    servers.wait_for(lambda: all(not lab.booked(r) for r in runs), what="all released")


def _started(lab: Lab, run_id: str) -> dict:
    path = lab.out / f"{run_id}.started"
    return json.loads(servers.wait_for(lambda: path.exists() and path.read_text(), timeout=120, what="the flow to start"))


@pytest.mark.lab
def test_a_killed_flow_process_releases_its_booking(lab):
    run_id = lab.run(lab.deploy({"resources": {"devices": [{"ids": ["GPU-1a"]}]}}), seconds=120)
    started = _started(lab, run_id)
    assert [p.device_ids for p in lab.booked(run_id)] == [["GPU-1a"]]
    os.kill(started["pid"], signal.SIGKILL)
    assert lab.wait(run_id)["state"]["type"] == "CRASHED"
    servers.wait_for(lambda: not lab.booked(run_id), what="release after a crash")


@pytest.mark.lab
def test_cancelling_a_running_run_stops_it_and_releases(lab):
    run_id = lab.run(lab.deploy({"resources": {"devices": [{"ids": ["GPU-1b"]}]}}), seconds=120)
    started = _started(lab, run_id)
    response = lab.http.post(f"/flow_runs/{run_id}/set_state",
                             json={"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True})
    response.raise_for_status()
    assert lab.wait(run_id, timeout=90)["state"]["type"] == "CANCELLED"
    servers.wait_for(lambda: not servers._alive(started["pid"]), what="the flow process to stop")
    servers.wait_for(lambda: not lab.booked(run_id), what="release after cancellation")


@pytest.mark.parametrize("resources", [{"cpu": "lots"}, {"min_memroy_mb": 1}, {"ports": [{"label": "a", "port": 70000}]},
                                       {"devices": [{"count": 0}]}, {"volumes": [{"name": "v", "source": "relative"}]}])
@pytest.mark.lab
def test_the_server_rejects_invalid_resources(lab, resources):
    from prefect.flows import Flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deployment = lab.deploy({"resources": {"cpu": 1}})
    response = lab.http.post(f"/deployments/{deployment}/create_flow_run",
                             json={"parameters": {"out_dir": "x"}, "job_variables": {"resources": resources}})
    assert response.status_code == 422, response.text
    with temporary_settings({PREFECT_API_URL: lab.server.api_url}):
        flow = Flow.from_source(source=str(FLOWS), entrypoint="probe.py:probe")
        with pytest.raises(Exception, match="422|Unprocessable|Validation"):
            flow.deploy(name="bad", work_pool_name=lab.pool, job_variables={"resources": resources}, print_next_steps=False)


@pytest.mark.lab
def test_prefect_deploy_of_the_project_yaml(lab, tmp_path):
    env = {**lab.server.env}
    # The project file as it is, but for its pool: the lab's own (mn-lab-<module>-<hex>) on the shared server.
    project = (ROOT / "deployments" / "prefect.yaml").read_text()
    assert project.count("\n      name: mn-lab\n") >= 3
    prefect_file = tmp_path / "prefect.yaml"
    prefect_file.write_text(project.replace("\n      name: mn-lab\n", f"\n      name: {lab.pool}\n"))
    result = subprocess.run([str(prefect_env.BIN / "prefect"), "--no-prompt", "deploy", "--all", "--prefect-file",
                             str(prefect_file)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    deployments = lab.http.post("/deployments/filter", json={"work_pools": {"name": {"any_": [lab.pool]}}}).json()
    names = {d["name"] for d in deployments}
    assert {"cuda-inference", "http-service", "scratch-writer"} <= names
    service = next(d for d in deployments if d["name"] == "http-service")
    assert service["job_variables"]["resources"]["ports"][0]["label"] == "http"
    run_id = lab.http.post(f"/deployments/{service['id']}/create_flow_run", json={}).json()["id"]
    assert lab.wait(run_id, timeout=120)["state"]["type"] == "COMPLETED"


def test_the_worker_runs_on_a_redis_store_too(lab, redis_server, tmp_path):
    url = f"redis://:{redis_server.password}@127.0.0.1:{redis_server.port}/0?prefix=worker{os.getpid()}:"
    pool = lab.new_pool("mn-redis")
    node = {"name": "redis-gpu", "cpu_cores": 4, "memory_mb": 8192, "devices": [gpu("R0", 0)]}
    worker = prefect_env.start_worker(lab.server, pool, node, url, tmp_path)
    try:
        store = open_store(url)
        servers.wait_for(lambda: store.list_nodes(), timeout=90, what="the redis worker to register")
        from prefect.flows import Flow
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: lab.server.api_url}):
            deployment = Flow.from_source(source=str(FLOWS), entrypoint="probe.py:probe").deploy(
                name="on-redis", work_pool_name=pool, job_variables={"resources": {"gpu": 1}}, print_next_steps=False)
        run_id = lab.run(str(deployment))
        assert lab.wait(run_id)["state"]["type"] == "COMPLETED"
        env = lab.record(run_id)["env"]
        assert env["MN_ALLOCATED_DEVICE_IDS"] == "R0"
        # The worker's store URL, its password in it, stays with the worker: a user's run cannot write the store.
        assert "MN_STORE_URL" not in env and not [k for k, v in env.items() if redis_server.password in v]
        assert store.history(run_id)[0].placements[0].node == "redis-gpu"
        servers.wait_for(lambda: not store.active_placements(job_id=run_id), what="release on redis")
    finally:
        prefect_env.stop_processes([worker])  # an idle worker may ignore the first SIGINT: a second follows
