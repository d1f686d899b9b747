"""The quota rule: whether a run fits its queue's quota, its borrowing limit and its cohort's unused quota.

Each queue with settings (model/queues.py) has an **account**, and so has each cohort: what the runs placed in
it hold now, per dimension. A run's **charge** (``charge``) goes to its queue's account in every dimension, and to
its cohort's account in the dimensions its queue has a quota for. The rule, per dimension ``d`` the queue has a
quota ``q`` for (a queue's use ``u``, a run's charge ``a``):

- ``u + a <= q + b``, where ``b`` is its borrowing limit: 0 outside a cohort, unlimited in one when none is set;
- in a cohort, ``U + a <= N``, where ``U`` is what the cohort's queues use and ``N`` the sum of their quotas:
  a queue borrows only what the others leave unused, and never takes what they are entitled to.

A commit adds the charge to both accounts under exactly these ceilings (``demands``), on every backend by the
same compare-and-apply as a node's capacity (store/admission.py): quotas hold under any number of concurrent
commits. Planning (scheduler/plan.py) and the dry run use ``reason`` on the same numbers, so a plan and its
commit never disagree. Pure: no store, no Prefect.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from mn_prefect.model.hints import ALLOCATION_VAR, allocation_json
from mn_prefect.model.placement import Placement
from mn_prefect.model.queues import BASE_DIMENSIONS, MODEL_PREFIX, CohortRecord, QueueRecord, QueueSpec, amount_words
from mn_prefect.scheduler import reasons

QUEUE_ACCOUNT = "@queue:"
COHORT_ACCOUNT = "@cohort:"
UNLIMITED = 1e15  # a ceiling nothing reaches (JSON has no infinity)
EPSILON = 1e-9
ROUND = 6


def queue_account(name: str) -> str:
    return QUEUE_ACCOUNT + name


def cohort_account(name: str) -> str:
    return COHORT_ACCOUNT + name


def is_account(name: str) -> bool:
    """Whether a name in the store is a queue's or a cohort's account (node names never start with ``@``)."""
    return name.startswith("@")


def charge(placements: Iterable[Placement], models: Iterable[str] = ()) -> dict[str, float]:
    """What the placements take, in every base dimension and in ``gpu:<model>`` for each of ``models``."""
    models = tuple(models)
    out = dict.fromkeys((*BASE_DIMENSIONS, *(MODEL_PREFIX + m for m in models)), 0.0)
    for p in placements:
        r = p.resources
        out["cpu"] += r.cpu_cores
        out["memory"] += r.memory_mb
        out["disk"] += r.disk_mb
        shared = {s.id: s for s in p.allocation.shares}
        gpus = 0.0
        for device in p.allocation.devices:
            if device.kind != "gpu":
                continue
            share = shared.get(device.id)
            count, memory = (share.shares, share.memory_mb) if share else (1.0, device.memory_total_mb or 0.0)
            gpus += count
            out["gpu_memory"] += memory
            model = (device.model or "").lower()
            for m in models:
                if m in model:
                    out[MODEL_PREFIX + m] += count
        out["gpu"] += max(gpus, float(r.gpu_count))  # a GPU counted without its device listed still counts
    return {dim: round(value, ROUND) for dim, value in out.items()}


def nominal(specs: Iterable[QueueSpec], cohort: str) -> dict[str, float]:
    """A cohort's quota: the sum of its queues' quotas, per dimension."""
    out: dict[str, float] = {}
    for spec in specs:
        if spec.cohort == cohort:
            for dim, amount in spec.quota.items():
                out[dim] = round(out.get(dim, 0.0) + amount, ROUND)
    return out


@dataclass
class Queues:
    """The queues and cohorts as a commit or a plan sees them: settings, use and versions."""

    queues: dict[str, QueueRecord] = field(default_factory=dict)
    cohorts: dict[str, CohortRecord] = field(default_factory=dict)

    @classmethod
    def of(cls, queues: Iterable[QueueRecord], cohorts: Iterable[CohortRecord]) -> Queues:
        return cls({q.spec.name: q for q in queues}, {c.name: c for c in cohorts})

    @classmethod
    def build(cls, specs: Iterable[QueueSpec], active: Iterable[Placement] = ()) -> Queues:
        """From settings alone, with the use of the ``active`` placements that name a queue (the dry run)."""
        by_name = {s.name: s for s in specs}
        by_queue: dict[str, list[Placement]] = {}
        for p in active:
            if p.queue is not None and p.queue in by_name:
                by_queue.setdefault(p.queue, []).append(p)
        out = cls({name: QueueRecord(spec=s) for name, s in by_name.items()},
                  {c: CohortRecord(name=c, nominal=nominal(by_name.values(), c))
                   for c in sorted({s.cohort for s in by_name.values() if s.cohort})})
        for name, placements in by_queue.items():
            out.add(name, out.amounts(name, placements))
        return out

    def amounts(self, name: str, placements: Iterable[Placement]) -> dict[str, float]:
        """The charge of ``placements`` to queue ``name`` (its GPU models counted too)."""
        record = self.queues.get(name)
        return charge(placements, record.spec.models if record else ())

    def add(self, name: str, amounts: Mapping[str, float], sign: int = 1) -> None:
        """Count (sign 1) or stop counting (-1) a charge to the queue and its cohort (a plan booked or let go)."""
        record = self.queues.get(name)
        if record is None:
            return
        record.used.update(_added(record.used, amounts, sign))
        cohort = self.cohorts.get(record.spec.cohort or "")
        if cohort is not None:
            cohort.used.update(_added(cohort.used, {d: amounts.get(d, 0.0) for d in record.spec.quota}, sign))

    def reason(self, name: str, amounts: Mapping[str, float]) -> str | None:
        """Why a run charging ``amounts`` does not fit queue ``name`` now (``quota: ...``), or None."""
        record = self.queues.get(name)
        if record is None:
            return None
        return _rule(record, self.cohorts.get(record.spec.cohort or ""), amounts)

    def never(self, name: str, amounts: Mapping[str, float]) -> str | None:
        """Why the run would not fit the queue even with nothing in use (it can only be refused), or None."""
        record = self.queues.get(name)
        if record is None:
            return None
        spec = record.spec
        cohort = self.cohorts.get(spec.cohort or "")
        for dim in _order(spec.quota):
            quota, ask = spec.quota[dim], amounts.get(dim, 0.0)
            limit = spec.borrow_limit(dim)
            room = 0.0 if cohort is None else max(cohort.nominal.get(dim, quota) - quota, 0.0)
            extra = room if limit is None else min(limit, room)
            if ask > quota + extra + EPSILON:
                more = f" plus the {extra:g} it may borrow" if extra > 0 else ""
                return reasons.reason(reasons.QUOTA, f"queue {name} asks {amount_words(ask, dim)}, more than it may "
                                                     f"ever hold: its quota of {quota:g}{more}")
        return None

    def demands(self, name: str, amounts: Mapping[str, float]) -> dict[str, tuple[dict[str, float], dict[str, float], int]]:
        """Per account the charge to add, the ceilings it is admitted under and the version read: what a commit
        hands the store with its nodes' demands. Empty for a queue with no settings (nothing is counted)."""
        record = self.queues.get(name)
        if record is None:
            return {}
        spec = record.spec
        out = {queue_account(name): (dict(amounts), {d: _queue_ceiling(spec, d) for d in amounts}, record.version)}
        cohort = self.cohorts.get(spec.cohort or "")
        if cohort is not None:
            add = {d: amounts.get(d, 0.0) for d in spec.quota}
            out[cohort_account(cohort.name)] = (add, {d: cohort.nominal.get(d, 0.0) for d in add}, cohort.version)
        return out

    def lent(self, name: str) -> dict[str, float]:
        """What others of the cohort use of queue ``name``'s unused quota, per dimension (0 outside a cohort)."""
        record = self.queues.get(name)
        if record is None or record.spec.cohort is None:
            return {}
        spec, cohort = record.spec, self.cohorts.get(record.spec.cohort)
        out = {}
        for dim, quota in spec.quota.items():
            unused = max(quota - record.used.get(dim, 0.0), 0.0)
            others_borrow = sum(max(q.used.get(dim, 0.0) - q.spec.quota.get(dim, 0.0), 0.0)
                                for q in self.queues.values() if q.spec.cohort == spec.cohort and q is not record)
            out[dim] = round(min(unused, others_borrow), ROUND) if cohort is not None else 0.0
        return out


