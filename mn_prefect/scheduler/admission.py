"""The admission rule: whether a placement fits a node with what is free and held there now.

One function, ``admission_reason``, decides; the planner (``ClusterView.admit``, scheduler/view.py) and every
store's commit (store/admission.py) call it, so a plan and its commit never disagree and every backend refuses
for the same reason with the same words (docs/architecture.md, "One admission rule").
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Protocol

from mn_prefect.model.node import Device, NodeRecord
from mn_prefect.model.node_status import SCHEDULABLE_STATES
from mn_prefect.model.placement import Placement
from mn_prefect.scheduler import reasons
from mn_prefect.scheduler.devices import GPU_MEMORY, MIG, SHARE, device_amounts, device_ceiling, held_whole
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.ports import family

EPSILON = 1e-9

# The capacity dimensions the rule checks, in the order of node_capacity: (name in reasons, unit).
CAPACITY = (("cpu", " cores"), ("memory", " MB"), ("disk", " MB"), ("gpu", ""))


def node_capacity(node: NodeRecord, limits: Limits) -> tuple[float, float, float, float]:
    """What may be booked on the node under the limits: CPU cores, memory MB, disk MB, GPUs."""
    pct = limits.for_node(node.name)
    return (Limits.scale(node.cpu_cores, pct["cpu"]), Limits.scale(node.memory_mb, pct["memory"]),
            Limits.scale(node.disk_mb, pct["disk"]), float(Limits.scale_count(len(node.gpu_devices), pct["gpu"])))


def capacity_shortfall(cap: tuple[float, ...], free: tuple[float, ...], need: tuple[float, ...]) -> str | None:
    """The first dimension where ``need`` exceeds what is free, worded for people; None if all fit."""
    for (name, unit), n, f, c in zip(CAPACITY, need, free, cap, strict=True):
        if n > f + EPSILON:
            return reasons.reason(f"{reasons.INSUFFICIENT} {name}", f"asks {n:g}{unit}, {max(f, 0):g} of {c:g} free")
    return None


class DeviceAmounts(Protocol):
    """Booked amounts by dimension name (a dict, or a commit's view of what was read plus what it took)."""

    def get(self, dim: str, default: float, /) -> float: ...


def admission_reason(node: NodeRecord, cap: tuple[float, ...], free: tuple[float, ...], devices: Mapping[str, Device],
                     devices_held: Container[str], ports_used: Container[tuple[str, int]],
                     placement: Placement, devices_used: DeviceAmounts | None = None) -> str | None:
    """The admission rule: why ``placement`` does not fit ``node`` with what is free and held there now, or
    None. ``devices`` are the node's devices by id, ``devices_used`` its per-device dimensions booked
    (scheduler/devices.py). ``ClusterView.admit`` and the store's commit (store/admission.py) both decide with
    it, so a plan and its commit never disagree and every backend refuses for the same reason."""
    if node.status not in SCHEDULABLE_STATES:
        return reasons.reason(reasons.NODE_NOT_READY, f"{node.name} status {node.status}")
    if node.scheduling_eligible is False:
        return reasons.reason(reasons.NODE_INELIGIBLE, node.name)
    if placement.group is not None and placement.group != node.group:
        return reasons.reason(reasons.OTHER_GROUP, f"{node.name} is in group {node.group!r}, "
                                                   f"the run in {placement.group!r}")
    r = placement.resources
    why = capacity_shortfall(cap, free, (r.cpu_cores, r.memory_mb, r.disk_mb, r.gpu_count))
    if why is not None:
        return f"{why} on {node.name}"
    allocation = placement.allocation
    if allocation.devices or allocation.shares:
        why = _devices_reason(node.name, devices, devices_held, devices_used or {}, placement)
        if why is not None:
            return why
    ports = [(family(p.protocol), p.port) for p in allocation.ports]
    for key in ports:
        if key in ports_used or ports.count(key) > 1:
            return reasons.reason(reasons.PORT_IN_USE, f"{key[0]}:{key[1]} on {node.name}")
    return None


def _devices_reason(name: str, devices: Mapping[str, Device], held: Container[str], used: DeviceAmounts,
                    placement: Placement) -> str | None:
    allocation = placement.allocation
    chosen = [d.id for d in allocation.devices]
    for device_id in chosen:
        if device_id not in devices:
            return reasons.reason(reasons.MISSING_DEVICES, f"device {device_id} is not on {name}")
    whole = held_whole(allocation)
    for device_id in whole:
        if device_id in held or whole.count(device_id) > 1:
            return reasons.reason(reasons.MISSING_DEVICES, f"device {device_id} on {name} is held")
    for share in allocation.shares:
        device = devices.get(share.id)
        if device is None or share.id not in chosen:
            return reasons.reason(reasons.MISSING_DEVICES, f"shared device {share.id} is not among the placement's "
                                                           f"devices on {name}")
        if device.parent is not None or device.mig_mode:
            return reasons.reason(reasons.MISSING_DEVICES, f"{share.id} on {name} is a MIG slice or in MIG mode: "
                                                           "it is not shared in fractions")
    for dim, amount in device_amounts(allocation).items():
        have, ceiling = used.get(dim, 0.0), device_ceiling(dim, devices)
        if have + amount > ceiling + EPSILON:
            return reasons.reason(reasons.MISSING_DEVICES, _device_shortfall(dim, have, amount, ceiling, name))
    return None


def _device_shortfall(dim: str, have: float, amount: float, ceiling: float, name: str) -> str:
    if dim.startswith(MIG):
        device = dim[len(MIG):]
        booked = "held whole" if have >= ceiling else f"has {have:g} slice(s) booked"
        return f"{device} on {name} {booked}: a GPU is booked whole or as MIG slices, never both"
    if dim.startswith(SHARE):
        device = dim[len(SHARE):]
        if have >= 1.0 - EPSILON:
            return f"{device} on {name} is held whole"
        if amount >= 1.0 - EPSILON:
            return f"{device} on {name} has {have:g} of its shares booked: a shared GPU is not booked whole"
        return f"{device} on {name}: asks shares {amount:g}, {max(1.0 - have, 0):g} free"
    device = dim[len(GPU_MEMORY):]
    return f"{device} on {name}: asks {amount:g} MB of GPU memory, {max(ceiling - have, 0):g} of {ceiling:g} unbooked"
