"""Preemption in the workers: evict the fewest preemptible runs that let a waiting run start, and put them back.

The pool's announcer alone decides (as it alone says why runs wait), with the rule of scheduler/preemption.py on
the store's bookings: each victim's flow run goes to Cancelling with a message saying which run took its place,
an ``mn.run.preempted`` event is sent, and its record says ``preempted``. Its worker stops it as it stops any
cancelled run. Once it is over, the announcer releases its booking and schedules it again (``requeue``): it waits
like any other run, under its queue's quota and its place in line. Victims already on their way out count as
freed, so a run that keeps waiting for them never evicts more.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelling, Scheduled

from mn_prefect import events
from mn_prefect.model.bookings import FlowRun
from mn_prefect.placement.placing import Placer
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.scheduler.preemption import Evictable, choose, evictable_booking, may_evict
from mn_prefect.scheduler.quotas import RunQueue
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import FlowRunRecord, get_record, list_records, put_record
from mn_prefect.store.releasing import release
from mn_prefect.worker.sweeps import InStore

EVICTABLE_STATES = (StateType.RUNNING, StateType.PENDING)


class Preempter:
    def __init__(self, *, store: ClusterStore, placer: Placer, client: Callable[[], Any], in_store: InStore,
                 logger: Any, run_logger: Callable[[Any], Any]):
        self._store, self._placer, self._client, self._in_store = store, placer, client, in_store
        self._logger, self._run_logger = logger, run_logger

    async def make_room(self, flow_run, ask: Ask, queue: RunQueue, strategy: str) -> list[str]:
        """Evict what ``flow_run`` needs (or count what is already on its way out); the runs evicted now."""
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
            message = (f"mn: preempted by run {flow_run.name} (queue {queue.name}, priority "
                       f"{queue.priority if queue.priority is not None else first.priority}) on {first.node}; "
                       "it is scheduled again once it has stopped")
            await self._client().set_flow_run_state(run.id, Cancelling(message=message), force=True)
            await self._in_store(_mark_preempted, self._store, victim.booking)
            events.emit("mn.run.preempted", events.job(victim.booking, run.name),
                        related=[events.flow_run(run.id, run.name), events.flow_run(flow_run.id, flow_run.name),
                                 events.node(first.node, "node")],
                        payload={"job_id": victim.booking, "by": str(flow_run.id), "queue": first.queue,
                                 "priority": first.priority, "node": first.node, "reason": message})
            self._run_logger(run).warning(message)
            evicted.append(run.name)
        if evicted:
            self._run_logger(flow_run).info("mn: preempting %s to make room for this run", ", ".join(evicted))
        return evicted

    def _choose(self, job_id: str, ask: Ask, queue: RunQueue, strategy: str) -> list[Evictable]:
        store = self._store
        queues = store.queues()
        leaving = {r.job_id for r in list_records(store, FlowRunRecord, status="preempted")}
        by_job: dict[str, list] = {}
        own_hold = []  # the run's own head-of-line hold: room for it, not another's booking to evict around
        for placement in store.active_placements():
            if placement.hold and placement.hold_for == job_id:
                own_hold.append(placement)
            elif placement.job_id:
                by_job.setdefault(placement.job_id, []).append(placement)
        priority, now = queue.resolved(queues), time.time()
        eligible: list[Evictable] = []
        pending: list[Evictable] = []
        for job, placements in by_job.items():
            if not evictable_booking(job, placements, for_booking=job_id):
                continue
            running = Evictable(booking=job, placements=tuple(placements), started=-math.inf)
            if job in leaving:
                pending.append(running)
            elif may_evict(running, queue.name, priority, queues, now):  # by rank alone: its age is read next
                history = store.history(job)
                running = replace(running, started=history[-1].committed_at if history else now)
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
                                                            queue=queue), eligible)
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


def _mark_preempted(store: ClusterStore, job_id: str) -> None:
    record = get_record(store, job_id, FlowRunRecord)
    if record is not None:
        put_record(store, record.model_copy(update={"status": "preempted", "updated_at": time.time()}))


def _settle(store: ClusterStore, job_id: str, status: str) -> None:
    record = get_record(store, job_id, FlowRunRecord)
    if record is not None:
        put_record(store, record.model_copy(update={
            "status": status, "updated_at": time.time(),
            "reschedules_ms": [*record.reschedules_ms, int(time.time() * 1000)] if status == "rescheduled"
            else record.reschedules_ms}))
