"""What a commit writes: per-node totals of a plan, its fingerprint, and snapshots from aggregates.

Shared by every backend so that they book exactly the same things.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np
import orjson

from mn_prefect.model.names import STORED
from mn_prefect.model.node import Device, NodeRecord
from mn_prefect.model.node_status import heartbeat_status
from mn_prefect.model.placement import Allocation, DeviceShare, PlacedResources, Placement, PortAllocation
from mn_prefect.scheduler.columns import FleetColumns, NodeColumns, row_of
from mn_prefect.scheduler.devices import GPU_MEMORY, SHARE, device_amounts
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.ports import family
from mn_prefect.scheduler.quotas import Queues
from mn_prefect.store.base import ClusterSnapshot, Event
from mn_prefect.store.dimensions import CLAIM_KINDS, DIMENSIONS, inside, port_key

ROUND = 6

__all__ = ["port_key"]


@dataclass
class NodeDemand:
    """What one commit takes from one node: amounts of each capacity dimension, and the keys it claims
    (device ids, ports) by kind. The backends apply it without knowing what the dimensions mean."""

    add: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIMENSIONS, 0.0))
    claim: dict[str, list[str]] = field(default_factory=lambda: {kind: [] for kind in CLAIM_KINDS})
    need: dict[str, list[str]] = field(default_factory=dict)  # keys that must be held when it lands

    def as_json(self) -> dict:
        if self.need:
            return {"add": self.add, "claim": self.claim, "need": self.need}
        return {"add": self.add, "claim": self.claim}


def demand_by_node(placements: list[Placement]) -> dict[str, NodeDemand]:
    demands: dict[str, NodeDemand] = defaultdict(NodeDemand)
    for p in placements:
        d = demands[p.node]
        space = ""
        if p.reservation:  # inside a reservation: its own space, and only while it lasts
            space = inside(p.reservation)
            needed = d.need.setdefault("reservation", [])
            if p.reservation not in needed:
                needed.append(p.reservation)
        if p.over_hold:  # on a hold's capacity: only while the hold stands
            needed = d.need.setdefault("reservation", [])
            if p.over_hold not in needed:
                needed.append(p.over_hold)
        for dim, amount in DIMENSIONS.items():
            d.add[space + dim] = d.add.get(space + dim, 0.0) + amount(p)
        if p.allocation.devices:
            for dim, value in device_amounts(p.allocation).items():
                d.add[space + dim] = d.add.get(space + dim, 0.0) + value
        for kind, keys in CLAIM_KINDS.items():
            d.claim[kind] += keys(p)
    return dict(sorted(demands.items()))


_SORTED = json.JSONEncoder(sort_keys=True)  # the first fingerprints' text (json.dumps(..., sort_keys=True))
_NUMPY = orjson.OPT_SERIALIZE_NUMPY  # a numpy scalar among the amounts is written as its number, as json.dumps did


def json_text(value: object) -> str:
    """``value`` as compact JSON text: what the commit path sends and stores (orjson; numpy scalars as numbers)."""
    return orjson.dumps(value, option=_NUMPY).decode()


def fingerprint(placements: list[Placement], demands: dict[str, NodeDemand] | None = None) -> str:
    """Identifies a plan's bookings, so re-committing the same plan is recognised as a no-op: the SHA-256 of the
    demands' JSON with sorted keys (orjson's compact text; ``same_booking`` also knows the first fingerprints')."""
    demands = demand_by_node(placements) if demands is None else demands
    body = orjson.dumps(_as_json(demands), option=orjson.OPT_SORT_KEYS | _NUMPY)
    return hashlib.sha256(body).hexdigest()[:32]


def same_booking(booked: str, fp: str, demands: dict[str, NodeDemand]) -> bool:
    """Whether a stored booking's fingerprint ``booked`` is this plan's (``fp``), also when it was written by an
    earlier version, whose fingerprint hashed ``json.dumps``'s spaced text (a commit retried across an upgrade)."""
    if booked == fp:
        return True
    return booked == hashlib.sha256(_SORTED.encode(_as_json(demands)).encode()).hexdigest()[:32]


def _as_json(demands: dict[str, NodeDemand]) -> dict[str, dict]:
    return {n: d.as_json() for n, d in demands.items()}


def rounded(value: float) -> float:
    return round(value, ROUND)


