"""Bookings typed by owner: what a booking id tells of its owner, each owner kind's release rule (kind x reason),
and the one release function, which refuses without touching the store (a real SQLite store file, no server)."""

from __future__ import annotations

import pytest
from builders import node

from mn_prefect.model.bookings import (
    OWNER_KINDS,
    WHYS,
    FlowRun,
    Hold,
    JobBooking,
    ReleaseRefused,
    Reservation,
    StepAttempt,
    SystemCopy,
    Unknown,
    copy_agent,
    job_booking,
    may_release,
    owning_job,
    owning_run,
    parse,
)
from mn_prefect.model.placement import PlacedResources, Placement
from mn_prefect.placement import bookings
from mn_prefect.placement.job_state import release_job
from mn_prefect.placement.placing import Placer
from mn_prefect.store import open_store
from mn_prefect.store.records import JobState, put_record

RUN = "6f1c2a1e-9b7d-4c3e-8a52-0d4e7b1f9a21"  # a flow run's id (fixed: xdist collects the ids alike)

# -- what the id alone tells ---------------------------------------------------------------------------------------

PARSED = [
    (RUN, FlowRun(RUN)),
    ("rsv-0123abcd", Reservation("rsv-0123abcd")),
    ("rsv-0123456789ab", Reservation("rsv-0123456789ab")),
    ("hold-0123456789abcdef", Hold("hold-0123456789abcdef")),
    ("hold-run", Unknown("hold-run")),  # not a hold's id
    ("wf-1#3", StepAttempt("wf-1", "3")),
    ("wf-1#3#x", StepAttempt("wf-1", "3#x")),  # the first '#' parts the workflow job from its launch
    ("job-1", Unknown("job-1")),  # a blueprint job is told by its record (classify)
    ("job-1@n1", Unknown("job-1@n1")),
    ("rsv-XYZ", Unknown("rsv-XYZ")),  # not a reservation's id
    ("by-hand", Unknown("by-hand")),
]


@pytest.mark.parametrize(("booking", "owner"), PARSED, ids=[b for b, _ in PARSED])
def test_parse_tells_the_owner_the_id_alone_tells_and_str_gives_the_id_back(booking, owner):
    assert parse(booking) == owner
    assert str(owner) == booking


# Every kind: its stored id, its owner's own id, and the words people are told (events, audit, up --down).
ROUND_TRIPS = [
    (FlowRun(RUN), RUN, RUN, "flow run"),
    (JobBooking("job-1"), "job-1", "job-1", "blueprint job"),
    (JobBooking("job-1", "m2"), "job-1@m2", "job-1", "blueprint job"),
    (SystemCopy("job-1", "n1"), "job-1@n1", "job-1", "blueprint job"),
    (Reservation("rsv-0123abcd"), "rsv-0123abcd", "rsv-0123abcd", "reservation"),
    (Hold("hold-0123456789abcdef"), "hold-0123456789abcdef", "hold-0123456789abcdef", "hold"),
    (StepAttempt("wf-1", "3"), "wf-1#3", "wf-1", "bundle step"),
    (Unknown("by-hand"), "by-hand", "by-hand", "unknown owner"),
]


@pytest.mark.parametrize(("owner", "stored", "owner_id", "words"), ROUND_TRIPS, ids=[r[1] for r in ROUND_TRIPS])
def test_each_owner_renders_its_stored_id_and_is_read_back_from_it(owner, stored, owner_id, words):
    assert str(owner) == stored and owner.owner_id == owner_id and owner.words == words
    if isinstance(owner, (JobBooking, SystemCopy)):  # told by the job's record: see classify below
        assert job_booking(owner.job_id, stored, system=isinstance(owner, SystemCopy)) == owner
        assert owning_job(stored) == owner.job_id
    else:
        assert parse(stored) == owner


def test_every_kind_has_its_round_trip_and_its_words():
    assert {type(owner) for owner, *_ in ROUND_TRIPS} == set(OWNER_KINDS)


