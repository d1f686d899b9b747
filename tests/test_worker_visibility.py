"""What people see of a placement, said once, and how an mn worker stops: a real Prefect server and three
real worker processes (tests/lab.py), read back through Prefect's API."""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import servers
from lab import Lab
from prefect_env import stop_process

from mn_prefect.model.resources import resource_request
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler.ask import Ask

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab

# A worker must be gone within this after SIGTERM: a hang detector, not a speed figure. Idle it takes 1-3 s;
# on two busy cores (a CPU burner beside the suite) it took over 15 s twice, putting the run back through a
# loaded SQLite-backed server. systemd's default stop timeout is 90 s.
STOP_WITHIN_S = 60


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("visibility"))
    yield lab
    lab.stop()


def _artifacts(lab: Lab, run_id: str) -> list:
    return lab.http.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run_id]}}}).json()


def _events(lab: Lab, event: str, *, related: str | None = None, resource: str | None = None) -> list:
    match = {"related": {"id": [related]}} if related else {"resource": {"id": [resource]}}
    body = {"filter": {**match, "event": {"name": [event]}, "occurred": {"since": lab.since}},
            "limit": 50}
    return lab.http.post("/events/filter", json=body).json().get("events", [])


def _logs(lab: Lab, run_id: str) -> list[str]:
    body = {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}
    return [entry["message"] for entry in lab.http.post("/logs/filter", json=body).json()]


def test_each_placement_gives_one_artifact_and_one_created_event(lab):
    # Several runs at once: all three workers race to place each of them.
    deployment = lab.deploy({"resources": {"cpu": 1, "memory_mb": 256}})
    runs = [lab.run(deployment) for _ in range(4)]
    for run_id in runs:
        assert lab.wait(run_id)["state"]["type"] == "COMPLETED"
    for run_id in runs:
        flow_run = f"prefect.flow-run.{run_id}"
        # The release comes after the commit: once it is in, every worker's word on the commit is too.
        servers.wait_for(lambda flow_run=flow_run: _events(lab, "mn.placement.released", related=flow_run), timeout=60,
                         interval=0.5, what="the released event")
        committed = _events(lab, "mn.placement.created", related=flow_run)
        assert not _events(lab, "mn.placement.committed", related=flow_run)  # one event per placement
        assert len(committed) == 1, committed
        assert committed[0]["resource"]["prefect.resource.id"] == f"mn.node.{lab.record(run_id)['env']['MN_NODE']}"
        assert [a["key"] for a in _artifacts(lab, run_id)] == ["placement"]
        assert len(_events(lab, "mn.placement.released", related=flow_run)) == 1


def test_a_run_no_node_can_take_is_reported_once_per_reason_then_failed_once(lab):
    run_id = lab.run(lab.deploy({"resources": {"gpu": 4}, "not_runnable_timeout_seconds": 4, "wait_for_new_nodes": True}))
    run = lab.wait(run_id, timeout=90)
    assert run["state"]["type"] == "FAILED"
    assert run["state"]["message"].count("no node can ever take this") == 1, run["state"]["message"]
    flow_run = f"prefect.flow-run.{run_id}"
    waiting = servers.wait_for(lambda: _events(lab, "mn.placement.waiting", resource=flow_run), timeout=30,
                               interval=0.5, what="the waiting event")
    reasons = [event["payload"]["reason"] for event in waiting]
    assert len(reasons) == len(set(reasons)), reasons  # each distinct reason once, from one worker
    assert all(e["resource"]["prefect.resource.name"] == run["name"] for e in waiting)
    assert all("work-pool" in {r["prefect.resource.role"] for r in e["related"]} for e in waiting)
    said = servers.wait_for(lambda: [line for line in _logs(lab, run_id) if "no node can ever take this run" in line],
                            timeout=30, what="the run's logs to say why it failed", interval=0.5)
    assert len(said) == 1, said
    assert not _events(lab, "mn.placement.waiting", resource="mn.node.none")


def test_a_blueprint_agent_run_gets_its_placement_artifact_once(lab):
    # What a blueprint job's coordinator does for one agent: book it in the store, start a run pinned to it.
    job_id = f"bp-{uuid.uuid4().hex[:8]}"
    booked = place_and_commit(lab.store, job_id, [Ask(agent_id="worker", request=resource_request({"cpu": 1}))])
    assert booked.placed
    deployment = lab.deploy({})
    response = lab.http.post(f"/deployments/{deployment}/create_flow_run", json={
        "parameters": {"out_dir": str(lab.out)}, "job_variables": {"booking": {"job_id": job_id, "agent_id": "worker"}}})
    response.raise_for_status()
    run_id = response.json()["id"]
    try:
        assert lab.wait(run_id)["state"]["type"] == "COMPLETED"
        assert lab.record(run_id)["env"]["MN_NODE"] == booked.commit.placements[0].node
        assert [a["key"] for a in _artifacts(lab, run_id)] == ["placement"]
        assert lab.booked(job_id)  # the job's booking is the job's to release
    finally:
        lab.store.release(job_id)


