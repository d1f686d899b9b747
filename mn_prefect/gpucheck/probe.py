"""The flow each placed run of the GPU check executes: it writes what it was booked and what it can see."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prefect import flow

from mn_prefect.gpucheck.visibility import observe
from mn_prefect.model.hints import ALLOCATION_VAR

SHARE_VARS = ("MN_GPU_SHARES", "MN_GPU_MEMORY_MB", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
              "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")


@flow(name="mn-gpu-probe")
def gpu_probe(out_dir: str, label: str, hold_until: str = "") -> str:
    """Writes ``<label>.started`` at once, waits while ``hold_until`` names a file that does not exist yet (so the
    check can hold several runs at the same time), then writes ``<label>.json``: the allocation the worker handed
    it and both views of the GPUs from inside this process."""
    out = Path(out_dir)
    (out / f"{label}.started").write_text(str(time.time()))
    while hold_until and not Path(hold_until).exists():
        time.sleep(0.1)
    allocation = json.loads(os.environ.get(ALLOCATION_VAR) or "{}")
    record = {
        "label": label,
        "node": os.environ.get("MN_NODE"),
        "booked": [d["id"] for d in allocation.get("devices", []) if d.get("driver") == "cuda"],
        "shares": {name: os.environ[name] for name in SHARE_VARS if name in os.environ},
        **observe(),
    }
    (out / f"{label}.json").write_text(json.dumps(record))
    return label
