"""What this process can see of the machine's NVIDIA GPUs, read two ways.

- **CUDA** (the driver API in ``libcuda.so.1``, through ctypes): the devices a CUDA program started here would get,
  after ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` have done their work, each named by its UUID. This is the
  answer to "which GPUs can this run use".
- **NVML** (``libnvidia-ml.so.1``, through pynvml): every GPU and MIG slice the driver shows this process. NVML does
  not read ``CUDA_VISIBLE_DEVICES``: a plain process sees every GPU of the machine, a container only those it was
  given.

Neither needs a CUDA toolkit or a framework: only the driver's own libraries.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

CUDA_LIBRARY = "libcuda.so.1"
CUDA_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
CUDA_ERROR_NO_DEVICE = 100


class CudaError(RuntimeError):
    pass


def format_uuid(raw: bytes, prefix: str = "GPU") -> str:
    """NVIDIA's text form of a 16-byte device UUID (``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``), as NVML writes it."""
    h = raw.hex()
    return f"{prefix}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _check(result: int, call: str) -> None:
    if result != 0:
        raise CudaError(f"{call} returned CUDA error {result}")


def cuda_devices() -> list[str]:
    """The UUIDs of the devices CUDA enumerates in this process, in CUDA's order. A MIG slice is named
    ``MIG-...`` (``cuDeviceGetUuid_v2``, where the driver has it). Raises CudaError when the driver cannot be
    loaded or initialised."""
    try:
        lib = ctypes.CDLL(CUDA_LIBRARY)
    except OSError as error:
        raise CudaError(f"cannot load {CUDA_LIBRARY}: {error}") from error
    result = lib.cuInit(0)
    if result == CUDA_ERROR_NO_DEVICE:  # what the driver answers when CUDA_VISIBLE_DEVICES leaves it none
        return []
    _check(result, "cuInit")
    count = ctypes.c_int(0)
    _check(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
    uuids = []
    for ordinal in range(count.value):
        device = ctypes.c_int(0)
        _check(lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
        raw = ctypes.create_string_buffer(16)
        _check(get_uuid(raw, device), "cuDeviceGetUuid")
        uuids.append(format_uuid(raw.raw))
    return uuids


def nvml_devices() -> list[dict[str, Any]]:
    """Every GPU and MIG slice NVML shows this process: ``{"uuid", "index", "parent"}`` (parent: the GPU's UUID
    for a slice). Raises RuntimeError when NVML cannot be used."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        raise RuntimeError(f"NVML: {error}") from error
    found: list[dict[str, Any]] = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            found.append({"uuid": uuid, "index": index, "parent": None})
            try:
                current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
                slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle) if current else 0
            except pynvml.NVMLError:
                slots = 0
            for slot in range(slots):
                try:
                    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except pynvml.NVMLError:
                    continue
                found.append({"uuid": _text(pynvml.nvmlDeviceGetUUID(mig)), "index": index, "parent": uuid})
    finally:
        pynvml.nvmlShutdown()
    return found


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def same_uuid(a: str, b: str) -> bool:
    """Whether two UUIDs name one device. CUDA's 16 bytes say nothing of the kind of device, so a MIG slice read
    through CUDA comes out ``GPU-...`` where NVML writes ``MIG-...``: compare what follows the prefix."""
    return a.split("-", 1)[-1].lower() == b.split("-", 1)[-1].lower()


def observe() -> dict[str, Any]:
    """Both views of this process, and the variables that shaped them; a view that failed carries its error. A
    device both views know is named as NVML names it (a slice ``MIG-...``)."""
    seen: dict[str, Any] = {"env": {name: os.environ.get(name) for name in CUDA_VARS}}
    try:
        seen["cuda"] = {"uuids": cuda_devices()}
    except CudaError as error:
        seen["cuda"] = {"error": str(error)}
    try:
        seen["nvml"] = {"devices": nvml_devices()}
    except (RuntimeError, ImportError) as error:
        seen["nvml"] = {"error": str(error)}
    names = [d["uuid"] for d in seen["nvml"].get("devices", [])]
    if "uuids" in seen["cuda"]:
        seen["cuda"]["uuids"] = [next((n for n in names if same_uuid(n, u)), u) for u in seen["cuda"]["uuids"]]
    return seen
