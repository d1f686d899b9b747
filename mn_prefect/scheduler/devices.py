"""Device selection: filter a node's free devices per request, then best fit (docs/scheduling.md, docs/resources.md).

A device is booked whole (a GPU, or a MIG slice, which is a device of its own), or a GPU is shared by
fractional bookings. Besides the exclusive claim on every device held whole, a booking takes amounts of
per-device dimensions, which the store applies like CPU or memory (under a ceiling, atomically):

- ``share:<gpu>`` (ceiling 1): a whole booking takes 1, a fraction its shares. So a GPU with a fraction
  booked cannot be booked whole, nor the reverse, and fractions add up to at most one GPU.
- ``gmem:<gpu>`` (ceiling the GPU's memory): a fraction's memory.
- ``mig:<gpu>`` (ceiling ``MIG_WHOLE``): a slice takes 1 on its parent, a whole booking of a GPU in MIG mode
  takes ``MIG_WHOLE``. So a GPU with a slice booked cannot be booked whole, nor the reverse.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mn_prefect.model.node import Device
from mn_prefect.model.placement import Allocation, DeviceShare
from mn_prefect.model.resources import DeviceRequest
from mn_prefect.model.scalars import MAX_QUANTITY
from mn_prefect.scheduler.constraints import version_key

SHARE = "share:"
GPU_MEMORY = "gmem:"
MIG = "mig:"
# What a whole booking of a GPU in MIG mode takes of its ``mig:`` dimension: more than it has slices.
MIG_WHOLE = 1024.0
EPSILON = 1e-9
_NOTHING: dict[str, float] = {}


def _memory(device: Device) -> float | None:
    return device.memory_free_mb if device.memory_free_mb is not None else device.memory_total_mb


def matches(request: DeviceRequest, device: Device, *, check_ids: bool = True) -> bool:
    """Whether ``device`` satisfies every filter of ``request`` (vendor/driver case-insensitive), bookings aside."""
    if device.kind != request.kind:
        return False
    if request.mig_profile is not None:
        if device.parent is None or device.mig_profile != request.mig_profile:
            return False
    elif device.parent is not None or device.mig_mode:
        # A request without mig_profile never gets a slice, nor a GPU in MIG mode: CUDA cannot hand that GPU to a
        # process whole (naming it in CUDA_VISIBLE_DEVICES gives at most one of its slices), only slice by slice.
        return False
    if request.shares is not None and (device.mig_mode or _fraction_memory(request, device) is None):
        return False
    if request.vendor is not None and device.vendor != request.vendor:
        return False
    if request.driver is not None and device.driver != request.driver:
        return False
    if check_ids and request.ids and device.id not in request.ids:
        return False
    if request.capabilities and not set(request.capabilities).issubset(device.capabilities):
        return False
    if request.min_memory_mb is not None:
        memory = _memory(device)
        if memory is None:
            return False
        op, want = request.memory_operator, request.min_memory_mb
        if not (memory > want if op == ">" else memory == want if op == "==" else memory >= want):
            return False
    if request.min_api_version is not None:
        if device.api_version is None:
            return False
        have, wanted = version_key(device.api_version), version_key(request.min_api_version)
        version_op = request.api_version_operator
        ok = {">": have > wanted, ">=": have >= wanted, "==": have == wanted, "<": have < wanted,
              "<=": have <= wanted}[version_op]
        if not ok:
            return False
    return True


def _fraction_memory(request: DeviceRequest, device: Device) -> float | None:
    """The GPU memory a fractional request books on ``device``; None when the device cannot hold it."""
    total = device.memory_total_mb
    if total is None:
        return None if request.memory_mb else 0.0
    memory = request.memory_mb if request.memory_mb is not None else (request.shares or 0.0) * total
    return memory if memory <= total + EPSILON else None


def device_amounts(allocation: Allocation) -> dict[str, float]:
    """The per-device dimensions a placement's devices take (see the module docstring)."""
    return amounts_of(allocation.devices, allocation.shares)


