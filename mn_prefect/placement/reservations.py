"""Reservations with expiry (docs/operating.md; ni-compute's timeline): capacity booked now, for a while.

A reservation is a booking like any other, under its own id, whose placements are stamped ``reserves`` and
claim the reservation's id on their node (store/dimensions.py). Its record (kind ``reservation``, same id)
says what was asked, for whom (a key's SHA-256) and until when. A run placed inside it (``place_inside``)
is planned against the reservation's own capacity, not the node's free capacity, and its commit books the
reservation's space and needs the reservation's claim to be held when it lands.

An expired reservation never blocks a commit: a commit that would be refused first ends the reservations
whose time is up (``expire_due``) and decides again, and every planner does the same before it reads the
cluster. The reconcile flow ends the rest on its schedule and announces each end with an event.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import secrets
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

from mn_prefect import events, notify
from mn_prefect.model.bookings import RESERVATION_ID, Reservation
from mn_prefect.model.constraints import Constraint, parse_constraint
from mn_prefect.model.issues import Issues
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import PlacedResources, Placement, Plan, PortAllocation
from mn_prefect.model.resources import ResourceRequest
from mn_prefect.model.scalars import is_uuid
from mn_prefect.placement import bookings
from mn_prefect.placement.ending import announce_ended, emit, end, expire_due
from mn_prefect.placement.placing import Placer, PlaceResult
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.scheduler.view import ClusterView
from mn_prefect.store.base import ClusterStore, Event
from mn_prefect.store.expiry import MIN_SECONDS, clock as _clock
from mn_prefect.store.records import ReservationRecord, get_record, list_records, put_record
from mn_prefect.store.releasing import release as release_booking

ID_PATTERN = RESERVATION_ID  # a reservation's id: its booking's owner (mn_prefect.model.bookings)

log = logging.getLogger(__name__)


class ReservationError(ValueError):
    """A reservation request or use that cannot be honoured; ``field`` names what was wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def new_id() -> str:
    return f"rsv-{secrets.token_hex(6)}"


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def is_reservation(booking: str) -> bool:
    return bool(ID_PATTERN.match(booking))


# The longest duration: ten years, in seconds.
MAX_DURATION_S = 10 * 365 * 86400.0


