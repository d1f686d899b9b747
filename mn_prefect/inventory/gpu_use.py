"""What each NVIDIA GPU of this machine is doing now, through NVML (pynvml): its utilisation (percent of the last
sample period with a kernel running; None for a MIG slice, which NVML does not report) and the memory in use.
Read by the worker's device watch (``lifecycle.device_use``); an empty answer where there is no NVML."""

from __future__ import annotations

from typing import Any

from mn_prefect.model.device_use import DeviceUse

MB = 1024 * 1024


def sample() -> dict[str, DeviceUse]:
    """Each GPU and MIG slice by its UUID (the device id mn-prefect books): what it is doing now."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return {}
    out: dict[str, DeviceUse] = {}
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                out[_text(pynvml.nvmlDeviceGetUUID(handle))] = _use(pynvml, handle)
            except pynvml.NVMLError:
                continue
            out.update(_slices(pynvml, handle))
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return out


def _use(pynvml: Any, handle: Any) -> DeviceUse:
    try:
        percent: float | None = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError:
        percent = None
    return DeviceUse(percent=percent, memory_used_mb=pynvml.nvmlDeviceGetMemoryInfo(handle).used / MB)


def _slices(pynvml: Any, handle: Any) -> dict[str, DeviceUse]:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        if current != pynvml.NVML_DEVICE_MIG_ENABLE:
            return {}
        slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except pynvml.NVMLError:
        return {}
    out = {}
    for slot in range(slots):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            out[_text(pynvml.nvmlDeviceGetUUID(mig))] = _use(pynvml, mig)
        except pynvml.NVMLError:
            continue
    return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
