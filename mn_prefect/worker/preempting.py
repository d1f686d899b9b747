"""Preemption in the workers: evict the fewest preemptible runs that let a waiting run start, and put them back.

The pool's announcer alone decides (as it alone says why runs wait), with the rule of scheduler/preemption.py on
the store's bookings (a bundle run counts with its steps' bookings, the least work lost first). Each victim is
told before it is stopped: its record says ``preempted``, with the deadline its grace gives it
(``preemption_grace_seconds``), and an ``mn.run.preemption.notice`` event is sent. Its node's worker writes the
notice where the run reads it (``mn_prefect.preemption``), and every other node running one of a bundle run's steps
writes it where that step reads it; the run's node stops it as soon as it says it checkpointed; the
announcer stops it at the deadline. Stopping is Prefect's cancellation (Cancelling, with a message saying who took
its place and how it stopped) and an ``mn.run.preempted`` event with the outcome and the work lost. Once it is
over, the announcer releases its booking and schedules it again (``requeue``): it waits like any other run, under
its queue's quota and its place in line. Victims already on their way out count as freed, so a run that keeps
waiting for them never evicts more; what they hold stays booked until they have stopped.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import anyio.to_thread
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelling, Scheduled

from mn_prefect import events
from mn_prefect.model.bookings import FlowRun, StepAttempt, parse
from mn_prefect.model.estimates import duration_words
from mn_prefect.model.grace import DEFAULT_GRACE_S
from mn_prefect.model.placement import Placement
from mn_prefect.placement.placing import Placer
from mn_prefect.preemption import NOTICE_FILE, Notice, last_checkpoint, read_notice, run_folder, runs_root, write_notice
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.scheduler.preemption import Evictable, choose, evictable_booking, may_evict
from mn_prefect.scheduler.quotas import RunQueue
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import FlowRunRecord, WorkflowRecord, get_record, list_records, put_record
from mn_prefect.store.releasing import release
from mn_prefect.worker.sweeps import InStore

Outcome = Literal["checkpointed", "killed"]

EVICTABLE_STATES = (StateType.RUNNING, StateType.PENDING)


class Preempter:
    def __init__(self, *, store: ClusterStore, placer: Placer, client: Callable[[], Any], in_store: InStore,
                 logger: Any, run_logger: Callable[[Any], Any]):
        self._store, self._placer, self._client, self._in_store = store, placer, client, in_store
        self._logger, self._run_logger = logger, run_logger
        self._seen_checkpoints: dict[str, float] = {}  # run id -> the checkpoint last copied into its record
        self._step_bookings: dict[str, str | None] = {}  # run folder here -> the step booking its run runs on

    async def make_room(self, flow_run, ask: Ask, queue: RunQueue, strategy: str) -> list[str]:
        """Evict what ``flow_run`` needs (or count what is already on its way out); the runs evicted now. Each
        victim is told first (``mn_prefect.preemption``): its node's worker writes its notice, and it is stopped
        once it says it checkpointed or its grace is over (``stop_noticed``); with no grace, at once."""
        chosen = await self._in_store(self._choose, str(flow_run.id), ask, queue, strategy)
        evicted = []
        for victim in chosen:
            try:
                run = await self._client().read_flow_run(uuid.UUID(victim.booking))
            except (ObjectNotFound, ValueError):
                continue
            if run.state is None or run.state.type not in EVICTABLE_STATES:
                continue
            first = victim.first
            record = await self._in_store(get_record, self._store, victim.booking, FlowRunRecord)
            grace = DEFAULT_GRACE_S if record is None or record.preemption_grace_s is None else record.preemption_grace_s
            now = time.time()
            marked = await self._in_store(_mark_preempted, self._store, victim.booking, {
                "noticed_at": now, "deadline": now + grace, "preempted_by": str(flow_run.id),
                "preempted_by_name": flow_run.name, "outcome": None})
            priority = await self._in_store(lambda: queue.resolved(self._store.queues()))
            self._run_logger(flow_run).info("mn: preempting %s to make room for this run", run.name)
            if grace <= 0 or marked is None:
                await self._stop(run, marked, victim.placements, "killed", queue=first.queue, priority=priority)
            else:
                self._run_logger(run).warning(
                    "mn: preempted by run %s (queue %s, priority %s) on %s: it has %s to checkpoint "
                    "(mn_prefect.preemption()), then it is stopped and scheduled again", flow_run.name, queue.name,
                    priority, first.node, duration_words(grace))
                events.emit("mn.run.preemption.notice", events.job(victim.booking, run.name),
                            related=[events.flow_run(run.id, run.name), events.flow_run(flow_run.id, flow_run.name),
                                     events.node(first.node, "node")],
                            payload={"job_id": victim.booking, "by": str(flow_run.id), "node": first.node,
                                     "grace_s": grace, "deadline": now + grace})
            evicted.append(run.name)
        return evicted

    async def node_pass(self, node: str) -> None:
        """What ``node``'s worker does every few seconds: its preempted runs told and stopped once they
        checkpointed, its preemptible runs' checkpoints recorded."""
        await self.stop_noticed(node)
        await self.checkpoints(node)

    async def pool_pass(self) -> None:
        """What the pool's announcer does every few seconds: runs past their grace stopped, stopped ones scheduled
        again."""
        await self.stop_noticed()
        await self.requeue()

    async def stop_noticed(self, node: str | None = None) -> None:
        """Runs told they are preempted that are to stop now: on ``node`` (its worker's sweep, which has written
        their notices and reads their checkpoints), those that checkpointed since their notice; anywhere (the
        announcer's pass, with ``node`` None), those past their deadline."""
        records = await self._in_store(list_records, self._store, FlowRunRecord, status="preempted")
        now = time.time()
        for record in records:
            deadline, noticed_at = record.deadline, record.noticed_at
            if record.outcome is not None or deadline is None or noticed_at is None:
                continue
            if node is not None:
                await self._tell_steps(record, node)
            if node is not None and record.node != node:
                continue
            outcome: Outcome | None = None
            if node is not None:
                folder = run_folder(record.job_id)
                if folder.is_dir() and read_notice(folder / NOTICE_FILE) is None:
                    write_notice(folder, Notice(deadline=deadline, by=record.preempted_by_name))
                checkpoint = last_checkpoint(folder)
                if checkpoint is not None and checkpoint != record.checkpointed_at:
                    marked = await self._in_store(_mark_preempted, self._store, record.job_id,
                                                  {"checkpointed_at": checkpoint})
                    record = marked if marked is not None else record
                if checkpoint is not None and checkpoint >= noticed_at:
                    outcome = "checkpointed"
            if outcome is None and now >= deadline:
                outcome = "killed"
            if outcome is None:
                continue
            placements = await self._in_store(_victim_placements, self._store, record.job_id)
            try:
                run = await self._client().read_flow_run(uuid.UUID(record.job_id))
            except (ObjectNotFound, ValueError):
                continue
            if run.state is None or run.state.type not in EVICTABLE_STATES or not placements:
                continue  # it ended by itself, within its grace: the requeue sees to it
            await self._stop(run, record, tuple(placements), outcome, queue=placements[0].queue,
                             priority=placements[0].priority)

    async def _tell_steps(self, record: FlowRunRecord, node: str) -> None:
        """A preempted bundle run's steps on ``node`` that run as their own flow runs (``mn-step``, placed by this
        node's worker on the step's booking) told too: its notice written in their run folders, where their
        ``MN_PREEMPT_NOTICE_FILE`` points. The run's own node tells the run itself (and the steps it runs)."""
        steps = {p.job_id for p in await self._in_store(_victim_placements, self._store, record.job_id)
                 if p.node == node and p.job_id and p.job_id != record.job_id}
        if not steps:
            return
        root = runs_root()
        folders = await anyio.to_thread.run_sync(lambda: [f for f in root.iterdir() if f.is_dir()]
                                                 if root.is_dir() else [])
        for folder in folders:
            if folder.name == record.job_id or (folder / NOTICE_FILE).exists():
                continue
            if folder.name not in self._step_bookings:
                try:
                    run = await self._client().read_flow_run(uuid.UUID(folder.name))
                except (ObjectNotFound, ValueError):
                    self._step_bookings[folder.name] = None
                    continue
                booking = (run.job_variables or {}).get("booking")
                self._step_bookings[folder.name] = booking.get("job_id") if isinstance(booking, dict) else None
            if self._step_bookings[folder.name] in steps:
                write_notice(folder, Notice(deadline=record.deadline or time.time(), by=record.preempted_by_name))
        self._step_bookings = {name: b for name, b in self._step_bookings.items()
                               if any(f.name == name for f in folders)}

    async def checkpoints(self, node: str) -> None:
        """The last checkpoints of the preemptible runs placed on ``node``, copied into their records (the victim
        choice reads them there). Only the run folders of this machine are looked at: a checkpoint file that changed
        since the last pass costs one record read and one write."""
        found = await anyio.to_thread.run_sync(_local_checkpoints)
        for run_id, checkpoint in found.items():
            if self._seen_checkpoints.get(run_id) == checkpoint:
                continue
            record = await self._in_store(get_record, self._store, run_id, FlowRunRecord)
            if record is not None and record.node == node and record.preemption_grace_s is not None \
                    and record.checkpointed_at != checkpoint:
                await self._in_store(_mark, self._store, run_id, {"checkpointed_at": checkpoint}, None)
            self._seen_checkpoints[run_id] = checkpoint
        self._seen_checkpoints = {r: c for r, c in self._seen_checkpoints.items() if r in found}

    async def _stop(self, run, record: FlowRunRecord | None, placements: tuple[Placement, ...], outcome: Outcome, *,
                    queue: str | None, priority: int | None) -> None:
        """Stop ``run`` through Prefect's cancellation, counting what its next attempt will have to do again (what
        ``placements`` hold, its steps' included, since its last checkpoint or its start)."""
        now = time.time()
        history = await self._in_store(self._store.history, str(run.id))
        checkpoint = record.checkpointed_at if record is not None and record.checkpointed_at is not None else None
        lost_gpu, lost_cpu = Evictable(booking=str(run.id), placements=placements,
                                       started=history[-1].committed_at if history else now,
                                       checkpointed=-math.inf if checkpoint is None else checkpoint).lost(now)
        placement = placements[0]
        by_name = record.preempted_by_name if record is not None else None
        by = f"run {by_name}" if by_name else "a run of higher priority"
        words = {"checkpointed": "it checkpointed in its grace", "killed": "stopped at the end of its grace"}
        message = (f"mn: preempted by {by} on {placement.node}, {words[outcome]}; it is scheduled again once it "
                   "has stopped")
        await self._client().set_flow_run_state(run.id, Cancelling(message=message), force=True)
        counted = f"preempted_{outcome}"
        await self._in_store(_mark_preempted, self._store, str(run.id), {
            "outcome": outcome, counted: (getattr(record, counted) if record is not None else 0) + 1},
            (lost_gpu, lost_cpu))
        events.emit("mn.run.preempted", events.job(str(run.id), run.name),
                    related=[events.flow_run(run.id, run.name), events.node(placement.node, "node")],
                    payload={"job_id": str(run.id), "by": record.preempted_by if record is not None else None,
                             "queue": queue, "priority": priority, "node": placement.node, "reason": message,
                             "outcome": outcome, "lost_gpu_s": round(lost_gpu, 3), "lost_cpu_s": round(lost_cpu, 3)})
        self._run_logger(run).warning(message)

    def _choose(self, job_id: str, ask: Ask, queue: RunQueue, strategy: str) -> list[Evictable]:
        store = self._store
        queues = store.queues()
        leaving = {r.job_id for r in list_records(store, FlowRunRecord, status="preempted")}
        checkpoints = {r.job_id: r.checkpointed_at for r in list_records(store, FlowRunRecord, status="placed")
                       if r.checkpointed_at is not None}
        by_job: dict[str, list] = {}
        own_hold = []  # the run's own head-of-line hold: room for it, not another's booking to evict around
        runs_of_workflows: dict[str, str | None] = {}
        for placement in store.active_placements():
            if placement.hold and placement.hold_for == job_id:
                own_hold.append(placement)
            elif placement.job_id:
                by_job.setdefault(_run_of(store, placement.job_id, runs_of_workflows), []).append(placement)
        priority, now = queue.resolved(queues), time.time()
        eligible: list[Evictable] = []
        pending: list[Evictable] = []
        for job, placements in by_job.items():
            if not (evictable_booking(job, placements, for_booking=job_id)
                    or (job != job_id and len(placements) > 1 and evictable_with_steps(placements))):
                continue
            running = Evictable(booking=job, placements=tuple(placements), started=-math.inf)
            if job in leaving:
                pending.append(running)
            elif may_evict(running, queue.name, priority, queues, now):  # by rank alone: its age is read next
                history = store.history(job)
                running = replace(running, started=history[-1].committed_at if history else now,
                                  checkpointed=checkpoints.get(job, -math.inf))
                if may_evict(running, queue.name, priority, queues, now):
                    eligible.append(running)
        if not eligible:
            return []
        self._placer.refresh()
        view = self._placer.view
        freed = [*own_hold, *(placement for gone in pending for placement in gone.placements)]
        for placement in freed:  # its own hold, and what runs on their way out hold, count as free
            view.unhold(placement)
        try:
            victims, _plan = choose(view, lambda: plan_asks([ask], [], strategy=strategy, explain=False, view=view,
                                                            queue=queue), eligible, now=now)
        finally:
            for placement in freed:
                view.hold(placement)
        return victims

    async def requeue(self) -> None:
        """Preempted runs that have stopped: their bookings released, scheduled again to wait their turn."""
        records = await self._in_store(list_records, self._store, FlowRunRecord, status="preempted")
        for record in records:
            try:
                run = await self._client().read_flow_run(uuid.UUID(record.job_id))
            except ObjectNotFound:
                await self._in_store(_settle, self._store, record.job_id, "failed")
                continue
            except Exception as error:  # the next pass looks again
                self._logger.warning("could not read preempted run %s: %s", record.job_id, error)
                continue
            state = run.state.type if run.state is not None else None
            if state in (StateType.RUNNING, StateType.PENDING, StateType.CANCELLING):
                continue  # still stopping
            if state in (StateType.CANCELLED, StateType.CRASHED):
                await self._in_store(release, self._store, FlowRun(record.job_id), "preempted")
                await self._client().set_flow_run_state(run.id, Scheduled(
                    message="mn: preempted; waiting to be placed again"), force=True)
                self._run_logger(run).warning("mn: preempted and stopped; scheduled again")
            await self._in_store(_settle, self._store, record.job_id, "rescheduled")