def parse_duration(text: str, field: str = "--for") -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``2h``, ``1d`` or a sum like ``1h30m``; ReservationError naming
    ``field`` otherwise."""
    value = text.strip().lower()
    if len(value) > 64:
        raise ReservationError(field, f"{text[:64]!r}... is not a duration (at most 64 characters)")
    parts = re.fullmatch(r"(?:\d+(?:\.\d+)?[smhd]?)+", value) and re.findall(r"(\d+(?:\.\d+)?)([smhd]?)", value)
    if not parts:
        raise ReservationError(field, f"{text!r} is not a duration (e.g. 90s, 15m, 2h, 1h30m, 1d)")
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
    seconds = sum(float(number) * unit[suffix] for number, suffix in parts)
    if not math.isfinite(seconds):
        raise ReservationError(field, f"{text!r} is not a duration")
    if seconds > MAX_DURATION_S:  # past this, ends overflow datetimes after the booking is made
        raise ReservationError(field, f"{text!r} is too long (at most 10 years, {MAX_DURATION_S:.0f}s)")
    return seconds


class Runs(Protocol):
    def cancel_run(self, run_id: str, reason: str) -> None: ...
    def cancel_waiting_run(self, run_id: str, reason: str) -> None: ...
    def run_state(self, run_id: str) -> str | None: ...


def reconcile(store: ClusterStore, runs: Runs, *, now: float | None = None) -> dict[str, Any]:
    """The reconcile flow's part: end every reservation whose time is up, announce ends no process could
    announce (ended where no Prefect server was configured), and deallocate runs still inside a reservation
    that has ended: a running flow run is cancelled (its worker stops it and releases it); one no worker has
    claimed (Scheduled, Paused: no process of it exists) is Cancelled at once and its booking released here, as
    is a booking whose run is over or gone (or that is no flow run). A Pending run is left to a later pass: its
    worker may be starting its process right now, and Prefect lets a Cancelled run go Running, so it would run
    with nothing booked. It becomes Running (then cancelled), ends, or goes back to Scheduled (its worker died
    while starting it: the worker's orphan sweep) and is then Cancelled here."""
    now = time.time() if now is None else now
    expired = [r.job_id for r in expire_due(store, now=now, force=True)]
    records = {r.job_id: r for r in list_records(store, ReservationRecord)}
    for record in records.values():
        if record.status in ("expired", "released") and not record.announced and emit(record.status, record,
                                                                                       record.reason):
            put_record(store, record.model_copy(update={"announced": True}))
    deallocated = []
    for placement in store.active_placements():
        owner = records.get(placement.reservation or "")
        if placement.reservation is None or placement.job_id is None or (owner is not None and
                                                                          owner.status == "active"):
            continue
        reason = f"mn: reservation {placement.reservation} has ended; its runs are deallocated"
        state = runs.run_state(placement.job_id) if is_uuid(placement.job_id) else None
        if state in ("CANCELLING", "PENDING"):
            continue  # asked already, or being started: its worker releases it when it stops
        if state in _NOT_STARTED:
            runs.cancel_waiting_run(placement.job_id, reason)
            bookings.release(store, bookings.classify(store, placement.job_id), "reservation_deallocated")
        elif state is not None and state not in _OVER:
            runs.cancel_run(placement.job_id, reason)
        else:
            bookings.release(store, bookings.classify(store, placement.job_id), "reservation_deallocated")
        store.record_event(Event(kind="allocation.deallocated", at=now, node=placement.node, job_id=placement.job_id,
                                 reason=reason, data={"reservation": placement.reservation}))
        events.allocation("deallocated", placement.job_id, node_name=placement.node, reason=reason,
                          held=placement.model_dump(mode="json", exclude={"env"}),
                          data={"reservation": placement.reservation})
        notify.publish("DEALLOCATION", "mn.allocation.deallocated", node=placement.node, job_id=placement.job_id,
                       reason=reason)
        deallocated.append(placement.job_id)
    return {"expired": expired, "deallocated": sorted(set(deallocated))}


_OVER = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
# No worker has claimed such a run, so no process of it exists: a Cancelling state would wait for a worker to stop
# one. Prefect refuses a Cancelled run's Pending, so no worker starts it after.
_NOT_STARTED = ("SCHEDULED", "PAUSED")


DURABLE_SECONDS = 30.0  # how long a reservation waits for a replica: a Sentinel failover and the resync after it


def _durable(store: ClusterStore, record: ReservationRecord, placements: list[Placement] | None) -> None:
    """A reservation is held for a long while, and a Redis failover drops what the old master had not sent on:
    it is reported made (or extended) only once a replica has it. While none acknowledges (the master is being
    replaced, or lost its replica), it is read back through the store, which follows the new master, and what is
    missing is written again: the record, and the booking (``placements``) unless someone took its capacity
    meanwhile: then ReservationError, and ``reserve`` takes back what it wrote. After DURABLE_SECONDS it is
    reported made with a warning in the log."""
    rid = record.job_id
    deadline = time.monotonic() + DURABLE_SECONDS
    acknowledged = _replicate(store, rid)
    while acknowledged == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        _write_again(store, record, placements)
        acknowledged = _replicate(store, rid)
    if acknowledged == 0:
        log.warning("reservation %s: no replica acknowledged it; a failover now could lose it", rid)


def _replicate(store: ClusterStore, rid: str) -> int | None:
    try:
        return store.replicate()
    except Exception as error:  # the master is being replaced: as good as no acknowledgement
        log.warning("reservation %s: could not confirm that the replicas have it: %s", rid, error)
        return 0


def _write_again(store: ClusterStore, record: ReservationRecord, placements: list[Placement] | None) -> None:
    rid = record.job_id
    stored = get_record(store, rid, ReservationRecord)
    if stored is None or stored.expires_at != record.expires_at:
        log.warning("reservation %s was lost from the store (a failover): written again", rid)
        put_record(store, record)
    if placements and not store.active_placements(job_id=rid):
        commit = store.commit_plan(rid, placements)
        announce_ended(store, commit.ended)
        if not commit.ok:
            why = commit.conflict.reason if commit.conflict is not None else "refused"
            raise ReservationError("--resources", f"reservation {rid} was lost in a store failover and its capacity "
                                                  f"was taken meanwhile ({why}): nothing is reserved; try again")
        log.warning("reservation %s: its booking was lost from the store (a failover): booked again", rid)


# -- making, checking, changing ----------------------------------------------------------------------------------

@dataclass
class Reserved:
    """What ``reserve`` did: the record (None for a check) and the plan it placed or would place."""

    record: ReservationRecord | None
    plan: Plan

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.plan.status, "reason": self.plan.reason,
                               "placements": [p.model_dump(mode="json") for p in self.plan.placements]}
        if self.record is not None:
            out["reservation"] = view(self.record)
        return out


