"""NVIDIA GPUs through NVML (the nvidia-ml-py package). No library or no driver means no devices."""

from __future__ import annotations

import logging

from mn_prefect.model.node import Device

log = logging.getLogger(__name__)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


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


def detect_nvidia() -> list[Device]:
    """Every NVIDIA GPU NVML reports; devices NVML cannot describe are skipped with a warning."""
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
            devices.append(Device(
                id=uuid, index=index, kind="gpu", vendor="nvidia", driver="cuda", model=name,
                memory_total_mb=round(memory.total / 2**20, 1), memory_free_mb=round(memory.free / 2**20, 1),
                api_version=api_version, capabilities=caps,
            ))
    except pynvml.NVMLError as error:
        log.warning("NVML device query failed (%s): no NVIDIA devices", error)
        devices = []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return devices
