"""Node classes and what the scheduler derives once per node record (Nomad's computed node classes).

A view is built many times from the same records (every ``plan_job``, every store snapshot: the store hands out
one parsed ``NodeRecord`` per stored JSON text). What depends only on the records is therefore derived once and
memoised, each memo keyed on inputs that do not change:

- ``NodeFacts``, per node record object: its class, capacity before limits and devices by id. Node records are
  values here: a record changed in place after planning with it is not seen (nothing in mn-prefect does that;
  the store and the worker make a new record, ``model_copy``). Its status and eligibility are compared on a hit.
- ``NodeClass``, per class key (everything the static checks read): the static chain's answer per ask shape and
  the device positions matching a request, shared by every view and every node of the class.
- ``Fleet``, per list of node records (the same objects in the same order): sorted order, index by name,
  capacity arrays, class of each node, static masks per ask shape. A changed record is a new object, so a new
  list and a new fleet, built from the facts memo (the unchanged records cost a lookup each).

Every memo is bounded (cleared when full) and ``forget`` empties them all.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mn_prefect.model.node import Device, NodeRecord
from mn_prefect.model.resources import DeviceRequest
from mn_prefect.scheduler.ask import Ask, ShapeKey
from mn_prefect.scheduler.devices import matching, pick_devices
from mn_prefect.scheduler.feasibility import ESCAPED_CONSTRAINTS, device_requests, first_static_failure, implies_gpu

MAX_FACTS = 200_000
MAX_CLASSES = 4096
MAX_PER_CLASS = 1024
MAX_FLEETS = 8
MAX_STATIC = 256

# (stage, reason) of the first static check a class fails for an ask shape, and whether its profile implies a GPU.
StaticAnswer = tuple[tuple[int, str] | None, bool]


def class_key(node: NodeRecord) -> tuple[Any, ...]:
    """Everything the static checks and the device filters read: nodes with equal keys answer alike."""
    devices = tuple(
        (d.kind, d.vendor, d.driver, d.model, d.memory_total_mb, d.memory_free_mb, d.api_version,
         tuple(d.capabilities), d.mig_mode, d.parent is not None, d.mig_profile)
        for d in node.devices
    )
    return (
        node.status, node.scheduling_eligible, node.role, node.os, node.arch, tuple(node.capabilities),
        tuple((p.name, p.gpu) for p in node.profiles),
        tuple((s.name, tuple(s.tags), s.status) for s in node.services),
        tuple(sorted(node.labels.items())), tuple(node.runtime_drivers), tuple(node.host_paths), devices,
    )


@dataclass(eq=False, slots=True)
class NodeClass:
    """Nodes whose static attributes are identical; ``representative`` is the first record seen with them."""

    key: tuple[Any, ...]
    representative: NodeRecord
    static: dict[ShapeKey, StaticAnswer] = field(default_factory=dict)
    positions: dict[DeviceRequest, tuple[int, ...]] = field(default_factory=dict)
    fit_bounds: dict[tuple[DeviceRequest, ...], float] = field(default_factory=dict)

    def answer(self, ask: Ask) -> StaticAnswer:
        """The static chain (feasibility.py) for ``ask`` on this class, computed once per ask shape."""
        hit = self.static.get(ask.static_key)
        if hit is None:
            if len(self.static) > MAX_PER_CLASS:
                self.static.clear()
            rep = self.representative
            hit = self.static[ask.static_key] = (first_static_failure(rep, ask), implies_gpu(rep, ask))
        return hit

    def matching(self, request: DeviceRequest) -> tuple[int, ...]:
        """Positions of this class's devices that match ``request`` apart from its ids (``devices.matching``)."""
        hit = self.positions.get(request)
        if hit is None:
            if len(self.positions) > MAX_PER_CLASS:
                self.positions.clear()
            hit = self.positions[request] = matching(request, self.representative.devices)
        return hit

    def fit_bound(self, requests: tuple[DeviceRequest, ...]) -> float:
        """The GPU memory ``requests`` leave unbooked on a node of this class with nothing booked (inf: never fit).
        For one whole-device request without ids it is the least any such node can leave (``devices`` takes
        the smallest free devices), so best fit may skip computing nodes whose bound is already worse."""
        hit = self.fit_bounds.get(requests)
        if hit is None:
            if len(self.fit_bounds) > MAX_PER_CLASS:
                self.fit_bounds.clear()
            picked, _, _ = pick_devices(requests, self.representative.devices, check_ids=False,
                                        positions=[self.matching(r) for r in requests])
            hit = self.fit_bounds[requests] = picked.leftover if picked is not None else float("inf")
        return hit


@dataclass(eq=False, slots=True)
class NodeFacts:
    """What the scheduler reads of one node record, derived once per record object."""

    record: NodeRecord
    status: str
    eligible: bool
    node_class: NodeClass
    capacity: tuple[float, float, float, float]  # CPU cores, memory MB, disk MB, whole GPUs; before limits
    devices: dict[str, Device]


_lock = threading.Lock()
_classes: dict[tuple[Any, ...], NodeClass] = {}
_facts: dict[int, NodeFacts] = {}
_fleets: OrderedDict[tuple[int, ...], Fleet] = OrderedDict()


def node_class(node: NodeRecord) -> NodeClass:
    key = class_key(node)
    found = _classes.get(key)
    if found is None:
        with _lock:
            if len(_classes) > MAX_CLASSES:
                _classes.clear()
            found = _classes.setdefault(key, NodeClass(key=key, representative=node))
    return found


