"""The worker's rules in one process (tests/harness.py): its real parts over a real SQLite store, Prefect's client
replaced by a table of runs. Waits, failures and sweeps, each end to end through a real server elsewhere
(tests/test_worker.py, tests/test_worker_visibility.py)."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

import anyio
import pytest
from builders import gpu, node
from harness import Harness
from prefect.states import Cancelled, Completed, Failed, Running, Scheduled
from prometheus_client import generate_latest

from mn_prefect.bundles.runner import preemptible_fields
from mn_prefect.model.placement import PlacedResources, Placement
from mn_prefect.model.pool_policy import PoolPolicy
from mn_prefect.model.queues import QueueSpec
from mn_prefect.model.resources import resource_request
from mn_prefect.ops.metrics import cluster_registry
from mn_prefect.ops.preemption_losses import losses_by_queue
from mn_prefect.placement.fair_share import advance
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.preemption import checkpointed, preemption, run_files, run_folder
from mn_prefect.scheduler.ask import Ask
from mn_prefect.store.records import (
    FlowRunRecord,
    PoolPolicyRecord,
    WorkflowRecord,
    get_record,
    pool_policy_id,
    put_record,
)
from mn_prefect.worker.decisions import ENDED_RUN_COPY_SECONDS, ORPHAN_PART_GRACE_SECONDS


@pytest.fixture
def pool(tmp_path, monkeypatch):
    """The lab's fleet: two GPU nodes and a CPU node; gpu-1's worker is the pool's announcer."""
    harness = Harness(tmp_path, [
        node("gpu-1", 16, 65536, devices=[gpu("GPU-1a", 0, 24576, caps=("fp16", "bf16")), gpu("GPU-1b", 1, 16384)]),
        node("gpu-2", 32, 131072, devices=[gpu("GPU-2a", 0, 40960, caps=("fp16", "bf16", "tf32"))]),
        node("cpu-1", 8, 32768)], monkeypatch=monkeypatch)
    yield harness
    harness.close()


def waiting_events(pool: Harness, run) -> list[dict]:
    return [payload for event, resource, payload in pool.events
            if event == "mn.placement.waiting" and resource == f"prefect.flow-run.{run.id}"]


@pytest.mark.parametrize("holds", [True, False])
def test_a_run_waits_for_capacity_with_its_reason_said_once_then_runs_when_the_holder_ends(pool, holds):
    """The waiting run needs what one booking frees: with holds on (the default) as off (``queue policy --holds
    off``) it makes no hold, being first in line for that capacity anyway, and only waits."""
    if not holds:
        put_record(pool.store, PoolPolicyRecord(job_id=pool_policy_id(pool.pool), pool=pool.pool,
                                                policy=PoolPolicy(holds=False)))
    deployment = pool.prefect.deploy({"resources": {"devices": [{"ids": ["GPU-2a"]}]}})
    holder = pool.prefect.run(deployment)
    assert pool.poll() == {holder.id: "gpu-2"}
    waiting = pool.prefect.run(deployment)
    for _ in range(3):  # three polls of every worker: told to wait, once
        assert pool.poll() == {}
    state = pool.prefect.state(waiting.id)
    assert state.is_scheduled() and state.message.startswith("mn runnable_later: ")
    assert "gpu-2: insufficient gpu: asks 1, 0 of 1 free" in state.message, state.message
    assert "holding" not in state.message, state.message
    [said] = pool.prefect.said(waiting.id)  # the state set once; only the announcer speaks
    assert said.message == state.message
    [event] = waiting_events(pool, waiting)
    assert event["status"] == "runnable_later" and set(event["agents"][waiting.name]) == {"gpu-1", "gpu-2", "cpu-1"}
    assert not pool.booked(waiting)
    holds_made = [e for e, _, _ in pool.events if e == "mn.hold.created"]
    assert holds_made == []

    pool.nodes["gpu-2"].ended(pool.prefect.runs[holder.id], Completed())
    assert not pool.booked(holder)
    assert pool.poll() == {waiting.id: "gpu-2"}
    assert [p.device_ids for p in pool.booked(waiting)] == [["GPU-2a"]]
    assert not [p for p in pool.store.active_placements(node="gpu-2") if p.hold]  # the hold ended with its start