def borrowed(record: QueueRecord) -> dict[str, float]:
    """What the queue uses past its quota, per dimension it has a quota for."""
    return {d: round(max(record.used.get(d, 0.0) - q, 0.0), ROUND) for d, q in record.spec.quota.items()}


def _queue_ceiling(spec: QueueSpec, dim: str) -> float:
    if dim not in spec.quota:
        return UNLIMITED
    limit = spec.borrow_limit(dim)
    return spec.quota[dim] + (UNLIMITED if limit is None else limit)


def _added(used: Mapping[str, float], amounts: Mapping[str, float], sign: int) -> dict[str, float]:
    return {d: max(round(used.get(d, 0.0) + sign * a, ROUND), 0.0) for d, a in amounts.items()}


def _order(dims: Iterable[str]) -> list[str]:
    """Base dimensions in their order first, then GPU models by name."""
    rank = {d: i for i, d in enumerate(BASE_DIMENSIONS)}
    return sorted(dims, key=lambda d: (rank.get(d, len(rank)), d))


def _rule(record: QueueRecord, cohort: CohortRecord | None, amounts: Mapping[str, float]) -> str | None:
    spec = record.spec
    for dim in _order(spec.quota):
        ask = amounts.get(dim, 0.0)
        if ask <= 0:
            continue
        quota, used = spec.quota[dim], record.used.get(dim, 0.0)
        limit = spec.borrow_limit(dim)
        ceiling = quota + (UNLIMITED if limit is None else limit)
        if used + ask > ceiling + EPSILON:
            if spec.cohort is None:
                return reasons.reason(reasons.QUOTA, f"queue {spec.name} asks {amount_words(ask, dim)} with "
                                                     f"{used:g} of its quota of {quota:g} in use")
            return reasons.reason(reasons.QUOTA, f"queue {spec.name} asks {amount_words(ask, dim)} with {used:g} in "
                                                 f"use: its quota of {quota:g} plus at most {limit:g} borrowed")
        if spec.cohort is None:
            continue
        cohort_used = cohort.used.get(dim, 0.0) if cohort else used
        cohort_quota = cohort.nominal.get(dim, quota) if cohort else quota
        if cohort_used + ask > cohort_quota + EPSILON:
            spare = round(max(cohort_quota - cohort_used, 0.0), ROUND)
            to_lend = "none" if spare <= EPSILON else f"only {spare:g}"
            if used + EPSILON >= quota:
                return reasons.reason(reasons.QUOTA, f"queue {spec.name} is at its quota of {amount_words(quota, dim)} "
                                                     f"and cohort {spec.cohort} has {to_lend} to lend")
            return reasons.reason(reasons.QUOTA, f"queue {spec.name} asks {amount_words(ask, dim)} with {used:g} of "
                                                 f"its quota of {quota:g} in use, and cohort {spec.cohort} has "
                                                 f"{to_lend} free")
    return None


@dataclass(frozen=True)
class RunQueue:
    """The queue a run is placed from, with its priority (None: the queue's) and whether it may be preempted."""

    name: str
    priority: int | None = None
    preemptible: bool = False
    min_runtime_s: int = 0

    def resolved(self, queues: Queues | None) -> int:
        """The run's priority: its own, else its queue's, else 0."""
        record = queues.queues.get(self.name) if queues is not None else None
        return self.priority if self.priority is not None else (record.spec.priority if record else 0)

    def stamp(self, placement: Placement, queues: Queues | None) -> Placement:
        """The placement marked with the queue, the run's priority and its preemptibility."""
        priority = self.resolved(queues)
        stamped = placement.model_copy(update={"queue": self.name, "priority": priority,
                                                "preemptible": self.preemptible,
                                                "min_runtime_s": self.min_runtime_s if self.preemptible else None})
        return stamped.model_copy(update={"env": {**placement.env, ALLOCATION_VAR: allocation_json(stamped)}})
