"""Usage accounting (docs/operating.md, "Usage accounting"): GPU-seconds, GPU-memory-seconds, CPU-seconds and
memory-seconds of every booking, by queue, work pool, deployment, flow, tag, node, owner kind or owner.

What is counted is the store's booking history (``ClusterStore.history_since``): each entry is one booking, from
the commit that made it to the release that ended it, both instants written by the store's own atomic commit and
release steps on every backend. So usage is as durable as the bookings themselves (it survives restarts and a
failover as they do), and counted once: a release retried, or made by two workers at once, ends the entry once
(only the release that finds the booking closes it), and a booking committed again after its release is a new
entry. A booking still live counts up to now.

A booking's placement on a node uses, for as long as the booking lives:

* GPUs: each whole GPU it holds 1, a MIG slice its GPU-instance slices over 7 (as ``resource list`` counts a
  GPU's use), a fraction of a shared GPU its shares; a placement that books GPUs but names no device (a hold) its
  ``gpu_count``;
* GPU memory: each whole GPU's or MIG slice's memory, a fraction's booked ``memory_mb`` (MB);
* CPU cores and memory (MB) as booked.

Reservations and holds count as used by their owner: a reservation's own booking for the reservation (its
name), through its whole life; runs placed inside a reservation take its capacity, so they add nothing again. A
head-of-line hold's booking counts for the run it holds for, in that run's queue.

Labels: queue and pool (the booking's resource group) come from the placement; deployment, flow and tags from
the run's ``FlowRunRecord`` (its Prefect ids and tags, written when it was placed). A booking of no flow run (a
blueprint job's agent, a bundle step, a reservation) has ``-`` there. A booking with several tags counts under
each of them (rows by tag add up to more than the total).

No Prefect here: the command line reads it without Prefect's import.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from mn_prefect.model.bookings import owning_job, parse
from mn_prefect.model.placement import Placement
from mn_prefect.scheduler.usage import MIG_SLICES, _mig_g
from mn_prefect.store.base import ClusterStore, HistoryEntry
from mn_prefect.store.records import FlowRunRecord, JobState, ReservationRecord, list_records

NONE = "-"  # a label a booking does not have
KEYS = ("queue", "pool", "deployment", "flow", "tag", "node", "kind", "owner")
DEFAULT_BY = ("queue",)
DEFAULT_SINCE = "7d"
AMOUNTS = ("gpu_seconds", "gpu_memory_mb_seconds", "cpu_seconds", "memory_mb_seconds")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# -- input ---------------------------------------------------------------------------------------------------------

def parse_since(text: str, now: float) -> float:
    """The start of the window ``--since`` names, in seconds since the epoch: a duration back from ``now``
    (``30m``, ``12h``, ``7d``, ``2w``; ``s`` for seconds), an ISO date or date and time (``2024-05-01``,
    ``2024-05-01T08:00``; UTC when no offset is given), or ``all`` (every booking ever). ValueError saying what
    is accepted otherwise; a start after ``now`` is refused too."""
    value = text.strip()
    if value.lower() == "all":
        return 0.0
    match = _DURATION.match(value)
    if match:
        seconds = float(match.group(1)) * _UNIT_S[match.group(2).lower()]
        if not math.isfinite(seconds):
            raise ValueError(f"{text!r} is too long a duration")
        return now - seconds
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{text!r} is neither a duration (30m, 12h, 7d, 2w) nor an ISO date or time "
                         "(2024-05-01, 2024-05-01T08:00) nor 'all'") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    start = when.timestamp()
    if start > now:
        raise ValueError(f"{text!r} is in the future: usage is counted up to now")
    return start


def parse_by(text: str) -> tuple[str, ...]:
    """The keys ``--by`` names, a comma list of KEYS (``pool`` is the work pool), in the order given, each once;
    ValueError naming the unknown ones and the known."""
    keys = [k.strip().lower() for k in text.split(",") if k.strip()]
    if not keys:
        raise ValueError(f"names no key (known: {', '.join(KEYS)})")
    unknown = [k for k in keys if k not in KEYS]
    if unknown:
        raise ValueError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(KEYS)})")
    return tuple(dict.fromkeys(keys))


# -- amounts ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class UsageRates:
    """What one placement uses while it lives: GPUs, GPU memory (MB), CPU cores, memory (MB)."""

    gpus: float = 0.0
    gpu_memory_mb: float = 0.0
    cpu_cores: float = 0.0
    memory_mb: float = 0.0


def rates(p: Placement) -> UsageRates:
    """What placement ``p`` uses (see the module's docstring)."""
    gpus = memory = 0.0
    named = False
    shared = {share.id for share in p.allocation.shares}  # a shared GPU is among the devices too: counted below
    for d in p.allocation.devices:
        if d.kind != "gpu" or d.id in shared:
            continue
        named = True
        gpus += _mig_g(d.mig_profile) / MIG_SLICES if d.parent is not None else 1.0
        memory += d.memory_total_mb or 0.0
    for share in p.allocation.shares:
        named = True
        gpus += share.shares
        memory += share.memory_mb
    if not named:
        gpus = float(p.resources.gpu_count)
    return UsageRates(gpus=gpus, gpu_memory_mb=memory, cpu_cores=p.resources.cpu_cores, memory_mb=p.resources.memory_mb)


@dataclass
class UsedAmounts:
    """Used resources over time: GPU-seconds, GPU-memory MB-seconds, CPU core-seconds, memory MB-seconds; and the
    bookings' seconds (each placement's lifetime in the window, summed)."""

    gpu_seconds: float = 0.0
    gpu_memory_mb_seconds: float = 0.0
    cpu_seconds: float = 0.0
    memory_mb_seconds: float = 0.0
    booked_seconds: float = 0.0

    def add(self, r: UsageRates, seconds: float) -> None:
        self.gpu_seconds += r.gpus * seconds
        self.gpu_memory_mb_seconds += r.gpu_memory_mb * seconds
        self.cpu_seconds += r.cpu_cores * seconds
        self.memory_mb_seconds += r.memory_mb * seconds
        self.booked_seconds += seconds

    def plus(self, other: UsedAmounts) -> UsedAmounts:
        return UsedAmounts(*(a + b for a, b in zip(self.values(), other.values(), strict=True)))

    def values(self) -> tuple[float, ...]:
        return (self.gpu_seconds, self.gpu_memory_mb_seconds, self.cpu_seconds, self.memory_mb_seconds,
                self.booked_seconds)

    def as_json(self) -> dict[str, float]:
        return {name: round(value, 3) for name, value in zip((*AMOUNTS, "booked_seconds"), self.values(), strict=True)}


# -- who a booking's use is counted for ------------------------------------------------------------------------------

@dataclass
class Owners:
    """What the store says of bookings' owners: the flow runs' records (queue, deployment, flow, tags), the
    reservations' names, the blueprint jobs' names, the nodes' groups. Read once (``of``), then looked up."""

    runs: dict[str, FlowRunRecord] = field(default_factory=dict)
    reservations: dict[str, ReservationRecord] = field(default_factory=dict)
    jobs: dict[str, JobState] = field(default_factory=dict)
    groups: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, store: ClusterStore) -> Owners:
        runs: dict[str, FlowRunRecord] = {}
        reservations: dict[str, ReservationRecord] = {}
        jobs: dict[str, JobState] = {}
        for record in list_records(store):
            if isinstance(record, FlowRunRecord):
                runs[record.job_id] = record
            elif isinstance(record, ReservationRecord):
                reservations[record.job_id] = record
            elif isinstance(record, JobState):
                jobs[record.job_id] = record
        return cls(runs, reservations, jobs, {s.record.name: s.record.group for s in store.list_nodes()})