def test_an_impossible_request_is_failed_by_the_announcer_only_with_every_nodes_reason(pool):
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 4}, "not_runnable_timeout_seconds": 0}))
    for name in ("gpu-2", "cpu-1"):  # not the announcer: places nothing, says nothing
        assert pool.nodes[name].poll() == []
    assert pool.prefect.said(run.id) == [] and pool.prefect.state(run.id).is_scheduled()
    assert pool.nodes["gpu-1"].poll() == []
    [failed] = pool.prefect.said(run.id)
    assert failed.is_failed() and pool.prefect.state(run.id).is_failed()
    assert "no node can ever take this run" in failed.message
    for where in ("gpu-1: insufficient gpu", "gpu-2: insufficient gpu", "cpu-1: insufficient gpu"):
        assert where in failed.message, failed.message
    assert not pool.booked(run)


def test_an_impossible_request_waits_out_its_timeout_before_it_fails(pool):
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 4}, "not_runnable_timeout_seconds": 3600,
                                                "wait_for_new_nodes": True}))
    pool.poll()
    [said] = pool.prefect.said(run.id)
    assert said.is_scheduled() and "not_runnable" in said.message and "no node can ever take" in said.message


def test_a_run_over_while_nobody_watched_it_is_released_by_its_nodes_sweep(pool):
    """Its worker was stopped, or its end was set by hand: the node's sweep finds the booking's run over (or gone)
    and gives the booking back, once; a run still Running keeps its booking."""
    deployment = pool.prefect.deploy({"resources": {"gpu": 1}})
    failed, gone, running = (pool.prefect.run(deployment) for _ in range(3))
    placed = pool.poll()
    assert set(placed) == {failed.id, gone.id, running.id}
    pool.prefect.set(failed.id, Failed(message="boom"))
    pool.prefect.delete(gone.id)
    for name in {placed[failed.id], placed[gone.id], placed[running.id]}:
        pool.nodes[name].sweep()
    assert not pool.booked(failed) and not pool.booked(gone)
    assert pool.booked(running) and pool.prefect.state(running.id).is_running()
    released = [(resource, payload["booking"], payload["reason"]) for event, resource, payload in pool.events
                if event == "mn.placement.released"]
    assert sorted(booking for _, booking, _ in released) == sorted([str(failed.id), str(gone.id)])
    assert {reason for _, _, reason in released} == {"the run is Failed", "the run no longer exists"}


def test_the_step_bookings_of_a_killed_bundle_run_are_released_and_a_live_ones_kept(pool):
    """A bundle run books each step as <job>#<launch>; killed before its cleanup (on another machine), its
    bookings would stay: the sweep of the step's node releases them once the bundle's flow run is over or gone,
    and marks its workflow crashed. A live bundle's step stays booked, sweep after sweep."""
    live = pool.prefect.run(pool.prefect.deploy({"resources": {"cpu": 1}}), state=Running())
    for job, flow_run_id in (("bundle-killed", str(uuid.uuid4())), ("bundle-live", str(live.id))):
        put_record(pool.store, WorkflowRecord(job_id=job, job_name=job, run_id="r", run_dir="/nowhere", bundle="b",
                                              host="elsewhere", pid=1, flow_run_id=flow_run_id))
        step = Placement(agent_id="step", node="cpu-1", resources=PlacedResources(cpu_cores=0.5))
        assert pool.store.commit_plan(f"{job}#1", [step]).ok
    for _ in range(3):
        pool.nodes["cpu-1"].sweep()
        assert not pool.booked("bundle-killed#1")
        assert get_record(pool.store, "bundle-killed", WorkflowRecord).status == "crashed"
        assert pool.booked("bundle-live#1") and get_record(pool.store, "bundle-live", WorkflowRecord).status == "running"
    pool.prefect.set(live.id, Completed())  # the live bundle's flow run ended without releasing (killed at its end)
    pool.nodes["cpu-1"].sweep()
    assert not pool.booked("bundle-live#1")


# -- system runs: a copy per node, each holding its node's part ------------------------------------------------

