"""Head-of-line holds for a blueprint job that waits to be placed: its agents are booked all or nothing (a gang),
so capacity that frees one GPU at a time on several nodes never adds up to the job while smaller runs keep taking
each GPU that frees. With holds on in its pool (the pool's policy, docs/scheduling.md "Holds and backfill"), a
job whose placement waits for capacity gets a hold over the nodes where it can start soonest, as a waiting run does;
once the hold and what is free there cover every agent, the job is placed over it and the hold ends.

A job's hold is owned like a run's (``Hold``), held for the job's id. It never takes over another run's hold: it is
made only while fewer than the pool's ``max_holds`` stand for runs placed from no work queue. The pool's announcer
ends it once the job no longer waits (placed, finished, or its coordinator run over: ``decisions.job_hold_over``);
the coordinator ends it when it places the job elsewhere or stops.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from mn_prefect import events
from mn_prefect.model.placement import Placement, Plan
from mn_prefect.model.pool_policy import PoolPolicy
from mn_prefect.placement.holding import StandingHold, end_hold, hold_needed, make_hold, place_over, read_holds
from mn_prefect.placement.placing import Placer
from mn_prefect.scheduler import reasons
from mn_prefect.scheduler.ask import Ask
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import PoolPolicyRecord, get_record, pool_policy_id

# Waits that capacity freeing on a node does not end: holding for them would only keep capacity idle.
_NOT_CAPACITY = (reasons.QUOTA, reasons.PORT_IN_USE, reasons.NO_DYNAMIC_PORT, reasons.RESERVATION_ENDED)


@dataclass(frozen=True)
class HoldStep:
    """What one placing pass did with the job's hold: ``placed`` (the booking made over it, by ``plan``), ``hold``
    (the hold standing for it now, if any) and ``made`` (this pass booked it)."""

    placed: list[Placement] | None = None
    hold: StandingHold | None = None
    made: bool = False
    plan: Plan | None = None  # the plan the job was placed by, over its hold


def pool_policy(store: ClusterStore, pool: str) -> PoolPolicy:
    record = get_record(store, pool_policy_id(pool), PoolPolicyRecord)
    return record.policy if record is not None else PoolPolicy()


def hold_step(store: ClusterStore, pool: str, job_id: str, asks: Sequence[Ask], plan: Plan, *, strategy: str,
              now: float | None = None) -> HoldStep:
    """After the job's plain placement did not fit (``plan``): place it over its own hold when that now covers it,
    else make it a hold when its pool's policy allows one more; nothing when it never fits or waits for something
    capacity does not end."""
    now = time.time() if now is None else now
    policy = pool_policy(store, pool)
    if not policy.holds or plan.status != "runnable_later" or any(f"{w}:" in (plan.reason or "") for w in _NOT_CAPACITY):
        return HoldStep()
    placer = Placer(store, group=pool)
    standing = read_holds(store, pool)
    own = standing.get(job_id)
    if own is not None:
        over = place_over(placer, job_id, list(asks), own, strategy=strategy)
        if over.placed and over.commit is not None:
            end_hold(placer, own)
            return HoldStep(placed=list(over.commit.placements or over.plan.placements), hold=own, plan=over.plan)
        return HoldStep(hold=own)
    others = [h for run, h in standing.items() if run != job_id and h.queue is None]
    if len(others) >= policy.max_holds:
        return HoldStep()
    if not hold_needed(placer, asks, now):
        return HoldStep()  # it starts as soon as one booking ends: no hold
    made = make_hold(placer, job_id, asks, now=now)
    return HoldStep(hold=made, made=made is not None)


def end_job_hold(store: ClusterStore, pool: str, job_id: str) -> StandingHold | None:
    """End the hold standing for the job (placed elsewhere, or stopping); the hold ended, or None."""
    hold = read_holds(store, pool).get(job_id)
    if hold is not None:
        end_hold(Placer(store, group=pool), hold)
    return hold


def emit(event: str, job_id: str, coordinator_run: str | None, hold: StandingHold, **payload: object) -> None:
    """One of the ``mn.hold.*`` events, about the job (and its coordinator run)."""
    related = [events.flow_run(coordinator_run, job_id)] if coordinator_run else []
    events.emit(event, events.job(job_id, job_id), related=related,
                payload={"hold": hold.hold_id, "nodes": list(hold.nodes), "expected_start": hold.expected_start,
                         "job_id": job_id, **payload})