def facts_of(node: NodeRecord) -> NodeFacts:
    """``NodeFacts`` of ``node``, memoised by record object (checked against its status and eligibility)."""
    found = _facts.get(id(node))
    if (found is not None and found.record is node and found.status == node.status
            and found.eligible == node.scheduling_eligible):
        return found
    gpus = sum(1 for d in node.devices if d.kind == "gpu" and d.parent is None)
    found = NodeFacts(record=node, status=node.status, eligible=node.scheduling_eligible, node_class=node_class(node),
                      capacity=(node.cpu_cores, node.memory_mb, node.disk_mb, float(gpus)),
                      devices={d.id: d for d in node.devices})
    if len(_facts) > MAX_FACTS:
        _facts.clear()
    _facts[id(node)] = found  # the entry holds the record, so its id is not reused while the entry lives
    return found


@dataclass(slots=True)
class StaticInfo:
    """Static feasibility of one ask shape over all nodes of a fleet."""

    mask: np.ndarray  # bool per node
    implied_gpu: np.ndarray  # 0/1 per node: an execution profile implies one GPU
    class_failure: list[tuple[int, str] | None]  # per class of the fleet
    escaped_failure: dict[int, str]  # node index -> reason from a per-node constraint
    implies_any: bool = False  # some node's execution profile implies a GPU


class Fleet:
    """The static part of a cluster view: what depends on the node records only, never on bookings or limits.
    Shared by every view built from the same records; read-only once built (its memos only grow)."""

    def __init__(self, records: Sequence[NodeRecord]):
        facts = sorted((facts_of(n) for n in records), key=_name_of)
        self.nodes: list[NodeRecord] = [f.record for f in facts]
        self.index: dict[str, int] = {node.name: i for i, node in enumerate(self.nodes)}
        count = len(facts)
        # One row per dimension (CPU cores, memory MB, disk MB, GPUs), before limits.
        self.capacity = np.array([f.capacity for f in facts], dtype=float).reshape(count, 4).T.copy()
        self.devices: list[dict[str, Device]] = [f.devices for f in facts]
        classes: dict[NodeClass, int] = {}
        of = [classes.setdefault(f.node_class, len(classes)) for f in facts]
        self.class_of = np.array(of, dtype=np.int64)
        self.classes: list[NodeClass] = list(classes)
        self.class_members: list[int] = [0] * len(self.classes)  # a representative node index per class
        for i in reversed(range(count)):
            self.class_members[of[i]] = i
        self._static: dict[ShapeKey, StaticInfo] = {}
        self._bounds: dict[tuple[ShapeKey, bool], np.ndarray | None] = {}

    def static_info(self, ask: Ask) -> StaticInfo:
        """Per node, whether ``ask`` passes the static chain: once per class, plus escaped constraints per node."""
        cached = self._static.get(ask.static_key)
        if cached is not None:
            return cached
        answers = [c.answer(ask) for c in self.classes]
        failures = [a[0] for a in answers]
        ok = np.array([f is None for f in failures], dtype=bool)
        implied = np.array([a[1] for a in answers], dtype=np.int64)
        count = len(self.nodes)
        mask = ok[self.class_of] if count else np.zeros(0, dtype=bool)
        escaped: dict[int, str] = {}
        if ask.escaped_constraints:
            for i in np.flatnonzero(mask):
                why = ESCAPED_CONSTRAINTS.check(self.nodes[i], ask)
                if why is not None:
                    escaped[int(i)] = why
                    mask[i] = False
        info = StaticInfo(mask=mask, implied_gpu=implied[self.class_of] if count else np.zeros(0, dtype=np.int64),
                          class_failure=failures, escaped_failure=escaped, implies_any=bool(implied.any()))
        if len(self._static) > MAX_STATIC:
            self._static.clear()
        self._static[ask.static_key] = info
        return info

    def fit_bounds(self, ask: Ask, implied: np.ndarray) -> np.ndarray | None:
        """Per node, the least GPU memory the ask's device requests can leave unbooked there (``fit_bound``);
        None when no such bound holds (fractions, slices, several requests, or device ids)."""
        key = (ask.devices_key, ask.request.gpu_count == 0)  # with the profile, what ``device_requests`` reads
        if key in self._bounds:
            return self._bounds[key]
        out: np.ndarray | None = np.empty(len(self.classes))
        for k, (cls, rep) in enumerate(zip(self.classes, self.class_members, strict=True)):
            requests = device_requests(self.nodes[rep], ask) if implied[rep] else ask.request.devices
            if not _bounded(requests):
                out = None
                break
            assert out is not None
            out[k] = cls.fit_bound(requests)
        if out is not None:
            out = out[self.class_of]
        if len(self._bounds) > MAX_STATIC:
            self._bounds.clear()
        self._bounds[key] = out
        return out


def _bounded(requests: tuple[DeviceRequest, ...]) -> bool:
    if len(requests) != 1:
        return False
    r = requests[0]
    return r.shares is None and r.mig_profile is None and not r.ids


def _name_of(facts: NodeFacts) -> str:
    return facts.record.name


def fleet_of(nodes: Sequence[NodeRecord]) -> Fleet:
    """The fleet of these records, memoised by the identity of the records in order (a few fleets are kept:
    one per resource group a process plans in, typically)."""
    key = tuple(map(id, nodes))
    found = _fleets.get(key)
    if found is not None:
        with _lock:
            if key in _fleets:
                _fleets.move_to_end(key)
        return found
    found = Fleet(nodes)
    with _lock:
        _fleets[key] = found  # the fleet holds the records, so their ids are not reused while it lives
        while len(_fleets) > MAX_FLEETS:
            _fleets.popitem(last=False)
    return found


def forget() -> None:
    """Empty every memo (benchmarks measure a view built from records never seen before with it)."""
    with _lock:
        _classes.clear()
        _facts.clear()
        _fleets.clear()