@pytest.fixture
def system_pool(tmp_path, monkeypatch):
    """Two GPU nodes and one without a GPU (no copy can go there); sys-a's worker is the announcer."""
    harness = Harness(tmp_path, [node("sys-a", 4, 8192, devices=[gpu("GPU-SA", 0)]),
                                 node("sys-b", 4, 8192, devices=[gpu("GPU-SB", 0)]), node("sys-c", 4, 8192)],
                      monkeypatch=monkeypatch)
    yield harness
    harness.close()


def copies_of(pool: Harness, run) -> list:
    return [r for r in pool.prefect.runs.values() if f"mn-copy-of:{run.id}" in r.tags]


def test_a_part_no_copy_holds_goes_soon_after_its_run_ended_not_after_the_long_grace(system_pool):
    """The run ends while its copy is gone (never made, or deleted): the copy never will be made, so the node's
    sweep releases the part once the run has been over ENDED_RUN_COPY_SECONDS, not ORPHAN_PART_GRACE_SECONDS after
    it first saw the part unheld; a run that ended only just now keeps it."""
    pool = system_pool
    run = pool.prefect.run(pool.prefect.deploy({"job_type": "system", "resources": {"cpu": 1, "gpu_count": 1}}))
    assert pool.nodes["sys-a"].poll() == [run.id]  # the run itself on the first node; a copy made for sys-b
    [copy] = copies_of(pool, run)
    assert copy.job_variables["system_copy"] == {"job_id": str(run.id), "node": "sys-b", "agent_id": f"{run.name}@sys-b"}
    assert sorted(p.node for p in pool.booked(run)) == ["sys-a", "sys-b"]
    pool.prefect.delete(copy.id)  # its part on sys-b: held by no run now
    pool.prefect.set(run.id, Cancelled())
    pool.nodes["sys-b"].sweep()
    assert sorted(p.node for p in pool.booked(run)) == ["sys-a", "sys-b"]  # over only just now: its copy may come
    assert ENDED_RUN_COPY_SECONDS < ORPHAN_PART_GRACE_SECONDS
    ended = datetime.now(UTC) - timedelta(seconds=ENDED_RUN_COPY_SECONDS + 1)
    pool.prefect.set(run.id, Cancelled(timestamp=ended))
    pool.nodes["sys-b"].sweep()
    assert [p.node for p in pool.booked(run)] == ["sys-a"]  # the run's own part is its own node's to release
    [(_, reason)] = [(p["node"], p["reason"]) for e, _, p in pool.events if e == "mn.placement.released"]
    assert reason == "the run is Cancelled and made no copy for this node"


def test_a_copy_whose_part_is_gone_fails_saying_so_and_is_never_placed_anew(system_pool):
    pool = system_pool
    deployment = pool.prefect.deploy({"job_type": "sysbatch", "resources": {"cpu": 1, "gpu_count": 1}})
    marker = {"job_id": str(uuid.uuid4()), "node": "sys-b", "agent_id": "gone@sys-b"}
    run = pool.prefect.run(deployment, job_variables={"system_copy": marker})
    assert pool.poll() == {}
    [failed] = pool.prefect.said(run.id)
    assert failed.is_failed() and "has no booking on sys-b any more" in failed.message, failed.message
    assert pool.booked(run) == [] and copies_of(pool, run) == []


# -- a wide run behind a stream of narrow ones (end to end with holds: tests/test_holds_lab.py) ----------------

ENDS = 12  # the stream's runs ended before judging: three times the four running


def stream_past(pool: Harness, *, ends: int) -> tuple[object, list]:
    """Two nodes of 2 GPUs kept busy by 1-GPU runs, two more waiting, and a 2-GPU run submitted behind them. The
    oldest running 1-GPU run ends, then every worker polls and the waiting line is topped up, ``ends`` times or
    until the 2-GPU run has started. The 2-GPU run, and the 1-GPU runs started after it was submitted."""
    narrow, wide = pool.prefect.deploy({"resources": {"gpu": 1}}), pool.prefect.deploy({"resources": {"gpu": 2}})
    running: list = []  # run ids, the oldest first
    waiting: list = []

    def top_up() -> None:
        while len(waiting) < 2:
            waiting.append(pool.prefect.run(narrow).id)

    def poll() -> None:
        for run_id in pool.poll():
            running.append(run_id)
            if run_id in waiting:
                waiting.remove(run_id)

    top_up()
    poll()
    top_up()
    poll()
    top_up()
    assert len(running) == 4
    big = pool.prefect.run(wide)
    behind: list = []
    for _ in range(ends):
        if pool.prefect.state(big.id).is_running():
            break
        oldest = running.pop(0)
        [placement] = pool.booked(str(oldest))
        pool.nodes[placement.node].ended(pool.prefect.runs[oldest], Completed())
        before = len(running)
        poll()
        behind += [r for r in running[before:] if r != big.id]
        top_up()
    return big, behind