def test_the_server_says_a_word_where_a_number_belongs_is_not_a_number(lab):
    deployment = lab.deploy({"resources": {"cpu": 1}})
    response = lab.http.post(f"/deployments/{deployment}/create_flow_run", json={
        "parameters": {"out_dir": "x"}, "job_variables": {"resources": {"cpu_cores": "lots"}}})
    assert response.status_code == 422, response.text
    assert "resources.cpu_cores" in response.text and "is not of type 'number'" in response.text
    assert "\\\\d" not in response.text  # not a regular expression
    accepted = lab.http.post(f"/deployments/{deployment}/create_flow_run", json={
        "parameters": {"out_dir": "x"}, "job_variables": {"resources": {"cpu_cores": "8", "memory_gb": "0.5"}}})
    assert accepted.status_code == 201, accepted.text
    lab.http.delete(f"/flow_runs/{accepted.json()['id']}")


def _stop(lab: Lab, node: str) -> float:
    """SIGTERM the node's worker (only it, as `kill` or `docker stop` would) and wait for it to exit."""
    worker = lab.worker_of(node)
    worker.send_signal(signal.SIGTERM)
    try:
        return worker.wait(STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {node} worker still runs {STOP_WITHIN_S} s after SIGTERM")


def test_sigterm_while_a_run_is_launching_puts_it_back_and_the_worker_exits(lab):
    deployment = lab.deploy({"resources": {"cpu": 1}, "constraints": [{"attribute": "node", "value": "cpu-1"}]})
    run_id = lab.run(deployment)
    # Placed and proposed Pending; its process takes seconds to reach Running on this machine.
    lab.wait(run_id, states={"PENDING", "RUNNING", "COMPLETED"}, timeout=60)
    try:
        _stop(lab, "cpu-1")
        state = lab.flow_run(run_id)["state"]["type"]
        assert state != "PENDING"
        if state == "SCHEDULED":  # never reached Running: back in the queue, holding nothing
            assert not lab.booked(run_id)
            history = lab.http.get("/flow_run_states/", params={"flow_run_id": run_id}).json()
            assert any("stopped before starting this run" in (s["message"] or "") for s in history)
        # (had it reached Running, it would keep its booking: the next test)
        assert lab.store.get_node("cpu-1").record.status == "disconnected"  # not after the heartbeat timeout
    finally:
        lab.restart_worker("cpu-1")
    assert lab.wait(run_id, timeout=120)["state"]["type"] == "COMPLETED"
    assert lab.store.get_node("cpu-1").record.status == "healthy"


def test_sigterm_while_a_run_is_running_keeps_its_booking_and_the_worker_exits(lab):
    deployment = lab.deploy({"resources": {"cpu": 1}, "constraints": [{"attribute": "node", "value": "cpu-1"}]})
    run_id = lab.run(deployment, seconds=60)
    lab.wait(run_id, states={"RUNNING"}, timeout=90)
    try:
        _stop(lab, "cpu-1")
        # A stopped worker is a lost node: the run's booking waits for reconcile (or the node's next sweep).
        assert [p.node for p in lab.booked(run_id)] == ["cpu-1"]
    finally:
        lab.restart_worker("cpu-1")
    lab.http.post(f"/flow_runs/{run_id}/set_state",
                  json={"state": {"type": "CANCELLED", "name": "Cancelled"}, "force": True}).raise_for_status()
    servers.wait_for(lambda: not lab.booked(run_id), timeout=60, what="the sweep to release the ended run")


def test_sigterm_stops_a_worker_that_inherited_sigint_as_ignored(lab):
    # A shell's background job (`worker &` in a script), nohup and some supervisors start a process with SIGINT
    # ignored; `prefect worker start` turns SIGTERM into a SIGINT to itself, which such a process never acts on.
    stop_process(lab.worker_of("cpu-1"))
    restarted_at = time.time()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the worker started now
    try:
        lab.restart_worker("cpu-1")
    finally:
        signal.signal(signal.SIGINT, before)
    worker = lab.worker_of("cpu-1")
    ignored = int(Path(f"/proc/{worker.pid}/status").read_text().split("SigIgn:")[1].split()[0], 16)
    assert ignored & (1 << (signal.SIGINT - 1))  # the case this test is about
    servers.wait_for(lambda: (node := lab.store.get_node("cpu-1")).record.status == "healthy"
                     and (node.last_heartbeat or 0) >= restarted_at, timeout=120,
                     what="the restarted cpu-1 worker to register its node")
    try:
        _stop(lab, "cpu-1")
        assert lab.store.get_node("cpu-1").record.status == "disconnected"  # it left the cluster on its way out
    finally:
        lab.restart_worker("cpu-1")


def test_the_pool_the_lab_created_shows_the_canonical_form(lab):
    variables = lab.http.get(f"/work_pools/{lab.pool}").json()["base_job_template"]["variables"]
    resources = variables["definitions"]["Resources"]
    # In the form's order (by position: a server on PostgreSQL does not keep the keys' order).
    properties = resources["properties"]
    assert sorted(properties, key=lambda key: properties[key]["position"]) == [
        "cpu_cores", "memory_mb", "disk_mb", "gpu_count", "devices", "ports", "volumes", "runtime_driver"]
    top = variables["properties"]
    assert sorted(top, key=lambda key: top[key]["position"])[-4:] == ["max_runtime_is_limit", "warm_start", "preload",
                                                                     "health"]
    assert not {"booking", "system_copy"} & set(top)  # set by mn-prefect on its own runs: not in the form
    assert "ResourcesVariable" not in str(variables) and "SPEC" not in str(variables)