def reservation_ask(request: ResourceRequest, node: str | None) -> Ask:
    constraints: tuple[Constraint, ...] = ()
    if node is not None:
        issues = Issues()
        pin = parse_constraint({"attribute": "node.name", "operator": "==", "value": node}, "--node", issues)
        assert pin is not None and not issues
        constraints = (pin,)
    return Ask(agent_id="reservation", source_agent_id="reservation", request=request, constraints=constraints)


def _check_request(request: ResourceRequest) -> None:
    if request.ports:
        raise ReservationError("resources.ports", "a reservation holds no ports: runs inside it take the node's")
    for i, device in enumerate(request.devices):
        if device.shares is not None:
            raise ReservationError(f"resources.devices[{i}].shares", "a reservation holds whole GPUs or MIG "
                                                                      "slices; runs inside it may share them")


def check(store: ClusterStore, request: ResourceRequest, *, group: str | None = None, node: str | None = None,
          strategy: str = "binpack") -> Plan:
    """Whether a reservation would be placed now, later, or never, and where; books nothing."""
    _check_request(request)
    expire_due(store)
    snap = store.snapshot(group=group)
    return plan_asks([reservation_ask(request, node)], [], strategy=strategy,
                     view=ClusterView(snap.columns, (), snap.limits))


# One Placer per store and group for the reservations this process makes: its view is read once and kept, not
# read again for every reservation (each commit re-checks what it relied on, a refusal re-reads before it is
# believed, and an end made here re-reads: placement.placing.Placer).
_PLACERS: weakref.WeakKeyDictionary[Any, dict[str | None, tuple[Placer, threading.Lock]]] = weakref.WeakKeyDictionary()
_PLACERS_LOCK = threading.Lock()


def _placer(store: ClusterStore, group: str | None) -> tuple[Placer, threading.Lock]:
    with _PLACERS_LOCK:
        try:
            by_group = _PLACERS.setdefault(store, {})
        except TypeError:  # a store that cannot be weakly referenced: a Placer of its own each time
            return Placer(store, group=group), threading.Lock()
        if group not in by_group:
            by_group[group] = (Placer(store, group=group), threading.Lock())
        return by_group[group]


def _capacity_freed(store: ClusterStore) -> None:
    """A reservation ended here: this process's placers read the store again before their next plan."""
    with _PLACERS_LOCK:
        try:
            placers = list(_PLACERS.get(store, {}).values())
        except TypeError:  # a store that cannot be weakly referenced has none kept
            placers = []
    for placer, lock in placers:
        with lock:
            placer.forget()


def reserve(store: ClusterStore, request: ResourceRequest, resources: dict[str, Any], seconds: float, *,
            group: str | None = None, node: str | None = None, key: str | None = None, name: str | None = None,
            strategy: str = "binpack", now: float | None = None) -> Reserved:
    """Book ``request`` now under a new reservation that lasts ``seconds``. The record is written first, with the
    nodes of the plan about to be committed (again before a commit of other nodes): a crash before the booking
    leaves a record that simply expires, never a booking nobody ends. A refusal keeps nothing in the store: the
    record written for a commit that lost its race is removed, the reason is the plan's (``Reserved.plan``) and
    the Prefect event ``mn.reservation.refused``. An error after the booking (the replica check, say) takes it
    back, booking and record, before it is raised."""
    _check_request(request)
    if not seconds >= MIN_SECONDS:
        raise ReservationError("--for", f"a reservation lasts at least {MIN_SECONDS:g} s (use --release to end one)")
    now = time.time() if now is None else now
    if expire_due(store, now=now):
        _capacity_freed(store)
    rid = new_id()
    record = ReservationRecord(job_id=rid, name=name, expires_at=now + seconds, resources=resources, group=group,
                               node=node, key_sha256=key_digest(key) if key else None, created_at=now, updated_at=now)

    def write(plan: Plan) -> None:  # before each commit: the record, naming the nodes it is about to book
        nonlocal record
        nodes = sorted({p.node for p in plan.placements})
        if nodes != record.nodes or not written:
            record = record.model_copy(update={"nodes": nodes})
            put_record(store, record)
            written.append(True)

    def created(plan: Plan) -> Event:  # the store's event, recorded with the booking
        nodes = sorted({p.node for p in plan.placements})
        return Event(kind="reservation.created", at=now, job_id=rid, node=nodes[0],
                     data={"expires_at": record.expires_at, "nodes": nodes})

    written: list[bool] = []
    placer, lock = _placer(store, group)
    # Pipelined: the record goes with the commit after it (in that order), and on Redis the replica check is
    # answered by the commit's script where the master has no replica.
    try:
        with store.pipelined():
            with lock:
                result = placer.place(rid, [reservation_ask(request, node)], strategy=strategy,
                                      update={"reserves": rid}, before_commit=write, event=created)
            if result.placed:
                _durable(store, record, list(result.commit.placements) if result.commit is not None else None)
    except BaseException:
        if written:
            withdraw(store, rid)
        raise
    if not result.placed:
        why = result.plan.reason if result.commit is None or result.commit.conflict is None else \
            result.commit.conflict.reason
        if written:  # the record of a commit that lost its race: a refusal keeps nothing
            store.delete_job(rid)
        emit("refused", record, why)
        return Reserved(record=None, plan=result.plan)
    emit("created", record)
    return Reserved(record=record, plan=result.plan)


