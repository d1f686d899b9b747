"""Who owns a booking, and the rules that release only what an ended owner held: the owner table, drains, and
`store audit` with its owner findings and `--repair` (real SQLite store files, the real command line)."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import cli_runner
import pytest
from builders import node

from mn_prefect.lifecycle.drain import advance_drain, start_drain
from mn_prefect.lifecycle.owners import judge, owner_of
from mn_prefect.model.placement import PlacedResources, Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.placement import reservations as rsv
from mn_prefect.store import open_store
from mn_prefect.store.records import JobState, WorkflowRecord, get_record, put_record

MN = str(Path(sys.executable).parent / "mn-prefect")


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'state.db'}"


@pytest.fixture
def store(url):
    s = open_store(url)
    s.register_node(node("n1", cpu=8))
    yield s
    s.close()


def book(store, booking: str, cpu: float = 1) -> None:
    assert store.commit_plan(booking, [Placement(agent_id=booking, node="n1",
                                                 resources=PlacedResources(cpu_cores=cpu))]).ok


def reserve(store, cpu: float = 2, seconds: float = 3600) -> str:
    made = rsv.reserve(store, resource_request({"cpu": cpu}), {"cpu": cpu}, seconds)
    assert made.record is not None, made.plan.reason
    return made.record.job_id


def workflow(store, job_id: str, status: str) -> None:
    put_record(store, WorkflowRecord(job_id=job_id, run_id=job_id, run_dir="/tmp/run", bundle="/tmp/bundle",
                                     status=status))


def job(store, job_id: str, status: str, flow_run_id: str | None = None) -> None:
    put_record(store, JobState(job_id=job_id, job_name="train", job_type="batch", status=status,
                               flow_run_id=flow_run_id))


# -- the owner table -------------------------------------------------------------------------------------------

def test_each_kind_of_booking_is_told_by_its_id_and_records(store):
    run = str(uuid.uuid4())
    job(store, "job-1", "running")
    assert owner_of(store, "rsv-0123abcd").kind == "reservation"
    assert owner_of(store, "wf-1#3").kind == "step_attempt" and owner_of(store, "wf-1#3").owner_id == "wf-1"
    assert owner_of(store, "job-1").kind == "blueprint_job"
    assert owner_of(store, "job-1@n1").kind == "blueprint_job" and owner_of(store, "job-1@n1").owner_id == "job-1"
    assert owner_of(store, run).kind == "flow_run"
    assert owner_of(store, "by-hand").kind == "unknown"


def test_a_reservation_lives_while_active_and_its_time_is_not_up(store):
    rid = reserve(store)
    assert judge(store, rid).gone is False
    assert judge(store, rid, now=time.time() + 7200).gone is True  # its time is up
    rsv.release(store, rid, None)
    assert judge(store, rid).gone is True
    assert judge(store, "rsv-00000000").gone is True  # no record at all


@pytest.mark.parametrize(("status", "gone"), [("running", False), ("pending", False), ("completed", True),
                                              ("crashed", True), ("cancelled", True)])
def test_a_bundle_step_lives_while_its_bundle_run_does(store, status, gone):
    workflow(store, "wf-1", status)
    assert judge(store, "wf-1#1").gone is gone
    assert judge(store, "wf-2#1").gone is True  # no record of its bundle run


@pytest.mark.parametrize(("state", "gone"), [("RUNNING", False), ("SCHEDULED", False), ("COMPLETED", True),
                                             ("CRASHED", True), (None, True)])
def test_a_flow_run_is_judged_by_its_state_and_not_at_all_without_prefect(store, state, gone):
    run = str(uuid.uuid4())
    assert judge(store, run).gone is None  # without Prefect nobody can tell
    assert judge(store, run, run_state={run: state}.get).gone is gone


def test_a_blueprint_job_lives_until_it_finishes_or_its_coordinator_run_is_over(store):
    coordinator = str(uuid.uuid4())
    job(store, "job-1", "running", coordinator)
    assert judge(store, "job-1").gone is False
    assert judge(store, "job-1@n1", run_state={coordinator: "RUNNING"}.get).gone is False
    assert judge(store, "job-1@n1", run_state={coordinator: "FAILED"}.get).gone is True
    job(store, "job-1", "completed", coordinator)
    assert judge(store, "job-1").gone is True


def test_an_unreadable_prefect_leaves_a_run_unjudged(store):
    def away(run_id):
        raise ConnectionError("the API does not answer")

    verdict = judge(store, str(uuid.uuid4()), run_state=away)
    assert verdict.gone is None and "cannot be read now" in verdict.why


# -- drains ----------------------------------------------------------------------------------------------------

class NoRunEffects:
    """A drain of a node holding only a reservation touches no flow run: any call is a failure."""

    def __getattr__(self, name):
        raise AssertionError(f"the drain called {name} for a reservation")


def test_a_drain_waits_for_a_reservation_and_never_releases_it(store):
    rid = reserve(store)
    start_drain(store, "n1", "kernel update", deadline_s=0)
    result = advance_drain(store, NoRunEffects(), "n1", now=time.time() + 10)  # past the deadline
    [action] = result.actions
    assert action["job_id"] == rid and action["action"] == "wait" and "holds capacity here until" in action["reason"]
    assert result.status == "draining"
    assert sum(p.resources.cpu_cores for p in store.active_placements(job_id=rid)) == 2
    rsv.release(store, rid, None)
    assert advance_drain(store, NoRunEffects(), "n1").status == "complete"


# -- store audit -----------------------------------------------------------------------------------------------

def audit(url: str, *args: str) -> tuple[int, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    done = cli_runner.run(["store", "audit", url, "--json", *args], env=env, whole_env=True)
    return done.returncode, json.loads(done.stdout)


def kinds(report: dict) -> list[tuple[str, str]]:
    return sorted((f["kind"], f["subject"]) for f in report["findings"])


def test_a_sound_store_has_no_findings_and_says_flow_runs_went_unchecked(store, url):
    book(store, str(uuid.uuid4()))
    reserve(store)
    code, report = audit(url)
    assert code == 0 and report["sound"] and report["findings"] == []
    assert report["flow_runs"] == "not checked: no Prefect server is configured"


def test_a_reservation_that_lost_its_capacity_is_found_and_held_again(store, url):
    rid = reserve(store)
    store.release(rid)  # what a stop that released everything did
    code, report = audit(url)
    assert code == 1 and kinds(report) == [("reservation_not_held", rid)]
    assert "holds no capacity" in report["findings"][0]["finding"]
    code, report = audit(url, "--repair", "--dry-run")
    assert code == 1 and report["repair"] == "dry run" and store.active_placements(job_id=rid) == []
    code, report = audit(url, "--repair")
    assert code == 0 and report["findings"][0]["repaired"], report
    assert sum(p.resources.cpu_cores for p in store.active_placements(job_id=rid)) == 2
    assert [e.kind for e in store.events(job_id=rid)][-1] == "audit.repaired"
    assert audit(url) == (0, audit(url)[1]) and audit(url)[1]["findings"] == []


def test_a_reservation_that_cannot_be_held_again_is_left_and_said(store, url):
    rid = reserve(store, cpu=8)
    store.release(rid)
    book(store, str(uuid.uuid4()), cpu=8)  # someone took the node meanwhile
    code, report = audit(url, "--repair")
    assert code == 1 and not report["findings"][0]["repaired"]
    assert report["findings"][0]["outcome"].startswith("cannot hold it again now")


def test_bookings_that_outlived_their_owner_are_found_and_released(store, url):
    rid = reserve(store)
    record = get_record(store, rid, rsv.ReservationRecord)
    put_record(store, record.model_copy(update={"status": "released", "reason": "by hand"}))  # booking kept
    workflow(store, "wf-9", "crashed")
    book(store, "wf-9#2")
    job(store, "job-7", "completed")
    book(store, "job-7")
    alive = str(uuid.uuid4())
    book(store, alive)  # a flow run: not judged without Prefect, kept
    code, report = audit(url)
    assert code == 1 and kinds(report) == [("owner_ended", "job-7"), ("owner_ended", rid),
                                           ("owner_ended", "wf-9#2")]
    before = sorted(store.active_jobs())
    assert audit(url, "--repair", "--dry-run")[0] == 1 and sorted(store.active_jobs()) == before
    code, report = audit(url, "--repair")
    assert code == 0 and all(f["repaired"] for f in report["findings"]), report
    assert store.active_jobs() == [alive]
    for booking in ("job-7", rid, "wf-9#2"):
        assert any(e.kind == "audit.repaired" for e in store.events(job_id=booking)), booking


def test_dry_run_without_repair_is_refused(url, store):
    done = cli_runner.run(["store", "audit", url, "--dry-run"])
    assert done.returncode == 2 and "--dry-run: only with --repair" in done.stderr


def test_a_reservation_whose_booking_a_failover_lost_is_booked_again_or_taken_back_if_taken(store):
    from mn_prefect.placement.reservations import ReservationError, _write_again

    rid = reserve(store, cpu=8)
    record = get_record(store, rid, rsv.ReservationRecord)
    placements = store.active_placements(job_id=rid)
    store.release(rid)  # what a failover that dropped the commit leaves
    _write_again(store, record, placements)
    assert sum(p.resources.cpu_cores for p in store.active_placements(job_id=rid)) == 8
    store.release(rid)
    book(store, str(uuid.uuid4()), cpu=8)  # taken meanwhile
    with pytest.raises(ReservationError, match="lost in a store failover"):
        _write_again(store, record, placements)
    # No refused record: the record stays as written, for reserve to take back (withdraw) before it raises.
    assert get_record(store, rid, rsv.ReservationRecord) == record and store.active_placements(job_id=rid) == []
    rsv.withdraw(store, rid)
    assert get_record(store, rid) is None


def test_a_refused_record_an_earlier_version_kept_is_never_listed_and_audits_clean(store, url):
    rid = reserve(store)
    old = rsv.ReservationRecord(job_id="rsv-00000000aaaa", status="refused", expires_at=time.time() + 3600,
                                resources={"cpu": 64}, reason="no node has 64 free cores", ended_at=time.time())
    put_record(store, old)
    assert [r.job_id for r in rsv.listing(store, every=True)] == [rid]
    listed = cli_runner.run(["reserve", "--list", "--all", "--json", "--store-url", url], env={"PREFECT_API_URL": ""})
    assert listed.returncode == 0 and [r["id"] for r in json.loads(listed.stdout)] == [rid]
    code, report = audit(url)
    assert code == 0 and report["sound"] and report["findings"] == []
    assert judge(store, old.job_id).gone  # a booking under its id, were there one, would be released


def test_a_stopped_lab_releases_what_its_runs_jobs_and_steps_held_and_keeps_reservations(store, url):
    from mn_prefect.lifecycle.interrupted import release_interrupted

    run = str(uuid.uuid4())
    book(store, run)
    job(store, "job-3", "running")
    book(store, "job-3")
    workflow(store, "wf-4", "running")
    book(store, "wf-4#1")
    book(store, "by-hand")
    hold = "hold-0123456789abcdef"
    book(store, hold)
    rid = reserve(store)
    released, kept, unknown = release_interrupted(url)
    assert sorted(released) == sorted([run, "job-3", "wf-4#1", hold]) and kept == [rid] and unknown == ["by-hand"]
    assert sorted(store.active_jobs()) == sorted(["by-hand", rid])
    assert [e.reason for e in store.events(job_id=run) if e.kind == "job.released"] == [
        "the lab was stopped while its flow run held the booking"]
    assert [e.reason for e in store.events(job_id="wf-4#1") if e.kind == "job.released"] == [
        "the lab was stopped while its bundle step held the booking"]
    assert [e.reason for e in store.events(job_id=hold) if e.kind == "job.released"] == [
        "the lab was stopped while its hold held the booking"]  # a hold's words were missing: a KeyError