@pytest.mark.parametrize(("booking", "run"), [(RUN, RUN), (f"{RUN}@n1", RUN), ("job-1@n1", "job-1")])
def test_a_run_s_booking_names_its_run(booking, run):
    assert owning_run(booking) == run


def test_a_system_job_s_agent_copy_is_named_by_its_agent_and_node():
    assert copy_agent("worker", "n1") == "worker@n1"
    assert owning_job(copy_agent("job-1", "n1")) == "job-1"


def test_a_blueprint_jobs_bookings_are_its_own_a_moved_agents_or_a_system_copys():
    assert job_booking("job-1", "job-1", system=False) == JobBooking("job-1")
    assert job_booking("job-1", "job-1@m2", system=False) == JobBooking("job-1", "m2")
    assert job_booking("job-1", "job-1@n1", system=True) == SystemCopy("job-1", "n1")
    assert str(JobBooking("job-1", "m2")) == "job-1@m2" and str(SystemCopy("job-1", "n1")) == "job-1@n1"
    with pytest.raises(ValueError, match="not one of job job-1's"):
        job_booking("job-1", "job-2@n1", system=True)


# -- the release rules: each kind x each reason ----------------------------------------------------------------------

ALLOWED = {
    FlowRun: {"run_ended", "preempted", "not_started", "health_check", "orphaned", "node_lost", "drain",
              "reservation_deallocated", "audit_owner_ended", "lab_stopped"},
    JobBooking: {"job_finished", "replaced", "reservation_deallocated", "audit_owner_ended", "lab_stopped"},
    SystemCopy: {"job_finished", "replaced", "audit_owner_ended", "lab_stopped"},
    Reservation: {"reservation_ended", "audit_owner_ended"},
    Hold: {"hold_ended", "audit_owner_ended", "lab_stopped"},
    StepAttempt: {"step_ended", "bundle_ended", "audit_owner_ended", "lab_stopped"},
    Unknown: {"reservation_deallocated"},
}
SAMPLE = {FlowRun: FlowRun(RUN), JobBooking: JobBooking("job-1"), SystemCopy: SystemCopy("job-1", "n1"),
          Reservation: Reservation("rsv-0123abcd"), Hold: Hold("hold-0123abcd"), StepAttempt: StepAttempt("wf-1", "3"), Unknown: Unknown("by-hand")}
CASES = [(kind, why) for kind in OWNER_KINDS for why in WHYS]


def test_the_table_covers_every_kind_and_names_only_known_reasons():
    assert set(ALLOWED) == set(OWNER_KINDS) == set(SAMPLE)
    assert all(allowed <= set(WHYS) for allowed in ALLOWED.values())
    assert all(kind.released_by == frozenset(ALLOWED[kind]) for kind in OWNER_KINDS)


@pytest.mark.parametrize(("kind", "why"), CASES, ids=[f"{k.kind}-{w}" for k, w in CASES])
def test_each_kind_is_released_for_its_own_reasons_only(kind, why):
    assert may_release(SAMPLE[kind], why) is (why in ALLOWED[kind])


def test_what_were_bugs_is_refused():
    reservation = Reservation("rsv-0123abcd")
    for why in ("lab_stopped", "node_down", "node_lost", "drain", "run_ended", "job_finished"):
        assert not may_release(reservation, why)  # mn up --down, a node going down, a drain: never a reservation
    assert not any(may_release(SAMPLE[kind], "node_down") for kind in OWNER_KINDS)  # its work waits for it
    assert not may_release(SystemCopy("job-1", "n1"), "node_lost")  # a system copy waits for its node
    assert not may_release(Unknown("by-hand"), "audit_owner_ended") and not may_release(Unknown("x"), "lab_stopped")
    assert not may_release(FlowRun(RUN), "no-such-reason")


# -- the one release function ---------------------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path):
    s = open_store(f"sqlite:///{tmp_path}/s.db")
    s.register_node(node("n1", cpu=8))
    s.register_node(node("n2", cpu=8))
    yield s
    s.close()