@pytest.fixture
def two_by_two(tmp_path, monkeypatch):
    harness = Harness(tmp_path, [node(name, 8, 32768, devices=[gpu(f"GPU-{name}-0", 0), gpu(f"GPU-{name}-1", 1)])
                                 for name in ("hold-a", "hold-b")], monkeypatch=monkeypatch)
    yield harness
    harness.close()


def test_greedily_a_2_gpu_run_behind_a_stream_of_1_gpu_runs_never_starts(two_by_two):
    """The greedy order (holds off): each freed GPU goes to the next 1-GPU run, and two GPUs of one node are never
    free at once."""
    pool = two_by_two
    put_record(pool.store, PoolPolicyRecord(job_id=pool_policy_id(pool.pool), pool=pool.pool,
                                            policy=PoolPolicy(holds=False)))
    big, behind = stream_past(pool, ends=ENDS)
    assert pool.prefect.state(big.id).is_scheduled() and not pool.booked(big)
    assert len(behind) == ENDS  # every freed GPU went to a 1-GPU run that came after it
    assert "insufficient gpu" in pool.prefect.state(big.id).message


def test_with_holds_the_same_2_gpu_run_starts_once_one_node_drains_on_the_node_it_held(two_by_two):
    pool = two_by_two
    big, behind = stream_past(pool, ends=ENDS)
    assert pool.prefect.state(big.id).is_running()
    about = f"prefect.flow-run.{big.id}"
    # The 1-GPU runs waiting ahead of it, which what one booking frees lets start, make no hold: the hold is its.
    assert {r for e, r, _ in pool.events if e == "mn.hold.created"} == {about}
    created = [p for e, r, p in pool.events if e == "mn.hold.created" and r == about]
    covered = [p for e, r, p in pool.events if e == "mn.hold.covered" and r == about]
    assert len(created) == len(covered) == 1 and created[0]["nodes"] == covered[0]["nodes"]
    [placement] = pool.booked(big)
    assert [placement.node] == created[0]["nodes"] and placement.resources.gpu_count == 2
    # At most the node's two runs end before the hold holds both GPUs; what ends elsewhere goes to 1-GPU runs.
    assert len(behind) <= 4
    assert not any(p.hold for p in pool.store.active_placements())


# -- queues: quotas and the order of freed capacity (end to end: tests/test_worker_queues.py) -------------------

def test_a_full_queue_holds_its_runs_back_with_the_quotas_reason_while_a_queue_without_settings_runs(pool):
    pool.store.set_queue(QueueSpec(name="train", quota={"gpu": 1}))
    train = pool.prefect.deploy({"resources": {"gpu": 1}})
    serve = pool.prefect.deploy({"resources": {"gpu": 1}, "priority": 3})
    trained = [pool.prefect.run(train, queue="train") for _ in range(3)]
    served = pool.prefect.run(serve, queue="serve")
    placed = pool.poll()
    [first] = [r.id for r in trained if r.id in placed]  # the fleet has three GPUs; train may hold one
    assert served.id in placed
    assert [(p.queue, p.priority, p.preemptible) for p in pool.booked(str(first))] == [("train", 0, False)]
    assert [(p.queue, p.priority) for p in pool.booked(served)] == [("serve", 3)]
    for run in trained:
        if run.id != first:
            message = pool.prefect.state(run.id).message
            assert "quota: queue train" in message and "asks 1 GPU with 1 of its quota of 1 in use" in message, message
    assert not [e for e, _, _ in pool.events if e == "mn.hold.created"]  # a quota wait is no capacity wait: no hold
    assert pool.store.queues().queues["train"].used["gpu"] == 1
    for _ in range(2):  # one at a time: each start waits for the run before it to end
        [running] = [r.id for r in trained if pool.prefect.state(r.id).is_running()]
        pool.end(running)
        placed = pool.poll()
        assert len([r for r in trained if r.id in placed]) == 1
    [last] = [r.id for r in trained if pool.prefect.state(r.id).is_running()]
    pool.end(last)
    assert all(pool.prefect.state(r.id).is_completed() for r in trained)
    assert pool.store.queues().queues["train"].used["gpu"] == 0  # the quota refunded


