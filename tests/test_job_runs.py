"""Blueprint jobs end to end: a real Prefect server, three real ``mn`` workers (mock inventories), a real
SQLite store; agents are small Python commands that record what they were given."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import prefect_env
import pytest
import servers
from lab import Lab

from mn_prefect.model.bookings import StepAttempt
from mn_prefect.model.placement import Allocation, PlacedResources, Placement
from mn_prefect.placement.job_state import load_job

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab

PROBE = str(Path(__file__).parent / "flows" / "agent_probe.py")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("joblab"))
    yield lab
    lab.stop()


def agent(name: str, out: Path, *args: str, resources: dict | None = None, **extra) -> dict:
    return {"node_id": name, "agent_type": "executor",
            "config": {"command": [sys.executable, PROBE, str(out), *args], **extra.pop("config", {})},
            "resources": resources or {"cpu_cores": 0.5, "memory_mb": 64}, **extra}


def blueprint(out: Path, agents: list[dict], **top) -> dict:
    return {"job_name": f"t-{uuid.uuid4().hex[:6]}", "nodes": agents, **top}


def start(lab: Lab, raw: dict) -> tuple[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from mn_prefect.jobs.deploy import compile_blueprint, start_job

    with temporary_settings({PREFECT_API_URL: lab.server.api_url}):
        with get_client(sync_client=True) as client:
            job_id, run = start_job(client, compile_blueprint(raw), lab.pool)
    return job_id, str(run.id)


def job(lab: Lab, job_id: str):
    return load_job(lab.store, job_id)


def wait_job(lab: Lab, job_id: str, check, what: str, timeout: float = 120):
    try:
        return servers.wait_for(lambda: (j := job(lab, job_id)) is not None and check(j) and j, timeout=timeout,
                                interval=0.5, what=what)
    except TimeoutError as error:  # say where the job stood, so that a failure here can be told apart
        state = job(lab, job_id)
        seen = state.model_dump(mode="json") if state is not None else None
        bookings = [(b.job_id, b.node, b.key) for b in lab.store.bookings()]
        events = [(e.kind, e.reason) for e in lab.store.events(job_id=job_id, limit=20)]
        raise AssertionError(f"{error}\njob: {json.dumps(seen, default=str)[:4000]}\nbookings: {bookings}\n"
                             f"events: {events}") from None


def records(out: Path, agent_id: str) -> list[dict]:
    found = sorted(out.glob(f"{agent_id}.*.json"), key=lambda p: int(p.stem.rsplit(".", 1)[1]))
    return [json.loads(p.read_text()) for p in found]


def cancel(lab: Lab, run_id: str) -> None:
    response = lab.http.post(f"/flow_runs/{run_id}/set_state",
                             json={"state": {"type": "CANCELLING", "message": "test cancels the job"}, "force": True})
    response.raise_for_status()


def held(lab: Lab, job_id: str) -> list[Placement]:
    return [p for p in lab.store.active_placements() if p.job_id and p.job_id.split("@")[0] == job_id]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose.
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


@pytest.fixture
def out(tmp_path):
    return tmp_path


def test_a_three_agent_batch_job_completes_and_each_agent_sees_its_own_hints(lab, out):
    raw = blueprint(out, [
        agent("api", out, resources={"cpu_cores": 1, "memory_mb": 128, "ports": [{"label": "api"}]},
              config={"environment": {"GREETING": "hi"}, "pass_env": ["HOME"]}),
        agent("trainer", out, resources={"cpu_cores": 1, "memory_mb": 128,
                                         "devices": [{"type": "nvidia/gpu", "min_memory_mb": 30000}]}),
        agent("worker", out, "--sleep", "1", config={"workdir": str(out)}),
    ])
    path = out / "three.json"
    path.write_text(json.dumps(raw))
    env = {**lab.server.env, "MN_STORE_URL": lab.store_url}
    result = subprocess.run([str(prefect_env.BIN / "mn-prefect"), "blueprint", "run", str(path), "--pool", lab.pool,
                             "--wait", "--json", "--timeout", "180"], env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["state"] == "COMPLETED" and data["status"] == "completed"
    assert {a: t["status"] for a, t in data["agents"].items()} == {"api": "completed", "trainer": "completed",
                                                                   "worker": "completed"}
    nodes = {a: t["node"] for a, t in data["agents"].items()}
    api, trainer, worker = (records(out, a)[0]["env"] for a in ("api", "trainer", "worker"))
    for name, env_seen in (("api", api), ("trainer", trainer), ("worker", worker)):
        assert env_seen["MN_AGENT_ID"] == name and env_seen["MN_JOB_ID"] == data["job_id"]
        assert env_seen["MN_NODE"] == nodes[name]
        assert json.loads(env_seen["MN_ALLOCATION_JSON"])["agent_id"] == name
        assert "MN_STORE_URL" not in env_seen and "PREFECT_API_URL" not in env_seen  # only pass_env passes
    assert nodes["trainer"] == "gpu-2" and trainer["MN_ALLOCATED_DEVICE_IDS"] == "GPU-2a"
    assert trainer["CUDA_VISIBLE_DEVICES"] == "0" and api["CUDA_VISIBLE_DEVICES"] == ""  # no GPU booked: none seen
    assert api["HOME"] == os.environ["HOME"] and api["GREETING"] == "hi" and "HOME" not in trainer
    assert 1024 <= int(api["MN_PORT_API"]) <= 65535
    assert records(out, "worker")[0]["cwd"] == str(out)
    assert held(lab, data["job_id"]) == []  # every booking released when the job completed


def test_gang_placement_starts_no_agent_until_every_agent_fits_then_starts_all(lab, out):
    gpu2 = lab.store.get_node("gpu-2").record
    big = next(d for d in gpu2.devices if d.id == "GPU-2a")
    blocker = Placement(agent_id="blocker", node="gpu-2", resources=PlacedResources(gpu_count=1),
                        allocation=Allocation(devices=(big,)), job_id="blocker")
    assert lab.store.commit_plan("blocker", [blocker]).ok
    raw = blueprint(out, [agent("light", out),
                          agent("heavy", out, resources={"cpu_cores": 1, "devices": [{"type": "gpu", "min_memory_mb": 30000}]})])
    job_id, run_id = start(lab, raw)
    waiting = wait_job(lab, job_id, lambda j: j.status == "waiting", "the job to wait for capacity")
    assert "waiting for capacity" in waiting.reason and "heavy" in waiting.reason
    time.sleep(3)  # several placement rounds
    assert job(lab, job_id).agents == {} and held(lab, job_id) == []
    assert list(out.glob("*.json")) == []  # no agent started, not even the one that fits
    lab.store.release("blocker")
    done = wait_job(lab, job_id, lambda j: j.finished, "the job to finish once capacity freed")
    assert done.status == "completed", done.reason
    assert {t.node for t in done.agents.values()} == {"gpu-2"}
    assert records(out, "light") and records(out, "heavy")
    status = mn_prefect_json(lab, "job", "status", job_id)
    assert status["status"] == "completed" and status["placements"] == []  # released
    assert status["plan"]["status"] == "runnable_now" and status["agents"]["heavy"]["node"] == "gpu-2"
    assert status["agents"]["heavy"]["remaining"]["restarts"] == 3  # batch default: 3 per 24 h, none used
    assert any(e["kind"] == "job.waiting" for e in status["events"])
    listed = {j["job_id"]: j for j in mn_prefect_json(lab, "job", "list")}
    assert listed[job_id]["status"] == "completed" and listed[job_id]["nodes"] == ["gpu-2"]
    assert job_id not in {j["job_id"] for j in mn_prefect_json(lab, "job", "list", "--running-only")}


def mn_prefect_json(lab: Lab, *args: str):
    result = subprocess.run([str(prefect_env.BIN / "mn-prefect"), *args, "--json", "--store-url", lab.store_url],
                            env=lab.server.env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_failing_agent_is_restarted_with_the_policy_delays_then_the_job_fails(lab, out):
    policy = {"attempts": 2, "interval_ms": 600000, "delay_ms": 1500, "delay_function": "exponential",
              "max_delay_ms": 60000, "mode": "fail"}
    raw = blueprint(out, [agent("flaky", out, "--exit", "3", policies={"restart": policy})])
    job_id, run_id = start(lab, raw)
    failed = wait_job(lab, job_id, lambda j: j.finished, "the job to fail", timeout=180)
    assert failed.status == "failed"
    assert "restart attempts exhausted (2 in 600 s)" in failed.reason and "#3 FAILED" in failed.reason
    starts = [r["start"] for r in records(out, "flaky")]
    assert len(starts) == 3
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    print(f"restart gaps (s): {[round(g, 2) for g in gaps]} for delays 1.5 s and 3 s")
    assert gaps[0] >= 1.5 and gaps[1] >= 3.0  # never earlier than the policy's delay
    assert len(failed.agents["flaky"].restarts_ms) == 2
    assert lab.wait(run_id)["state"]["type"] == "FAILED"
    assert held(lab, job_id) == []


def test_a_killed_service_agent_is_restarted(lab, out):
    raw = blueprint(out, [agent("svc", out, "--forever")], policies={"job_type": "service"})
    job_id, run_id = start(lab, raw)
    first = servers.wait_for(lambda: records(out, "svc"), timeout=120, what="the service agent to start")[0]
    os.kill(first["pid"], signal.SIGKILL)
    second = servers.wait_for(lambda: len(records(out, "svc")) >= 2 and records(out, "svc")[1], timeout=120,
                              what="the killed service agent to be restarted")
    assert second["pid"] != first["pid"] and second["env"]["MN_AGENT_ATTEMPT"] == "2"
    state = job(lab, job_id)
    assert state.status == "running" and len(state.agents["svc"].restarts_ms) == 1
    assert "exited unexpectedly" in state.agents["svc"].reason or "failed" in state.agents["svc"].reason
    cancel(lab, run_id)
    wait_job(lab, job_id, lambda j: j.finished, "the job to stop")


def test_a_service_agent_failing_its_health_check_is_cancelled_and_restarted(lab, out):
    """``health`` on a blueprint agent: the node's worker probes the agent's booked port (nothing listens there),
    cancels the agent's run after two failures in a row, and the job's restart policy starts it again."""
    check = {"tcp": True, "port_label": "http", "interval_s": 0.5, "timeout_s": 1, "failures_to_deallocate": 2}
    raw = blueprint(out, [agent("deaf", out, "--forever", health=check,
                                resources={"cpu_cores": 0.5, "memory_mb": 64, "ports": [{"label": "http"}]})],
                    policies={"job_type": "service"})
    job_id, run_id = start(lab, raw)
    first = wait_job(lab, job_id, lambda j: "deaf" in j.agents and j.agents["deaf"].runs, "the agent to start")
    first_run = first.agents["deaf"].runs[0].run_id
    cancelled = servers.wait_for(lambda: (r := lab.flow_run(first_run))["state"]["type"] in ("CANCELLING", "CANCELLED")
                                 and r, timeout=120, interval=0.5, what="the unhealthy agent run to be cancelled")
    assert "health check failed 2 times" in cancelled["state"]["message"]
    # The event is recorded beside the cancel request, not before it: wait for it rather than read it once.
    deallocated = servers.wait_for(lambda: [e for e in lab.store.events(job_id=first_run, limit=20)
                                            if e.kind == "allocation.deallocated"], timeout=30, interval=0.5,
                                   what="the deallocation event")
    assert deallocated[0].node == first.agents["deaf"].node
    wait_job(lab, job_id, lambda j: len(j.agents["deaf"].runs) >= 2, "the job to restart the agent")
    assert len(held(lab, job_id)) == 1  # the job keeps its booking across the restart
    cancel(lab, run_id)
    wait_job(lab, job_id, lambda j: j.finished, "the job to stop")


def test_cancelling_a_job_cancels_its_agents_and_releases_every_booking(lab, out):
    raw = blueprint(out, [
        agent("front", out, "--forever", resources={"cpu_cores": 1, "ports": [{"label": "http", "port": 0}]}),
        agent("gpu", out, "--forever", resources={"cpu_cores": 1, "devices": [{"type": "gpu"}]}),
    ], policies={"job_type": "service"})
    job_id, run_id = start(lab, raw)
    running = wait_job(lab, job_id, lambda j: all(records(out, a) for a in j.agents) and len(j.agents) == 2,
                       "both agents to run")
    pids = [records(out, a)[0]["pid"] for a in running.agents]
    assert len(held(lab, job_id)) == 2 and lab.store.bookings()
    cancel(lab, run_id)
    ended = wait_job(lab, job_id, lambda j: j.finished, "the job to be cancelled")
    assert ended.status == "cancelled"
    assert held(lab, job_id) == []
    assert not [b for b in lab.store.bookings() if b.job_id.split("@")[0] == job_id]
    for track in ended.agents.values():
        servers.wait_for(lambda track=track: lab.flow_run(track.current.run_id)["state"]["type"] == "CANCELLED", timeout=60,
                         what=f"agent run {track.agent_id} to be cancelled", interval=0.5)
    servers.wait_for(lambda: not any(alive(pid) for pid in pids), timeout=60, what="the agent processes to end")


def test_a_system_job_runs_one_copy_of_the_group_on_every_node(lab, out):
    raw = blueprint(out, [agent("monitor", out, "--forever", resources={"cpu_cores": 0.1, "memory_mb": 16})],
                    policies={"job_type": "system"})
    job_id, run_id = start(lab, raw)
    names = {"monitor@gpu-1", "monitor@gpu-2", "monitor@cpu-1"}
    running = wait_job(lab, job_id, lambda j: set(j.agents) == names and all(records(out, a) for a in names),
                       "a copy on every node")
    for name in names:
        seen = records(out, name)[0]["env"]
        assert seen["MN_NODE"] == name.split("@")[1] and seen["MN_AGENT_ID"] == name
        assert running.agents[name].source_agent_id == "monitor"
    assert sorted(running.bookings) == sorted(f"{job_id}@{n}" for n in ("gpu-1", "gpu-2", "cpu-1"))
    cancel(lab, run_id)
    wait_job(lab, job_id, lambda j: j.finished, "the system job to stop")
    assert held(lab, job_id) == []


def test_a_sysbatch_job_completes_once_every_node_has_run_its_copy(lab, out):
    raw = blueprint(out, [agent("sweep", out, resources={"cpu_cores": 0.1, "memory_mb": 16})],
                    policies={"job_type": "sysbatch"})
    job_id, run_id = start(lab, raw)
    done = wait_job(lab, job_id, lambda j: j.finished, "the sysbatch job to complete", timeout=180)
    assert done.status == "completed", done.reason
    assert {a: t.status for a, t in done.agents.items()} == {f"sweep@{n}": "completed" for n in ("gpu-1", "gpu-2", "cpu-1")}
    assert {records(out, f"sweep@{n}")[0]["env"]["MN_NODE"] for n in ("gpu-1", "gpu-2", "cpu-1")} == {"gpu-1", "gpu-2", "cpu-1"}
    assert lab.wait(run_id)["state"]["type"] == "COMPLETED"


def sweep_once(lab: Lab, sweep, client_wrapper=None) -> None:
    """``await sweep(sweeps)`` with one node's sweeps (a worker's own, on node cpu-1 of the lab's pool and store)
    and a real Prefect client of the lab's server (handed to ``client_wrapper`` first, when given)."""
    import logging

    import anyio
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from mn_prefect.placement.placing import Placer
    from mn_prefect.worker.sweeps import Sweeps

    async def in_store(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    async def never(*args, **kwargs):
        raise AssertionError("this sweep releases no flow run's booking")

    async def run() -> None:
        async with get_client() as client:
            used = client_wrapper(client) if client_wrapper else client
            await sweep(Sweeps(store=lab.store, placer=Placer(lab.store), node="cpu-1", pool=lab.pool,
                               client=lambda: used, work_pool=lambda: None, in_store=in_store,
                               logger=logging.getLogger("sweep-test"), run_logger=lambda run: logging.getLogger("run"),
                               busy=set, release=never, release_part=never))

    with temporary_settings({PREFECT_API_URL: lab.server.api_url}):
        anyio.run(run)


def test_the_sweep_leaves_a_job_as_its_coordinator_ended_it(lab, out):
    """A sweep that read a job while it ran and finds its coordinator's run over has read it too early: the
    coordinator wrote the job's end before its run ended. The job stays as the coordinator left it (completed),
    not cancelled by the sweep's stale copy."""
    raw = blueprint(out, [agent("brief", out, resources={"cpu_cores": 0.1, "memory_mb": 16})])
    job_id, run_id = start(lab, raw)
    stale = wait_job(lab, job_id, lambda j: j.status == "running", "the job to run")
    assert lab.wait(run_id)["state"]["type"] == "COMPLETED"
    assert job(lab, job_id).status == "completed"

    sweep_once(lab, lambda sweeps: sweeps._job(stale))
    ended = job(lab, job_id)
    assert (ended.status, ended.reason) != ("cancelled", "its coordinator run is over")
    assert ended.status == "completed", ended.reason
    assert [e.kind for e in lab.store.events(job_id=job_id, limit=50) if e.kind.startswith("job.")].count(
        "job.cancelled") == 0


def test_the_sweep_leaves_a_bundle_workflow_as_its_run_ended_it(lab, tmp_path):
    """A bundle step's booking the sweep finds while the bundle's flow run ends: the run writes the workflow's
    end, then goes Completed, between the sweep's read of the workflow and its read of the run. The workflow
    stays completed (the sweep reads it again once the run is over), not marked crashed from the first read."""
    from mn_prefect.store.records import WorkflowRecord, get_record, put_record

    flow = lab.http.post("/flows/", json={"name": "mn-sweep-race"}).json()
    run = lab.http.post("/flow_runs/", json={"flow_id": flow["id"], "name": "bundle-ending",
                                             "state": {"type": "RUNNING"}}).json()
    workflow = f"wf-{uuid.uuid4().hex[:8]}"
    put_record(lab.store, WorkflowRecord(job_id=workflow, run_id=workflow, run_dir=str(tmp_path),
                                         bundle=str(tmp_path), flow_run_id=run["id"], status="running"))

    class EndsAsItIsRead:
        """The bundle's run ending just as the sweep asks about it: its workflow written completed, its run
        Completed, then the real answer."""

        def __init__(self, client):
            self.client = client

        async def read_flow_run(self, run_id):
            ended = get_record(lab.store, workflow, WorkflowRecord).model_copy(update={"status": "completed"})
            put_record(lab.store, ended)
            lab.http.post(f"/flow_runs/{run['id']}/set_state",
                          json={"state": {"type": "COMPLETED"}, "force": True}).raise_for_status()
            return await self.client.read_flow_run(run_id)

    sweep_once(lab, lambda sweeps: sweeps._step(StepAttempt(workflow, "step-1")), EndsAsItIsRead)
    assert get_record(lab.store, workflow, WorkflowRecord).status == "completed"


def test_ops_deploy_schedules_reconcile_with_a_concurrency_limit_and_deploys_drain(lab):
    result = subprocess.run([str(prefect_env.BIN / "mn-prefect"), "ops", "deploy", "--pool", lab.pool, "--interval", "20",
                             "--json"], env=lab.server.env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    names = json.loads(result.stdout)["deployments"]
    assert names == [f"mn-reconcile/{lab.pool}", f"mn-drain/{lab.pool}"]
    reconcile = lab.http.get(f"/deployments/name/mn-reconcile/{lab.pool}").json()
    drain = lab.http.get(f"/deployments/name/mn-drain/{lab.pool}").json()
    try:
        assert reconcile["entrypoint"] == "mn_prefect.ops.flows.reconcile_cluster"
        assert [s["schedule"]["interval"] for s in reconcile["schedules"]] == [20.0]
        assert reconcile["global_concurrency_limit"]["limit"] == 1
        assert reconcile["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
        assert drain["entrypoint"] == "mn_prefect.ops.flows.drain_node" and drain["schedules"] == []
        assert {"node", "reason", "deadline_minutes"} <= set(drain["parameter_openapi_schema"]["properties"])
    finally:  # keep the lab quiet for the other tests
        for deployment in (reconcile, drain):
            lab.http.delete(f"/deployments/{deployment['id']}")
