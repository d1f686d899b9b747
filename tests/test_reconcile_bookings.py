"""Reconcile after node loss for bookings that span nodes or hold capacity for others (docs/operating.md):
a system deployment's copies and reservations, on a real SQLite store."""

from __future__ import annotations

import time
import uuid

from builders import node

from mn_prefect.lifecycle.reconcile import reconcile
from mn_prefect.model.resources import resource_request
from mn_prefect.placement import reservations
from mn_prefect.placement.placing import Placer
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store
from mn_prefect.store.records import FlowRunRecord, put_record


class PrefectRuns:
    """What reconcile asked of Prefect, as the ops flow's effects would carry it out (Prefect is not running)."""

    def __init__(self, states: dict[str, str] | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.states = states or {}

    def reschedule_run(self, run_id: str, reason: str, delay_s: float) -> None:
        self.calls.append(("reschedule", run_id))

    def pause_run(self, run_id: str, reason: str) -> None:
        self.calls.append(("pause", run_id))

    def fail_run(self, run_id: str, reason: str) -> None:
        self.calls.append(("fail", run_id))

    def cancel_run(self, run_id: str, reason: str) -> None:
        self.calls.append(("cancel", run_id))

    def cancel_waiting_run(self, run_id: str, reason: str) -> None:
        self.calls.append(("cancel at once", run_id))

    def run_state(self, run_id: str) -> str | None:
        return self.states.get(run_id, "RUNNING")


def _lose(store, name: str) -> None:
    store.transition_node(name, "offline", from_statuses=("healthy",), reason="test: lost")


def test_losing_one_node_of_a_system_run_releases_only_that_node_s_copy(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    for name in ("n1", "n2", "n3"):
        store.register_node(node(name, cpu=4))
    ask = Ask(agent_id="sweep", request=resource_request({"cpu": 1}))
    assert Placer(store).place("run-1", [ask], job_type="sysbatch").placed
    put_record(store, FlowRunRecord(job_id="run-1", name="sweep", job_type="sysbatch", node="n1"))
    _lose(store, "n2")
    runs = PrefectRuns()
    report = reconcile(store, runs)
    assert sorted(p.node for p in store.active_placements(job_id="run-1")) == ["n1", "n3"]
    assert runs.calls == []  # the copies on n1 and n3 run on: nothing paused, failed or moved
    assert report.checked == 1


def test_a_reservation_on_a_lost_node_is_left_to_its_expiry(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store.register_node(node("n1", cpu=4))
    rid = reservations.reserve(store, resource_request({"cpu": 2}), {"cpu": 2}, 3600).record.job_id
    _lose(store, "n1")
    runs = PrefectRuns()
    report = reconcile(store, runs)
    assert report.checked == 0 and runs.calls == []
    assert [p.reserves for p in store.active_placements(job_id=rid)] == [rid]


def test_the_reconcile_pass_ends_expired_reservations_and_deallocates_the_runs_left_inside(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store.register_node(node("n1", cpu=4))
    rid = reservations.reserve(store, resource_request({"cpu": 2}), {"cpu": 2}, 60).record.job_id
    run_id = str(uuid.uuid4())  # a flow run: cancelled, its worker releases it
    one_core = [Ask(agent_id="a", request=resource_request({"cpu": 1}))]
    assert reservations.place_inside(store, run_id, one_core, rid, None).placed
    assert reservations.place_inside(store, "job-7", one_core, rid, None).placed  # no flow run: released here
    runs = PrefectRuns()
    done = reservations.reconcile(store, runs, now=time.time() + 120)
    assert done == {"expired": [rid], "deallocated": sorted([run_id, "job-7"])}
    assert runs.calls == [("cancel", run_id)]
    assert store.active_placements(job_id=rid) == [] and store.active_placements(job_id="job-7") == []
    assert [e.kind for e in store.events(job_id="job-7")][-1] == "allocation.deallocated"


def test_a_run_inside_an_ended_reservation_that_no_worker_claimed_is_cancelled_at_once_and_released(tmp_path):
    """Scheduled (or Paused): a Cancelling state would wait for a worker to stop a process that does not exist,
    holding the booking; it ends here instead. A Pending run's worker may be starting its process: Prefect lets a
    Cancelled run go Running, so it is left until it is Running (then cancelled) or back to Scheduled."""
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store.register_node(node("n1", cpu=4))
    rid = reservations.reserve(store, resource_request({"cpu": 3}), {"cpu": 3}, 60).record.job_id
    pending, scheduled, running = (str(uuid.uuid4()) for _ in range(3))
    one_core = [Ask(agent_id="a", request=resource_request({"cpu": 1}))]
    for run_id in (pending, scheduled, running):
        assert reservations.place_inside(store, run_id, one_core, rid, None).placed
    runs = PrefectRuns({pending: "PENDING", scheduled: "SCHEDULED", running: "RUNNING"})
    done = reservations.reconcile(store, runs, now=time.time() + 120)
    assert done["deallocated"] == sorted([scheduled, running])
    assert sorted(runs.calls) == sorted([("cancel at once", scheduled), ("cancel", running)])
    assert store.active_placements(job_id=scheduled) == []
    assert [p.job_id for p in store.active_placements(job_id=running)] == [running]  # its worker releases it
    assert [p.job_id for p in store.active_placements(job_id=pending)] == [pending]  # being started: left

    runs.states[pending] = "RUNNING"  # its process started: cancelled like any running run
    done = reservations.reconcile(store, runs, now=time.time() + 180)
    assert pending in done["deallocated"] and ("cancel", pending) in runs.calls

    back = str(uuid.uuid4())  # its worker died while starting it: the orphan sweep put it back to Scheduled
    rid2 = reservations.reserve(store, resource_request({"cpu": 1}), {"cpu": 1}, 60).record.job_id
    assert reservations.place_inside(store, back, one_core, rid2, None).placed
    runs.states[back] = "SCHEDULED"
    done = reservations.reconcile(store, runs, now=time.time() + 120)
    assert back in done["deallocated"] and ("cancel at once", back) in runs.calls
    assert store.active_placements(job_id=back) == []
