"""What a polled run that did not fit does next, as a value: the head-of-line part of its route.

``route(facts)`` is a pure rule over plain facts (the plan's status, the run's estimate, the holds standing in its
scope, whether it is the head of its line this poll and whether this worker decides holds) and returns one of
``PlaceOver`` (place it over its own hold), ``Backfill`` (try it over the holds it ends before, then ``then``),
``MakeHold`` (book a hold for it, ending the holds it takes over), or ``KeepWaiting``; the router (routing.py)
carries it out. No Prefect and no store here (docs/scheduling.md, "Holds and backfill").
"""

from __future__ import annotations

from dataclasses import dataclass

from mn_prefect.placement.holding import StandingHold
from mn_prefect.scheduler import reasons
from mn_prefect.scheduler.holds import may_backfill

DEFAULT_MAX_HOLDS = 1  # per queue (per pool without queues): more would leave capacity idle for long


@dataclass(frozen=True)
class HoldFacts:
    """What the route of a run that did not fit depends on (times in epoch seconds)."""

    plan_status: str  # the plain placement's plan: runnable_later, or not_runnable (never fits: no hold)
    estimate_s: float | None  # the run's runtime estimate; None: unknown
    now: float
    own: StandingHold | None  # the hold standing for this run
    standing: tuple[StandingHold, ...]  # the holds standing in the run's scope (its queue, else the pool)
    head: bool  # the first run of this poll in its scope that did not fit
    decider: bool  # this worker makes the pool's holds (it holds the announcer lease)
    max_holds: int = DEFAULT_MAX_HOLDS
    holds_on: bool = True
    reason: str | None = None  # why the plain placement did not fit (the plan's reason)


@dataclass(frozen=True)
class KeepWaiting:
    """Nothing more now: the run keeps waiting with its reason (its hold's, when it has one)."""


@dataclass(frozen=True)
class PlaceOver:
    """Try the run over its own hold: it lands once what is free there plus the hold covers its request."""

    hold: StandingHold


@dataclass(frozen=True)
class MakeHold:
    """Book a hold for the run, first ending ``replacing``: the holds of runs that lost the head of the line."""

    replacing: tuple[StandingHold, ...] = ()


@dataclass(frozen=True)
class Backfill:
    """Try the run over each of ``holds`` (it ends before each one's expected start); if none takes it, ``then``."""

    holds: tuple[StandingHold, ...]
    then: KeepWaiting | MakeHold


Route = KeepWaiting | PlaceOver | MakeHold | Backfill

# Waits that capacity freeing on one node does not end: holding capacity for them would only keep it idle.
NOT_CAPACITY = (reasons.QUOTA, reasons.PORT_IN_USE, reasons.NO_DYNAMIC_PORT, reasons.RESERVATION_ENDED)


def capacity_wait(reason: str | None) -> bool:
    """Whether a run waits for capacity (a hold can help), not for its queue's quota or a port."""
    return not any(f"{word}:" in (reason or "") for word in NOT_CAPACITY)


def route(facts: HoldFacts) -> Route:
    """The next step of a run that did not fit where nothing was held (see the module docstring)."""
    if not facts.holds_on or facts.plan_status == "not_runnable" or not capacity_wait(facts.reason):
        return KeepWaiting()
    if facts.own is not None:
        return PlaceOver(facts.own)
    then: KeepWaiting | MakeHold = KeepWaiting()
    if facts.head and facts.decider:
        others = tuple(h for h in facts.standing if h.run_id)
        over = len(others) - facts.max_holds + 1
        then = MakeHold(replacing=others[-over:] if over > 0 else ())
    fits_before = tuple(h for h in facts.standing
                        if may_backfill(facts.estimate_s, facts.now, h.expected_start))
    if fits_before:
        return Backfill(fits_before, then)
    return then
