"""Prefect events (docs/events.md): what mn-prefect changes reaches Prefect's event feed, emitted by the process
that made the change, and emitting never holds up or fails a commit. A real Prefect server and one real ``mn``
worker (the lab), real store files, the real CLI in subprocesses; events are read back through
``POST /api/events/filter``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import prefect_env
import pytest
import servers
from builders import node
from lab import Lab

from mn_prefect import events
from mn_prefect.lifecycle.reconcile import reconcile
from mn_prefect.lifecycle.states import advance_node_states, apply_transition, heartbeat
from mn_prefect.model.placement import Placement
from mn_prefect.placement.job_state import load_job
from mn_prefect.store import open_store
from mn_prefect.store.records import FlowRunRecord, put_record


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("events"), fleet=[{"name": "ev-cpu", "cpu_cores": 4, "memory_mb": 8192}])
    yield lab
    lab.stop()


@pytest.fixture
def store(tmp_path):
    s = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    yield s
    s.close()


def feed(lab: Lab, *, resource: str | None = None, related: str | None = None, prefix: str = "mn.") -> list[dict]:
    """The events whose resource (or a related one) is the given id, oldest first."""
    chosen: dict = {"occurred": {"since": lab.since}, "event": {"prefix": [prefix]}}  # not earlier labs' events
    if resource:
        chosen["resource"] = {"id": [resource]}
    if related:
        chosen["related"] = {"id": [related]}
    found = lab.http.post("/events/filter", json={"filter": chosen, "limit": 50}).json().get("events", [])
    return sorted(found, key=lambda e: e["occurred"])


def settled(lab: Lab, count: int, **query) -> list[dict]:
    """The feed once ``count`` events are in it (the server stores what it received a moment later)."""
    return servers.wait_for(lambda: len(found := feed(lab, **query)) >= count and found, timeout=30, interval=0.5,
                            what=f"{count} events for {query}")


def names(found: list[dict]) -> list[str]:
    return [e["event"] for e in found]


def related_ids(event: dict) -> set[str]:
    return {r["prefect.resource.id"] for r in event["related"]}


def in_process(lab: Lab):
    """This test process talks to the lab's server (its emitter posts there)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings({PREFECT_API_URL: lab.server.api_url})


def test_the_api_url_follows_prefects_settings_as_they_are_entered_and_left():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from mn_prefect import events

    outer = events._api_url()
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert events._api_url() == "http://127.0.0.1:9/api"
        with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:10/api"}):
            assert events._api_url() == "http://127.0.0.1:10/api"
        assert events._api_url() == "http://127.0.0.1:9/api"  # asked again per call: never a stale answer
    assert events._api_url() == outer


@pytest.mark.lab
def test_a_node_put_in_maintenance_from_the_cli_is_the_event_mn_node_maintenance_about_the_node(lab, store, tmp_path):
    store.register_node(node("ev-m1"))
    changed = subprocess.run([str(prefect_env.BIN / "mn-prefect"), "node", "maintenance", "ev-m1", "--enable",
                              "--reason", "disk swap", "--store-url", store.url.raw],
                             env={**lab.server.env, "MN_PREFECT_HOME": str(tmp_path)}, capture_output=True,
                             text=True, timeout=120)
    assert changed.returncode == 0, changed.stderr
    # The CLI has exited: what it queued went out before it did.
    found = settled(lab, 1, resource="mn.node.ev-m1")
    assert names(found) == ["mn.node.maintenance"], found
    assert found[0]["resource"]["prefect.resource.name"] == "ev-m1"
    assert found[0]["payload"] == {"node": "ev-m1", "from": "healthy", "to": "maintenance", "reason": "disk swap",
                                   "scheduling_eligible": False}


@pytest.mark.lab
def test_a_silent_node_goes_disconnected_then_offline_and_its_next_heartbeat_makes_it_healthy(lab, store):
    store.register_node(node("ev-h1"))
    with in_process(lab):
        later = time.time() + 600
        swept = advance_node_states(store, now=later, heartbeat_timeout_s=30, grace_s=30)
        # Offline once it was seen disconnected for the grace (a later sweep).
        swept += advance_node_states(store, now=later + 31, heartbeat_timeout_s=30, grace_s=30)
        back = heartbeat(store, "ev-h1")
        assert events.emitter().flush(30) == 0
    assert [(t.from_status, t.to_status) for t in swept] == [("healthy", "disconnected"), ("disconnected", "offline")]
    assert back is not None and back.to_status == "healthy"
    found = settled(lab, 3, resource="mn.node.ev-h1")
    assert names(found) == ["mn.node.disconnected", "mn.node.offline", "mn.node.healthy"], found
    assert found[2]["payload"]["reason"] == "heartbeat received while offline"


