"""Node loss with real parts: a real Prefect server, three real ``mn`` workers, a real SQLite store. A node's
worker and its runs are SIGKILLed; the reconciler (the real CLI) moves or pauses what the node held."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import prefect_env
import pytest
import servers
from lab import Lab

from mn_prefect.local_lab import kill_tree
from mn_prefect.placement.job_state import load_job
from mn_prefect.store.records import FlowRunRecord, get_record

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab

PROBE = str(Path(__file__).parent / "flows" / "agent_probe.py")

LOST_NODE = "cpu-1"
FAST = {"MN_HEARTBEAT_TIMEOUT_SECONDS": "3", "MN_DISCONNECT_GRACE_SECONDS": "2"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("recoverylab"))
    yield lab
    lab.stop()


def mn_prefect(lab: Lab, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(prefect_env.BIN / "mn-prefect"), *args, "--store-url", lab.store_url],
                          env={**lab.server.env, **(env or {})}, capture_output=True, text=True, timeout=120)


def started(lab: Lab, run_id: str) -> dict | None:
    path = lab.out / f"{run_id}.started"
    return json.loads(path.read_text()) if path.exists() else None


def kill_node(lab: Lab, name: str, pids: list[int] = ()) -> None:
    """The machine is gone: its worker, every process the worker started, and the given processes."""
    kill_tree(lab.worker_of(name), *pids)


def reconcile_until(lab: Lab, done, what: str, timeout: float = 120, parallel: int = 1,
                    tolerate_failures: bool = False) -> dict:
    """Run the real reconciler (``parallel`` at once) until ``done(totals)``; returns the summed counters.
    ``tolerate_failures``: a pass may fail (the store was down) and is simply run again."""
    totals = {k: 0 for k in ("checked", "recovered", "paused", "blocked", "skipped", "failed")}
    counters = list(totals)
    leaders = []
    deadline = time.monotonic() + timeout
    while not done(totals):
        assert time.monotonic() < deadline, f"reconcile never got to {what}: {totals}"
        procs = [subprocess.Popen([str(prefect_env.BIN / "mn-prefect"), "node", "reconcile", "--json", "--store-url",
                                   lab.store_url], env={**lab.server.env, **FAST}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(parallel)]
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            if tolerate_failures and proc.returncode != 0:
                totals["failed_passes"] = totals.get("failed_passes", 0) + 1
                continue
            assert proc.returncode == 0, err
            report = json.loads(out)
            leaders.append(report["leader"])
            for key in counters:
                totals[key] += report[key]
        time.sleep(1)
    totals["passes"] = len(leaders)
    return totals


def test_a_lost_nodes_cluster_recover_run_moves_and_completes_while_local_restart_pauses(lab):
    placed_on_lost = {"preferred_node": LOST_NODE, "resources": {"cpu_cores": 1, "memory_mb": 64}}
    recover = lab.deploy({**placed_on_lost, "recovery_mode": "cluster_recover"})
    local = lab.deploy({**placed_on_lost, "recovery_mode": "local_restart"})
    barrier = lab.out / "lost-node.barrier"  # opened once the moved run runs again: it then completes
    recover_run = lab.run(recover, hold_until=str(barrier))
    local_run = lab.run(local, hold_until=str(barrier))
    first = servers.wait_for(lambda: started(lab, recover_run), timeout=120, what="the recoverable run to start")
    servers.wait_for(lambda: started(lab, local_run), timeout=120, what="the local_restart run to start")
    assert {p.node for p in lab.booked(recover_run) + lab.booked(local_run)} == {LOST_NODE}

    killed_at = time.time()
    kill_node(lab, LOST_NODE, [first["pid"], started(lab, local_run)["pid"]])
    (lab.out / f"{recover_run}.started").unlink()
    # Two reconcilers at once, every round: the lease lets only one act, so the run moves exactly once.
    totals = reconcile_until(lab, lambda t: t["recovered"] >= 1 and t["paused"] >= 1, "recover and pause", parallel=2)
    assert totals["recovered"] == 1
    assert lab.store.get_node(LOST_NODE).record.status == "offline"

    again = servers.wait_for(lambda: started(lab, recover_run), timeout=120, what="the run to start elsewhere")
    moved_in = again["start"] - killed_at
    print(f"kill to re-placed and running: {moved_in:.1f} s (heartbeat timeout 3 s + grace 2 s)")
    barrier.write_text("go")
    done = lab.wait(recover_run, timeout=120)
    assert done["state"]["type"] == "COMPLETED"
    assert lab.record(recover_run)["env"]["MN_NODE"] != LOST_NODE
    assert lab.store.active_placements(node=LOST_NODE) == []  # the lost node's bookings are released
    paused = lab.flow_run(local_run)
    assert paused["state"]["type"] == "PAUSED" and "paused for review" in paused["state"]["message"]
    events = [e.kind for e in lab.store.events(job_id=recover_run)]
    assert events.count("job.rescheduled") == 1
    assert len(get_record(lab.store, recover_run, FlowRunRecord).reschedules_ms) == 1
    lab.restart_worker(LOST_NODE)
    servers.wait_for(lambda: lab.store.get_node(LOST_NODE).record.status == "healthy", timeout=90,
                     what="the node to come back healthy on its heartbeat")


def start_job(lab: Lab, raw: dict, coordinator: dict | None = None) -> tuple[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from mn_prefect.jobs.deploy import compile_blueprint, start_job as start

    with temporary_settings({PREFECT_API_URL: lab.server.api_url}):
        with get_client(sync_client=True) as client:
            job_id, run = start(client, compile_blueprint(raw), lab.pool, job_variables=coordinator)
    return job_id, str(run.id)


def agent(name: str, out: Path, *args: str, **extra) -> dict:
    return {"node_id": name, "config": {"command": [sys.executable, PROBE, str(out), *args], **extra.pop("config", {})},
            "resources": {"cpu_cores": 0.5, "memory_mb": 64}, **extra}


def agent_records(out: Path, agent_id: str) -> list[dict]:
    found = sorted(out.glob(f"{agent_id}.*.json"), key=lambda p: int(p.stem.rsplit(".", 1)[1]))
    return [json.loads(p.read_text()) for p in found]


def job_state(lab: Lab, job_id: str):
    return load_job(lab.store, job_id)


@pytest.mark.parametrize("coordinator_on", ["gpu-2", "gpu-1"], ids=["coordinator-elsewhere", "coordinator-lost-too"])
def test_a_blueprint_agent_on_a_lost_node_is_re_placed_and_its_job_completes(lab, tmp_path, coordinator_on):
    lost = "gpu-1"
    raw = {"job_name": "recover", "policies": {"recovery_mode": "cluster_recover"},
           "nodes": [agent("steady", tmp_path, "--until", str(tmp_path / "barrier"),
                           policies={"scheduler": {"preferred_node": lost}})]}
    job_id, run_id = start_job(lab, raw, coordinator={"preferred_node": coordinator_on})
    first = servers.wait_for(lambda: agent_records(tmp_path, "steady"), timeout=120, what="the agent to start")[0]
    assert first["env"]["MN_NODE"] == lost
    coordinator_node = lab.store.active_placements(job_id=run_id)[0].node
    assert coordinator_node == coordinator_on
    killed_at = time.time()
    kill_node(lab, lost, [first["pid"]])
    reconcile_until(lab, lambda t: t["recovered"] + t["skipped"] >= 1 and
                    lab.store.get_node(lost).record.status == "offline", "act on the lost agent")
    second = servers.wait_for(lambda: len(agent_records(tmp_path, "steady")) >= 2 and agent_records(tmp_path, "steady")[1],
                              timeout=180, what="the agent to run again elsewhere")
    path = "coordinator re-placed the whole job" if coordinator_node == lost else "coordinator moved the agent"
    assert second["env"]["MN_AGENT_ATTEMPT"] == "2"
    print(f"agent re-placed and running {second['start'] - killed_at:.1f} s after the kill ({path})")
    assert second["env"]["MN_NODE"] != lost
    (tmp_path / "barrier").write_text("go")  # the agent, running again elsewhere, now ends
    done = servers.wait_for(lambda: (j := job_state(lab, job_id)) and j.finished and j, timeout=180,
                            what="the job to finish")
    assert done.status == "completed", done.reason
    assert len(done.agents["steady"].reschedules_ms) == 1
    assert done.generation == (2 if coordinator_on == lost else 1)
    assert lab.store.active_placements(node=lost) == []  # nothing stays booked on the lost node
    lab.restart_worker(lost)
    servers.wait_for(lambda: lab.store.get_node(lost).record.status == "healthy", timeout=90,
                     what="the node to come back")


def test_a_drain_migrates_services_lets_batch_finish_and_leaves_system_copies(lab, tmp_path):
    node = "gpu-2"
    prefer = {"scheduler": {"preferred_node": node}}
    service_id, service_run = start_job(lab, {"job_name": "svc", "policies": {"job_type": "service", "recovery_mode": "cluster_recover"},
                                              "nodes": [agent("svc", tmp_path, "--forever", policies=prefer)]})
    batch_id, batch_run = start_job(lab, {"job_name": "bat", "nodes": [agent("bat", tmp_path, "--until", str(tmp_path / "bat.barrier"),
                                                                              policies=prefer)]})
    system_id, system_run = start_job(lab, {"job_name": "sys", "policies": {"job_type": "system"},
                                            "nodes": [agent("mon", tmp_path, "--forever")]})
    copy = f"mon@{node}"
    servers.wait_for(lambda: all(agent_records(tmp_path, a) for a in ("svc", "bat", copy)), timeout=300,
                     what="all three kinds of work running")
    assert {agent_records(tmp_path, a)[0]["env"]["MN_NODE"] for a in ("svc", "bat", copy)} == {node}

    events_before = len(lab.store.events(node=node, limit=1000))
    preview = mn_prefect(lab, "node", "drain", node, "--reason", "driver update", "--dry-run", "--json")
    assert preview.returncode == 0, preview.stderr
    actions = {a["job_id"].split("@")[0]: a["action"] for a in json.loads(preview.stdout)["actions"]}
    assert actions[system_id] == "ignore" and actions[batch_id] == "wait" and actions[service_id] == "wait"
    assert lab.store.get_node(node).record.status == "healthy"  # the dry run changed nothing
    assert len(lab.store.events(node=node, limit=1000)) == events_before

    drain = subprocess.Popen([str(prefect_env.BIN / "mn-prefect"), "node", "drain", node, "--reason", "driver update",
                              "--deadline", "10m", "--wait", "--json", "--timeout", "150", "--store-url", lab.store_url],
                             env=lab.server.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # a new flow run on another node: a poll, a placement and a process start, slow on a loaded machine
        moved = servers.wait_for(lambda: len(agent_records(tmp_path, "svc")) >= 2 and agent_records(tmp_path, "svc"),
                                 timeout=150, what="the migrated service to start elsewhere")
    except TimeoutError:
        if drain.poll() is not None:
            out, err = drain.communicate()
            raise AssertionError(f"the drain ended early ({drain.returncode}): {out}{err}") from None
        drain.kill()
        raise
    assert moved[1]["env"]["MN_NODE"] != node  # the service migrated
    assert drain.poll() is None and lab.store.get_node(node).record.status == "draining"  # it waits for the batch
    (tmp_path / "bat.barrier").write_text("go")  # the batch, left to finish in place, ends now
    out, err = drain.communicate(timeout=150)
    assert drain.returncode == 0, out + err
    assert json.loads(out)["status"] == "complete"
    assert lab.store.get_node(node).record.status == "maintenance"
    svc = job_state(lab, service_id).agents["svc"]
    assert svc.reschedules_ms == []  # a drain move is not a reschedule
    bat = job_state(lab, batch_id)
    assert bat.status == "completed" and len(agent_records(tmp_path, "bat")) == 1  # finished in place
    assert len(agent_records(tmp_path, copy)) == 1  # the system copy was left alone
    sys_track = job_state(lab, system_id).agents[copy]
    assert lab.flow_run(sys_track.current.run_id)["state"]["type"] == "RUNNING"

    stay = mn_prefect(lab, "node", "undrain", node, "--reason", "done", "--json")
    assert stay.returncode == 0 and lab.store.get_node(node).record.status == "maintenance"
    back = mn_prefect(lab, "node", "undrain", node, "--reason", "done", "--mark-eligible", "--json")
    assert back.returncode == 0, back.stderr
    restored = lab.store.get_node(node).record
    assert restored.status == "healthy" and restored.scheduling_eligible
    for run in (service_run, system_run):
        lab.http.post(f"/flow_runs/{run}/set_state", json={"state": {"type": "CANCELLING"}, "force": True})