def withdraw(store: ClusterStore, rid: str) -> None:
    """Take back a reservation that was never reported made, on the way out of an error (``reserve`` failing
    after its booking, its output not given): its booking released and its record removed, as if it had been
    refused. Never raises, so the error stays the one raised; a store that cannot be reached now keeps the
    record, which expires and then holds nothing."""
    try:
        release_booking(store, Reservation(rid), "reservation_ended")
        store.delete_job(rid)
    except Exception as error:
        log.warning("reservation %s: could not take it back after an error: %s", rid, error)
    _capacity_freed(store)


def usable(store: ClusterStore, rid: str, key: str | None, *, field: str = "reservation",
           key_field: str = "--key", now: float | None = None) -> ReservationRecord:
    """The live reservation ``rid`` if ``key`` opens it; ReservationError naming the field otherwise."""
    now = time.time() if now is None else now
    if not isinstance(rid, str) or not ID_PATTERN.match(rid):
        raise ReservationError(field, f"{rid!r} is not a reservation id (rsv-<hex>)")
    record = get_record(store, rid, ReservationRecord)
    if record is None:
        raise ReservationError(field, f"no reservation {rid}")
    if record.key_sha256 is not None and (not key or key_digest(key) != record.key_sha256):
        raise ReservationError(key_field, f"does not match the key of reservation {rid}" if key else
                               f"reservation {rid} has a key: give it")
    if record.status != "active" or record.expires_at <= now:
        if record.status == "active":
            record = end(store, record, "expired", f"expired at {_clock(record.expires_at)}", now=now)
        raise ReservationError(field, f"reservation {rid} has ended ({record.status}: {record.reason})")
    return record


def release(store: ClusterStore, rid: str, key: str | None, *, reason: str = "released on request") -> ReservationRecord:
    ended = end(store, usable(store, rid, key, field="--release"), "released", reason)
    _capacity_freed(store)
    return ended


def extend(store: ClusterStore, rid: str, seconds: float, key: str | None, *,
           now: float | None = None) -> ReservationRecord:
    """Move the expiry to ``seconds`` from now (0: end it now)."""
    now = time.time() if now is None else now
    record = usable(store, rid, key, field="--extend", now=now)
    if seconds <= 0:
        ended = end(store, record, "released", "released on request (--for 0)", now=now)
        _capacity_freed(store)
        return ended
    if seconds < MIN_SECONDS:
        raise ReservationError("--for", f"a reservation lasts at least {MIN_SECONDS:g} s")
    record = record.model_copy(update={"expires_at": now + seconds, "updated_at": now})
    with store.pipelined():  # the record and its event go with the replica check
        put_record(store, record)
        store.record_event(Event(kind="reservation.extended", at=now, job_id=rid,
                                 data={"expires_at": record.expires_at}))
        _durable(store, record, None)
    emit("extended", record)
    return record