@dataclass(frozen=True)
class UsageLine:
    """One placement of one booking in the window: its labels (a value per key but ``tag``), its tags, for how
    long it lived in the window and what it used."""

    booking: str
    committed_at: float
    released_at: float | None
    labels: Mapping[str, str]
    tags: tuple[str, ...]
    seconds: float
    rates: UsageRates


def _labels(entry: HistoryEntry, p: Placement, owners: Owners | None) -> tuple[dict[str, str], tuple[str, ...]]:
    job = entry.job_id
    owner, kind, queue, run_id = job, parse(job).kind, p.queue, job
    if p.hold:  # a head-of-line hold: its run's, in its run's queue
        owner, kind, queue, run_id = p.hold_for or job, "hold", p.hold_queue or p.queue, p.hold_for or job
    elif p.reserves or kind == "reservation":
        reservation = owners.reservations.get(job) if owners else None
        owner, kind = (reservation.name if reservation and reservation.name else job), "reservation"
    run = owners.runs.get(run_id) if owners else None
    if run is not None and kind != "hold":
        kind = "flow_run"
    elif owners is not None and kind == "unknown":
        base = owning_job(job)
        if base in owners.jobs:
            kind, owner = "blueprint_job", owners.jobs[base].job_name or base
    if queue is None and run is not None:
        queue = run.queue
    pool = p.group or (owners.groups.get(p.node) if owners else None)
    labels = {"queue": queue or NONE, "pool": pool or NONE, "node": p.node, "kind": kind, "owner": owner,
              "deployment": (run.deployment_id if run else None) or NONE,
              "flow": (run.flow_id if run else None) or NONE}
    return labels, tuple(run.tags) if run is not None else ()