def book(store, booking: str, *nodes: str) -> None:
    assert store.commit_plan(booking, [Placement(agent_id=f"{booking}-{n}", node=n,
                                                 resources=PlacedResources(cpu_cores=1))
                                       for n in nodes or ("n1",)]).ok


@pytest.mark.parametrize(("kind", "why"), [(k, w) for k, w in CASES if w not in ALLOWED[k]],
                         ids=[f"{k.kind}-{w}" for k, w in CASES if w not in ALLOWED[k]])
def test_a_refused_release_raises_and_touches_nothing(store, kind, why):
    owner = SAMPLE[kind]
    book(store, str(owner))
    with pytest.raises(ReleaseRefused) as refused:
        bookings.release(store, owner, why)
    text = str(refused.value)
    assert str(owner) in text and kind.kind.replace("_", " ") in text and repr(why) in text
    assert refused.value.owner == owner and refused.value.why == why
    assert str(owner) in store.active_jobs() and len(store.active_placements(job_id=str(owner))) == 1


@pytest.mark.parametrize(("kind", "why"), [(k, w) for k, w in CASES if w in ALLOWED[k]],
                         ids=[f"{k.kind}-{w}" for k, w in CASES if w in ALLOWED[k]])
def test_an_allowed_release_releases(store, kind, why):
    owner = SAMPLE[kind]
    book(store, str(owner))
    assert bookings.release(store, owner, why) == 1
    assert str(owner) not in store.active_jobs()
    assert bookings.release(store, owner, why) == 0  # released already: nothing left


def test_an_allowed_release_on_one_node_keeps_the_others(store):
    book(store, RUN, "n1", "n2")
    assert bookings.release(store, FlowRun(RUN), "orphaned", node="n2") == 1
    assert [p.node for p in store.active_placements(job_id=RUN)] == ["n1"]
    with pytest.raises(ReleaseRefused):
        bookings.release(store, FlowRun(RUN), "node_down", node="n1")
    assert [p.node for p in store.active_placements(job_id=RUN)] == ["n1"]


def test_classify_tells_a_blueprint_jobs_bookings_by_its_record(store):
    put_record(store, JobState(job_id="job-1", job_name="train", job_type="batch", status="running"))
    put_record(store, JobState(job_id="sys-1", job_name="agents", job_type="system", status="running"))
    assert bookings.classify(store, "job-1") == JobBooking("job-1")
    assert bookings.classify(store, "job-1@m1") == JobBooking("job-1", "m1")
    assert bookings.classify(store, "sys-1@n2") == SystemCopy("sys-1", "n2")
    assert bookings.classify(store, "job-2@n1") == Unknown("job-2@n1")
    assert bookings.classify(store, RUN) == FlowRun(RUN)
    assert bookings.classify(store, "rsv-0123abcd") == Reservation("rsv-0123abcd")
    assert bookings.classify(store, "job-1#2") == StepAttempt("job-1", "2")


def test_a_finished_jobs_bookings_copies_and_moves_included_are_released(store):
    job = JobState(job_id="sys-1", job_name="agents", job_type="system", status="running",
                   bookings=["sys-1@n1", "sys-1@n2"])
    book(store, "sys-1@n1", "n1")
    book(store, "sys-1@n2", "n2")
    assert release_job(store, job, "cancelled", "by hand") == 2
    assert store.active_jobs() == []


def test_the_placer_checks_the_rule_when_told_why(store):
    placer = Placer(store)
    book(store, "rsv-0123abcd")
    with pytest.raises(ReleaseRefused):
        placer.release("rsv-0123abcd", why="run_ended")
    assert placer.release("rsv-0123abcd", why="reservation_ended") == 1
    book(store, "wf-1#3")
    assert placer.release("wf-1#3", why="bundle_ended") == 1
    book(store, "by-hand")
    with pytest.raises(TypeError):
        placer.release("by-hand")  # type: ignore[call-arg]  # no release without a reason
    assert store.active_placements(job_id="by-hand")
