"""What a node's sweeps and the pool announcer's pass do with runs whose worker lost them (killed while starting
or stopping one, or whose last state never reached the server), in one process (tests/harness.py): the real
``Sweeps`` over a real SQLite store, Prefect's client a table of runs whose states are as old as each case needs.
End to end through a real server and real workers: tests/test_offline_e2e.py (a killed worker's node, a run placed
on a node that died, the sweeps' own timer while no poll gets through)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import uuid

import pytest
import servers
from builders import node
from harness import Harness
from prefect.states import Cancelling, Completed, Pending, Running

from mn_prefect.model.placement import PlacedResources, Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store.records import FlowRunRecord, put_record
from mn_prefect.worker.decisions import (
    ORPHAN_PENDING_GRACE_SECONDS,
    STRAY_KILL_SECONDS,
    Keep,
    StopProcess,
    stray_process,
)

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


# -- flow-run processes a killed worker left behind ---------------------------------------------------------------

@pytest.fixture
def strays_pool(tmp_path, monkeypatch):
    """A pool of its own name: the sweep finds processes by node and pool, and this machine runs other tests' labs."""
    harness = Harness(tmp_path, [node("stray-here", 4, 8192), node("stray-there", 4, 8192)],
                      pool=f"strays-{uuid.uuid4().hex[:8]}", monkeypatch=monkeypatch)
    yield harness
    harness.close()


def flow_process(pool: Harness, run, tmp_path, *, job_id: str | None = None, ignore_term: bool = False):
    """A process as a killed worker's flow run leaves it on stray-here: its environment names the run, the node and
    an allocation of the pool."""
    ready = tmp_path / f"{run.id}.ready"
    trap = "trap '' TERM; " if ignore_term else ""
    script = f"{trap}touch {ready}; exec sleep 120"
    env = {"PATH": os.environ["PATH"], "PREFECT__FLOW_RUN_ID": str(run.id), "MN_NODE": "stray-here",
           "MN_ALLOCATION_JSON": json.dumps({"job_id": job_id or str(run.id), "group": pool.pool})}
    process = subprocess.Popen(["bash", "-c", script], env=env)
    servers.wait_for(ready.exists, timeout=30, what="the flow process to start")
    return process


def test_a_killed_workers_flow_process_is_stopped_once_its_run_is_placed_elsewhere_over_or_gone(strays_pool,
                                                                                                  tmp_path):
    pool = strays_pool
    deployment = pool.prefect.deploy({"resources": {"cpu": 1}})
    moved, over, gone, living = (pool.prefect.run(deployment, state=Running()) for _ in range(4))
    booked_on(pool, moved, "stray-there")  # placed again elsewhere while stray-here was lost
    booked_on(pool, living, "stray-here")
    pool.prefect.set(over.id, Completed())
    processes = {run.id: flow_process(pool, run, tmp_path) for run in (moved, over, gone, living)}
    pool.prefect.delete(gone.id)
    try:
        pool.nodes["stray-there"].strays()  # not its node: it stops nothing
        assert all(p.poll() is None for p in processes.values())
        pool.nodes["stray-here"].strays()
        for run in (moved, over, gone):
            assert processes[run.id].wait(10) == -signal.SIGTERM
        assert processes[living.id].poll() is None  # its run lives, booked here: its end releases the booking
    finally:
        for process in processes.values():
            process.kill()
            process.wait()


def test_a_process_the_worker_runs_itself_or_of_another_pool_is_never_a_stray(strays_pool, tmp_path):
    pool = strays_pool
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"cpu": 1}}), state=Completed())
    mine = flow_process(pool, run, tmp_path)
    other_pool = Harness(tmp_path / "other", [node("stray-here", 4, 8192)], pool="another-pool")
    try:
        pool.nodes["stray-here"].busy.add(str(run.id))  # a launch of this worker: never judged
        pool.nodes["stray-here"].strays()
        other_pool.nodes["stray-here"].strays()  # its allocation is of another pool: not that worker's to judge
        assert mine.poll() is None
    finally:
        other_pool.close()
        mine.kill()
        mine.wait()


def test_a_stray_that_ignores_sigterm_is_killed_once_it_outlives_the_grace(strays_pool, tmp_path):
    pool = strays_pool
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"cpu": 1}}), state=Completed())
    stubborn = flow_process(pool, run, tmp_path, ignore_term=True)
    try:
        sweeps = pool.nodes["stray-here"].sweeps
        pool.nodes["stray-here"].strays()
        assert stubborn.poll() is None and stubborn.pid in sweeps._stopped_strays  # told, and still there
        sweeps._stopped_strays[stubborn.pid] -= STRAY_KILL_SECONDS  # as if the grace had passed
        pool.nodes["stray-here"].strays()
        assert stubborn.wait(10) == -signal.SIGKILL
    finally:
        stubborn.kill()
        stubborn.wait()


def test_the_stray_rule():
    assert stray_process(None, False, "n") == StopProcess("its run no longer exists; stopped by the worker of n")
    assert stray_process("COMPLETED", True, "n") == StopProcess("its run is over (completed); stopped by the "
                                                                "worker of n")
    assert stray_process("RUNNING", False, "n") == StopProcess(
        "its run is no longer booked on n (placed again elsewhere, or released)")
    assert stray_process("RUNNING", True, "n") == stray_process("PENDING", True, "n") == Keep()
