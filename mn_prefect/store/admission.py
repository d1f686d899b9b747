"""One admission rule for every backend: decide in Python, apply conditionally (optimistic concurrency).

A commit reads the plan's nodes (records, usage, held keys, versions), the limits, the job's booking and the
lease, decides with ``scheduler.admission.admission_reason`` (the rule ``ClusterView.admit`` and so the planner use), and hands the backend a ``Ticket``:
per node the amounts to add, the ceilings the rule admitted them under, the keys to claim, and the node
version it read. The backend applies a ticket atomically only if, at that moment, every node still has the
version read, every dimension stays under its ceiling and no key is held; otherwise it writes nothing and
the commit reads again. So the Redis script, the PostgreSQL function and the SQLite transaction know no
rule, only "compare and apply", as Nomad's plan applier re-checks a plan against the latest state.

Because usage only ever makes a node fuller, "usage + amount <= ceiling" at apply time implies the rule
still admits the plan: releases in between never cause a retry, and two commits on one node conflict only
when together they would not fit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from mn_prefect.model.node import Device, NodeRecord
from mn_prefect.model.placement import Placement
from mn_prefect.model.queues import CohortRecord, QueueRecord
from mn_prefect.scheduler import reasons
from mn_prefect.scheduler.admission import admission_reason, node_capacity
from mn_prefect.scheduler.devices import device_amounts, device_ceiling, held_whole
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.quotas import Queues, cohort_account, queue_account
from mn_prefect.store.accounts import accounts_for, missing_accounts, queues_of
from mn_prefect.store.base import CommitResult, Conflict, Lease, StaleLease, StoreError
from mn_prefect.store.booking import NodeDemand, NodeState, demand_by_node, fingerprint, json_text, same_booking
from mn_prefect.store.dimensions import DIMENSIONS, INSIDE, inside, inside_key, port_key
from mn_prefect.store.failpoints import failpoint

Applied = Literal["ok", "changed", "stale_lease"]
ATTEMPTS = 200  # a commit re-reads at most this often before giving up (each retry means others committed)


@dataclass
class CommitRead:
    """What a commit decides on, read in one consistent step."""

    states: list[NodeState]  # the plan's nodes that exist
    limits: Limits
    booked: str | None = None  # the fingerprint of the job's booking, if it has one
    lease_ok: bool = True
    queues: Queues | None = None  # the accounts read (queues and cohorts), when the commit named any


@dataclass
class Ticket:
    """A decided commit, for the backend to apply if nothing it relied on has changed."""

    job_id: str
    fingerprint: str
    placements: str  # JSON of the placements
    demands: dict[str, NodeDemand]
    versions: dict[str, int]
    ceilings: dict[str, dict[str, float]]
    now: float
    count: int  # how many placements
    seq: int | None = field(default=None, compare=False)  # set by backends that number commits
    event: str | None = field(default=None, compare=False)  # an Event's JSON to record with the booking (Redis)

    def plan_json(self) -> str:
        """The generic form the server-side apply takes: per node its version, amounts, ceilings and claims. The
        booking keeps it as its demands (a release reads ``add`` and ``claim``)."""
        return json_text({n: {"version": self.versions[n], "ceiling": self.ceilings[n], **d.as_json()}
                          for n, d in self.demands.items()})


class CommitSession(Protocol):
    def read(self, job_id: str, nodes: list[str], lease: Lease | None) -> CommitRead: ...

    def apply(self, ticket: Ticket, lease: Lease | None) -> tuple[Applied, CommitRead | None]:
        """Apply the ticket if nothing it relied on changed; with "changed", the state found instead when the
        backend read it on the way (saves the next read's round trip), else None."""
        ...


class Committer(Protocol):
    def commit_session(self) -> AbstractContextManager[CommitSession]: ...


def decide(read: CommitRead, job_id: str, placements: list[Placement], fp: str, demands: dict[str, NodeDemand],
           now: float, *, bookings: bool = True, budgets: Mapping[str, list[Placement]] | None = None,
           holds: Mapping[str, list[Placement]] | None = None) -> CommitResult | Ticket:
    """The result when the commit is settled by what was read (already booked, refused), else the ticket.

    ``bookings=False`` decides on the nodes' records alone, as if nothing were booked there: the ticket is the
    same (its ceilings are capacities, not what is free), and the apply checks what is booked when it lands.
    A placement inside a reservation is admitted against the reservation's own placements on its node
    (``budgets``: each reservation's placements, which never change while it lasts) instead of the node's
    free capacity, and only while the reservation's key is held there.

    A hold's own placement (``hold``) is admitted while what is booked on its node is within capacity, and books
    its amounts past it (two holds never stack on a node). A placement on a hold's capacity (``over_hold``) is
    admitted against the node's free capacity plus the hold's amounts there (``holds``: each hold's placements),
    under ceilings raised by as much, and only while the hold's key is held there; every other placement of the
    commit on that node must be over the hold too.
    """
    if read.booked is not None:
        if same_booking(read.booked, fp, demands):
            return CommitResult(ok=True, job_id=job_id, already_committed=True, placements=placements)
        return CommitResult(ok=False, job_id=job_id, conflict=Conflict(
            reason=f"job {job_id} already holds a different booking", job_booked=True))
    states = {s.record.name: s for s in read.states}
    nodes: dict[str, _NodeNow] = {}
    inside_of: dict[tuple[str, str], _NodeNow] = {}
    over_nodes = {p.node: p.over_hold for p in placements if p.over_hold}
    for placement in placements:
        state = states.get(placement.node)
        if state is None:
            return _refused(job_id, placement.node, reasons.reason(reasons.UNKNOWN_NODE, placement.node))
        if placement.node in over_nodes and not placement.over_hold:
            # The hold raises the node's ceilings for the whole commit: a placement not over it would take its capacity.
            return _refused(job_id, placement.node, f"{placement.agent_id} is not over {over_nodes[placement.node]} on "
                                                    f"{placement.node}, where the commit places over it")
        now_there = nodes.get(placement.node) or nodes.setdefault(placement.node,
                                                                   _NodeNow.of(state, read.limits, bookings))
        if placement.hold:
            now_there.lift(_amounts([placement]))
        elif placement.over_hold and placement.over_hold not in now_there.lifted:
            held = [p for p in (holds or {}).get(placement.over_hold, ()) if p.node == placement.node]
            if not held or (bookings and placement.over_hold not in state.keys("reservation")):
                return _refused(job_id, placement.node, reasons.reason(
                    reasons.HOLD_ENDED, f"{placement.over_hold} holds nothing on {placement.node} (its run started, "
                                        "ended or lost the head of the line)"))
            now_there.lift(_amounts(held))
            now_there.lifted.add(placement.over_hold)
        reservation = placement.reservation
        if reservation:
            where = (placement.node, reservation)
            if where not in inside_of:
                held = [p for p in (budgets or {}).get(reservation, ()) if p.node == placement.node]
                if not held or (bookings and reservation not in state.keys("reservation")):
                    return _refused(job_id, placement.node, reasons.reason(
                        reasons.RESERVATION_ENDED, f"{reservation} holds nothing on {placement.node} (released or "
                                                   "expired)"))
                inside_of[where] = _NodeNow.inside(state, held, reservation, now_there.ports, bookings)
            now_there = inside_of[where]
        why = admission_reason(state.record, now_there.cap, tuple(now_there.free), now_there.by_id,
                               now_there.devices, now_there.ports, placement, now_there.device_used)
        if why is not None:
            if reservation:
                why = f"{why} (inside reservation {reservation})"
            return _refused(job_id, placement.node, why)
        now_there.book(placement)
    versions = {name: states[name].version for name in demands}
    ceilings = {name: _ceilings(nodes[name], inside_of, name, demands[name]) for name in demands}
    charged = _charged(read, job_id, placements, refuse=bookings)
    if isinstance(charged, CommitResult):
        return charged
    if charged:
        demands = {**demands}
        for account, (add, ceiling, version) in charged.items():
            demands[account] = NodeDemand(add=add)
            versions[account], ceilings[account] = version, ceiling
    body = "[" + ",".join(p.model_dump_json() for p in placements) + "]"
    return Ticket(job_id=job_id, fingerprint=fp, placements=body, demands=demands, versions=versions,
                  ceilings=ceilings, now=now, count=len(placements))


def _charged(read: CommitRead, job_id: str, placements: list[Placement], *,
             refuse: bool = True) -> CommitResult | dict[str, tuple[dict, dict, int]]:
    """The accounts the placements' queues are charged to (scheduler/quotas.py): their amounts, ceilings and
    versions; or the refusal when a queue is past its quota (never with ``refuse`` False: a decision on cached
    use refuses nothing, the apply checks the ceilings). Nothing for placements without a queue, or a queue
    with no settings."""
    queues = read.queues
    names = sorted({p.queue for p in placements if p.queue})
    if not names or queues is None:
        return {}
    out: dict[str, tuple[dict, dict, int]] = {}
    for name in names:
        mine = [p for p in placements if p.queue == name]
        amounts = queues.amounts(name, mine)
        why = queues.reason(name, amounts) if refuse else None
        if why is not None:
            return CommitResult(ok=False, job_id=job_id, conflict=Conflict(reason=why))
        out.update(queues.demands(name, amounts))
    return out


def _ceilings(node: _NodeNow, inside_of: dict[tuple[str, str], _NodeNow], name: str,
              demand: NodeDemand) -> dict[str, float]:
    """The ceiling of every dimension the demand adds to: the node's, or a reservation's for its own space."""
    out = node.ceilings(demand)
    for dim in demand.add:
        if dim.startswith(INSIDE):
            reservation, _, own = dim[len(INSIDE):].partition(":")
            out[dim] = inside_of[(name, reservation)].ceiling(own)
    return out


def _amounts(placements: Sequence[Placement]) -> tuple[float, float, float, float]:
    """What the placements book of the node's capacity dimensions, in the order of DIMENSIONS."""
    return (sum(p.resources.cpu_cores for p in placements), sum(p.resources.memory_mb for p in placements),
            sum(p.resources.disk_mb for p in placements), float(sum(p.resources.gpu_count for p in placements)))


def _refused(job_id: str, node: str, why: str) -> CommitResult:
    return CommitResult(ok=False, job_id=job_id, conflict=Conflict(node=node, reason=why))


class _Used:
    """Per-device dimensions booked on a node as read, plus what the commit's earlier placements took."""

    def __init__(self, read: dict[str, float]):
        self.read = read
        self.taken: dict[str, float] = {}

    def get(self, dim: str, default: float, /) -> float:
        return self.read.get(dim, default) + self.taken.get(dim, 0.0)


class _Held:
    """Keys held on a node as read, plus those the commit's earlier placements took; looked up without copying
    or converting what was read (a busy node holds many keys, a placement asks for few)."""

    def __init__(self, read: set[str]):
        self.read = read
        self.taken: set[str] = set()

    def __contains__(self, key: object) -> bool:
        if isinstance(key, tuple):  # a port as the rule names it: (family, number)
            key = f"{key[0]}:{key[1]}"
        return key in self.read or key in self.taken


@dataclass
class _NodeNow:
    """One node while a commit is decided: its capacity, and what is free and held as placements are admitted."""

    cap: tuple[float, float, float, float]
    free: list[float]
    by_id: dict[str, Device]
    devices: _Held
    ports: _Held
    device_used: _Used
    extra: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # a hold's amounts, lifted off
    lifted: set[str] = field(default_factory=set)  # the holds whose capacity this commit may take here

    def lift(self, amounts: tuple[float, float, float, float]) -> None:
        """Count a hold's amounts as free here, and raise the ceilings by as much (see ``decide``)."""
        for k, amount in enumerate(amounts):
            self.free[k] += amount
            self.extra[k] += amount

    @classmethod
    def of(cls, state: NodeState, limits: Limits, bookings: bool = True) -> _NodeNow:
        cap, by_id = _static(state.record, limits)
        if not bookings:
            return cls(cap=cap, free=list(cap), by_id=by_id, devices=_Held(_NOTHING), ports=_Held(_NOTHING),
                       device_used=_Used(_NO_AMOUNTS))
        return cls(cap=cap, free=[c - max(state.amount(dim), 0.0) for c, dim in zip(cap, DIMENSIONS, strict=True)],
                   by_id=by_id, devices=_Held(state.keys("device")), ports=_Held(state.keys("port")),
                   device_used=_Used(state.used))

    def book(self, placement: Placement) -> None:
        for k, amount in enumerate(DIMENSIONS.values()):
            self.free[k] -= amount(placement)
        allocation = placement.allocation
        if allocation.devices:
            self.devices.taken.update(held_whole(allocation))
            taken = self.device_used.taken
            for dim, value in device_amounts(allocation).items():
                taken[dim] = taken.get(dim, 0.0) + value
        self.ports.taken.update(port_key(p.protocol, p.port) for p in allocation.ports)

    @classmethod
    def inside(cls, state: NodeState, held: list[Placement], reservation: str, ports: _Held,
               bookings: bool = True) -> _NodeNow:
        """A reservation's space on a node: what its placements ``held`` there, less what runs inside it booked
        (the ``rsv:<id>:`` dimensions, the ``<id>/`` device keys); ports are the node's own."""
        cap = (sum(p.resources.cpu_cores for p in held), sum(p.resources.memory_mb for p in held),
               sum(p.resources.disk_mb for p in held), float(sum(p.resources.gpu_count for p in held)))
        by_id = {d.id: d for p in held for d in p.allocation.devices}
        if not bookings:
            return cls(cap=cap, free=list(cap), by_id=by_id, devices=_Held(_NOTHING), ports=ports,
                       device_used=_Used(_NO_AMOUNTS))
        space, key_space = inside(reservation), inside_key(reservation, "")
        used = {dim[len(space):]: amount for dim, amount in state.used.items() if dim.startswith(space)}
        keys = {key[len(key_space):] for key in state.keys("device") if key.startswith(key_space)}
        return cls(cap=cap, free=[c - max(used.get(dim, 0.0), 0.0) for c, dim in zip(cap, DIMENSIONS, strict=True)],
                   by_id=by_id, devices=_Held(keys), ports=ports, device_used=_Used(used))

    def ceiling(self, dim: str) -> float:
        """The most dimension ``dim`` may reach here: a capacity, or a device's limit."""
        if dim in DIMENSIONS:
            return self.cap[list(DIMENSIONS).index(dim)]
        return device_ceiling(dim, self.by_id)

    def ceilings(self, demand: NodeDemand) -> dict[str, float]:
        """The ceiling of every dimension the demand adds to: the node's capacities, each device's limits."""
        out = {dim: cap + extra for dim, cap, extra in zip(DIMENSIONS, self.cap, self.extra, strict=True)}
        for dim in demand.add:
            if dim not in out and not dim.startswith(INSIDE):
                out[dim] = device_ceiling(dim, self.by_id)
        return out


_NOTHING: set[str] = set()  # never changed: a commit's own keys go to _Held.taken
_NO_AMOUNTS: dict[str, float] = {}  # never changed: a commit's own amounts go to _Used.taken
_STATIC: dict[tuple[int, int], tuple[NodeRecord, Limits, tuple[float, float, float, float], dict[str, Device]]] = {}


def _static(record: NodeRecord, limits: Limits) -> tuple[tuple[float, float, float, float], dict[str, Device]]:
    """A node's capacity under the limits and its devices by id; records and limits are immutable and parsed once
    per distinct text (booking.parse_record), so this is computed once per pair, not per commit."""
    key = (id(record), id(limits))
    hit = _STATIC.get(key)
    if hit is None or hit[0] is not record or hit[1] is not limits:
        if len(_STATIC) > 4096:
            _STATIC.clear()
        hit = _STATIC[key] = (record, limits, node_capacity(record, limits), {d.id: d for d in record.devices})
    return hit[2], hit[3]


class ReadCache:
    """The nodes' records, versions and the limits as a process last read them.

    A commit first decides against these, on the records alone (status, eligibility, capacity, devices: what
    the version covers), and sends the ticket straight away: one round trip instead of two. That is safe
    because the apply checks everything else against the real state: the versions, usage under the
    ceilings, claims free. When the apply finds that something changed (the node is fuller, a key is held,
    the record moved on) it answers with the state it found, and the commit decides on that: an admitted
    commit and a refused one both cost one round trip, and no refusal is ever made from the cache, so every
    refusal's reason is the one the current state gives.
    """

    def __init__(self) -> None:
        self.states: dict[str, NodeState] = {}
        self.limits: Limits | None = None
        self.accounts: dict[str, QueueRecord | CohortRecord | None] = {}  # None: no such account when read

    def read(self, nodes: list[str], accounts: Sequence[str] = ()) -> CommitRead | None:
        """The nodes and the queues' accounts as last read; None when any was never read. An account read as
        absent (a queue with no settings) is decided on as absent: creating settings raises every node's version
        (store.set_queue), so a ticket decided so before they existed never applies."""
        if self.limits is None or any(n not in self.states for n in nodes) or any(
                a not in self.accounts for a in accounts):
            return None
        queues = queues_of(r for r in (self.accounts[a] for a in accounts) if r is not None) if accounts else None
        return CommitRead(states=[self.states[n] for n in nodes], limits=self.limits, queues=queues)

    def remember(self, read: CommitRead, accounts: Sequence[str] = ()) -> None:
        self.limits = read.limits
        for state in read.states:
            self.states[state.record.name] = state
        if accounts and read.queues is not None:
            found: dict[str, QueueRecord | CohortRecord] = {
                **{queue_account(n): r for n, r in read.queues.queues.items()},
                **{cohort_account(n): c for n, c in read.queues.cohorts.items()}}
            for name in accounts:
                self.accounts[name] = found.get(name)


# -- which reservations hold what -------------------------------------------------------------------------------

_BUDGETS: dict[str, list[Placement]] = {}
_LOCK = threading.Lock()


def reservation_budgets(store: Any, ids: set[str]) -> dict[str, list[Placement]]:
    """Each reservation's own placements (what runs inside it may take). They never change while it lasts,
    so each is read once per process; an ended one has none."""
    out: dict[str, list[Placement]] = {}
    for rid in sorted(ids):
        held = _BUDGETS.get(rid)
        if held is None:
            held = [p for p in store.active_placements(job_id=rid) if p.reserves == rid]
            if held:
                with _LOCK:
                    if len(_BUDGETS) > 1024:
                        _BUDGETS.clear()
                    _BUDGETS[rid] = held
        out[rid] = held
    return out


def hold_budgets(store: Any, ids: set[str]) -> dict[str, list[Placement]]:
    """Each hold's own placements (what a placement over it may take); read at every commit, since a hold id is new
    each time one is made and the placements it books end with it."""
    return {h: [p for p in store.active_placements(job_id=h) if p.hold == h] for h in sorted(ids)}


def commit(store: Committer, job_id: str, placements: list[Placement], lease: Lease | None, now: float,
           cache: ReadCache | None = None, *, expire: Callable[[], bool] | None = None,
           event: str | None = None) -> CommitResult:
    """Decide on the cached records and apply; else (or when that apply found the state changed) read,
    decide, apply, and read again while the apply finds the state changed underneath. Before refusing, it
    calls ``expire`` (which ends the reservations whose time is up: an expired reservation never blocks a
    commit) and, if that ended any, decides again. The result's ``rereads`` says how often an apply found the
    state changed. Every ticket applied carries ``event`` (an Event's JSON), for a backend that records it in the
    apply itself."""
    changed: list[Applied] = []
    result = _commit(store, job_id, placements, lease, now, cache, expire, changed, event)
    result.rereads = len(changed)
    return result


def _commit(store: Committer, job_id: str, placements: list[Placement], lease: Lease | None, now: float,
            cache: ReadCache | None, expire: Callable[[], bool] | None, changed: list[Applied],
            event: str | None = None) -> CommitResult:
    placements = list(placements)
    demands = demand_by_node(placements)
    fp = fingerprint(placements, demands)
    reserved = {p.reservation for p in placements if p.reservation}
    budgets = reservation_budgets(store, reserved) if reserved else None
    over = {p.over_hold for p in placements if p.over_hold}
    holds = hold_budgets(store, over) if over else None
    queued = [p.queue for p in placements if p.queue]
    names = list(demands) + accounts_for(queued)  # a queued run's accounts are read with its nodes
    cached = cache.read(list(demands), names[len(demands):]) if cache is not None else None
    if cached is not None and cached.queues is not None and missing_accounts(cached.queues, names):
        cached = None  # a cohort this process had not named: read it with the rest
    fresh: CommitRead | None = None
    if cached is not None:
        decided = decide(cached, job_id, placements, fp, demands, now, bookings=False, budgets=budgets,
                         holds=holds)
        if isinstance(decided, Ticket):
            decided.event = event
            with store.commit_session() as session:
                applied, fresh = session.apply(decided, lease)
            if applied == "ok":
                return CommitResult(ok=True, job_id=job_id, placements=placements)
            if applied == "changed":
                changed.append(applied)
    expired_checked = False
    for _ in range(ATTEMPTS):
        refused: CommitResult | None = None
        with store.commit_session() as session:
            # The state an apply found covers what its ticket named: a ticket without the queue's accounts
            # (decided on a memory of no settings) is decided again on a read that names them.
            usable = fresh is not None and (fresh.queues is not None or len(names) == len(demands))
            read = fresh if usable and fresh is not None else session.read(job_id, names, lease)
            fresh = None
            if cache is not None:
                cache.remember(read, names[len(demands):])
            if read.queues is not None and (missing := missing_accounts(read.queues, names)):
                names += missing  # the queue is in a cohort this process did not know of: read its account too
                continue
            if not read.lease_ok:
                assert lease is not None
                raise StaleLease(f"lease {lease.name!r} epoch {lease.epoch} held by {lease.owner!r} is no longer current")
            decided = decide(read, job_id, placements, fp, demands, now, budgets=budgets, holds=holds)
            if isinstance(decided, CommitResult):
                refused = decided
            else:
                failpoint("commit.after_reads")
                decided.event = event
                applied, fresh = session.apply(decided, lease)
        if refused is not None:
            if refused.ok or refused.conflict is None or refused.conflict.job_booked or expired_checked:
                return refused
            expired_checked = True  # outside the session: ending a reservation is a write of its own
            if expire is None or not expire():
                return refused
            continue
        if applied == "ok":
            return CommitResult(ok=True, job_id=job_id, placements=placements)
        if applied == "stale_lease":
            assert lease is not None
            raise StaleLease(f"lease {lease.name!r} epoch {lease.epoch} held by {lease.owner!r} is no longer current")
        changed.append(applied)
    raise StoreError(f"commit of job {job_id} kept finding its nodes changed ({ATTEMPTS} reads); try again")