@pytest.mark.lab
def test_a_run_re_placed_after_its_node_was_lost_is_mn_job_rescheduled_with_its_flow_run_related(lab, store):
    from prefect import flow
    from prefect.client.orchestration import get_client

    from mn_prefect.ops.flows import PrefectRunEffects

    @flow(name="mn-events-probe")
    def probe() -> None:
        pass

    store.register_node(node("ev-r1"))
    with in_process(lab), get_client(sync_client=True) as client:
        run_id = str(client.create_flow_run(probe).id)
        assert store.commit_plan(run_id, [Placement(agent_id="probe", node="ev-r1", job_id=run_id,
                                                    resources={"cpu_cores": 1, "memory_mb": 64})]).ok
        put_record(store, FlowRunRecord(job_id=run_id, node="ev-r1", recovery_mode="cluster_recover"))
        apply_transition(store, "ev-r1", "healthy", "offline", reason="test: the machine is gone")
        report = reconcile(store, PrefectRunEffects(client))
        assert events.emitter().flush(30) == 0
    assert [(a.job_id, a.action) for a in report.actions] == [(run_id, "recovered")]
    found = settled(lab, 2, related=f"prefect.flow-run.{run_id}")
    assert names(found) == ["mn.placement.released", "mn.job.rescheduled"], found
    released, rescheduled = found
    assert released["resource"]["prefect.resource.id"] == "mn.node.ev-r1"
    assert rescheduled["resource"]["prefect.resource.id"] == f"mn.job.{run_id}"
    assert "mn.node.ev-r1" in related_ids(rescheduled)
    assert rescheduled["payload"]["reason"].startswith("node ev-r1 is offline: re-placing elsewhere")


@pytest.mark.lab
def test_a_blueprint_job_reports_its_statuses_as_mn_job_events_with_its_coordinator_run_related(lab):
    from prefect.client.orchestration import get_client

    from mn_prefect.jobs.deploy import compile_blueprint, start_job

    raw = {"job_name": f"ev-{uuid.uuid4().hex[:6]}",
           "nodes": [{"node_id": "w", "agent_type": "executor", "config": {"command": [sys.executable, "-c", "pass"]},
                      "resources": {"cpu_cores": 0.5, "memory_mb": 64}}]}
    with in_process(lab), get_client(sync_client=True) as client:
        job_id, run = start_job(client, compile_blueprint(raw), lab.pool)
    done = servers.wait_for(lambda: (j := load_job(lab.store, job_id)) is not None and j.finished and j, timeout=120,
                            interval=0.5, what="the job to finish")
    assert done.status == "completed", done.reason
    lab.wait(str(run.id))  # the coordinator's process has exited: its events went out before it did
    found = settled(lab, 3, resource=f"mn.job.{job_id}")
    assert names(found) == ["mn.job.submitted", "mn.job.placed", "mn.job.completed"], found
    assert all(f"prefect.flow-run.{run.id}" in related_ids(e) for e in found)
    placed = found[1]["payload"]["placements"]
    assert [(p["agent_id"], p["node"]) for p in placed] == [("w", "ev-cpu")]
    # The worker placed the coordinator's own run: one event, under the name in docs/events.md.
    about_run = names(settled(lab, 2, related=f"prefect.flow-run.{run.id}", prefix="mn.placement."))
    assert about_run.count("mn.placement.created") == 1 and "mn.placement.committed" not in about_run


COMMITS = """
import json, sys, time
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Placement
from mn_prefect.store import open_store
from mn_prefect.lifecycle.states import apply_transition
from mn_prefect.worker import visibility
from mn_prefect import events

store = open_store(sys.argv[1])
store.register_node(NodeRecord(name="n1", cpu_cores=64, memory_mb=65536))
start = time.monotonic()
committed = 0
for i in range(200):
    job = f"run-{i}"
    placement = Placement(agent_id="a", node="n1", job_id=job, resources={"cpu_cores": 0.25, "memory_mb": 16})
    committed += store.commit_plan(job, [placement]).ok
    visibility.emit_placement(visibility.CREATED, job, "n1", visibility.summary(placement))
    store.release(job)
    visibility.emit_placement(visibility.RELEASED, job, "n1", {"reason": "over"})
changed = apply_transition(store, "n1", "healthy", "maintenance", reason="test") is not None
print(json.dumps({"committed": committed, "changed": changed, "seconds": time.monotonic() - start,
                  "queued": events.emit("mn.test", events.node("n1")),
                  "thread": any(t.name == "mn-events" for t in __import__("threading").enumerate())}))
"""


