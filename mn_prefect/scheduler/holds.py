"""Head-of-line holds and backfill: the pure rule the worker and the simulator share (docs/simulator.md).

Without holds, a waiting run that does not fit lets later, smaller runs by, and a wide run can wait for ever
behind a stream of narrow ones: four GPUs of one node are never free at once. With holds (as Slurm's backfill
scheduler does it):

- **Estimates.** Every run has a runtime estimate: the one it declares (``max_runtime_s``), else one learned from
  its deployment's history: the 90th percentile, by nearest rank, of the last ``HISTORY`` completed runs'
  durations (``learned_estimate``), else none (unknown).
- **The hold.** The first waiting run in line that does not fit gets a hold (at most one per pool, or per queue,
  by default). ``choose_hold`` picks the node where it can start soonest: the node's running runs are released
  in the order of their estimated ends (start + estimate; unknown: never) until the request fits, and the
  expected start is the estimated end of the last one needed. When no node has a known expected start, it picks
  the node that needs the fewest releases (ties: node order), with the expected start unknown. A gang (several
  asks) takes one node per ask, distinct nodes, each chosen so, and starts when the last of them is free.
- **No hold where one end will do.** A run that what one booking frees would let start, with the holds standing
  where they are and nothing free now needed (``worth_holding``), gets no hold: in line order it takes that capacity anyway, and the hold goes
  to the next waiting run that needs more (the wide one), whose drain then starts without waiting for the narrow
  runs queued ahead of it to start first.
- **Booked capacity.** The hold books the held run's whole request (CPU, memory, disk, whole GPUs; no device
  ids, no ports) on its node(s), past what is free there, so no ordinary placement sees room for it. What is
  free beyond what the hold books stays usable (CPU-only work on a GPU node, say).
- **Backfill.** A run may take held capacity only when its estimate is known and it ends by the hold's expected
  start (``may_backfill``); a run without an estimate never does. A run that fits elsewhere goes elsewhere.
- **The end of a hold.** Once what is free on its node(s), the hold's booking aside, covers the held run's
  request, the held run is placed there and the hold released; a hold also ends when its run is no longer first
  in line (the hold moves to the new head).

Nothing here books, sleeps or reads a store: ``choose_hold`` reads a ``ClusterView`` holding the current
bookings and returns a ``HoldChoice``; the caller books it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mn_prefect.scheduler.admission import EPSILON
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.view import ClusterView

HISTORY = 20  # completed runs of a deployment an estimate is learned from (the most recent)
PERCENTILE = 0.9  # the learned estimate: this percentile of their durations, by nearest rank


@dataclass(frozen=True)
class Running:
    """A running run's booking on one node, with its estimated end (epoch or virtual seconds; None: unknown)."""

    job_id: str
    node: str
    ends_at: float | None
    cpu_cores: float
    memory_mb: float
    disk_mb: float
    gpu_count: int


@dataclass(frozen=True)
class HoldChoice:
    """Where a hold goes: one node per ask, when the held run is expected to start there (None: unknown, a run
    it waits for has no estimate), and the runs whose ends it waits for, soonest first."""

    nodes: tuple[str, ...]
    expected_start: float | None
    waits_on: tuple[str, ...]
    # part of the request is capacity free now (others could take it while the run waits); not where the hold goes
    uses_free: bool = field(default=True, compare=False)


def learned_estimate(durations: Sequence[float]) -> float | None:
    """A runtime estimate (seconds) from past durations, oldest first: the 90th percentile by nearest rank of the
    last ``HISTORY`` of them; None when there are none."""
    recent = sorted(list(durations)[-HISTORY:])  # a deque is a Sequence too, but cannot be sliced
    if not recent:
        return None
    return float(recent[max(math.ceil(PERCENTILE * len(recent)) - 1, 0)])


def runtime_estimate(declared: float | None, durations: Sequence[float]) -> float | None:
    """A run's estimate (seconds): the one it declares, else one learned from ``durations``, else None."""
    return declared if declared is not None else learned_estimate(durations)


def worth_holding(choice: HoldChoice) -> bool:
    """Whether a run's hold would do anything: it waits for more than one booking to end, or for capacity free now
    as well as what one booking frees (others would take the free part meanwhile). A run that what one booking
    frees lets start (on some node, with the holds standing there) takes it in line order without a hold."""
    return len(choice.waits_on) > 1 or choice.uses_free


def may_backfill(estimate_s: float | None, now: float, expected_start: float | None) -> bool:
    """Whether a run estimated at ``estimate_s`` seconds, starting ``now``, may take a hold's capacity: only when
    both are known and it ends by the hold's ``expected_start``."""
    return estimate_s is not None and expected_start is not None and now + estimate_s <= expected_start


@dataclass(frozen=True)
class _NodeOption:
    """What waiting on one node would take: the releases needed, soonest end first, and when the last ends."""

    node: int
    start: float  # math.inf when a release needed has no estimate
    releases: tuple[str, ...]
    uses_free: bool = True  # the releases alone do not cover the request: it takes capacity free now too


