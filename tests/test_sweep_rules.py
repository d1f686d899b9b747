"""What a node's sweeps and the pool announcer's pass do with runs whose worker lost them (killed while starting
or stopping one, or whose last state never reached the server), in one process (tests/harness.py): the real
``Sweeps`` over a real SQLite store, Prefect's client a table of runs whose states are as old as each case needs.
End to end through a real server and real workers: tests/test_offline_e2e.py (a killed worker's node, a run placed
on a node that died, the sweeps' own timer while no poll gets through)."""

from __future__ import annotations

import socket
import subprocess

import pytest
from builders import node
from harness import Harness
from prefect.states import Cancelling, Pending, Running

from mn_prefect.model.placement import PlacedResources, Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store.records import FlowRunRecord, put_record
from mn_prefect.worker.decisions import ORPHAN_PENDING_GRACE_SECONDS

OLD = ORPHAN_PENDING_GRACE_SECONDS + 1  # seconds: a state this old is past the orphan grace
NEW = 1.0  # and this one within it


@pytest.fixture
def pool(tmp_path, monkeypatch):
    """Two CPU nodes; the first one's worker (e2e-lives) is the pool's announcer."""
    harness = Harness(tmp_path, [node("e2e-lives", 4, 8192), node("e2e-dies", 4, 8192)], monkeypatch=monkeypatch)
    yield harness
    harness.close()


def ended_pid() -> str:
    """The ``host:pid`` of a flow process that has ended (as a worker records a run's infrastructure pid)."""
    done = subprocess.Popen(["true"])
    done.wait()
    return f"{socket.gethostname()}:{done.pid}"


def booked_on(pool: Harness, run, name: str) -> None:
    placed = place_and_commit(pool.store, str(run.id), [Ask(agent_id=run.name, request=resource_request(
        {"cpu_cores": 1}), preferred_node=name)], group=pool.pool)
    assert placed.placed and placed.commit.placements[0].node == name


def test_a_run_left_pending_by_a_worker_killed_while_starting_it_is_put_back_and_started_on_its_node(pool):
    """Nothing else would ever start it (workers take Scheduled runs): past the grace its node's sweep puts it back
    to Scheduled, booking kept, and that node's next poll starts it; within the grace it is left alone."""
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"cpu": 1}}), state=Pending())
    booked_on(pool, run, "e2e-lives")
    pool.prefect.set(run.id, Pending(), age_s=NEW)
    pool.nodes["e2e-lives"].sweep()
    assert pool.prefect.state(run.id).is_pending() and pool.prefect.said(run.id) == []
    pool.prefect.set(run.id, Pending(), age_s=OLD)
    pool.nodes["e2e-dies"].sweep()  # not its node: not its sweep's to judge
    assert pool.prefect.said(run.id) == []
    pool.nodes["e2e-lives"].sweep()
    [put_back] = pool.prefect.said(run.id)
    assert put_back.is_scheduled() and "stopped before it started; it starts again" in put_back.message
    assert [p.node for p in pool.booked(run)] == ["e2e-lives"]  # kept for its node's next poll
    assert pool.poll() == {run.id: "e2e-lives"}


def test_a_run_being_started_by_its_worker_is_never_judged_orphaned(pool):
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"cpu": 1}}), state=Pending())
    booked_on(pool, run, "e2e-lives")
    pool.prefect.set(run.id, Pending(), age_s=OLD)
    pool.nodes["e2e-lives"].busy.add(str(run.id))  # its launch is under way on this worker
    pool.nodes["e2e-lives"].sweep()
    pool.nodes["e2e-lives"].pool_pass()
    assert pool.prefect.said(run.id) == [] and pool.booked(run)


def test_a_run_left_cancelling_with_no_process_to_stop_is_cancelled_and_then_released(pool):
    """Cancelling asks the worker running the flow process to stop it; that worker was killed with the process:
    past the grace the node's sweep says it Cancelled, and the next sweep releases its booking."""
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"cpu": 1}}), state=Running())
    booked_on(pool, run, "e2e-lives")
    pool.prefect.patch(run.id, infrastructure_pid=ended_pid())
    pool.prefect.set(run.id, Cancelling(message="a reservation ended"), age_s=OLD)
    pool.nodes["e2e-lives"].sweep()
    [cancelled] = pool.prefect.said(run.id)
    assert cancelled.is_cancelled()
    assert "no process of this run is left on e2e-lives to stop" in cancelled.message, cancelled.message
    pool.nodes["e2e-lives"].sweep()
    assert not pool.booked(run)