def _commits(tmp_path, api_url: str | None) -> tuple[dict, float, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_EPHEMERAL_ENABLED": "false"}
    if api_url:
        env["PREFECT_API_URL"] = api_url
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", COMMITS, f"sqlite:///{tmp_path / 'state.db'}"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), time.monotonic() - start, done.stderr


def test_commits_stay_prompt_and_succeed_when_the_prefect_server_never_answers(tmp_path):
    hung = socket.socket()  # accepts connections (the kernel does) and never reads or answers them
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    try:
        result, took, stderr = _commits(tmp_path, f"http://127.0.0.1:{hung.getsockname()[1]}/api")
    finally:
        hung.close()
    assert result["committed"] == 200 and result["changed"] and result["queued"]
    # Generous bounds: 400 commits and releases take well under a second here; a commit that waited on the
    # server would take its 10 s timeout. At exit the process gives the queue at most events.EXIT_WAIT_S.
    assert result["seconds"] < 10, result
    assert took < 60, took
    assert "Traceback" not in stderr, stderr


def test_a_process_with_no_prefect_server_emits_nothing_and_starts_nothing(tmp_path):
    result, _, stderr = _commits(tmp_path, None)
    assert result["committed"] == 200 and result["changed"]
    assert result["queued"] is False and result["thread"] is False
    assert "Traceback" not in stderr, stderr


# A node-state change as `mn-prefect node maintenance` makes it: whether an event was queued, and whether Prefect
# was loaded to find out where to send it.
TRANSITION = """
import json, sys
from mn_prefect.model.node import NodeRecord
from mn_prefect.store import open_store
from mn_prefect.lifecycle.states import apply_transition

store = open_store(sys.argv[1])
store.register_node(NodeRecord(name="n1", cpu_cores=4, memory_mb=4096))
changed = apply_transition(store, "n1", "healthy", "maintenance", reason="test") is not None
queued = any(t.name == "mn-events" for t in __import__("threading").enumerate())
print(json.dumps({"changed": changed, "queued": queued, "prefect_loaded": "prefect" in sys.modules}))
"""


@pytest.mark.parametrize("named_by", [None, "profile", "env"])
def test_prefect_is_loaded_for_events_only_where_something_names_a_server(tmp_path, named_by):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    url = f"http://127.0.0.1:{servers.free_port()}/api"  # nothing listens: the events are queued, then dropped
    if named_by == "profile":
        (tmp_path / "prefect").mkdir()
        (tmp_path / "prefect" / "profiles.toml").write_text(
            f'active = "lab"\n\n[profiles.lab]\nPREFECT_API_URL = "{url}"\n')
    elif named_by == "env":
        env["PREFECT_API_URL"] = url
    done = subprocess.run([sys.executable, "-c", TRANSITION, f"sqlite:///{tmp_path / 'state.db'}"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["changed"] is True
    assert result["queued"] is (named_by is not None) and result["prefect_loaded"] is (named_by is not None), result


@pytest.mark.lab
def test_the_example_automation_of_mn_prefect_up_calls_its_webhook_when_a_node_goes_offline(lab, store, tmp_path):
    from mn_prefect.lab_notifications import (
        NotificationReceiver,
        create_node_offline_automation,
        delete_node_offline_automation,
    )

    said: list[str] = []
    receiver = NotificationReceiver(tmp_path / "notifications.jsonl", said.append)
    try:
        create_node_offline_automation(lab.server.api_url, receiver.url, receiver.secret)
        store.register_node(node("ev-o1"))
        with in_process(lab):
            apply_transition(store, "ev-o1", "healthy", "offline", reason="test: unplugged")
            assert events.emitter().flush(30) == 0
        got = servers.wait_for(lambda: receiver.path.exists() and receiver.path.read_text().splitlines(), timeout=60,
                               what="the Automation's webhook call")
    finally:
        receiver.stop()
        delete_node_offline_automation(lab.server.api_url)
    body = json.loads(got[0])  # kept only when signed with the receiver's secret (MNNotificationWebhook)
    assert {k: body[k] for k in ("kind", "event", "node", "reason")} == {
        "kind": "OFFLINE", "event": "mn.node.offline", "node": "ev-o1", "reason": "test: unplugged"}
    assert len(said) == 1 and "signature verified" in said[0] and "ev-o1" in said[0]