def lines(entries: Iterable[HistoryEntry], since: float, until: float, owners: Owners | None = None) -> list[UsageLine]:
    """Every placement of ``entries`` that lived in [``since``, ``until``], with the seconds it lived there (a
    live booking up to ``until``). Runs placed inside a reservation are left out: the reservation's booking
    counts that capacity."""
    out = []
    for entry in entries:
        start = max(entry.committed_at, since)
        end = min(entry.released_at if entry.released_at is not None else until, until)
        seconds = end - start
        if seconds < 0 or (seconds == 0 and entry.released_at is not None and entry.committed_at < since):
            continue
        for p in entry.placements:
            if p.reservation:
                continue
            labels, tags = _labels(entry, p, owners)
            out.append(UsageLine(entry.job_id, entry.committed_at, entry.released_at, labels, tags, seconds, rates(p)))
    return out


@dataclass
class UsageRow:
    """One group of ``report``: its key values, the bookings in it, and what they used."""

    key: dict[str, str]
    bookings: int
    amounts: UsedAmounts

    def as_json(self) -> dict[str, Any]:
        return {**self.key, "bookings": self.bookings, **self.amounts.as_json()}


def group(found: Sequence[UsageLine], by: Sequence[str]) -> list[UsageRow]:
    """``found`` summed by the keys ``by`` (KEYS): one row per value combination, largest GPU use first. By
    ``tag``, a line counts under each of its tags (``-`` when it has none)."""
    sums: dict[tuple[str, ...], tuple[set[tuple[str, float]], UsedAmounts]] = {}
    for line in found:
        tags = line.tags or (NONE,)
        for tag in (tags if "tag" in by else (NONE,)):
            values = tuple(tag if key == "tag" else line.labels[key] for key in by)
            booked, amounts = sums.setdefault(values, (set(), UsedAmounts()))
            booked.add((line.booking, line.committed_at))
            amounts.add(line.rates, line.seconds)
    rows = [UsageRow(dict(zip(by, values, strict=True)), len(booked), amounts) for values, (booked, amounts) in sums.items()]
    return sorted(rows, key=lambda r: (-r.amounts.gpu_seconds, -r.amounts.cpu_seconds, tuple(r.key.values())))


def total(found: Sequence[UsageLine]) -> UsageRow:
    amounts = UsedAmounts()
    for line in found:
        amounts.add(line.rates, line.seconds)
    return UsageRow({}, len({(line.booking, line.committed_at) for line in found}), amounts)


def report(store: ClusterStore, *, since: float, until: float, by: Sequence[str] = DEFAULT_BY) -> dict[str, Any]:
    """The usage of every booking in [``since``, ``until``] grouped by ``by``, for programs: the window, the
    keys, one row per group and the total (each booking once)."""
    found = lines(store.history_since(since), since, until, Owners.of(store))
    return {"since": since, "until": until, "by": list(by), "rows": [row.as_json() for row in group(found, by)],
            "total": total(found).as_json()}


