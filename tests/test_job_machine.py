"""A blueprint job's supervision without a server: the pure machine the coordinator flow drives."""

from __future__ import annotations

from typing import Any

import pytest

from mn_prefect.jobs.machine import Effects, JobFailed, JobMachine, JobNotRunnable, Move, Stop, ending
from mn_prefect.model.blueprint import Blueprint, parse_blueprint
from mn_prefect.model.blueprint_job import AgentRun, AgentTrack, BlueprintJob
from mn_prefect.model.placement import Placement, Plan

NOW = 1_700_000_000.0
NOW_MS = int(NOW * 1000)
FITS = Plan(status="runnable_now")


def blueprint(*agents: str, job_type: str = "batch", recovery_mode: str = "cluster_recover",
              config: dict[str, Any] | None = None, **policies: Any) -> Blueprint:
    raw = {"job_name": "t", "policies": {"job_type": job_type, "recovery_mode": recovery_mode, **policies},
           "nodes": [{"node_id": a, "config": {"command": ["true"], **(config or {})}} for a in agents]}
    parsed, issues = parse_blueprint(raw)
    assert not issues and parsed is not None
    return parsed


def record(spec: Blueprint, **fields: Any) -> BlueprintJob:
    return BlueprintJob(job_id="job", job_name=spec.job_name, job_type=spec.job_type, pool="p",
                        recovery_mode=spec.recovery_mode, **fields)


def placed(agent_id: str, node: str) -> Placement:
    return Placement(agent_id=agent_id, source_agent_id=agent_id.split("@")[0], node=node)


def started(spec: Blueprint, nodes: dict[str, str]) -> JobMachine:
    """A machine whose job was booked with each agent (or ``agent@node`` copy) on its node, its first runs
    started at NOW."""
    machine = JobMachine(spec, record(spec))
    machine.begin(None, {}, NOW)
    [book] = machine.placing(NOW).books
    committed: dict[str, list[Placement]] = {}
    for agent_id, node in nodes.items():
        committed.setdefault(f"job@{node}" if book.copies else "job", []).append(placed(agent_id, node))
    assert machine.booked(book, committed, FITS, NOW) == Effects()
    for launch in machine.due(NOW):
        machine.launched(launch, f"{launch.agent_id}-run-1", NOW)
    return machine


def kinds(machine: JobMachine) -> list[str | None]:
    return [note.kind for note in machine.take_notes()]


# -- booking and starting -------------------------------------------------------------------------------------

def test_a_new_job_is_submitted_booked_whole_and_every_agent_started():
    machine = started(blueprint("a", "b"), {"a": "n1", "b": "n2"})
    job = machine.job
    assert (job.status, job.reason, job.bookings) == ("running", "2 agent(s) started", ["job"])
    assert kinds(machine) == ["job.submitted", None, None, "job.placed", None, None]  # None: only logged
    assert machine.running() == {"a": "a-run-1", "b": "b-run-1"}
    assert machine.due(NOW) == []  # nothing more to start


def test_an_agent_s_run_carries_its_command_and_is_pinned_to_its_booking():
    spec = blueprint("a", config={"command": ["python", "-V"], "environment": {"X": "1"}, "timeout_seconds": 9})
    machine = JobMachine(spec, record(spec))
    [book] = machine.placing(NOW).books
    machine.booked(book, {"job": [placed("a", "n1")]}, FITS, NOW)
    [launch] = machine.due(NOW)
    assert launch.name == "job.a.1"
    assert launch.parameters == {"job_id": "job", "agent_id": "a", "command": ["python", "-V"],
                                 "environment": {"X": "1"}, "pass_env": [], "workdir": None, "timeout_seconds": 9,
                                 "attempt": 1}
    assert launch.job_variables == {"booking": {"job_id": "job", "agent_id": "a"}}