def _run_of(store: ClusterStore, booking: str, workflows: dict[str, str | None]) -> str:
    """The booking a preemption evicts ``booking`` with: a bundle step's is its bundle run's (its flow run id, from
    the workflow's record; ``workflows`` caches them), any other its own."""
    owner = parse(booking)
    if not isinstance(owner, StepAttempt):
        return booking
    if owner.workflow_job not in workflows:
        record = get_record(store, owner.workflow_job, WorkflowRecord)
        workflows[owner.workflow_job] = record.flow_run_id if record is not None else None
    return workflows[owner.workflow_job] or booking


def _local_checkpoints() -> dict[str, float]:
    """The last checkpoint of each run with a folder on this machine (``mn_prefect.preemption``)."""
    root = runs_root()
    if not root.is_dir():
        return {}
    out = {}
    for folder in root.iterdir():
        checkpoint = last_checkpoint(folder)
        if checkpoint is not None:
            out[folder.name] = checkpoint
    return out


def _victim_placements(store: ClusterStore, run_id: str) -> list[Placement]:
    """What a preempted run holds: its own booking's placements first, then its bundle steps' (if any)."""
    own = store.active_placements(job_id=run_id)
    workflows: dict[str, str | None] = {}
    steps = [p for p in store.active_placements() if p.job_id and p.job_id != run_id
             and isinstance(parse(p.job_id), StepAttempt) and _run_of(store, p.job_id, workflows) == run_id]
    return [*own, *steps]