def choose_hold(view: ClusterView, asks: Sequence[Ask], running: Sequence[Running], now: float
                ) -> HoldChoice | None:
    """Where a hold for ``asks`` (one run: one ask, or a gang of asks on distinct nodes) should go, given the
    bookings in ``view`` (running runs and other holds) and the estimated ends of the ``running`` runs; None when
    no node (no set of distinct nodes) could take it even once every running run there has ended."""
    if not asks:
        return None
    by_node: dict[str, list[tuple[int, Running]]] = {}
    for k, r in enumerate(running):
        by_node.setdefault(r.node, []).append((k, r))
    empty = _empty_view(view)
    taken: set[int] = set()
    chosen: list[_NodeOption] = []
    for ask in asks:
        best: _NodeOption | None = None
        for option in _options(view, empty, ask, by_node, now, taken):
            if best is None or _better(option, best):
                best = option
        if best is None:
            return None
        taken.add(best.node)
        chosen.append(best)
    start = max(o.start for o in chosen)
    waits: dict[str, float] = {}
    ends = {r.job_id: (math.inf if r.ends_at is None else r.ends_at) for r in running}
    for option in chosen:
        for job in option.releases:
            waits.setdefault(job, ends[job])
    order = sorted(waits, key=lambda job: (waits[job], job))
    return HoldChoice(nodes=tuple(view.nodes[o.node].name for o in chosen),
                      expected_start=None if math.isinf(start) else start, waits_on=tuple(order),
                      uses_free=any(o.uses_free for o in chosen))


def _better(option: _NodeOption, best: _NodeOption) -> bool:
    """The sooner known start; among unknown starts, the fewer releases; then node order."""
    if math.isinf(option.start) and math.isinf(best.start):
        return (len(option.releases), option.node) < (len(best.releases), best.node)
    return (option.start, option.node) < (best.start, best.node)


def _options(view: ClusterView, empty: ClusterView, ask: Ask, by_node: dict[str, list[tuple[int, Running]]],
             now: float, taken: set[int]) -> list[_NodeOption]:
    """Per node that could ever take ``ask``, what it would take to wait there."""
    info = view.static_info(ask)
    r = ask.request
    out = []
    for i in _could_take(view, empty, ask):
        if i in taken:
            continue
        short = [r.cpu_cores - float(view.free_cpu[i]), r.memory_mb - float(view.free_mem[i]),
                 r.disk_mb - float(view.free_disk[i]),
                 float(r.gpu_count + int(info.implied_gpu[i]) - int(view.free_gpu[i]))]
        releases: list[str] = []
        freed = [0.0, 0.0, 0.0, 0.0]
        start = now
        pending = sorted(by_node.get(view.nodes[i].name, ()),
                         key=lambda kr: (kr[1].ends_at is None, kr[1].ends_at or 0.0, kr[0]))
        for _, run in pending:
            if all(s <= EPSILON for s in short):
                break
            short = [short[0] - run.cpu_cores, short[1] - run.memory_mb, short[2] - run.disk_mb,
                     short[3] - run.gpu_count]
            freed = [freed[0] + run.cpu_cores, freed[1] + run.memory_mb, freed[2] + run.disk_mb,
                     freed[3] + run.gpu_count]
            releases.append(run.job_id)
            start = math.inf if run.ends_at is None else max(start, run.ends_at)
        if all(s <= EPSILON for s in short):
            wanted = (r.cpu_cores, r.memory_mb, r.disk_mb, float(r.gpu_count + int(info.implied_gpu[i])))
            uses_free = any(w > f + EPSILON for w, f in zip(wanted, freed, strict=True))
            out.append(_NodeOption(node=i, start=start, releases=tuple(releases), uses_free=uses_free))
    return out


def _could_take(view: ClusterView, empty: ClusterView, ask: Ask) -> list[int]:
    """The nodes that could take ``ask`` with nothing booked on them, in node order: the static checks and the
    capacity as arrays, then the scheduler's own check (``explain``) on the empty view, once per node class (it
    answers alike for nodes of one class) unless the ask has per-node constraints or ports."""
    info = view.static_info(ask)
    r = ask.request
    ok = (info.mask & (view.cap_cpu >= r.cpu_cores - EPSILON) & (view.cap_mem >= r.memory_mb - EPSILON)
          & (view.cap_disk >= r.disk_mb - EPSILON) & (view.cap_gpu >= info.implied_gpu + r.gpu_count))
    per_node = bool(ask.escaped_constraints or r.ports)
    verdict: dict[int, bool] = {}  # node class -> whether its first candidate could take it
    out = []
    for i in np.flatnonzero(ok).tolist():
        if per_node:
            good = empty.explain(i, ask) is None
        else:
            cls = int(view.class_of[i])
            known = verdict.get(cls)
            good = verdict[cls] = empty.explain(i, ask) is None if known is None else known
        if good:
            out.append(i)
    return out


_EMPTY: dict[tuple[int, int], tuple[object, object, ClusterView]] = {}


def _empty_view(view: ClusterView) -> ClusterView:
    """A view of the same nodes and limits with nothing booked: "could this node ever take it?"."""
    key = (id(view.fleet), id(view.limits))
    known = _EMPTY.get(key)
    if known is not None and known[0] is view.fleet and known[1] is view.limits:
        return known[2]
    if len(_EMPTY) > 16:
        _EMPTY.clear()
    empty = ClusterView(view.fleet.columns, (), view.limits)
    _EMPTY[key] = (view.fleet, view.limits, empty)
    return empty