def test_a_job_that_does_not_fit_waits_1_s_doubling_to_5_s_and_says_why_once():
    spec = blueprint("a")
    machine = JobMachine(spec, record(spec))
    short = Plan(status="runnable_later", reason="waiting for capacity: a")
    now, waits = NOW, []
    for _ in range(5):
        [book] = machine.placing(now).books
        assert machine.booked(book, {}, short, now) == Effects()
        wait = next(t for t in (0.5, 1, 2, 4, 5) if machine.placing(now + t).books)
        waits.append(wait)
        now += wait
    assert waits == [1, 2, 4, 5, 5]
    assert (machine.job.status, machine.job.reason) == ("waiting", "waiting for capacity: a")
    assert kinds(machine) == ["job.waiting"] and machine.job.agents == {}


def test_a_job_no_node_could_ever_take_is_refused():
    spec = blueprint("a")
    machine = JobMachine(spec, record(spec))
    [book] = machine.placing(NOW).books
    effects = machine.booked(book, {}, Plan(status="not_runnable", reason="no node has 64 cpu"), NOW)
    assert isinstance(effects.failure, JobNotRunnable)
    assert str(effects.failure) == "no node can ever take this job: no node has 64 cpu"


def test_a_node_whose_copy_completed_or_restarts_gets_no_second_copy_but_a_new_node_gets_one():
    for job_type, state in (("sysbatch", "COMPLETED"), ("system", "FAILED")):
        machine = started(blueprint("m", job_type=job_type), {"m@n1": "n1", "m@n2": "n2"})
        assert machine.job.bookings == ["job@n1", "job@n2"]
        machine.observed("m@n1", state, state.title(), None, NOW + 1)
        plan = Plan(status="runnable_now", placements=tuple(placed(f"m@{n}", n) for n in ("n1", "n2", "n3")))
        assert {b: [p.agent_id for p in ps] for b, ps in machine.copies(plan).items()} == {"job@n3": ["m@n3"]}


def test_a_system_job_looks_for_new_nodes_every_5_s_and_a_batch_job_books_once():
    system = started(blueprint("m", job_type="system"), {"m@n1": "n1"})
    assert system.placing(NOW + 4).books == [] and system.placing(NOW + 5).books[0].copies
    batch = started(blueprint("a"), {"a": "n1"})
    assert batch.placing(NOW + 60).books == []


# -- runs ending ----------------------------------------------------------------------------------------------

def test_a_batch_job_completes_once_every_agent_has_completed():
    machine = started(blueprint("a", "b"), {"a": "n1", "b": "n2"})
    first = machine.observed("a", "COMPLETED", "Completed", None, NOW + 1)
    assert first is not None and first.action == "complete"
    assert machine.done() is None  # b still runs
    machine.observed("b", "COMPLETED", "Completed", None, NOW + 2)
    done = machine.done()
    assert done is not None and (done.status, done.reason) == ("completed", "all 2 agent(s) completed")


def test_a_run_that_has_not_ended_only_updates_the_agent_s_record():
    machine = started(blueprint("a"), {"a": "n1"})
    assert machine.observed("a", "RUNNING", "Running", None, NOW + 1) is None
    track = machine.job.agents["a"]
    assert track.status == "running" and track.current is not None and track.current.state == "RUNNING"


def test_a_failed_agent_restarts_after_its_delay_then_fails_the_job_with_its_history():
    policy = {"attempts": 1, "interval_ms": 600_000, "delay_ms": 2000, "delay_function": "constant", "mode": "fail"}
    machine = started(blueprint("a", restart=policy), {"a": "n1"})
    machine.take_notes()
    restart = machine.observed("a", "FAILED", "Failed", "exit 3", NOW + 1)
    assert restart is not None and restart.action == "restart" and restart.start_at == NOW + 3
    assert machine.job.agents["a"].restarts_ms == [NOW_MS + 1000]
    assert kinds(machine) == ["agent.restarting"]
    assert machine.due(NOW + 2.9) == []
    [launch] = machine.due(NOW + 3)
    assert launch.name == "job.a.2" and launch.parameters["attempt"] == 2
    machine.launched(launch, "a-run-2", NOW + 3)
    failed = machine.observed("a", "FAILED", "Failed", "exit 3", NOW + 4)
    assert failed is not None and failed.action == "fail"
    assert failed.reason == ("agent a failed (Failed: exit 3); restart attempts exhausted (1 in 600 s); "
                             "history: #1 FAILED (exit 3), #2 FAILED (exit 3)")
    assert machine.job.agents["a"].status == "failed" and machine.done() is None