def test_freed_capacity_goes_by_priority_then_fair_share_not_by_arrival(pool):
    """Runs that each need both GPUs of gpu-1 wait behind one that holds them; as each ends the next starts: the
    high-priority run first, then the queue that has had nothing over the one that has had the node, though that
    one's run arrived first."""
    for name in ("heavy", "light"):
        pool.store.set_queue(QueueSpec(name=name))
    both = {"resources": {"gpu": 2}}
    heavy, light = pool.prefect.deploy(both), pool.prefect.deploy(both)
    urgent = pool.prefect.deploy({**both, "priority": 10})
    first = pool.prefect.run(heavy, queue="heavy")
    assert pool.poll() == {first.id: "gpu-1"}
    now = time.time()
    advance(pool.store, now)
    advance(pool.store, now + 60)  # the announcer's passes a minute apart: heavy has a past, light none
    waiting = [pool.prefect.run(heavy, queue="heavy", waited_s=3), pool.prefect.run(light, queue="light", waited_s=2),
               pool.prefect.run(urgent, queue="heavy", waited_s=1)]
    assert pool.poll() == {}
    assert all(pool.prefect.state(r.id).message.startswith("mn runnable_later") for r in waiting)
    order, running = [], first.id
    for _ in waiting:
        pool.end(running)
        [(running, where)] = pool.poll().items()
        assert where == "gpu-1"
        order.append(running)
    assert order == [waiting[2].id, waiting[1].id, waiting[0].id]  # urgent, light, heavy


def test_a_late_run_keeps_saying_why_it_waits_and_stays_late(pool):
    """Prefect's Late transition (a Scheduled state named Late) drops the state's message: the announcer sets the
    reason again at its next poll, under the state's own name (the run is not made plain Scheduled again), and
    says nothing more while the message stands."""
    deployment = pool.prefect.deploy({"resources": {"devices": [{"ids": ["GPU-2a"]}]}})
    holder = pool.prefect.run(deployment)
    pool.poll()
    waiting = pool.prefect.run(deployment)
    pool.poll()
    [first] = pool.prefect.said(waiting.id)
    pool.prefect.set(waiting.id, Scheduled(name="Late"))  # what the server's late-runs service does
    assert pool.prefect.state(waiting.id).message is None
    pool.poll()
    pool.poll()
    [_, again] = pool.prefect.said(waiting.id)
    assert (again.type, again.name, again.message) == (first.type, "Late", first.message)
    pool.end(holder.id)
    assert pool.poll() == {waiting.id: "gpu-2"}


@pytest.mark.parametrize("holds", [True, False])
def test_a_higher_priority_run_preempts_a_preemptible_one_and_starts_once_it_stopped(pool, holds):
    """urgent (priority 10) needs both GPUs of gpu-1, held by a preemptible batch run; a batch run that is not
    preemptible holds gpu-2. The announcer evicts the preemptible one (its own hold, with holds on, counts as room
    for it, not as another's booking), urgent starts once it stopped, and the evicted run waits its turn again."""
    if not holds:
        put_record(pool.store, PoolPolicyRecord(job_id=pool_policy_id(pool.pool), pool=pool.pool,
                                                policy=PoolPolicy(holds=False)))
    for name, priority in (("batch", 0), ("urgent", 10)):
        pool.store.set_queue(QueueSpec(name=name, priority=priority))
    evictable = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 2}, "preemptible": True,
                                                      "preemption_grace_seconds": 0}), queue="batch")
    steady = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 1}, "preferred_node": "gpu-2"}),
                              queue="batch")
    assert pool.poll() == {evictable.id: "gpu-1", steady.id: "gpu-2"}
    urgent = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 2}}), queue="urgent")
    assert pool.poll() == {}
    [preempted] = [e for e in pool.events if e[0] == "mn.run.preempted"]  # no grace: stopped at once
    assert preempted[2]["by"] == str(urgent.id) and preempted[2]["job_id"] == str(evictable.id)
    assert preempted[2]["outcome"] == "killed" and preempted[2]["lost_gpu_s"] >= 0
    [told] = pool.prefect.said(evictable.id)
    assert told.type.value == "CANCELLING" and f"preempted by run {urgent.name}" in told.message
    assert pool.prefect.state(steady.id).is_running() and pool.prefect.said(steady.id) == []  # never touched
    pool.end(evictable.id, Cancelled())  # Prefect stopped its process; its worker released the booking
    pool.nodes["gpu-1"].pool_pass()  # the announcer schedules it again
    assert pool.prefect.state(evictable.id).is_scheduled()
    assert pool.poll() == {urgent.id: "gpu-1"}
    pool.end(urgent.id)
    assert pool.poll() == {evictable.id: "gpu-1"}


