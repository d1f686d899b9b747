"""A store plan's hold (docs/cli.md, "plan"): for a run that does not fit now but would once running bookings end,
where its head-of-line hold stands, or where the hold rule (``scheduler.holds.choose_hold``, as a worker books one:
``placement.holding.make_hold``) would put it, and when the run is expected to start there.

The rule is the worker's own: the bookings' estimated ends (``ends_by``, from their runs' runtime estimates:
``placement.estimates``) say when each node frees, and a run that waits for its quota or a port gets no hold
(``worker.route.capacity_wait``). Nothing is booked here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mn_prefect.model.estimates import duration_words
from mn_prefect.model.placement import Placement
from mn_prefect.placement.holding import StandingHold, read_holds, running_of
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.holds import Running, choose_hold, worth_holding
from mn_prefect.scheduler.view import ClusterView
from mn_prefect.worker.route import capacity_wait


@dataclass(frozen=True)
class PlanHoldFacts:
    """What a store plan's hold depends on, read once: the holds standing (by the run each holds for) and the
    bookings a hold may wait for, with their estimated ends."""

    holds: dict[str, StandingHold]
    running: list[Running]


@dataclass(frozen=True)
class PlanHold:
    """Where a run's hold stands (``standing``) or would go: its nodes, one per ask, and when the run is expected
    to start there (epoch seconds; None: a booking it waits for has no estimate)."""

    nodes: tuple[str, ...]
    expected_start: float | None
    standing: bool

    def as_json(self, now: float) -> dict[str, Any]:
        """``expected_start_s``: seconds from ``now`` (never below 0), or None when unknown."""
        start = None if self.expected_start is None else round(max(self.expected_start - now, 0.0), 1)
        return {"nodes": list(self.nodes), "expected_start_s": start, "standing": self.standing}

    def words(self, now: float) -> str:
        where = ", ".join(self.nodes)
        what = f"a hold stands for this run on {where}" if self.standing else \
            f"a hold for this run would go on {where} (when its pool has holds on)"
        if self.expected_start is None:
            return f"{what}; expected start unknown (a run it waits for has no runtime estimate)"
        return f"{what}; expected start in about {duration_words(max(self.expected_start - now, 0.0))}"


def read_hold_facts(store: Any, group: str | None, active: Sequence[Placement] = ()) -> PlanHoldFacts:
    """The holds standing in ``store`` (of ``group``'s nodes, with it, as its workers read them) and when its
    bookings, and ``active`` on top, are expected to end."""
    return PlanHoldFacts(holds=read_holds(store, group), running=running_of([*store.active_placements(), *active]))


def own_hold(facts: PlanHoldFacts | None, run_id: str | None) -> StandingHold | None:
    """The hold standing for flow run ``run_id``; None without one (or without a run named)."""
    if facts is None or run_id is None:
        return None
    return facts.holds.get(run_id)


def plan_hold(view: ClusterView, asks: Sequence[Ask], facts: PlanHoldFacts, own: StandingHold | None,
              reason: str | None, now: float) -> PlanHold | None:
    """The hold of a run whose plan is ``runnable_later`` for ``reason``: its own standing one, else where the
    rule would book one against ``view`` (the bookings now, other holds included); None when it waits for its
    quota or a port, starts as soon as one booking ends, or no node could ever take it."""
    if own is not None:
        return PlanHold(nodes=own.nodes, expected_start=own.expected_start, standing=True)
    if not capacity_wait(reason):
        return None
    choice = choose_hold(view, list(asks), facts.running, now)
    if choice is None or not worth_holding(choice):
        return None  # no node could ever take it, or it starts as soon as one booking ends: no hold
    return PlanHold(nodes=choice.nodes, expected_start=choice.expected_start, standing=False)
