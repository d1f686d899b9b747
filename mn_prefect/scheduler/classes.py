"""Node classes and what the scheduler derives once per node record (Nomad's computed node classes).

A view is built many times from the same records (every ``plan_job``, every store snapshot: the store hands out
one parsed ``NodeRecord`` per stored JSON text, and the fleet as columns, scheduler/columns.py). What depends only
on the records is therefore derived once and memoised, each memo keyed on inputs that do not change:

- ``DerivedNode`` (columns.py), per node record object: its class shape, capacity before limits and devices by id.
  Node records are values here: a record changed in place after planning with it is not seen (nothing in
  mn-prefect does that; the store and the worker make a new record, ``model_copy``). Its status and eligibility
  are compared on a hit.
- ``NodeClass``, per class key (everything the static checks read): the static chain's answer per ask shape and
  the device positions matching a request, shared by every view and every node of the class.
- ``Fleet``, per ``NodeColumns`` (kept on them) and per list of node records (the same objects in the same
  order, through their columns): the class of each node, static masks per ask shape, best-fit bounds. Built
  from the columns with one lookup per class, whatever the number of nodes.

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
from mn_prefect.scheduler.columns import NodeColumns, columns_of, forget_rows
from mn_prefect.scheduler.devices import matching, pick_devices
from mn_prefect.scheduler.feasibility import ESCAPED_CONSTRAINTS, device_requests, first_static_failure, implies_gpu

MAX_CLASSES = 4096
MAX_PER_CLASS = 1024
MAX_FLEETS = 8
MAX_STATIC = 256

# (stage, reason) of the first static check a class fails for an ask shape, and whether its profile implies a GPU.
StaticAnswer = tuple[tuple[int, str] | None, bool]


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


_lock = threading.Lock()
_classes: dict[tuple[Any, ...], NodeClass] = {}
_fleets: OrderedDict[tuple[int, ...], Fleet] = OrderedDict()
_generation = 0  # grows with every ``forget``: a fleet cached on columns of an older generation is not used


def node_class(key: tuple[Any, ...], representative: NodeRecord) -> NodeClass:
    """The class of ``key`` (``columns.class_key``); a new one takes ``representative`` for its static checks."""
    found = _classes.get(key)
    if found is None:
        with _lock:
            if len(_classes) > MAX_CLASSES:
                _classes.clear()
            found = _classes.setdefault(key, NodeClass(key=key, representative=representative))
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

    def __init__(self, columns: NodeColumns):
        self.columns = columns
        self.nodes: list[NodeRecord] = columns.nodes
        self.index: dict[str, int] = columns.index
        self.capacity = columns.capacity  # one row per dimension (CPU cores, memory MB, disk MB, GPUs), before limits
        self.devices: list[dict[str, Device]] = columns.devices
        classes = [node_class(shape.key, record)
                   for shape, record in zip(columns.shapes, columns.representatives, strict=True)]
        self.class_of: np.ndarray = columns.shape_of
        self.class_members: list[int] = list(columns.first)  # a representative node index per class
        if len(set(classes)) < len(classes):  # two shapes of one key (interned apart): one class
            distinct: dict[NodeClass, int] = {}
            remap = np.array([distinct.setdefault(c, len(distinct)) for c in classes], dtype=np.int64)
            self.class_of = remap[self.class_of]
            self.class_members = [min(i for i, k in zip(columns.first, remap.tolist(), strict=True) if k == code)
                                  for code in range(len(distinct))]
            classes = list(distinct)
        self.classes: list[NodeClass] = classes
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
    found = fleet_for(columns_of(nodes))
    with _lock:
        _fleets[key] = found  # the fleet holds the records, so their ids are not reused while it lives
        while len(_fleets) > MAX_FLEETS:
            _fleets.popitem(last=False)
    return found


def fleet_for(columns: NodeColumns) -> Fleet:
    """The fleet of these columns, kept on them (columns from a store snapshot are shared by every view of it)."""
    cached = columns.fleet
    if cached is not None and cached[0] == _generation:
        fleet: Fleet = cached[1]
        return fleet
    fleet = Fleet(columns)
    columns.fleet = (_generation, fleet)
    return fleet


def forget() -> None:
    """Empty every memo (benchmarks measure a view built from records never seen before with it); fleets kept on
    columns are not used again."""
    global _generation
    with _lock:
        _classes.clear()
        _fleets.clear()
        _generation += 1
    forget_rows()