def test_a_run_whose_worker_stopped_while_launching_it_goes_back_unbooked_and_a_running_one_is_left(pool):
    """``Router.put_back`` (the worker's stop, mid-launch) carries out ``decisions.stopped_launch``."""
    deployment = pool.prefect.deploy({"resources": {"gpu": 1}})
    launching, running = pool.prefect.run(deployment), pool.prefect.run(deployment)
    placed = pool.poll(start=False)  # both Pending: their launches under way
    pool.prefect.set(running.id, Running())
    for run in (launching, running, launching):  # judged once, however often it is asked
        anyio.run(pool.nodes[placed[run.id]].router.put_back, pool.prefect.runs[run.id])
    [back] = pool.prefect.said(launching.id)
    assert back.is_scheduled() and back.message == (f"mn: the worker on {placed[launching.id]} stopped before "
                                                    "starting this run; it waits to be placed again")
    assert not pool.booked(launching) and pool.booked(running)
    assert pool.prefect.said(running.id) == [] and pool.prefect.state(running.id).is_running()


def _preempting(pool: Harness, grace: float):
    """A preemptible 2-GPU run on gpu-1 with ``grace`` seconds to checkpoint, launched (its run folder made, as
    the worker's launch does), and an urgent run that needs gpu-1's GPUs: preempted, told, not yet stopped."""
    for name, priority in (("batch", 0), ("urgent", 10)):
        pool.store.set_queue(QueueSpec(name=name, priority=priority))
    evictable = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 2}, "preemptible": True,
                                                      "preemption_grace_seconds": grace}), queue="batch")
    pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 1}, "preferred_node": "gpu-2"}), queue="batch")
    pool.poll()
    env = run_files(run_folder(str(evictable.id)))
    urgent = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 2}}), queue="urgent")
    assert pool.poll() == {}
    return evictable, urgent, env


def test_a_preempted_run_is_told_first_and_stopped_as_soon_as_it_checkpoints(pool, monkeypatch):
    """With a grace, the victim is not stopped: its node's sweep writes its notice (what mn_prefect.preemption()
    reads, with the deadline), and stops it once it says it checkpointed; the work since then is all it loses."""
    evictable, urgent, env = _preempting(pool, 300)
    assert pool.prefect.said(evictable.id) == []  # not stopped yet
    assert not [e for e in pool.events if e[0] == "mn.run.preempted"]
    [notice_event] = [e for e in pool.events if e[0] == "mn.run.preemption.notice"]
    assert notice_event[2]["grace_s"] == 300
    pool.nodes["gpu-1"].sweep()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    notice = preemption()
    assert notice is not None and notice.by == urgent.name and 290 < notice.seconds_left <= 300
    pool.nodes["gpu-1"].sweep()
    assert pool.prefect.said(evictable.id) == []  # told, and still running: no checkpoint yet
    assert checkpointed()
    pool.nodes["gpu-1"].sweep()
    [told] = pool.prefect.said(evictable.id)
    assert told.type.value == "CANCELLING" and "it checkpointed in its grace" in told.message
    [preempted] = [e for e in pool.events if e[0] == "mn.run.preempted"]
    assert preempted[2]["outcome"] == "checkpointed" and preempted[2]["lost_gpu_s"] < 2 * 5  # 2 GPUs, seconds
    pool.end(evictable.id, Cancelled())
    pool.nodes["gpu-1"].pool_pass()
    assert pool.prefect.state(evictable.id).is_scheduled()
    assert pool.poll() == {urgent.id: "gpu-1"}