def test_a_service_never_completes_by_itself_a_clean_exit_restarts_it():
    machine = started(blueprint("svc", job_type="service"), {"svc": "n1"})
    exit = machine.observed("svc", "COMPLETED", "Completed", None, NOW + 1)
    assert exit is not None and exit.action == "restart" and "exited unexpectedly" in exit.reason
    assert machine.done() is None


def test_the_runs_to_cancel_at_the_end_are_those_of_agents_that_did_not_complete():
    machine = started(blueprint("a", "b"), {"a": "n1", "b": "n2"})
    machine.observed("a", "COMPLETED", "Completed", None, NOW + 1)
    assert [(s.run.run_id, s.lost) for s in machine.stops("cancelled")] == [("b-run-1", False)]


@pytest.mark.parametrize("error,cancelling,expected", [
    (JobFailed("agent a failed"), True, ("failed", "agent a failed")),
    (KeyboardInterrupt(), False, ("cancelled", "the job was cancelled")),
    (ConnectionError("api down"), True, ("cancelled", "the job was cancelled")),
    (ConnectionError("api down"), False, ("failed", "ConnectionError: api down")),
])
def test_what_stopped_the_coordinator_decides_how_the_job_ends(error, cancelling, expected):
    assert ending(error, cancelling=cancelling) == expected


# -- lost nodes -----------------------------------------------------------------------------------------------

def test_an_agent_on_a_lost_node_moves_and_uses_a_reschedule_attempt():
    machine = started(blueprint("a"), {"a": "n1"})
    [book] = machine.node_actions({"n1": "offline"}, {}, NOW).books
    assert book.move == Move("a", "node n1 is offline", lost=True) and book.booking == "job@m1"
    after = machine.booked(book, {book.booking: [placed("a", "n2")]}, FITS, NOW)
    track = machine.job.agents["a"]
    assert after.stops == [Stop(track.runs[0], lost=True, reason="node n1 is offline")]  # crashed: no worker left
    assert after.releases == [("job", "n1")]
    assert track.reschedules_ms == [NOW_MS] and (track.node, track.booking) == ("n2", "job@m1")
    assert track.status == "restarting" and track.next_start_at == NOW + 5  # batch reschedule delay: 5 s
    assert machine.job.bookings == ["job", "job@m1"] and kinds(machine)[-1] == "job.rescheduled"


def test_a_gang_booking_is_released_only_when_no_other_agent_holds_it_on_that_node():
    machine = started(blueprint("a", "b"), {"a": "n1", "b": "n1"})
    first, second = machine.node_actions({"n1": "offline"}, {}, NOW).books
    assert first.booking != second.booking
    assert machine.booked(first, {first.booking: [placed("a", "n2")]}, FITS, NOW).releases == []  # b holds it
    assert machine.booked(second, {second.booking: [placed("b", "n3")]}, FITS, NOW).releases == [("job", "n1")]


def test_a_lost_node_fails_the_job_once_the_agent_s_reschedules_are_exhausted():
    machine = started(blueprint("a"), {"a": "n1"})
    [book] = machine.node_actions({"n1": "offline"}, {}, NOW).books
    machine.booked(book, {book.booking: [placed("a", "n2")]}, FITS, NOW)
    [launch] = machine.due(NOW + 5)
    machine.launched(launch, "a-run-2", NOW + 5)
    effects = machine.node_actions({"n1": "offline", "n2": "offline"}, {}, NOW + 10)
    assert isinstance(effects.failure, JobFailed) and effects.books == []
    assert str(effects.failure) == "agent a: node n2 is offline; reschedule attempts exhausted (1 used)"