@dataclass
class NodeState:
    """A node as the store holds it: its record (with live status), what is booked on it (``used`` per
    dimension, ``held`` keys per claim kind) and its ``version``, which grows with every change of the
    record, status, eligibility or limits (what admission reads besides usage and claims)."""

    record: NodeRecord
    used: dict[str, float] = field(default_factory=dict)
    held: dict[str, set[str]] = field(default_factory=dict)
    version: int = 0

    def amount(self, dim: str) -> float:
        return self.used.get(dim, 0.0)

    def keys(self, kind: str) -> set[str]:
        return self.held.get(kind, set())

    @property
    def busy(self) -> bool:
        return any(self.used.values()) or any(self.held.values())

    def hold(self) -> Placement:
        """One synthetic placement that holds everything booked on this node: the devices held whole, and each
        shared GPU's booked shares and memory (its ``share:`` and ``gmem:`` dimensions)."""
        devices, shares, _ = self.holding()
        return Placement(
            agent_id=f"held@{self.record.name}", node=self.record.name,
            resources=PlacedResources(cpu_cores=max(self.amount("cpu"), 0.0), memory_mb=max(self.amount("mem"), 0.0),
                                      disk_mb=max(self.amount("disk"), 0.0), gpu_count=max(int(self.amount("gpu")), 0)),
            allocation=Allocation(devices=tuple(devices), shares=tuple(shares), ports=tuple(
                PortAllocation(label=key, port=int(number), protocol=fam)
                for key in sorted(self.keys("port")) for fam, _, number in (key.partition(":"),))),
        )

    def holding(self) -> tuple[list[Device], list[DeviceShare], list[tuple[str, int]]]:
        """What ``hold`` holds beyond the scalars: its devices, shares and (port family, number) pairs."""
        node_devices = {d.id: d for d in self.record.devices}
        held = self.keys("device")
        shares = []
        for device_id in sorted(node_devices):
            booked = self.amount(SHARE + device_id)
            if booked > 0 and device_id not in held:
                shares.append(DeviceShare(id=device_id, shares=min(booked, 1.0),
                                          memory_mb=max(self.amount(GPU_MEMORY + device_id), 0.0)))
        ports = []
        for key in sorted(self.keys("port")):
            fam, _, number = key.partition(":")
            ports.append((family(fam), int(number)))
        devices = [node_devices[d] for d in sorted({*held, *(s.id for s in shares)}) if d in node_devices]
        return devices, shares, ports

    def held_scalars(self) -> tuple[float, float, float, float]:
        """What ``hold`` books of CPU cores, memory MB, whole GPUs and disk MB (the scheduler's row order)."""
        return (max(self.amount("cpu"), 0.0), max(self.amount("mem"), 0.0), float(max(int(self.amount("gpu")), 0)),
                max(self.amount("disk"), 0.0))


_COLUMNS: dict[str | None, NodeColumns] = {}  # per group: the columns of the last snapshot, patched by the next


def snapshot_of(states: list[NodeState], limits: Limits, queues: Queues, group: str | None = None) -> ClusterSnapshot:
    """The snapshot of these node states: the records, and the same nodes as columns (scheduler/columns.py),
    with what is held on them (``holds``, one placement per busy node, built only when read). A record is
    derived into its row once (``row_of``: the store hands out one record object per stored text and status),
    and the columns of the group's previous snapshot are patched where rows changed."""
    ordered = sorted(states, key=_state_name)  # the columns' order (``NodeColumns.of`` sorts alike, stably)
    previous = _COLUMNS.get(group)
    columns = NodeColumns.of([row_of(s.record) for s in states], previous)
    if columns is not previous:
        with _PARSED_LOCK:
            if len(_COLUMNS) > 64:
                _COLUMNS.clear()
            _COLUMNS[group] = columns
    count = len(ordered)
    used = np.array([s.held_scalars() for s in ordered], dtype=float).reshape(count, 4).T.copy()

    def holding(i: int) -> tuple[list[Device], list[DeviceShare], list[tuple[str, int]]] | None:
        state = ordered[i]
        return state.holding() if state.busy else None

    return ClusterSnapshot(nodes=[s.record for s in states], limits=limits,
                           columns=FleetColumns.of(columns, used, holding, limits),
                           make_holds=lambda: [s.hold() for s in states if s.busy],
                           queues=list(queues.queues.values()), cohorts=list(queues.cohorts.values()))


def _state_name(state: NodeState) -> str:
    return state.record.name


