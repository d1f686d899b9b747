"""What ``resource list`` reports: per-node and cluster totals, schedulable, used and free capacity."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

from pydantic import BaseModel, Field

from mn_prefect.model.node import Device, NodeRecord
from mn_prefect.model.placement import Placement
from mn_prefect.scheduler.devices import GPU_MEMORY, SHARE
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.view import ClusterView

SCALARS = ("cpu_cores", "memory_mb", "disk_mb", "gpu_count")


class Amounts(BaseModel):
    cpu_cores: float = 0.0
    memory_mb: float = 0.0
    disk_mb: float = 0.0
    gpu_count: float = 0.0

    def __add__(self, other: Amounts) -> Amounts:
        return Amounts(**{k: getattr(self, k) + getattr(other, k) for k in SCALARS})


class DeviceUsage(BaseModel):
    id: str
    index: int
    kind: str
    vendor: str | None
    driver: str | None
    model: str | None
    memory_total_mb: float | None
    memory_free_mb: float | None
    capabilities: list[str]
    mig_mode: bool = False
    parent: str | None = Field(None, description="For a MIG slice: its GPU.")
    mig_profile: str | None = None
    held: bool = Field(description="Booked whole by an active placement.")
    shares_booked: float = Field(0.0, description="Fractions of this GPU booked (0..1; 1 when held whole).")
    memory_booked_mb: float = Field(0.0, description="GPU memory booked by fractions.")
    slices_booked: int = Field(0, description="For a GPU in MIG mode: how many of its slices are booked.")


class NodeUsage(BaseModel):
    name: str
    status: str
    scheduling_eligible: bool
    role: str
    group: str
    total: Amounts
    schedulable: Amounts = Field(description="Total after the coarse limits.")
    used: Amounts
    free: Amounts
    gpu_memory_total_mb: float
    devices: list[DeviceUsage]
    runtime_drivers: list[str]
    host_paths: list[str]
    capabilities: list[str]
    ports_in_use: list[str]


class ClusterUsage(BaseModel):
    nodes: list[NodeUsage]
    total: Amounts
    schedulable: Amounts
    used: Amounts
    free: Amounts
    gpu_memory_total_mb: float
    limits: Limits


def _devices(node: NodeRecord, held: set[str], used: dict[str, float]) -> list[DeviceUsage]:
    """The node's devices, each MIG slice right under its GPU, with what is booked on each."""
    slices: dict[str, list[Device]] = {}
    for device in node.devices:
        if device.parent is not None:
            slices.setdefault(device.parent, []).append(device)
    ordered = [d for parent in node.devices if parent.parent is None for d in (parent, *slices.get(parent.id, []))]
    fields = {"id", "index", "kind", "vendor", "driver", "model", "memory_total_mb", "memory_free_mb", "capabilities",
              "mig_mode", "parent", "mig_profile"}
    return [DeviceUsage(**d.model_dump(include=fields), held=d.id in held,
                        shares_booked=round(min(used.get(SHARE + d.id, 0.0), 1.0), 6),
                        memory_booked_mb=used.get(GPU_MEMORY + d.id, 0.0),
                        slices_booked=sum(s.id in held for s in slices.get(d.id, [])))
            for d in ordered]


def cluster_usage(nodes: Iterable[NodeRecord], active: Iterable[Placement] = (),
                  limits: Limits | None = None) -> ClusterUsage:
    """Usage computed through the same ClusterView the scheduler books against."""
    view = ClusterView(nodes, active, limits)
    rows = []
    for i, node in enumerate(view.nodes):
        cap = Amounts(cpu_cores=view.cap_cpu[i], memory_mb=view.cap_mem[i], disk_mb=view.cap_disk[i],
                      gpu_count=view.cap_gpu[i])
        free = Amounts(cpu_cores=view.free_cpu[i], memory_mb=view.free_mem[i], disk_mb=view.free_disk[i],
                       gpu_count=view.free_gpu[i])
        rows.append(NodeUsage(
            name=node.name, status=node.status, scheduling_eligible=node.scheduling_eligible, role=node.role,
            group=node.group,
            total=Amounts(cpu_cores=node.cpu_cores, memory_mb=node.memory_mb, disk_mb=node.disk_mb,
                          gpu_count=len(node.gpu_devices)),
            schedulable=cap,
            used=Amounts(**{k: getattr(cap, k) - getattr(free, k) for k in SCALARS}),
            free=free,
            gpu_memory_total_mb=sum(d.memory_total_mb or 0.0 for d in node.gpu_devices),
            devices=_devices(node, view.devices_held[i], view.devices_used[i]),
            runtime_drivers=node.runtime_drivers, host_paths=node.host_paths, capabilities=node.capabilities,
            ports_in_use=sorted(f"{fam}:{port}" for fam, port in view.ports_used[i]),
        ))
    zero = Amounts()
    return ClusterUsage(
        nodes=rows,
        total=sum((r.total for r in rows), zero),
        schedulable=sum((r.schedulable for r in rows), zero),
        used=sum((r.used for r in rows), zero),
        free=sum((r.free for r in rows), zero),
        gpu_memory_total_mb=sum(r.gpu_memory_total_mb for r in rows),
        limits=view.limits,
    )