def test_a_preempted_run_that_never_checkpoints_is_stopped_at_its_deadline_and_its_work_counted_lost(pool):
    evictable, urgent, _ = _preempting(pool, 30)
    record = get_record(pool.store, str(evictable.id), FlowRunRecord)
    pool.nodes["gpu-1"].sweep()
    pool.nodes["gpu-1"].pool_pass()
    assert pool.prefect.said(evictable.id) == []  # inside its grace
    put_record(pool.store, record.model_copy(update={"deadline": time.time() - 1}))  # the grace is over
    pool.nodes["gpu-1"].pool_pass()
    [told] = pool.prefect.said(evictable.id)
    assert told.type.value == "CANCELLING" and "stopped at the end of its grace" in told.message
    [preempted] = [e for e in pool.events if e[0] == "mn.run.preempted"]
    assert preempted[2]["outcome"] == "killed"
    assert get_record(pool.store, str(evictable.id), FlowRunRecord).outcome == "killed"
    pool.nodes["gpu-1"].pool_pass()  # said once
    assert len(pool.prefect.said(evictable.id)) == 1
    # counted for its queue: queue status and the cluster's metrics
    lost = losses_by_queue(pool.store)["batch"]
    assert (lost.preempted, lost.killed, lost.checkpointed) == (1, 1, 0)
    assert lost.lost_gpu_s > 0 and lost.lost_cpu_s == 0  # it booked 2 GPUs and no cores
    scraped = generate_latest(cluster_registry(pool.store)).decode()
    assert 'mn_queue_evicted_runs_total{outcome="killed",queue="batch"} 1.0' in scraped
    assert 'mn_queue_preemption_lost_seconds{queue="batch",resource="gpu"}' in scraped


def test_a_grace_above_the_pools_maximum_is_refused_naming_the_variable_and_nothing_is_booked(pool):
    put_record(pool.store, PoolPolicyRecord(job_id=pool_policy_id(pool.pool), pool=pool.pool,
                                            policy=PoolPolicy(max_preemption_grace_s=60)))
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 1}, "preemptible": True,
                                                "preemption_grace_seconds": 61}))
    assert pool.poll() == {}
    [failed] = pool.prefect.said(run.id)
    assert failed.is_failed() and "preemption_grace_seconds: 61 s is above the pool's maximum of 60 s" in failed.message
    assert not pool.booked(run)


def test_the_victim_is_the_run_whose_eviction_loses_the_least_work_since_its_last_checkpoint(pool, monkeypatch):
    """Two preemptible 1-GPU runs on gpu-1: the older one checkpointed a moment ago, the younger never did. By
    recency alone the younger would go; it would lose all its work, the older almost none: the older is chosen."""
    for name, priority in (("batch", 0), ("urgent", 10)):
        pool.store.set_queue(QueueSpec(name=name, priority=priority))
    one_gpu = pool.prefect.deploy({"resources": {"gpu": 1}, "preferred_node": "gpu-1", "preemptible": True})
    older = pool.prefect.run(one_gpu, queue="batch")
    assert pool.poll() == {older.id: "gpu-1"}
    time.sleep(0.05)  # the younger one's booking is committed strictly later
    younger = pool.prefect.run(one_gpu, queue="batch")
    pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 1}, "preferred_node": "gpu-2"}), queue="batch")
    assert pool.poll()[younger.id] == "gpu-1"
    for name, value in run_files(run_folder(str(older.id))).items():
        monkeypatch.setenv(name, value)
    assert checkpointed()
    pool.nodes["gpu-1"].sweep()  # its node's worker records the checkpoint
    assert get_record(pool.store, str(older.id), FlowRunRecord).checkpointed_at is not None
    pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 1}}), queue="urgent")
    assert pool.poll() == {}
    [notice] = [e for e in pool.events if e[0] == "mn.run.preemption.notice"]
    assert notice[2]["job_id"] == str(older.id)