def unbooked_with_its_process_ended(pool: Harness, state, job_type: str = "batch"):
    """A run placed on e2e-lives once (its record says so), its booking gone, its flow process's pid ended."""
    run = pool.prefect.run(pool.prefect.deploy({"job_type": job_type, "resources": {"cpu": 1}}))
    put_record(pool.store, FlowRunRecord(job_id=str(run.id), node="e2e-lives", job_type=job_type))
    pool.prefect.patch(run.id, infrastructure_pid=ended_pid())
    pool.prefect.set(run.id, state, age_s=OLD)
    return run


def test_a_run_left_running_after_its_process_ended_unreported_is_marked_crashed(pool):
    """Its worker released the booking but the final state never reached the server: Running for ever, but for
    the sweep of the node it was placed on (no other node's sweep judges it)."""
    run = unbooked_with_its_process_ended(pool, Running())
    pool.nodes["e2e-dies"].sweep()
    assert pool.prefect.said(run.id) == []
    pool.nodes["e2e-lives"].sweep()
    [crashed] = pool.prefect.said(run.id)
    assert crashed.is_crashed() and "ended, and its end never reached the server" in crashed.message


def test_a_run_left_cancelling_after_its_worker_stopped_and_released_it_is_cancelled(pool):
    run = unbooked_with_its_process_ended(pool, Cancelling(message="mn: reservation rsv-x has ended"))
    pool.nodes["e2e-lives"].sweep()
    [cancelled] = pool.prefect.said(run.id)
    assert cancelled.is_cancelled() and "was stopped, and its end never reached the server" in cancelled.message


def test_a_run_left_pending_after_its_booking_was_released_is_crashed_by_the_announcer_only(pool):
    run = unbooked_with_its_process_ended(pool, Pending(name="Submitting"))
    pool.nodes["e2e-dies"].pool_pass()  # not the announcer: it makes no pool pass
    assert pool.prefect.said(run.id) == []
    pool.nodes["e2e-lives"].pool_pass()
    crashed = [s for s in pool.prefect.said(run.id) if s.is_crashed()]
    assert len(crashed) == 1 and "ended before the run started" in crashed[0].message
    assert pool.booked(run) == []


def test_a_system_run_left_pending_after_its_own_part_was_released_is_crashed_while_a_copy_still_runs(pool):
    """The run is judged by its own part (on its own node), not by its copies': a copy on another node still holds
    its part, well before that part could go for want of a holder."""
    run = pool.prefect.run(pool.prefect.deploy({"job_type": "system", "resources": {"cpu": 1}}))
    parts = [Placement(agent_id=f"sys@{name}", source_agent_id="sys", node=name, locality="system",
                       job_id=str(run.id), resources=PlacedResources(cpu_cores=1)) for name in ("e2e-dies", "e2e-lives")]
    assert pool.store.commit_plan(str(run.id), parts).ok
    put_record(pool.store, FlowRunRecord(job_id=str(run.id), node="e2e-lives", job_type="system"))
    assert pool.store.release(str(run.id), node="e2e-lives")  # its own process ended; the copy's part is held
    pool.prefect.set(run.id, Pending(), age_s=OLD)
    pool.nodes["e2e-lives"].pool_pass()
    [crashed] = pool.prefect.said(run.id)
    assert crashed.is_crashed() and "ended before the run started" in crashed.message
    assert [p.node for p in pool.booked(run)] == ["e2e-dies"]  # the copy's part: the copy's to release


def test_a_run_pending_within_the_grace_or_still_booked_is_not_crashed(pool):
    fresh = unbooked_with_its_process_ended(pool, Pending())
    pool.prefect.set(fresh.id, Pending(), age_s=NEW)
    booked = pool.prefect.run(pool.prefect.deploy({"resources": {"cpu": 1}}))
    booked_on(pool, booked, "e2e-dies")
    pool.prefect.set(booked.id, Pending(), age_s=OLD)
    pool.nodes["e2e-lives"].pool_pass()
    assert pool.prefect.said(fresh.id) == [] and pool.prefect.said(booked.id) == []
    assert pool.prefect.state(booked.id).is_pending() and pool.prefect.state(fresh.id).is_pending()
