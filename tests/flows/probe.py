"""A flow that records what it was given (its MN_ environment, pid, timing) for the worker tests."""

import json
import os
import time
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

KEEP = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "MY_SETTING",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")


@flow(name="probe")
def probe(out_dir: str, seconds: float = 0.0, fail: bool = False, hold_until: str = "") -> str:
    run_id = str(flow_run.id)
    out = Path(out_dir)
    env = {k: v for k, v in os.environ.items() if k.startswith("MN_") or k in KEEP}
    (out / f"{run_id}.started").write_text(json.dumps({"pid": os.getpid(), "start": time.time()}))
    while hold_until and not Path(hold_until).exists():  # a barrier the test opens: runs overlap for sure
        time.sleep(0.1)
    time.sleep(seconds)
    record = {"run": run_id, "pid": os.getpid(), "env": env, "end": time.time(),
              "start": json.loads((out / f"{run_id}.started").read_text())["start"]}
    (out / f"{run_id}.json").write_text(json.dumps(record))
    if fail:
        raise RuntimeError("asked to fail")
    return run_id