def test_a_lost_node_pauses_work_not_under_cluster_recover_for_review():
    machine = started(blueprint("a", recovery_mode="local_restart"), {"a": "n1"})
    machine.take_notes()
    reason = "node n1 is offline; recovery_mode local_restart: paused for review"
    assert machine.node_actions({"n1": "offline"}, {}, NOW) == Effects(pauses=[("a-run-1", reason)])
    assert (machine.job.agents["a"].status, machine.job.agents["a"].reason) == ("paused", reason)
    assert kinds(machine) == ["job.paused"]
    assert machine.node_actions({"n1": "offline"}, {}, NOW + 10) == Effects()  # paused once


def test_a_disconnected_node_inside_its_grace_window_is_waited_for():
    machine = started(blueprint("a"), {"a": "n1"})
    assert machine.node_actions({"n1": "disconnected"}, {}, NOW) == Effects()
    assert machine.job.agents["a"].status == "running"


def test_a_blocked_agent_is_retried_after_5_s_doubling_to_60_s_without_using_a_reschedule():
    machine = started(blueprint("a"), {"a": "n1"})
    full = Plan(status="runnable_later", reason="no node has 1 cpu free")
    now, waits = NOW, []
    for _ in range(6):
        [book] = machine.node_actions({"n1": "offline"}, {}, now).books
        assert machine.booked(book, {}, full, now) == Effects()
        track = machine.job.agents["a"]
        waits.append(track.blocked_backoff_s)
        assert track.status == "blocked" and track.next_start_at == now + track.blocked_backoff_s
        assert machine.node_actions({"n1": "offline"}, {}, now + track.blocked_backoff_s - 0.1) == Effects()
        now += track.blocked_backoff_s
    assert waits == [5, 10, 20, 40, 60, 60]
    track = machine.job.agents["a"]
    assert track.reason == "node n1 is offline; blocked, nothing fits now (retry in 60 s): no node has 1 cpu free"
    assert track.reschedules_ms == [] and machine.job.bookings == ["job"]
    [book] = machine.node_actions({"n1": "offline"}, {}, now).books
    machine.booked(book, {book.booking: [placed("a", "n2")]}, FITS, now)
    assert track.blocked_backoff_s == 0 and track.reschedules_ms == [int(now * 1000)]


# -- drains ---------------------------------------------------------------------------------------------------

def test_a_drain_migrates_a_service_without_using_a_reschedule_attempt():
    machine = started(blueprint("svc", job_type="service"), {"svc": "n1"})
    [book] = machine.node_actions({"n1": "draining"}, {"n1": NOW + 600}, NOW).books
    assert book.move == Move("svc", "drain of n1: service with cluster_recover migrates", lost=False)
    after = machine.booked(book, {book.booking: [placed("svc", "n2")]}, FITS, NOW)
    track = machine.job.agents["svc"]
    assert [s.lost for s in after.stops] == [False]  # cancelled: its worker stops it
    assert track.reschedules_ms == [] and track.next_start_at == NOW  # starts at once
    assert kinds(machine)[-1] == "job.migrated"


def test_batch_work_on_a_draining_node_may_finish_before_the_deadline():
    machine = started(blueprint("a"), {"a": "n1"})
    assert machine.node_actions({"n1": "draining"}, {"n1": NOW + 600}, NOW) == Effects()
    assert machine.job.agents["a"].status == "running"


def test_past_the_deadline_batch_work_safe_to_retry_migrates():
    machine = started(blueprint("a", config={"safe_to_retry": True}), {"a": "n1"})
    [book] = machine.node_actions({"n1": "draining"}, {"n1": NOW - 1}, NOW).books
    assert book.move is not None and not book.move.lost


def test_past_the_deadline_batch_work_not_safe_to_retry_is_left_running_for_review():
    machine = started(blueprint("a"), {"a": "n1"})
    machine.take_notes()
    assert machine.node_actions({"n1": "draining"}, {"n1": NOW - 1}, NOW) == Effects()
    track = machine.job.agents["a"]
    assert track.status == "running"  # never killed
    assert track.reason == "deadline passed and not safe to move: paused for review (left running)"
    assert kinds(machine) == ["agent.paused"]
    machine.node_actions({"n1": "draining"}, {"n1": NOW - 1}, NOW + 2)
    assert kinds(machine) == []  # said once