def evictable_with_steps(placements: list) -> bool:
    """A bundle run with its steps' bookings: evicted whole, when every one of them is preemptible and none is
    inside a reservation."""
    return all(p.preemptible and not p.reservation for p in placements)


def _mark(store: ClusterStore, job_id: str, update: dict[str, Any], lost: tuple[float, float] | None,
          status: str | None = None) -> FlowRunRecord | None:
    record = get_record(store, job_id, FlowRunRecord)
    if record is None:
        return None
    update = {**update, "updated_at": time.time(), **({"status": status} if status else {})}
    if lost is not None:
        update.update(lost_gpu_s=record.lost_gpu_s + lost[0], lost_cpu_s=record.lost_cpu_s + lost[1])
    marked = record.model_copy(update=update)
    put_record(store, marked)
    return marked


def _mark_preempted(store: ClusterStore, job_id: str, update: dict[str, Any],
                    lost: tuple[float, float] | None = None) -> FlowRunRecord | None:
    return _mark(store, job_id, update, lost, "preempted")


def _settle(store: ClusterStore, job_id: str, status: str) -> None:
    record = get_record(store, job_id, FlowRunRecord)
    if record is not None:
        put_record(store, record.model_copy(update={
            "status": status, "updated_at": time.time(),
            "reschedules_ms": [*record.reschedules_ms, int(time.time() * 1000)] if status == "rescheduled"
            else record.reschedules_ms}))
