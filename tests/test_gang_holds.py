"""Head-of-line holds for a blueprint job (``jobs.gang_holds``): its agents are booked all or nothing, so it holds
the nodes where it can start soonest until they cover it, then lands there; the pool's announcer ends a hold
whose job no longer waits. The real store (SQLite), the real placer; the workers' parts through the harness."""

from __future__ import annotations

import pytest
from builders import gpu, node
from harness import Harness
from prefect.states import Completed, Running

from mn_prefect.jobs.gang_holds import end_job_hold, hold_step
from mn_prefect.model.pool_policy import PoolPolicy
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.holding import read_holds
from mn_prefect.placement.job_state import JobState
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler.ask import Ask
from mn_prefect.store.records import PoolPolicyRecord, pool_policy_id, put_record
from mn_prefect.worker.decisions import Keep, Release, job_hold_over

JOB = "train-0a1b2c3d"


@pytest.fixture
def pool(tmp_path, monkeypatch):
    harness = Harness(tmp_path, [
        node("gpu-1", 16, 65536, devices=[gpu("GPU-1a", 0, 24576), gpu("GPU-1b", 1, 16384)]),
        node("gpu-2", 32, 131072, devices=[gpu("GPU-2a", 0, 40960)])], monkeypatch=monkeypatch)
    yield harness
    harness.close()


def gang() -> list[Ask]:
    """Two agents: one needs both of gpu-1's GPUs, the other a GPU of its own (so gpu-2's)."""
    return [Ask(agent_id="trainer", request=resource_request({"gpu": 2})),
            Ask(agent_id="evaluator", request=resource_request({"gpu": 1}))]


def place_job(pool: Harness):
    """What the coordinator does each pass: the plain placement, then the hold's step when it did not fit."""
    result = place_and_commit(pool.store, JOB, gang(), group=pool.pool, explain=True)
    if result.placed:
        return "placed", result.commit.placements
    return "held", hold_step(pool.store, pool.pool, JOB, gang(), result.plan, strategy="binpack")


def test_a_job_behind_1_gpu_runs_holds_the_nodes_it_needs_and_lands_on_them_once_they_drain(pool):
    one_gpu = pool.prefect.deploy({"resources": {"gpu": 1}})
    first, second = pool.prefect.run(one_gpu), pool.prefect.run(one_gpu)
    assert sorted(pool.poll().values()) == ["gpu-1", "gpu-2"]  # one on each node: the job fits nowhere
    outcome, step = place_job(pool)
    assert outcome == "held" and step.made and sorted(step.hold.nodes) == ["gpu-1", "gpu-2"]
    later = pool.prefect.run(one_gpu)
    assert pool.poll() == {}  # gpu-1's free GPU is held for the job: the 1-GPU run that came later waits
    outcome, step = place_job(pool)
    assert outcome == "held" and step.placed is None and not step.made  # still the same hold, not yet covered
    for run in (first, second):
        pool.end(run.id)
    outcome, step = place_job(pool)
    assert outcome == "held" and step.placed is not None  # placed over its hold, which then ends
    assert step.plan is not None and step.plan.status == "runnable_now"  # the plan it was placed by
    assert sorted(p.node for p in step.placed) == ["gpu-1", "gpu-2"]
    assert JOB not in read_holds(pool.store, pool.pool)
    assert pool.poll() == {}  # every GPU is the job's now
    assert pool.prefect.state(later.id).is_scheduled()


def test_a_job_makes_no_hold_with_holds_off_or_while_the_pools_holds_are_taken(pool):
    one_gpu = pool.prefect.deploy({"resources": {"gpu": 1}})
    for _ in range(3):
        pool.prefect.run(one_gpu)
    assert len(pool.poll()) == 3  # every GPU taken
    put_record(pool.store, PoolPolicyRecord(job_id=pool_policy_id(pool.pool), pool=pool.pool,
                                            policy=PoolPolicy(holds=False)))
    assert place_job(pool)[1].hold is None  # greedy order: no hold
    put_record(pool.store, PoolPolicyRecord(job_id=pool_policy_id(pool.pool), pool=pool.pool,
                                            policy=PoolPolicy(max_holds=1)))
    waiting = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 2}}))  # two bookings must end for it
    assert pool.poll() == {}
    assert list(read_holds(pool.store, pool.pool)) == [str(waiting.id)]  # the pool's one hold: the waiting run's
    assert place_job(pool)[1].hold is None  # the job never takes another's hold over
    assert list(read_holds(pool.store, pool.pool)) == [str(waiting.id)]


def test_the_announcer_ends_a_jobs_hold_once_the_job_no_longer_waits(pool):
    coordinator = pool.prefect.run(state=Running())
    pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 1}}))
    pool.poll()
    job = JobState(job_id=JOB, job_name="train", job_type="batch", flow_run_id=str(coordinator.id), pool=pool.pool,
                   status="waiting")
    job.save(pool.store)
    _, step = place_job(pool)
    assert step.made
    pool.nodes["gpu-1"].pool_pass()
    assert JOB in read_holds(pool.store, pool.pool)  # the job waits and its coordinator runs: kept
    pool.prefect.set(coordinator.id, Completed())
    pool.nodes["gpu-1"].pool_pass()
    assert JOB not in read_holds(pool.store, pool.pool)
    assert any(e[0] == "mn.hold.released" for e in pool.events)
    assert end_job_hold(pool.store, pool.pool, JOB) is None  # nothing left for the coordinator to end


@pytest.mark.parametrize(("status", "placed", "coordinator", "kept"), [
    ("waiting", False, "RUNNING", True),
    ("waiting", False, "PENDING", True),
    ("waiting", True, "RUNNING", False),   # placed
    ("running", False, "RUNNING", False),  # no longer waits
    ("waiting", False, "CANCELLED", False),
    ("waiting", False, None, False),       # its coordinator run is gone
    (None, False, "RUNNING", False),       # its job is gone
])
def test_a_jobs_hold_stands_while_the_job_waits_and_its_coordinator_lives(status, placed, coordinator, kept):
    decision = job_hold_over(status, placed, coordinator)
    assert isinstance(decision, Keep if kept else Release)
