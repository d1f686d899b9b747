"""NVIDIA GPUs and their MIG slices through NVML (the nvidia-ml-py package). No library or no driver means no
devices."""

from __future__ import annotations

import logging
import math
from typing import Any

from mn_prefect.model.node import Device

log = logging.getLogger(__name__)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _mb(size_bytes: int) -> float:
    return round(size_bytes / 2**20, 1)


def capabilities_for(major: int, minor: int) -> list[str]:
    """Capability labels from the CUDA compute capability (what a request's ``capabilities`` names)."""
    cc = (major, minor)
    caps = [f"sm_{major}{minor}"]
    if cc >= (5, 3):
        caps.append("fp16")
    if cc >= (8, 0):
        caps += ["bf16", "tf32"]
    if cc >= (8, 9):
        caps.append("fp8")
    return caps


def mig_profile_name(gpu_slices: int, memory_mb: int, compute_slices: int) -> str:
    """NVIDIA's name for a MIG device: ``<gpu slices>g.<memory GB>gb``, memory (MiB) rounded up to whole GiB
    (9984 -> ``1g.10gb``); a device with only part of its GPU instance's compute is ``<compute slices>c.`` that."""
    name = f"{gpu_slices}g.{math.ceil(memory_mb / 1024)}gb"
    return name if compute_slices >= gpu_slices else f"{compute_slices}c.{name}"


def _mig_enabled(pynvml: Any, handle: Any) -> bool:
    """Whether the GPU's current MIG mode is on; a GPU without MIG support (an NVML error) is not in MIG mode."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:
        return False
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


def _mig_slices(pynvml: Any, handle: Any, gpu: Device) -> list[Device]:
    """The MIG slices of ``gpu`` (in MIG mode), each a device of its own; one NVML cannot describe is skipped."""
    try:
        slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except pynvml.NVMLError as error:
        log.warning("NVML could not count the MIG slices of GPU %d (%s): none reported", gpu.index, error)
        return []
    slices: list[Device] = []
    for slot in range(slots):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            uuid = _text(pynvml.nvmlDeviceGetUUID(mig))
            memory = pynvml.nvmlDeviceGetMemoryInfo(mig)
            attributes = pynvml.nvmlDeviceGetAttributes(mig)
        except pynvml.NVMLError_NotFound:
            continue  # no slice at this index: slices need not be numbered contiguously
        except pynvml.NVMLError as error:
            log.warning("NVML could not describe MIG slice %d of GPU %d (%s): skipped", slot, gpu.index, error)
            continue
        profile = mig_profile_name(attributes.gpuInstanceSliceCount, attributes.memorySizeMB,
                                   attributes.computeInstanceSliceCount)
        slices.append(Device.model_validate({
            **gpu.model_dump(), "id": uuid, "mig_mode": False, "parent": gpu.id, "mig_profile": profile,
            "memory_total_mb": _mb(memory.total), "memory_free_mb": _mb(memory.free),
        }))
    return slices


def detect_nvidia() -> list[Device]:
    """Every NVIDIA GPU NVML reports, and the slices of those in MIG mode; devices NVML cannot describe are
    skipped with a warning."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return []
    except pynvml.NVMLError as error:
        log.warning("NVML present but failed to initialise (%s): no NVIDIA devices", error)
        return []
    devices: list[Device] = []
    try:
        try:
            raw = pynvml.nvmlSystemGetCudaDriverVersion()
            api_version = f"{raw // 1000}.{(raw % 1000) // 10}"
        except pynvml.NVMLError:
            api_version = None
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                name = _text(pynvml.nvmlDeviceGetName(handle))
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                try:
                    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
                    caps = capabilities_for(major, minor)
                except pynvml.NVMLError:
                    caps = []
            except pynvml.NVMLError as error:
                log.warning("NVML could not describe GPU %d (%s): skipped", index, error)
                continue
            gpu = Device(
                id=uuid, index=index, kind="gpu", vendor="nvidia", driver="cuda", model=name,
                memory_total_mb=_mb(memory.total), memory_free_mb=_mb(memory.free),
                api_version=api_version, capabilities=caps, mig_mode=_mig_enabled(pynvml, handle),
            )
            devices.append(gpu)
            if gpu.mig_mode:
                devices += _mig_slices(pynvml, handle, gpu)
    except pynvml.NVMLError as error:
        log.warning("NVML device query failed (%s): no NVIDIA devices", error)
        devices = []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return devices
