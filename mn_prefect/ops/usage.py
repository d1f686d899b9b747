"""What ``resource list`` and the metrics report of each node: capacity, schedulable, used, free, and what the
head-of-line holds standing there book (docs/scheduling.md, "Holds and backfill").

A hold books the held run's request past what is free, so counted as any booking it would show as use no run
makes, and leave free below 0. Here it is counted apart: used is what the runs' bookings hold, held what the holds
book, free what neither takes (never below 0). No Prefect here: the command line reads it without Prefect's
import.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Placement
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.usage import SCALARS, Amounts, ClusterUsage, cluster_usage, gpus_booked
from mn_prefect.store.base import ClusterStore

RUN_ID_SHOWN = 8  # characters of a held run's id in tables (as a hold's message names the runs it waits for)


@dataclass(frozen=True)
class UsageReport:
    """Per node: its usage (used leaves the holds out, free subtracts them), its GPU memory not booked (MB), and
    the placements of the holds standing on it."""

    usage: ClusterUsage
    gpu_memory_free: dict[str, float]
    holds: dict[str, list[Placement]]

    def held(self, node: str) -> Amounts:
        """What the holds on ``node`` book (CPU cores, memory and disk MB, whole GPUs)."""
        return held_amounts(self.holds.get(node, ()))

    def held_total(self) -> Amounts:
        return sum((self.held(n.name) for n in self.usage.nodes), Amounts())


def holds_by_node(placements: Iterable[Placement]) -> dict[str, list[Placement]]:
    """The holds' placements among ``placements`` (a store's active ones), by node."""
    out: dict[str, list[Placement]] = {}
    for p in placements:
        if p.hold:
            out.setdefault(p.node, []).append(p)
    return out


def held_amounts(holds: Iterable[Placement]) -> Amounts:
    """What hold placements book, summed: CPU cores, memory and disk MB, whole GPUs (a hold books no device)."""
    return sum((Amounts(**p.resources.model_dump(include=set(SCALARS))) for p in holds), Amounts())


def usage_report(nodes: Sequence[NodeRecord], active: Sequence[Placement], limits: Limits | None,
                 holds: Iterable[Placement]) -> UsageReport:
    """``cluster_usage`` of ``nodes`` under ``active`` (everything booked, holds included), a GPU with any share or
    MIG slice booked counted as not free (``gpus_booked``), with the hold placements among ``holds`` counted
    apart: used leaves them out, free subtracts them and stops at 0."""
    usage, gpu_memory_free = gpus_booked(cluster_usage(nodes, active, limits))
    names = {n.name for n in usage.nodes}
    by_node = {node: placed for node, placed in holds_by_node(holds).items() if node in names}
    rows = []
    for n in usage.nodes:
        held = held_amounts(by_node.get(n.name, ()))
        # GPUs used are counted from the devices booked (``gpus_booked``): a hold, booking none, is not among them.
        used = Amounts(cpu_cores=max(n.used.cpu_cores - held.cpu_cores, 0.0),
                       memory_mb=max(n.used.memory_mb - held.memory_mb, 0.0),
                       disk_mb=max(n.used.disk_mb - held.disk_mb, 0.0), gpu_count=n.used.gpu_count)
        free = Amounts(**{k: max(getattr(n.free, k), 0.0) for k in SCALARS})
        rows.append(n.model_copy(update={"used": used, "free": free}))
    zero = Amounts()
    usage = usage.model_copy(update={"nodes": rows, "used": sum((n.used for n in rows), zero),
                                     "free": sum((n.free for n in rows), zero)})
    return UsageReport(usage=usage, gpu_memory_free=gpu_memory_free, holds=by_node)


def store_usage(store: ClusterStore, *, group: str | None = None, active: Sequence[Placement] = (),
                limits: Limits | None = None) -> UsageReport:
    """``usage_report`` of the store's nodes (with ``group``, that group's), what is booked on them, ``active``
    on top, under ``limits`` (default the store's), with the holds standing in the store (and any among
    ``active``)."""
    snap = store.snapshot(group=group)
    holds = [p for p in store.active_placements() if p.hold] + [p for p in active if p.hold]
    return usage_report(snap.nodes, [*snap.holds, *active], limits or snap.limits, holds)


def hold_json(placement: Placement) -> dict[str, Any]:
    """One hold's placement for programs: the hold's id, the run it holds for, that run's queue, when it is
    expected to start (epoch seconds; None: unknown) and what it books on the node."""
    return {"hold": placement.hold, "run": placement.hold_for, "queue": placement.hold_queue,
            "expected_start": placement.hold_start, "resources": placement.resources.model_dump(mode="json")}


def held_words(holds: Iterable[Placement]) -> str:
    """What holds book on one node, for people: ``2 GPUs, 2 cores for run 1f2e3d4c``; ``-`` when none."""
    return "; ".join(f"{booked_words(held_amounts([p]))} for run {(p.hold_for or '?')[:RUN_ID_SHOWN]}"
                     for p in holds) or "-"


def booked_words(amounts: Amounts) -> str:
    """Amounts for people, GPUs first: ``2 GPUs, 2 cores, 1024 MB``; ``-`` when nothing."""
    parts = [f"{amounts.gpu_count:g} GPU{'' if amounts.gpu_count == 1 else 's'}" if amounts.gpu_count else "",
             f"{amounts.cpu_cores:g} core{'' if amounts.cpu_cores == 1 else 's'}" if amounts.cpu_cores else "",
             f"{amounts.memory_mb:g} MB" if amounts.memory_mb else "",
             f"{amounts.disk_mb:g} MB disk" if amounts.disk_mb else ""]
    return ", ".join(part for part in parts if part) or "-"
