"""benchmarks/worker.py's first-line flow: ``numpy_first`` imports numpy (a stand-in for a heavy ML import) as its
first line and writes when that line was done (wall clock) to ``$MN_BENCH_PROBE_DIR/<flow run id>.json``; the
benchmark sets its run's Submitting time (the worker starting the flow process) against it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prefect import flow


@flow(name="numpy-first")
def numpy_first(i: int = 0) -> int:
    import numpy  # noqa: F401  # already imported in a warm launcher started with preload ["numpy"]

    done = time.time()
    folder = Path(os.environ["MN_BENCH_PROBE_DIR"])
    target = folder / f"{os.environ['PREFECT__FLOW_RUN_ID']}.json"
    target.with_suffix(".tmp").write_text(json.dumps({"first_line": done}))
    target.with_suffix(".tmp").replace(target)
    return i
