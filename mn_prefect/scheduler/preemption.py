"""Preemption: which running runs a waiting run may evict, and the fewest that let it start.

A run may be evicted only if it is **preemptible** (job variable ``preemptible``) and has run at least its
``min_runtime_seconds``, and only for a run that either has a **higher priority**, or has the same priority and
**reclaims** what its queue lent: the victim's queue uses more than its quota (it borrows) in a dimension where
the waiting run's queue, in the same cohort, is below its own. Nothing else is ever preempted.

**Lost work.** A run evicted at ``now`` loses what it did since its last checkpoint, or since it started when it
has none (``Evictable.checkpointed``, -inf: never): its booked resources times ``now - max(started,
checkpointed)``, in GPU-seconds (the GPUs it holds, a fraction counting its ``shares``) and CPU-seconds (the cores
it booked). A resource it books none of loses nothing, even when its start is unknown (-inf).

Among those that may go, victims are taken in order until the waiting run fits: given ``now``, the least lost
work first (GPU-seconds, then CPU-seconds), then lowest priority, then most recently started, then by booking;
without ``now``, by priority, recency and booking alone. Then each victim that turns out not to be needed is
spared again, in the order taken, so the fewest are evicted. If even all of them would not make room, nothing is
evicted. Pure: planning on a ``ClusterView`` that is left as it was found.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Placement, Plan
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.quotas import Queues, RunQueue, charge
from mn_prefect.scheduler.view import ClusterView


@dataclass(frozen=True)
class Evictable:
    """A running run that might be evicted: its booking, where it holds what, since when, and when it last
    checkpointed (epoch seconds; -inf: never)."""

    booking: str
    placements: tuple[Placement, ...]
    started: float
    checkpointed: float = -math.inf

    def lost_seconds(self, now: float) -> float:
        """Seconds of work an eviction at ``now`` loses: since its last checkpoint, else since it started (never
        below 0; inf when neither is known)."""
        return lost_seconds(self.started, self.checkpointed, now)

    def lost(self, now: float) -> tuple[float, float]:
        """The work an eviction at ``now`` loses: (GPU-seconds, CPU-seconds) of what it books."""
        amounts = charge(self.placements)
        return lost_work(amounts["gpu"], amounts["cpu"], self.lost_seconds(now))

    @property
    def first(self) -> Placement:
        return self.placements[0]

    @property
    def priority(self) -> int:
        return self.first.priority or 0


def lost_seconds(started: float, checkpointed: float, now: float) -> float:
    """``now`` less the later of ``started`` and ``checkpointed``, never below 0 (the work an eviction loses)."""
    return max(now - max(started, checkpointed), 0.0)


def lost_work(gpus: float, cpus: float, seconds: float) -> tuple[float, float]:
    """(GPU-seconds, CPU-seconds) lost over ``seconds`` by a run booking ``gpus`` and ``cpus``: a resource booked
    not at all loses 0, also over an unknown (infinite) time."""
    return (gpus * seconds if gpus > 0 else 0.0, cpus * seconds if cpus > 0 else 0.0)


def victim_order(candidates: Sequence[Evictable], now: float | None = None) -> list[Evictable]:
    """``candidates`` in the order they are taken: given ``now``, least lost work first (GPU-seconds, then
    CPU-seconds); then lowest priority, most recently started, booking."""
    def key(r: Evictable) -> tuple[float, float, int, float, str]:
        gpu_s, cpu_s = r.lost(now) if now is not None else (0.0, 0.0)
        return (gpu_s, cpu_s, r.priority, -r.started, r.booking)
    return sorted(candidates, key=key)


def evictable_booking(booking: str, placements: Sequence[Placement], *, for_booking: str) -> bool:
    """Whether booking ``booking`` is one preemption may consider for ``for_booking`` at all: another's, of one
    placement (a gang or a system run's parts are never split), marked preemptible, and not inside a reservation
    (what a reservation holds is its owner's)."""
    if booking == for_booking or len(placements) != 1:
        return False
    return bool(placements[0].preemptible) and not placements[0].reservation


def may_evict(victim: Evictable, queue: str | None, priority: int, queues: Queues | None, now: float) -> bool:
    """Whether a run of ``queue`` at ``priority`` may evict ``victim`` (the rule above)."""
    first = victim.first
    if not first.preemptible or now - victim.started < (first.min_runtime_s or 0):
        return False
    if victim.priority < priority:
        return True
    return victim.priority == priority and _reclaims(queue, first.queue, queues)


def _reclaims(queue: str | None, victim_queue: str | None, queues: Queues | None) -> bool:
    if queues is None or not queue or not victim_queue or queue == victim_queue:
        return False
    mine, theirs = queues.queues.get(queue), queues.queues.get(victim_queue)
    if mine is None or theirs is None or not mine.spec.cohort or mine.spec.cohort != theirs.spec.cohort:
        return False
    return any(theirs.used.get(d, 0.0) > q + 1e-9 and mine.used.get(d, 0.0) < mine.spec.quota.get(d, 0.0) - 1e-9
               for d, q in theirs.spec.quota.items())


def choose(view: ClusterView, plan: Callable[[], Plan], candidates: Sequence[Evictable], *,
           now: float | None = None) -> tuple[list[Evictable], Plan]:
    """The fewest of ``candidates`` (already filtered by ``may_evict``) whose eviction lets ``plan`` succeed, and
    the plan made then; ([], the refused plan) when none would. Taken in ``victim_order``: least lost work at
    ``now`` first when it is given. ``plan`` plans against ``view`` and leaves a successful plan booked there; the
    view is given back as it was found (the plan undone, victims held)."""
    order = victim_order(candidates, now)
    evicted: list[Evictable] = []
    found: Plan | None = None
    for victim in order:
        _release(view, victim)
        evicted.append(victim)
        attempt = plan()
        if attempt.status == "runnable_now":
            _undo(view, attempt)
            found = attempt
            break
    if found is None:
        for victim in evicted:
            _hold(view, victim)
        return [], plan_refused(plan, view)
    for victim in list(evicted):  # spare those that were not needed, in the order taken
        _hold(view, victim)
        attempt = plan()
        if attempt.status == "runnable_now":
            _undo(view, attempt)
            evicted.remove(victim)
            found = attempt
        else:
            _release(view, victim)
    for victim in evicted:
        _hold(view, victim)
    return evicted, found


def plan_refused(plan: Callable[[], Plan], view: ClusterView) -> Plan:
    refused = plan()
    _undo(view, refused)
    return refused


def _release(view: ClusterView, victim: Evictable) -> None:
    for placement in victim.placements:
        view.unhold(placement)


def _hold(view: ClusterView, victim: Evictable) -> None:
    for placement in victim.placements:
        view.hold(placement)


def _undo(view: ClusterView, plan: Plan) -> None:
    for placement in plan.placements:
        view.unhold(placement)


def preempting_plan(asks: list[Ask], nodes: list[NodeRecord], held: Sequence[Placement], limits: Limits | None,
                    queues: Queues | None, queue: RunQueue, job_type: str, strategy: str, now: float) -> Plan | None:
    """The dry run's answer for a run that does not fit now: the plan made after evicting the fewest of the
    ``held`` placements it may evict (each booking named by its ``job_id``, else its ``agent_id``), with their
    bookings in every placement's ``preempts``; None when no eviction lets it start."""
    from mn_prefect.scheduler.plan import plan_asks

    view = ClusterView(nodes, held, limits, queues)
    bookings: dict[str, list[Placement]] = {}
    for placement in held:
        bookings.setdefault(placement.job_id or placement.agent_id, []).append(placement)
    priority = queue.resolved(queues)
    candidates = [c for c in (Evictable(booking=b, placements=tuple(ps), started=-float("inf"))
                              for b, ps in bookings.items()) if may_evict(c, queue.name, priority, queues, now)]
    if not candidates:
        return None
    victims, plan = choose(view, lambda: plan_asks(asks, [], job_type=job_type, strategy=strategy, explain=False,
                                                   view=view, queue=queue), candidates)
    if not victims:
        return None
    names = tuple(v.booking for v in victims)
    return plan.model_copy(update={
        "placements": tuple(p.model_copy(update={"preempts": names}) for p in plan.placements),
        "reason": f"{plan.reason} after preempting {len(names)} run(s): {', '.join(names)}"})