def amounts_of(devices: Sequence[Device], shares: Sequence[DeviceShare]) -> dict[str, float]:
    """``device_amounts`` of an allocation's devices and shares (the view books a choice without building one)."""
    amounts: dict[str, float] = {}
    shared = {s.id for s in shares}
    for device in devices:
        if device.id not in shared:
            for dim, amount in _held_whole_amounts(device):
                amounts[dim] = amounts.get(dim, 0.0) + amount
    for share in shares:
        amounts[SHARE + share.id] = amounts.get(SHARE + share.id, 0.0) + share.shares
        amounts[GPU_MEMORY + share.id] = amounts.get(GPU_MEMORY + share.id, 0.0) + share.memory_mb
    return amounts


def _held_whole_amounts(device: Device) -> tuple[tuple[str, float], ...]:
    """What holding ``device`` whole takes: a slice, one of its parent's ``mig:``; a GPU, all its ``share:`` (and
    all its ``mig:`` when in MIG mode)."""
    if device.parent is not None:
        return ((MIG + device.parent, 1.0),)
    if device.mig_mode:
        return ((SHARE + device.id, 1.0), (MIG + device.id, MIG_WHOLE))
    return ((SHARE + device.id, 1.0),)


def held_whole(allocation: Allocation) -> list[str]:
    """The ids a placement holds exclusively: every device but the shared GPUs."""
    return whole_ids(allocation.devices, allocation.shares)


def whole_ids(devices: Sequence[Device], shares: Sequence[DeviceShare]) -> list[str]:
    """``held_whole`` of an allocation's devices and shares."""
    if not shares:
        return [d.id for d in devices]
    shared = {s.id for s in shares}
    return [d.id for d in devices if d.id not in shared]


def device_ceiling(dim: str, devices: Mapping[str, Device]) -> float:
    """The most a per-device dimension may reach on the node whose devices are ``devices`` (by id)."""
    if dim.startswith(SHARE):
        return 1.0
    if dim.startswith(MIG):
        return MIG_WHOLE
    device = devices.get(dim[len(GPU_MEMORY):])
    total = device.memory_total_mb if device is not None else None
    return total if total is not None else MAX_QUANTITY


@dataclass(slots=True)
class Picked:
    """The devices chosen for a node's requests: all of them in ``devices``, the shared ones also in ``shares``."""

    devices: list[Device] = field(default_factory=list)
    shares: list[DeviceShare] = field(default_factory=list)
    leftover: float = 0.0  # GPU memory the memory-sized requests leave unbooked: the smaller, the better the fit


class _Free:
    """What is free on a node while a plan's requests take devices one after another."""

    def __init__(self, held: Container[str], used: Mapping[str, float]):
        self.held = held
        self.used = used
        self.taken: set[str] = set()
        self.added: dict[str, float] = {}

    def amount(self, dim: str) -> float:
        return self.used.get(dim, 0.0) + self.added.get(dim, 0.0)

    def is_held(self, device_id: str) -> bool:
        return device_id in self.taken or device_id in self.held

    def whole(self, device: Device) -> bool:
        """Free to be held whole: a GPU with no fraction and no slice booked, a slice whose parent is not held."""
        if self.is_held(device.id):
            return False
        if device.parent is not None:
            return not self.is_held(device.parent)
        return self.amount(SHARE + device.id) <= EPSILON and self.amount(MIG + device.id) <= EPSILON

    def room(self, request: DeviceRequest, device: Device) -> float | None:
        """The GPU memory a fraction leaves unbooked on ``device``; None when it does not fit there now."""
        memory = _fraction_memory(request, device)
        if memory is None or self.is_held(device.id):
            return None
        shares = request.shares or 0.0
        if self.amount(SHARE + device.id) + shares > 1.0 + EPSILON:
            return None
        total = device.memory_total_mb if device.memory_total_mb is not None else MAX_QUANTITY
        left = total - self.amount(GPU_MEMORY + device.id) - memory
        return left if left >= -EPSILON else None

    def take(self, device: Device) -> None:
        self.taken.add(device.id)
        for dim, amount in _held_whole_amounts(device):
            self.added[dim] = self.added.get(dim, 0.0) + amount

    def share(self, request: DeviceRequest, device: Device) -> DeviceShare:
        memory = _fraction_memory(request, device) or 0.0
        share = DeviceShare(id=device.id, shares=request.shares or 0.0, memory_mb=memory)
        for dim, amount in ((SHARE + device.id, share.shares), (GPU_MEMORY + device.id, memory)):
            self.added[dim] = self.added.get(dim, 0.0) + amount
        return share


