"""The fleet as columns: what the scheduler reads of the node records, one array per dimension.

A node record is derived once into a ``DerivedNode`` (its class shape, capacity before limits, devices by id). Rows
in name order make ``NodeColumns``: the records, the index by name, a 4 x n capacity array and a shape code per
node, from which a view is built with a handful of array operations whatever the number of nodes. A store
snapshot hands over ``FleetColumns``: the node columns plus what is held on each node, its scalars as one
4 x n array and its devices and ports per node on demand (a plan looks at a few nodes). The store derives a row
when a node's stored text or status changes and patches the previous columns where rows changed
(``NodeColumns.of`` with ``previous``), so nothing is parsed per plan and nothing per node per snapshot beyond
reading what is held.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mn_prefect.model.node import Device, NodeRecord
from mn_prefect.model.placement import DeviceShare
from mn_prefect.scheduler.limits import Limits

MAX_SHAPES = 4096
MAX_ROWS = 200_000

# What is held on one node beyond its scalars: devices (held whole, or shared: in ``shares``), the GPU shares,
# and the booked ports as (port family, number) pairs.
Holding = tuple[Sequence[Device], Sequence[DeviceShare], Iterable[tuple[str, int]]]


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


class ClassShape:
    """A class key, interned: one object per distinct key, so columns group nodes by identity (no key is hashed
    per node when columns are built)."""

    __slots__ = ("key",)

    def __init__(self, key: tuple[Any, ...]):
        self.key = key


_lock = threading.Lock()
_shapes: dict[tuple[Any, ...], ClassShape] = {}
_rows: dict[int, DerivedNode] = {}


def shape_of(node: NodeRecord) -> ClassShape:
    key = class_key(node)
    found = _shapes.get(key)
    if found is None:
        with _lock:
            if len(_shapes) > MAX_SHAPES:
                _shapes.clear()  # later rows get new shapes; equal keys still make one class (classes.Fleet)
            found = _shapes.setdefault(key, ClassShape(key))
    return found


@dataclass(eq=False, slots=True)
class DerivedNode:
    """What the scheduler reads of one node record, derived once per record object."""

    record: NodeRecord
    status: str
    eligible: bool
    shape: ClassShape
    capacity: tuple[float, float, float, float]  # CPU cores, memory MB, disk MB, whole GPUs; before limits
    devices: dict[str, Device]

    @property
    def name(self) -> str:
        return self.record.name


def row_of(node: NodeRecord) -> DerivedNode:
    """``DerivedNode`` of ``node``, memoised by record object (checked against its status and eligibility). Records
    are values: one changed in place is not seen (the store and the worker make a new one, ``model_copy``)."""
    found = _rows.get(id(node))
    if (found is not None and found.record is node and found.status == node.status
            and found.eligible == node.scheduling_eligible):
        return found
    gpus = sum(1 for d in node.devices if d.kind == "gpu" and d.parent is None)
    found = DerivedNode(record=node, status=node.status, eligible=node.scheduling_eligible, shape=shape_of(node),
                    capacity=(node.cpu_cores, node.memory_mb, node.disk_mb, float(gpus)),
                    devices={d.id: d for d in node.devices})
    if len(_rows) > MAX_ROWS:
        _rows.clear()
    _rows[id(node)] = found  # the entry holds the record, so its id is not reused while the entry lives
    return found


def forget_rows() -> None:
    """Empty the rows memo (records never seen; classes.forget)."""
    with _lock:
        _rows.clear()


def _name(row: DerivedNode) -> str:
    return row.record.name


class NodeColumns:
    """Node rows in name order, as columns. Read-only once built: a changed node makes new columns (``of`` with
    ``previous`` copies the arrays and patches the changed positions). ``fleet`` is the scheduler's cache of
    what it derives from these columns (classes.fleet_for)."""

    __slots__ = ("rows", "nodes", "names", "index", "capacity", "devices", "shapes", "shape_of", "first",
                 "representatives", "fleet", "limited")

    def __init__(self, rows: list[DerivedNode], nodes: list[NodeRecord], names: list[str], index: dict[str, int],
                 capacity: np.ndarray, devices: list[dict[str, Device]], shapes: list[ClassShape], codes: np.ndarray,
                 first: list[int], representatives: list[NodeRecord]):
        self.rows = rows
        self.nodes = nodes
        self.names = names
        self.index = index
        self.capacity = capacity  # 4 x n: CPU cores, memory MB, disk MB, whole GPUs; before limits
        self.devices = devices  # per node: its devices by id
        self.shapes = shapes  # the distinct shapes
        self.shape_of = codes  # per node: its shape's position in ``shapes``
        self.first = first  # per shape: the first node (in name order) that has it
        # per shape: the first record given with it, which a class first seen here checks for all its nodes (a
        # reason that quotes device ids quotes this record's, as before columns)
        self.representatives = representatives
        self.fleet: Any = None
        self.limited: tuple[Limits, np.ndarray] | None = None  # ``limited``: the last limits and capacity under them

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def of(cls, rows: Iterable[DerivedNode], previous: NodeColumns | None = None) -> NodeColumns:
        """Columns of ``rows`` (sorted by name here, stably). With ``previous`` columns of the same names in the
        same order, only the positions whose row changed are written (``previous`` itself when none did)."""
        given = rows if isinstance(rows, list) else list(rows)
        rows = sorted(given, key=_name)
        nodes = [r.record for r in rows]
        names = [n.name for n in nodes]
        if previous is not None and previous.names == names:
            return _patched(previous, rows, nodes, names)
        count = len(rows)
        lookup: dict[ClassShape, int] = {}
        codes = np.fromiter((lookup.setdefault(r.shape, len(lookup)) for r in rows), dtype=np.int64, count=count)
        capacity = np.array([r.capacity for r in rows], dtype=float).reshape(count, 4).T.copy()
        first = np.unique(codes, return_index=True)[1].tolist() if count else []
        representatives: dict[ClassShape, NodeRecord] = {}
        for row in given:  # the first record of each shape in the order given
            representatives.setdefault(row.shape, row.record)
        return cls(rows, nodes, names, {name: i for i, name in enumerate(names)}, capacity,
                   [r.devices for r in rows], list(lookup), codes, first, [representatives[k] for k in lookup])


def _patched(previous: NodeColumns, rows: list[DerivedNode], nodes: list[NodeRecord], names: list[str]) -> NodeColumns:
    changed = [i for i, (old, new) in enumerate(zip(previous.rows, rows, strict=True)) if old is not new]
    if not changed:
        return previous
    capacity, codes, devices = previous.capacity.copy(), previous.shape_of.copy(), list(previous.devices)
    shapes = list(previous.shapes)
    lookup = {shape: k for k, shape in enumerate(shapes)}
    representatives = list(previous.representatives)
    for i in changed:
        row = rows[i]
        capacity[:, i] = row.capacity
        devices[i] = row.devices
        code = lookup.get(row.shape)
        if code is None:
            code = lookup[row.shape] = len(shapes)
            shapes.append(row.shape)
            representatives.append(row.record)
        codes[i] = code
    used, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    if len(used) != len(shapes):  # a shape no node has any more is dropped
        kept = used.tolist()
        shapes, representatives = [shapes[k] for k in kept], [representatives[k] for k in kept]
        codes = inverse.astype(np.int64)
    return NodeColumns(rows, nodes, names, previous.index, capacity, devices, shapes, codes, first.tolist(),
                       representatives)


def columns_of(records: Iterable[NodeRecord]) -> NodeColumns:
    """The columns of these records (each derived once, ``row_of``)."""
    return NodeColumns.of(map(row_of, records))


def limited(columns: NodeColumns, limits: Limits) -> np.ndarray:
    """Capacity under ``limits`` (``admission.node_capacity`` for every node at once, the same arithmetic element by
    element), 4 x n in the row order of a view's arrays: CPU cores, memory MB, whole GPUs, disk MB. Read-only, and
    kept on the columns for the last limits they were asked with."""
    cached = columns.limited
    if cached is not None and (cached[0] is limits or cached[0] == limits):
        out: np.ndarray = cached[1]
        return out
    pct = np.array([[limits.cpu], [limits.memory], [limits.disk], [limits.gpu]], dtype=float)
    if any(name in columns.index for name in limits.per_node):  # a percentage per node
        pct = np.repeat(pct, len(columns), axis=1)
        for name in limits.per_node:
            i = columns.index.get(name)
            if i is not None:
                values = limits.for_node(name)
                pct[:, i] = (values["cpu"], values["memory"], values["disk"], values["gpu"])
    raw = columns.capacity
    out = np.empty((4, len(columns)))
    out[[0, 1, 3]] = raw[:3] * pct[:3] / 100.0
    out[2] = np.floor(raw[3] * pct[3] / 100.0 + 1e-9)
    out.flags.writeable = False
    columns.limited = (limits, out)
    return out


@dataclass(frozen=True, slots=True)
class FleetColumns:
    """Nodes and what is held on them, as a store snapshot hands them to the scheduler (``ClusterView`` takes them
    for its nodes). Arrays are 4 x n in the row order of a view's (CPU cores, memory MB, whole GPUs, disk MB):
    ``used`` what is held per node, ``capacity`` the capacity under ``limits``, ``free`` the one less the other;
    ``holding(i)`` is what node ``i`` holds beyond the scalars (None: nothing). Read-only."""

    nodes: NodeColumns
    used: np.ndarray
    holding: Callable[[int], Holding | None]
    limits: Limits
    capacity: np.ndarray
    free: np.ndarray

    @classmethod
    def of(cls, nodes: NodeColumns, used: np.ndarray, holding: Callable[[int], Holding | None],
           limits: Limits) -> FleetColumns:
        capacity = limited(nodes, limits)
        free = capacity - used
        used.flags.writeable = free.flags.writeable = False
        return cls(nodes=nodes, used=used, holding=holding, limits=limits, capacity=capacity, free=free)
