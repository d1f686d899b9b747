"""A volume flow: writes into the host path booked for it (MN_VOLUME_SCRATCH)."""

import os
from pathlib import Path

from prefect import flow, get_run_logger

import mn_prefect
from mn_prefect.decorators import requires


@requires(cpu=0.5, memory_mb=256, volumes=[{"name": "scratch", "source": "/tmp", "target": "/scratch", "mode": "rw"}])
@flow(name="scratch-writer")
def scratch_writer(text: str = "hello from mn-prefect") -> str:
    allocation = mn_prefect.allocation()
    folder = Path(os.environ["MN_VOLUME_SCRATCH"]) / "mn-prefect-examples"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{allocation.job_id}.txt"
    path.write_text(text)
    get_run_logger().info("wrote %s on %s (volume scratch, target %s)", path, allocation.node,
                          allocation.volume("scratch").target)
    return str(path)
