"""A run that notes when its process started and when its flow code began (the wake-ups benchmark)."""

import json
import os
import time
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run


def process_started() -> float:
    """This process's start (seconds since the epoch, 10 ms steps), from /proc: before Python and Prefect loaded."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # since boot
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


@flow(name="waited")
def waited(out_dir: str, seconds: float = 1.0) -> str:
    run_id = str(flow_run.id)
    record = {"process": process_started(), "flow": time.time()}
    (Path(out_dir) / f"{run_id}.started").write_text(json.dumps(record))
    time.sleep(seconds)
    return run_id
