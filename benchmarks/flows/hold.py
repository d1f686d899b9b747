"""A run that holds its node for a while and notes where and when it started (the recovery benchmark)."""

import json
import os
import time
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run


@flow(name="hold")
def hold(out_dir: str, seconds: float = 10.0) -> str:
    run_id = str(flow_run.id)
    started = Path(out_dir) / f"{run_id}.{os.environ.get('MN_NODE', 'unknown')}.started"
    started.write_text(json.dumps({"pid": os.getpid(), "start": time.time()}))
    time.sleep(seconds)
    return run_id