def test_a_preempted_bundle_runs_step_on_another_node_is_told_too(pool, monkeypatch):
    """The bundle run's own process runs on cpu-1, its GPU step on gpu-1 as its own mn-step flow run (on the
    step's booking, with its own run folder, as gpu-1's worker launches it). Preempted, the run is told by
    cpu-1's sweep and its step by gpu-1's: the step's preemption() answers with the run's deadline."""
    for name, priority in (("batch", 0), ("urgent", 10)):
        pool.store.set_queue(QueueSpec(name=name, priority=priority))
    bundle = pool.prefect.run(pool.prefect.deploy({"resources": {"cpu": 1}, "preferred_node": "cpu-1",
                                                   "preemptible": True, "preemption_grace_seconds": 300}),
                              queue="batch")
    assert pool.poll() == {bundle.id: "cpu-1"}
    own_env = run_files(run_folder(str(bundle.id)))
    driver = pool.store.active_placements(job_id=str(bundle.id))[0]
    put_record(pool.store, WorkflowRecord(job_id="wf-0c2d", run_id="r1", run_dir="/tmp/r1", bundle="/tmp/b",
                                          flow_run_id=str(bundle.id)))
    step = place_and_commit(pool.store, "wf-0c2d#1", [Ask(agent_id="train", request=resource_request({"gpu": 2}))],
                            group=pool.pool, update=preemptible_fields(driver))
    assert step.placed and step.commit.placements[0].node == "gpu-1"
    child = pool.prefect.run(job_variables={"booking": {"job_id": "wf-0c2d#1", "agent_id": "train"}},
                             state=Running())
    step_env = run_files(run_folder(str(child.id)))
    other = pool.prefect.run(job_variables={"booking": {"job_id": "wf-9999#1", "agent_id": "x"}}, state=Running())
    other_env = run_files(run_folder(str(other.id)))  # another workflow's step on gpu-1: not told
    pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 1}, "preferred_node": "gpu-2"}), queue="batch")
    pool.poll()
    urgent = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 2}}), queue="urgent")
    assert pool.poll() == {}
    [event] = [e for e in pool.events if e[0] == "mn.run.preemption.notice"]
    assert event[2]["job_id"] == str(bundle.id)
    deadline = get_record(pool.store, str(bundle.id), FlowRunRecord).deadline

    def told(env) -> object:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return preemption()

    assert told(step_env) is None and told(own_env) is None  # not yet: each node's sweep writes its notices
    pool.nodes["gpu-1"].sweep()
    notice = told(step_env)
    assert notice is not None and notice.deadline == deadline and notice.by == urgent.name
    assert told(other_env) is None
    assert told(own_env) is None, "the run itself is told by its own node"
    pool.nodes["cpu-1"].sweep()
    assert told(own_env) is not None and told(own_env).deadline == deadline
    assert pool.prefect.said(bundle.id) == []  # told, not stopped


def test_a_preemptible_bundle_run_is_evicted_with_its_steps_bookings(pool):
    """A bundle run's GPU work is booked by its steps (``<workflow>#<launch>``), each stamped preemptible when the
    run is: preemption counts the run and its steps as one victim, and tells the run (its flow run)."""
    for name, priority in (("batch", 0), ("urgent", 10)):
        pool.store.set_queue(QueueSpec(name=name, priority=priority))
    bundle = pool.prefect.run(pool.prefect.deploy({"resources": {"cpu": 1}, "preferred_node": "gpu-1",
                                                   "preemptible": True}), queue="batch")
    assert pool.poll() == {bundle.id: "gpu-1"}
    driver = pool.store.active_placements(job_id=str(bundle.id))[0]
    put_record(pool.store, WorkflowRecord(job_id="wf-0a1b", run_id="r1", run_dir="/tmp/r1", bundle="/tmp/b",
                                          flow_run_id=str(bundle.id)))
    step = place_and_commit(pool.store, "wf-0a1b#1", [Ask(agent_id="train", request=resource_request({"gpu": 2}))],
                            group=pool.pool, update=preemptible_fields(driver))
    assert step.placed and step.commit.placements[0].node == "gpu-1" and step.commit.placements[0].preemptible
    pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 1}, "preferred_node": "gpu-2"}), queue="batch")
    pool.poll()
    urgent = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 2}}), queue="urgent")
    assert pool.poll() == {}
    [notice] = [e for e in pool.events if e[0] == "mn.run.preemption.notice"]
    assert notice[2]["job_id"] == str(bundle.id) and notice[2]["by"] == str(urgent.id)
