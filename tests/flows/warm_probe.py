"""A flow that records what its process sees (environment, working directory, sys.argv, sys.path, its module's
state, its parent, its process group) for the warm start tests; it can wait for a file and end with ``os._exit``."""

import json
import os
import sys
import time
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

STATE: list[int] = []


@flow(name="warm-probe")
def warm_probe(out_dir: str, hold_until: str = "", exit_code: int = 0) -> str:
    run_id = str(flow_run.id)
    STATE.append(len(STATE))
    cwd = os.getcwd()
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()

    def plain(value: str) -> str:
        return value.replace(cwd, "<cwd>").replace(run_id, "<run>")

    record = {"run": run_id, "pid": os.getpid(), "warm": "warm_launcher" in parent, "cwd": cwd,
              "env": {k: plain(v) for k, v in os.environ.items()}, "argv": [plain(a) for a in sys.argv],
              "path": [plain(p) for p in sys.path], "state": list(STATE), "main": sys.modules["__main__"].__spec__.name,
              "pgid": os.getpgid(0)}
    Path(out_dir, f"{run_id}.json").write_text(json.dumps(record))
    while hold_until and not Path(hold_until).exists():
        time.sleep(0.1)
    if exit_code:
        os._exit(exit_code)
    return run_id