_PARSED: dict[str, NodeRecord] = {}
_LIVE: dict[tuple[str, str, bool], NodeRecord] = {}  # a record whose live status differs from its text's
_PARSED_LOCK = threading.Lock()


def parse_record(text: str, status: str, eligible: bool) -> NodeRecord:
    """A stored record with its live status; each distinct JSON text is parsed once, and made one record object
    per live status (commits and snapshots re-read the same records constantly, and what is derived from a
    record, its scheduler row and admission's capacities, is kept per object)."""
    record = _PARSED.get(text)
    if record is None:
        record = NodeRecord.model_validate_json(text, context=STORED)
        with _PARSED_LOCK:
            if len(_PARSED) > 4096:
                _PARSED.clear()
            _PARSED[text] = record
    if record.status == status and record.scheduling_eligible == bool(eligible):
        return record
    key = (text, status, bool(eligible))
    live = _LIVE.get(key)
    if live is None:
        live = record.model_copy(update={"status": status, "scheduling_eligible": bool(eligible)})
        with _PARSED_LOCK:
            if len(_LIVE) > 4096:
                _LIVE.clear()
            _LIVE[key] = live
    return live


class RecordTexts:
    """The node records' JSON texts a process has read, with their versions: a commit's read asks the store for
    a node's record only where the version known here is stale (Redis and PostgreSQL alike)."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[int, str]] = {}

    def known(self, nodes: list[str]) -> dict[str, int]:
        """Each node's known version, -1 where none is known."""
        return {name: self._texts[name][0] if name in self._texts else -1 for name in nodes}

    def record(self, name: str, version: int, text: str | None, status: str, eligible: bool) -> NodeRecord:
        """The node's record with its live status; ``text`` is None where the store left it out as known."""
        return parse_record(self.text(name, version, text), status, eligible)

    def text(self, name: str, version: int, text: str | None) -> str:
        """The record's text (a node's, or an account's: store/accounts.py); None where the store left it out."""
        if text is not None:
            self._texts[name] = (version, text)
        return self._texts[name][1]


def stored_limits(text: str | None) -> Limits:
    """The limits from their stored JSON (none stored: the defaults), parsed once per text."""
    return limits_once(text, lambda: Limits.model_validate_json(text) if text else Limits())


_LIMITS: dict[Hashable, Limits] = {}


def limits_once(raw: Hashable, parse: Callable[[], Limits]) -> Limits:
    """The limits as read, parsed once per distinct stored form: the same object while they do not change,
    so what admission computes from them per node (the capacities) is computed once, not per read."""
    limits = _LIMITS.get(raw)
    if limits is None:
        limits = parse()
        with _PARSED_LOCK:
            if len(_LIMITS) > 64:
                _LIMITS.clear()
            _LIMITS[raw] = limits
    return limits


def transition_event(name: str, from_status: str, to_status: str, at: float, reason: str | None) -> Event:
    return Event(kind=f"node.{to_status}", at=at, node=name, reason=reason, data={"from": from_status, "to": to_status})


def reconnect_event(name: str, from_status: str, at: float, last_heartbeat: float | None) -> Event:
    """The event of a heartbeat that brings a disconnected/offline node back (the Redis HEARTBEAT script
    writes the same reason)."""
    reason = f"heartbeat received while {from_status}"
    if last_heartbeat is not None:
        reason += f", {at - last_heartbeat:.0f} s after the last one"
    return Event(kind="node.reconnected", at=at, node=name, reason=reason,
                 data={"from": from_status, "to": heartbeat_status(from_status)})


def usage_of(state: NodeState) -> dict[str, float]:
    """Every dimension's booked amount on the node (0 where nothing was ever booked), the per-device ones
    (a GPU's shares, fractional memory, MIG slices) included."""
    return {**state.used, **{dim: state.amount(dim) for dim in DIMENSIONS}}


def demands_json(placements_body: str) -> str:
    """The per-node demands of a stored placements JSON, as a booking keeps them for its release."""
    placements = [Placement.model_validate(p) for p in json.loads(placements_body)]
    return json.dumps({n: d.as_json() for n, d in demand_by_node(placements).items()})


def added(used: dict[str, float], amounts: dict[str, float], sign: int = 1) -> dict[str, float]:
    """``used`` with ``amounts`` added (sign 1) or taken away (sign -1), rounded as every backend rounds it
    and never below zero."""
    out = dict(used)
    for dim, amount in amounts.items():
        out[dim] = max(rounded(out.get(dim, 0.0) + sign * amount), 0.0)
    return out