def _whole_key(device: Device, free: _Free) -> tuple[float, float, str]:
    # Best fit: the smallest sufficient device first (least memory left over), so big devices stay free for big
    # asks; slices first on a GPU that already has slices booked, keeping whole GPUs whole. Ties by id.
    memory = _memory(device)
    fragmented = 0.0 if device.parent is not None and free.amount(MIG + device.parent) > 0 else 1.0
    return (fragmented, memory if memory is not None else 0.0, device.id)


def matching(request: DeviceRequest, devices: list[Device]) -> tuple[int, ...]:
    """Positions of the devices that match ``request`` apart from its ids: the same for every node of a class
    (their devices differ only in ids), so a view computes it once per class and request."""
    return tuple(n for n, device in enumerate(devices) if matches(request, device, check_ids=False))


def pick_devices(
    requests: Iterable[DeviceRequest],
    devices: list[Device],
    held: Container[str] = frozenset(),
    used: Mapping[str, float] = _NOTHING,
    *,
    check_ids: bool = True,
    positions: list[tuple[int, ...]] | None = None,
) -> tuple[Picked | None, DeviceRequest | None, int]:
    """Choose devices for each request in turn, given the ids ``held`` whole and the per-device dimensions
    ``used`` on the node. ``positions``, per request, the result of ``matching`` (saves the filters).

    Returns (picked, None, 0) on success, or (None, failing_request, how many matching devices were free).
    """
    picked = Picked()
    free = _Free(held, used)
    for k, request in enumerate(requests):
        if positions is None:
            candidates = [d for d in devices if matches(request, d, check_ids=check_ids)]
        else:
            candidates = [devices[n] for n in positions[k]]
            if check_ids and request.ids:
                candidates = [d for d in candidates if d.id in request.ids]
        if request.shares is not None:
            best: tuple[float, str, Device] | None = None
            for device in candidates:
                room = free.room(request, device)
                if room is not None and (best is None or (room, device.id) < best[:2]):
                    best = (room, device.id, device)
            if best is None:
                return None, request, 0
            picked.leftover += best[0]
            picked.devices.append(best[2])
            picked.shares.append(free.share(request, best[2]))
            continue
        free_now = sorted((d for d in candidates if free.whole(d)), key=lambda d: _whole_key(d, free))
        if len(free_now) < request.count:
            return None, request, len(free_now)
        for device in free_now[: request.count]:
            picked.devices.append(device)
            free.take(device)
            if request.min_memory_mb is not None:
                picked.leftover += (_memory(device) or 0.0) - request.min_memory_mb
    return picked, None, 0


def fits_by_memory(requests: Iterable[DeviceRequest]) -> bool:
    """Whether device fit ranks nodes for these requests: fractions, and whole GPUs with a memory minimum."""
    return any(r.shares is not None or r.min_memory_mb is not None for r in requests)


def describe(request: DeviceRequest) -> str:
    parts = [f"{request.kind} x{request.count}"]
    if request.mig_profile is not None:
        parts.append(f"mig_profile={request.mig_profile}")
    if request.shares is not None:
        parts.append(f"shares={request.shares:g}")
    if request.memory_mb is not None:
        parts.append(f"memory_mb={request.memory_mb:g}")
    for key in ("vendor", "driver"):
        if getattr(request, key):
            parts.append(f"{key}={getattr(request, key)}")
    if request.min_memory_mb is not None:
        parts.append(f"memory{request.memory_operator}{request.min_memory_mb:g}MB")
    if request.min_api_version is not None:
        parts.append(f"api{request.api_version_operator}{request.min_api_version}")
    if request.capabilities:
        parts.append("capabilities=" + "+".join(request.capabilities))
    if request.ids:
        parts.append("ids=" + ",".join(request.ids))
    return " ".join(parts)
