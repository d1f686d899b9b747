"""Who goes next: the order in which waiting runs are offered the capacity that frees up.

Runs are taken by **priority** (higher first), then by their queue's **fair share**: a queue's dominant
share (DRF: the largest, over CPU, memory and GPUs, of what it holds as a share of the fleet's capacity),
with its past use added as it decays over a half-life (Slurm's fair-share factor), over its weight; the
queue that has had least for its weight goes first. Ties go to the run that has waited longest. A queue
without settings has weight 1 and priority 0.

``Usage`` keeps each queue's decayed past use (resource-seconds that halve every ``half_life_s``) and turns
it into an equivalent amount held now (``decayed / half_life``), so a queue that ran a large burst an hour
ago still ranks after one that has had nothing, and forgets it after a few half-lives. With ``half_life_s``
0 only what is held now counts (Kueue's fair sharing). Pure: no store, no Prefect.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from mn_prefect.model.node import NodeRecord
from mn_prefect.scheduler.quotas import Queues

DIMENSIONS = ("cpu", "memory", "gpu")
LN2 = math.log(2)


@dataclass
class Usage:
    """Each queue's past use per dimension, decaying with ``half_life_s``, as of ``at``."""

    half_life_s: float = 3600.0
    at: float = 0.0
    decayed: dict[str, dict[str, float]] = field(default_factory=dict)

    def advance(self, now: float, held: Mapping[str, Mapping[str, float]]) -> None:
        """Move to ``now``: what each queue held (``held``, constant since ``at``) is added as resource-seconds,
        and everything decays. Exact for a constant holding: the integral of ``h * 2^(-(now - s)/T)``."""
        dt = now - self.at
        if dt <= 0:
            return
        if self.half_life_s <= 0:
            self.at = now
            return
        factor = math.exp(-LN2 * dt / self.half_life_s)
        gained = (1.0 - factor) * self.half_life_s / LN2  # the integral of the decay over dt, per unit held
        for queue in set(self.decayed) | set(held):
            past = self.decayed.setdefault(queue, {})
            now_held = held.get(queue, {})
            for dim in DIMENSIONS:
                past[dim] = past.get(dim, 0.0) * factor + now_held.get(dim, 0.0) * gained
        self.at = now

    def equivalent(self, queue: str) -> dict[str, float]:
        """The queue's past use as an amount held now (decayed resource-seconds over the half-life)."""
        if self.half_life_s <= 0:
            return {}
        past = self.decayed.get(queue, {})
        return {dim: past.get(dim, 0.0) / self.half_life_s for dim in DIMENSIONS}


def dominant_share(held: Mapping[str, float], capacity: Mapping[str, float]) -> float:
    """The largest share of the fleet's capacity the amounts ``held`` take, over CPU, memory and GPUs."""
    return max((held.get(d, 0.0) / capacity[d] for d in DIMENSIONS if capacity.get(d, 0.0) > 0), default=0.0)


def share(queue: str, held: Mapping[str, float], capacity: Mapping[str, float], queues: Queues | None = None,
          usage: Usage | None = None) -> float:
    """A queue's fair-share standing: its dominant share (past use included) over its weight. Lower goes first."""
    past = usage.equivalent(queue) if usage is not None else {}
    total = {d: held.get(d, 0.0) + past.get(d, 0.0) for d in DIMENSIONS}
    record = queues.queues.get(queue) if queues is not None else None
    weight = record.spec.weight if record is not None else 1.0
    return dominant_share(total, capacity) / weight


def capacity_of(nodes: Iterable[NodeRecord]) -> dict[str, float]:
    """The fleet's CPU cores, memory MB and GPUs (what shares are measured against)."""
    nodes = list(nodes)
    return {"cpu": sum(n.cpu_cores for n in nodes), "memory": sum(n.memory_mb for n in nodes),
            "gpu": float(sum(len(n.gpu_devices) for n in nodes))}


def standings(queues: Queues, capacity: Mapping[str, float], usage: Usage | None = None) -> dict[str, float]:
    """Each queue's fair-share standing now (``share``): what its runs hold (its account) and its past use."""
    return {name: share(name, record.used, capacity, queues, usage) for name, record in queues.queues.items()}


def precedence(run: str, queue: str | None, priority: int | None, since: float, queues: Queues,
               shares: Mapping[str, float]) -> tuple[int, float, float, str]:
    """A waiting run's place in line (smaller first): its priority (else its queue's), its queue's standing,
    how long it has waited. The workers and the simulator both sort by it."""
    record = queues.queues.get(queue or "")
    if priority is None:
        priority = record.spec.priority if record is not None else 0
    return (-priority, shares.get(queue or "", 0.0), since, run)
