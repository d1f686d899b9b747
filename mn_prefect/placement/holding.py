"""Head-of-line holds in the store: make one, place a run over one, end one (docs/scheduling.md, "Holds and
backfill").

A hold is a booking under its own id (``hold-<hex>``, owner ``Hold``) whose placement books the held run's request
on the node where it can start soonest (``scheduler.holds.choose_hold``), even past what is free there: every other
commit sees that capacity as booked, so capacity freeing there goes to the held run. Two kinds of placement may take
it (``over_hold``): the held run itself, once what is free there plus the hold covers its request, and a run
backfilled ahead of it, whose estimate says it ends before the hold's expected start. The store's one commit rule
(store/admission.py) admits them against the hold's amounts, and only while the hold's key is held.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mn_prefect.model.bookings import Hold
from mn_prefect.model.estimates import duration_words
from mn_prefect.model.placement import PlacedResources, Placement
from mn_prefect.placement.placing import Placer, PlaceResult
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.holds import HoldChoice, Running, choose_hold, worth_holding
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.scheduler.quotas import RunQueue
from mn_prefect.scheduler.view import ClusterView
from mn_prefect.store.base import ClusterStore


def new_hold_id() -> str:
    return f"hold-{secrets.token_hex(8)}"


@dataclass(frozen=True)
class StandingHold:
    """One hold as the store keeps it: its id, the run it holds for, its placements (one per node) and when the run
    is expected to start (epoch seconds; None: unknown)."""

    hold_id: str
    run_id: str
    placements: tuple[Placement, ...]
    expected_start: float | None
    queue: str | None = None  # the held run's work queue: holds are counted per queue

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(p.node for p in self.placements)

    @property
    def owner(self) -> Hold:
        return Hold(self.hold_id)


def holds_of(placements: Iterable[Placement]) -> dict[str, StandingHold]:
    """The holds among ``placements`` (any booking's), by the run each holds for."""
    by_id: dict[str, list[Placement]] = {}
    for p in placements:
        if p.hold:
            by_id.setdefault(p.hold, []).append(p)
    out: dict[str, StandingHold] = {}
    for hold_id, held in sorted(by_id.items()):
        first = held[0]
        out[first.hold_for or ""] = StandingHold(hold_id=hold_id, run_id=first.hold_for or "",
                                                 placements=tuple(sorted(held, key=lambda p: p.node)),
                                                 expected_start=first.hold_start, queue=first.hold_queue)
    return out


def read_holds(store: ClusterStore, group: str | None = None) -> dict[str, StandingHold]:
    """The holds standing in the store (of one resource group's nodes, with ``group``), by the run each holds for."""
    placements = store.active_placements()
    return holds_of(p for p in placements if group is None or p.group == group)


def running_of(placements: Iterable[Placement]) -> list[Running]:
    """The bookings a hold may wait for, with their estimated ends (holds themselves are not among them)."""
    return [Running(job_id=p.job_id or p.agent_id, node=p.node, ends_at=p.ends_by, cpu_cores=p.resources.cpu_cores,
                    memory_mb=p.resources.memory_mb, disk_mb=p.resources.disk_mb, gpu_count=p.resources.gpu_count)
            for p in placements if not p.hold]


def hold_placements(hold_id: str, run_id: str, asks: Sequence[Ask], choice: HoldChoice,
                    queue: str | None = None) -> list[Placement]:
    """A hold's placements: each ask's request (its scalars and whole GPUs; no device ids, no ports) on the node the
    choice names for it."""
    out = []
    for ask, node in zip(asks, choice.nodes, strict=True):
        r = ask.request
        out.append(Placement(agent_id=f"hold:{ask.agent_id}", source_agent_id=ask.source_agent_id, node=node,
                             resources=PlacedResources(cpu_cores=r.cpu_cores, memory_mb=r.memory_mb,
                                                       disk_mb=r.disk_mb, gpu_count=r.gpu_count),
                             job_id=hold_id, hold=hold_id, hold_for=run_id, hold_start=choice.expected_start,
                             hold_queue=queue, locality="hold"))
    return out


def hold_needed(placer: Placer, asks: Sequence[Ask], now: float | None = None) -> bool:
    """Whether a run that did not fit needs a hold, with the holds standing where they are: not when it starts as
    soon as one booking ends (``scheduler.holds.worth_holding``: it takes that capacity in line order); yes when it
    needs more, or fits only where holds stand (then a hold of its own, taking the head of the line over, is how it
    gets there)."""
    now = time.time() if now is None else now
    placer.refresh()
    choice = choose_hold(placer.view, list(asks), running_of(placer.store.active_placements()), now)
    return choice is None or worth_holding(choice)


def make_hold(placer: Placer, run_id: str, asks: Sequence[Ask], *, queue: str | None = None,
              now: float | None = None) -> StandingHold | None:
    """Book a hold for run ``run_id`` where its asks can start soonest; None when no node could ever take them, or
    the commit was refused (another hold was booked on that node first: the next pass chooses again)."""
    now = time.time() if now is None else now
    placer.refresh()
    view = placer.view
    running = running_of(placer.store.active_placements())
    choice = choose_hold(view, list(asks), running, now)
    if choice is None:
        return None
    hold_id = new_hold_id()
    placements = hold_placements(hold_id, run_id, asks, choice, queue)
    commit = placer.commit(hold_id, placements)
    if not commit.ok:
        return None
    return StandingHold(hold_id=hold_id, run_id=run_id, placements=tuple(commit.placements or placements),
                        expected_start=choice.expected_start, queue=queue)


def covered(view: ClusterView, hold: StandingHold) -> list[tuple[str, int, int]]:
    """Per node of the hold: (node, GPUs of the hold already free there, GPUs it holds), from a view that counts
    the hold as booked (what the held run's state message says)."""
    out = []
    for p in hold.placements:
        i = view.index.get(p.node)
        if i is None:
            continue
        free = int(view.free_gpu[i]) + p.resources.gpu_count  # what the runs there leave free
        out.append((p.node, max(0, min(free, p.resources.gpu_count)), p.resources.gpu_count))
    return out


def hold_message(hold: StandingHold, view: ClusterView, running: Sequence[Running], now: float) -> str:
    """The held run's waiting reason, in words: what is held where, and when it is expected to start."""
    parts = []
    for node, free, want in covered(view, hold):
        parts.append(f"{free} of {want} GPUs on {node}" if want else f"capacity on {node}")
    where = ", ".join(parts) or ", ".join(hold.nodes)
    nodes = set(hold.nodes)
    ends = sorted((r for r in running if r.node in nodes and r.ends_at is not None
                   and (hold.expected_start is None or r.ends_at <= hold.expected_start + 1e-6)),
                  key=lambda r: r.ends_at or 0.0)
    if hold.expected_start is None:
        when = "expected start unknown (a run it waits for has no runtime estimate)"
    else:
        when = f"expected start in about {duration_words(max(hold.expected_start - now, 0.0))}"
        if ends:
            names = [r.job_id[:8] for r in ends[-3:]]
            when += f", when run{'s' if len(names) > 1 else ''} {' and '.join(names)} end{'' if len(names) > 1 else 's'}"
    return f"holding {where} for this run; {when}"


def place_over(placer: Placer, job_id: str, asks: list[Ask], hold: StandingHold, *, strategy: str = "binpack",
               queue: RunQueue | None = None, ends_by: float | None = None) -> PlaceResult:
    """Plan and commit ``asks`` with ``hold``'s capacity counted as free on its nodes; the placements that land
    there are stamped ``over_hold``, so the store admits them against the hold's amounts, and only while it
    stands. The hold itself stays booked (its owner ends it: ``end_hold``)."""
    view = placer.view
    for p in hold.placements:
        view.unhold(p)
    try:
        return _plan_over(placer, job_id, asks, hold, strategy, queue, ends_by)
    finally:
        placer.forget()  # the view counted the hold as free: read it again before the next plan


def _plan_over(placer: Placer, job_id: str, asks: list[Ask], hold: StandingHold, strategy: str,
               queue: RunQueue | None, ends_by: float | None) -> PlaceResult:
    plan = plan_asks(asks, [], strategy=strategy, explain=False, job_id=job_id, view=placer.view, queue=queue)
    if plan.status != "runnable_now":
        return PlaceResult(plan=plan, commit=None, attempts=1)
    held = set(hold.nodes)
    placements = [p.model_copy(update={"over_hold": hold.hold_id if p.node in held else None, "ends_by": ends_by})
                  for p in plan.placements]
    commit = placer.commit(job_id, placements, booked_in_view=True)
    return PlaceResult(plan=plan, commit=commit, attempts=1)


def end_hold(placer: Placer, hold: StandingHold) -> int:
    """Release the hold's booking (its run started, ended, was deleted or lost the head of the line)."""
    return placer.release(hold.owner, why="hold_ended")