# -- a coordinator re-placed after node loss ------------------------------------------------------------------

def previous_track(spec: Blueprint, agent_id: str, node: str, **history: Any) -> AgentTrack:
    agent = spec.agent(agent_id)
    return AgentTrack(agent_id=agent_id, source_agent_id=agent_id, node=node, booking="job", status="running",
                      runs=[AgentRun(run_id=f"{agent_id}-old", attempt=1, state="RUNNING", started_at=NOW - 60)],
                      restart=agent.restart, reschedule=agent.reschedule, **history)


def test_resume_carries_history_and_stops_lost_runs_as_crashed_and_others_as_cancelled():
    spec = blueprint("a", "b")
    previous = record(spec, status="running", bookings=["job", "job@m1"],
                      agents={"a": previous_track(spec, "a", "n1", restarts_ms=[NOW_MS - 30_000]),
                              "b": previous_track(spec, "b", "n2")})
    machine = JobMachine(spec, record(spec))
    effects = machine.begin(previous, {"n1": "offline", "n2": "healthy"}, NOW)
    assert effects.failure is None and machine.job.generation == 2
    assert [(s.run.run_id, s.lost) for s in effects.stops] == [("a-old", True), ("b-old", False)]
    assert effects.releases == [("job", None), ("job@m1", None)]
    assert kinds(machine) == ["job.resumed", "job.submitted"]
    [book] = machine.placing(NOW).books
    machine.booked(book, {"job": [placed("a", "n3"), placed("b", "n2")]}, FITS, NOW)
    a, b = machine.job.agents["a"], machine.job.agents["b"]
    assert [r.run_id for r in a.runs] == ["a-old"] and a.restarts_ms == [NOW_MS - 30_000]
    assert a.reschedules_ms == [NOW_MS] and b.reschedules_ms == []  # only the lost one used an attempt
    assert [launch.parameters["attempt"] for launch in machine.due(NOW)] == [2, 2]


def test_resume_fails_when_an_agent_lost_with_the_coordinator_has_no_reschedule_left():
    spec = blueprint("a")
    previous = record(spec, status="running", bookings=["job"],
                      agents={"a": previous_track(spec, "a", "n1", reschedules_ms=[NOW_MS - 60_000])})
    effects = JobMachine(spec, record(spec)).begin(previous, {"n1": "offline"}, NOW)
    assert isinstance(effects.failure, JobFailed)
    assert str(effects.failure) == ("agent a: node n1 was lost with the coordinator and its reschedule attempts "
                                    "are exhausted")
    assert [s.run.run_id for s in effects.stops] == ["a-old"] and effects.releases == [("job", None)]


def test_a_finished_job_s_record_is_not_resumed():
    spec = blueprint("a")
    previous = record(spec, status="completed", agents={"a": previous_track(spec, "a", "n1")})
    machine = JobMachine(spec, record(spec))
    assert machine.begin(previous, {"n1": "offline"}, NOW) == Effects()
    assert machine.job.generation == 1 and kinds(machine) == ["job.submitted"]


def test_a_blocked_agent_whose_node_comes_back_stays_there_and_is_watched_again():
    machine = started(blueprint("a"), {"a": "n1"})
    full = Plan(status="runnable_later", reason="no node has 1 cpu free")
    [book] = machine.node_actions({"n1": "offline"}, {}, NOW).books
    machine.booked(book, {}, full, NOW)
    track = machine.job.agents["a"]
    assert track.status == "blocked" and machine.running() == {}

    assert machine.node_actions({"n1": "ready"}, {}, NOW + 5) == Effects()

    assert track.status == "running" and track.blocked_backoff_s == 0 and track.node == "n1"
    assert machine.running() == {"a": track.current.run_id}  # its run was never stopped: watched again
    assert track.reason == "node n1 is ready again: a stays there"
    assert machine.observed("a", "COMPLETED", "Completed", None, NOW + 6).action == "complete"
    assert machine.done() is not None and machine.done().status == "completed"
