"""Environment hints handed to a placed run (docs/resources.md, "Environment hints"), and reading them back inside the
run."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Literal, TypeVar, overload

from mn_prefect.model.envnames import env_suffix
from mn_prefect.model.placement import QUEUE_FIELDS, Placement

ALLOCATION_VAR = "MN_ALLOCATION_JSON"


ALLOCATION_KEYS = ("devices", "ports", "volumes", "runtime_driver")

_Value = TypeVar("_Value", bound=str | None)


def allocation_json(placement: Placement) -> str:
    """The allocation map as MirrorNeuron encodes it: ``devices``, ``ports``, ``volumes`` and ``runtime_driver``
    at the top level (bundle code reads ``devices`` there), with the placement's node, agent, resources and
    score beside them. Two compact JSON objects joined into one (every placement is planned with it: pydantic
    writes them without building the dicts first)."""
    queued = placement.queue is not None  # the queue fields only where a queue placed it
    outer = placement.model_dump_json(exclude=_QUEUED_EXCLUDED if queued else _EXCLUDED)
    return outer[:-1] + "," + placement.allocation.model_dump_json()[1:]  # both have fields: never "{}"


_QUEUED_EXCLUDED = {"env", "allocation"}  # never changed: pydantic only reads them
_EXCLUDED = {*_QUEUED_EXCLUDED, *QUEUE_FIELDS}


# The variables that say which GPUs a process may see. mn-prefect owns them (docs/drivers.md: no run sees what
# it did not book): a run that booked none of a vendor's GPUs gets them empty, and a user's value never wins.
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def env_hints(placement: Placement, *, in_container: bool = False) -> dict[str, str]:
    """All MN_* / *_VISIBLE_DEVICES variables for a placement. ``in_container``: the run sees only its own GPUs,
    renumbered from 0, so CUDA_VISIBLE_DEVICES names them by id (the NVIDIA UUID) instead of host index."""
    devices = placement.allocation.devices
    env = {
        ALLOCATION_VAR: allocation_json(placement),
        "MN_NODE": placement.node,
        "MN_ALLOCATED_DEVICE_IDS": ",".join(d.id for d in devices),
    }
    # CUDA takes no index for a MIG slice, only its MIG-... UUID (the slice's id).
    cuda = [d.id if in_container or d.parent is not None else str(d.index) for d in devices if d.driver == "cuda"]
    rocm = [str(d.index) for d in devices if d.driver == "rocm"]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(cuda)
    # CUDA numbers GPUs fastest first unless told otherwise; the host indices above are NVML's (PCI bus order), so
    # on a machine of mixed GPUs index 1 would be another GPU than the one booked.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["ROCR_VISIBLE_DEVICES"] = env["HIP_VISIBLE_DEVICES"] = ",".join(rocm)
    env.update(share_hints(placement, in_container=in_container))
    drivers = list(dict.fromkeys(d.driver for d in devices if d.driver))
    if drivers:
        env["MN_GPU_DRIVER"] = ",".join(drivers)
    for port in placement.allocation.ports:
        env[f"MN_PORT_{env_suffix(port.label)}"] = str(port.port)
    for volume in placement.allocation.volumes:
        name = env_suffix(volume.name)
        env[f"MN_VOLUME_{name}"] = volume.source
        env[f"MN_VOLUME_{name}_TARGET"] = volume.target
    return env


def share_hints(placement: Placement, *, in_container: bool = False) -> dict[str, str]:
    """A fractional GPU's hints (docs/resources.md, "Sharing GPUs"): the shares and memory booked, and the CUDA MPS
    limits that say the same to an MPS client. Without an MPS daemon these are limits the program must honour, not
    enforcement."""
    shares = placement.allocation.shares
    if not shares:
        return {}
    by_id = {d.id: d for d in placement.allocation.devices}
    position = {d.id: n for n, d in enumerate(placement.allocation.devices)}
    pinned = []
    for share in shares:
        device = by_id.get(share.id)
        index = position[share.id] if in_container else (device.index if device is not None else 0)
        pinned.append(f"{index}={int(share.memory_mb)}M")
    return {
        "MN_GPU_SHARES": ",".join(f"{s.shares:g}" for s in shares),
        "MN_GPU_MEMORY_MB": ",".join(f"{s.memory_mb:g}" for s in shares),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, math.floor(min(s.shares for s in shares) * 100 + 1e-9))),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(pinned),
    }


def merge_env(user_env: Mapping[str, _Value], hints: Mapping[str, str]) -> dict[str, _Value | str]:
    """User variables plus hints; a hint never replaces a user's variable other than the MN_ ones and the GPU
    visibility ones (``VISIBILITY_VARS``), which are mn-prefect's. A user's value may be None (Prefect's job
    env: the variable is unset); it is kept as it is."""
    merged: dict[str, _Value | str] = dict(user_env)
    for key, value in hints.items():
        if key.startswith("MN_") or key in VISIBILITY_VARS or key not in merged:
            merged[key] = value
    return merged


@overload
def allocation(environ: Mapping[str, str] | None = None, *, required: Literal[True] = True) -> Placement: ...
@overload
def allocation(environ: Mapping[str, str] | None = None, *, required: bool) -> Placement | None: ...
def allocation(environ: Mapping[str, str] | None = None, *, required: bool = True) -> Placement | None:
    """The allocation of the running flow or agent, read back from ``MN_ALLOCATION_JSON``.

    Raises RuntimeError when the variable is missing and ``required`` is true.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(ALLOCATION_VAR)
    if not text:
        if required:
            raise RuntimeError(f"{ALLOCATION_VAR} is not set: this run was not placed by mn-prefect")
        return None
    doc = json.loads(text)
    if "allocation" not in doc:  # the MirrorNeuron shape: the allocation's keys at the top level
        doc["allocation"] = {key: doc.pop(key) for key in ALLOCATION_KEYS if key in doc}
    return Placement.model_validate(doc)