def listing(store: ClusterStore, *, every: bool = False) -> list[ReservationRecord]:
    """The live reservations (every one ever made with ``every``), soonest expiry first. A refusal's record,
    which earlier versions kept, is no reservation and is never listed."""
    expire_due(store)
    records = [r for r in list_records(store, ReservationRecord, status=None if every else "active")
               if r.status != "refused"]
    return sorted(records, key=lambda r: (r.status != "active", r.expires_at))


def view(record: ReservationRecord, now: float | None = None) -> dict[str, Any]:
    """What people and programs read of a reservation (never the key's digest)."""
    now = time.time() if now is None else now
    return {"id": record.job_id, "name": record.name, "status": record.status, "nodes": record.nodes,
            "group": record.group, "resources": record.resources, "expires_at": record.expires_at,
            "seconds_left": max(round(record.expires_at - now, 1), 0.0) if record.status == "active" else 0.0,
            "keyed": record.key_sha256 is not None, "reason": record.reason, "created_at": record.created_at}


def holdings(store: ClusterStore, *, group: str | None = None) -> list[dict[str, Any]]:
    """Each live reservation (of ``group``) with what it holds and what the runs inside it use now."""
    out = []
    for record in listing(store):
        if group is not None and record.group != group:
            continue
        held = [p for p in store.active_placements(job_id=record.job_id) if p.reserves == record.job_id]
        inside = [p for n in record.nodes for p in store.active_placements(node=n) if p.reservation == record.job_id]
        out.append({**view(record), "held": _amounts(held), "used": _amounts(inside),
                    "runs": sorted({p.job_id for p in inside if p.job_id})})
    return out


def _amounts(placements: list[Placement]) -> dict[str, Any]:
    return {"cpu_cores": sum(p.resources.cpu_cores for p in placements),
            "memory_mb": sum(p.resources.memory_mb for p in placements),
            "gpu_count": sum(p.resources.gpu_count for p in placements),
            "devices": sorted({d.id for p in placements for d in p.allocation.devices})}


# -- running inside one ------------------------------------------------------------------------------------------

def inside_view(store: ClusterStore, rid: str) -> ClusterView:
    """The reservation as a small cluster: each of its nodes with only what it holds there, and what runs
    inside it hold already; the node's ports held by anyone are held here too (ports are the node's)."""
    held = [p for p in store.active_placements(job_id=rid) if p.reserves == rid]
    nodes: list[NodeRecord] = []
    holds: list[Placement] = []
    for name in sorted({p.node for p in held}):
        stored = store.get_node(name)
        if stored is None:
            continue
        mine = [p for p in held if p.node == name]
        nodes.append(stored.record.model_copy(update={
            "cpu_cores": sum(p.resources.cpu_cores for p in mine), "memory_mb": sum(p.resources.memory_mb for p in mine),
            "disk_mb": sum(p.resources.disk_mb for p in mine),
            "devices": [d for p in mine for d in p.allocation.devices]}))
        on_node = store.active_placements(node=name)
        holds += [p for p in on_node if p.reservation == rid]
        ports = [port for p in on_node if p.reservation != rid for port in p.allocation.ports]
        if ports:
            holds.append(Placement(agent_id=f"ports@{name}", node=name, resources=PlacedResources(),
                                   allocation=mine[0].allocation.model_copy(update={
                                       "devices": (), "shares": (), "volumes": (),
                                       "ports": tuple(PortAllocation(label=f"p{i}", port=p.port, protocol=p.protocol)
                                                      for i, p in enumerate(ports))})))
    return ClusterView(nodes, holds, Limits())


class InsidePlacer(Placer):
    """A Placer whose cluster is one reservation (``inside_view``); what it commits is stamped inside it."""

    def __init__(self, store: ClusterStore, reservation: str, *, group: str | None = None):
        super().__init__(store, retries=8, group=group)
        self.reservation = reservation

    def _read(self) -> None:
        self._view = inside_view(self.store, self.reservation)


def place_inside(store: ClusterStore, job_id: str, asks: list[Ask], rid: str, key: str | None, *,
                 job_type: str = "batch", strategy: str = "binpack", group: str | None = None,
                 field: str = "job_variables.reservation", key_field: str = "job_variables.reservation_key",
                 ) -> PlaceResult:
    """Place ``asks`` inside reservation ``rid`` (its key ``key``); ReservationError when it cannot be used."""
    usable(store, rid, key, field=field, key_field=key_field)
    return InsidePlacer(store, rid, group=group).place(job_id, asks, job_type=job_type, strategy=strategy,
                                                       update={"reservation": rid})