_MIG_G = re.compile(r"(?:^|\.)([1-8])g\.")
MIG_SLICES = 7  # GPU-instance slices of an A100 / H100 in MIG mode (as the simulator counts them)


class GpuUse(NamedTuple):
    """What is booked of one GPU (not a MIG slice): ``used`` of one GPU (1 held whole, its shares, its booked
    slices' weight), its memory booked and not booked, and whether nothing of it is booked."""

    device: DeviceUsage
    used: float
    memory_booked_mb: float
    memory_free_mb: float
    untouched: bool


def gpu_use(node: NodeUsage) -> list[GpuUse]:
    """Each GPU of ``node`` (MIG slices counted in their GPU) as ``gpus_booked`` counts it."""
    slices: dict[str, list[DeviceUsage]] = {}
    for d in node.devices:
        if d.parent is not None:
            slices.setdefault(d.parent, []).append(d)
    out = []
    for d in node.devices:
        if d.kind != "gpu" or d.parent is not None:
            continue
        mine, total = slices.get(d.id, []), d.memory_total_mb or 0.0
        if d.held:
            out.append(GpuUse(d, 1.0, total, 0.0, False))
        elif d.shares_booked > 0:
            out.append(GpuUse(d, d.shares_booked, d.memory_booked_mb, max(total - d.memory_booked_mb, 0.0), False))
        elif any(s.held for s in mine):
            weight = max(MIG_SLICES, sum(_mig_g(s.mig_profile) for s in mine))
            out.append(GpuUse(d, sum(_mig_g(s.mig_profile) for s in mine if s.held) / weight,
                              sum(s.memory_total_mb or 0.0 for s in mine if s.held),
                              sum(s.memory_total_mb or 0.0 for s in mine if not s.held), False))
        else:
            out.append(GpuUse(d, 0.0, 0.0, total, True))
    return out


def gpus_booked(usage: ClusterUsage) -> tuple[ClusterUsage, dict[str, float]]:
    """``usage`` with its GPUs counted as they are booked, and each node's GPU memory not booked.

    A GPU is free only when nothing of it is booked: not whole, not a fraction, not a MIG slice. Used counts a
    GPU held whole as 1, a fraction as its shares, MIG slices as their GPU-instance slices over 7 (over the sum
    of the GPU's slices when larger), as the simulator counts utilisation. Free GPU memory: a free GPU's memory,
    what fractions left of a shared one, the slices not booked of a GPU in MIG mode (none on a node that can
    take no GPU, e.g. not eligible)."""
    nodes = []
    memory_free: dict[str, float] = {}
    for n in usage.nodes:
        gpus = gpu_use(n)
        used = sum((g.used for g in gpus), 0.0)
        free_gpus = min(n.free.gpu_count, float(sum(g.untouched for g in gpus)))
        memory_free[n.name] = sum((g.memory_free_mb for g in gpus), 0.0) if n.schedulable.gpu_count > 0 else 0.0
        nodes.append(n.model_copy(update={"used": n.used.model_copy(update={"gpu_count": round(used, 6)}),
                                          "free": n.free.model_copy(update={"gpu_count": free_gpus})}))
    zero = Amounts()
    return usage.model_copy(update={"nodes": nodes, "used": sum((n.used for n in nodes), zero),
                                    "free": sum((n.free for n in nodes), zero)}), memory_free


def _mig_g(profile: str | None) -> int:
    match = _MIG_G.search(profile or "")
    return int(match.group(1)) if match else 1
