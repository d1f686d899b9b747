"""Device selection: filter a node's free devices per request, then best fit (SPEC section 5)."""

from __future__ import annotations

from collections.abc import Iterable

from mn_prefect.model.node import Device
from mn_prefect.model.resources import DeviceRequest
from mn_prefect.scheduler.constraints import version_key


def _memory(device: Device) -> float | None:
    return device.memory_free_mb if device.memory_free_mb is not None else device.memory_total_mb


def matches(request: DeviceRequest, device: Device, *, check_ids: bool = True) -> bool:
    """Whether ``device`` satisfies every filter of ``request`` (vendor/driver case-insensitive)."""
    if device.kind != request.kind:
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


def _fit_key(device: Device) -> tuple[float, str]:
    # Best fit: the smallest sufficient device first, so big devices stay free for big asks; ties by id.
    memory = _memory(device)
    return (memory if memory is not None else 0.0, device.id)


def pick_devices(
    requests: Iterable[DeviceRequest],
    devices: list[Device],
    held: set[str] | frozenset[str] = frozenset(),
    *,
    check_ids: bool = True,
) -> tuple[list[Device] | None, DeviceRequest | None, int]:
    """Choose devices for each request in turn.

    Returns (chosen, None, 0) on success, or (None, failing_request, matching_free_count).
    """
    chosen: list[Device] = []
    taken = set(held)
    for request in requests:
        candidates = sorted((d for d in devices if d.id not in taken and matches(request, d, check_ids=check_ids)),
                            key=_fit_key)
        if len(candidates) < request.count:
            return None, request, len(candidates)
        for device in candidates[: request.count]:
            chosen.append(device)
            taken.add(device.id)
    return chosen, None, 0


def describe(request: DeviceRequest) -> str:
    parts = [f"{request.kind} x{request.count}"]
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