def day_window(day: date) -> tuple[float, float]:
    """The UTC day ``day`` as [start, end) in seconds since the epoch."""
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return start.timestamp(), (start + timedelta(days=1)).timestamp()


DAY_BY = ("queue", "pool", "deployment")
DAY_KEY = "mn-usage-{day}"  # a Prefect artifact key: lowercase letters, digits, dashes


def day_rows(store: ClusterStore, day: date) -> list[dict[str, Any]]:
    """The UTC day ``day``'s usage by queue, pool and deployment, in hours, for the daily table artifact (each
    row a booking group; a last row the total)."""
    start, end = day_window(day)
    data = report(store, since=start, until=end, by=DAY_BY)

    def hours(row: dict[str, Any]) -> dict[str, Any]:
        return {"bookings": row["bookings"], "gpu_hours": round(row["gpu_seconds"] / 3600, 3),
                "gpu_memory_gb_hours": round(row["gpu_memory_mb_seconds"] / 3600 / 1024, 3),
                "cpu_core_hours": round(row["cpu_seconds"] / 3600, 3),
                "memory_gb_hours": round(row["memory_mb_seconds"] / 3600 / 1024, 3)}

    rows = [{**{k: row[k] for k in DAY_BY}, **hours(row)} for row in data["rows"]]
    return [*rows, {**{k: "total" if i == 0 else "" for i, k in enumerate(DAY_BY)}, **hours(data["total"])}]


# -- counters for Prometheus ----------------------------------------------------------------------------------------

COUNTER_KEYS = ("queue", "pool")
REREAD_S = 3600.0  # a scrape reads again the entries released this long before the last one (late releases)


class UsageCounters:
    """All-time usage per queue and pool for ``mn_usage_*_total``: the released bookings counted once each (by
    booking and commit time), the live ones up to now. The first read takes every entry of the store's history
    (so the totals start from the store's, surviving a restart of the process); each later read only the
    entries live or released since shortly before the previous read. Totals never go down: a live booking
    counted up to one scrape's now and released a little earlier (another clock) keeps the higher value."""

    def __init__(self, clock: Callable[[], float] | None = None):
        self._clock = clock or (lambda: time.time())
        self._closed: dict[tuple[str, ...], UsedAmounts] = {}
        self._seen: dict[tuple[str, float], float] = {}  # (booking, committed_at) -> released_at
        self._read_at: float | None = None
        self._last: dict[tuple[str, ...], tuple[float, ...]] = {}
        self._lock = threading.Lock()

    def read(self, store: ClusterStore) -> dict[tuple[str, ...], tuple[float, ...]]:
        """(queue, pool) -> (GPU-s, GPU memory MB-s, CPU-s, memory MB-s, booked s) as of now."""
        with self._lock:
            now = self._clock()
            since = None if self._read_at is None else self._read_at - REREAD_S
            live: dict[tuple[str, ...], UsedAmounts] = {}
            for entry in store.history_since(since):
                key = (entry.job_id, entry.committed_at)
                if entry.released_at is not None and key in self._seen:
                    continue
                if entry.released_at is not None:
                    self._seen[key] = entry.released_at
                    into = self._closed
                else:
                    into = live
                for line in lines([entry], 0.0, max(now, entry.released_at or now)):
                    labels = tuple(line.labels[k] for k in COUNTER_KEYS)
                    into.setdefault(labels, UsedAmounts()).add(line.rates, line.seconds)
            self._read_at = now
            self._seen = {k: at for k, at in self._seen.items() if at >= now - REREAD_S}
            out: dict[tuple[str, ...], tuple[float, ...]] = {}
            for labels in {*self._closed, *live, *self._last}:
                values = self._closed.get(labels, UsedAmounts()).plus(live.get(labels, UsedAmounts())).values()
                out[labels] = tuple(max(a, b) for a, b in zip(values, self._last.get(labels, values), strict=True))
            self._last = out
            return out
