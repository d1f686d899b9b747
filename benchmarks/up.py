"""How long ``mn-prefect up`` takes to be ready: a Prefect server, three workers, the pool and the deployments.

Each run is ``mn-prefect up --runs 0 --exit-when-done --port 0`` with no Prefect server configured and no Docker
daemon, all in one lab home, as a user's ``up`` after ``up``: the first run creates the lab (the Prefect server's
SQLite database, with its migrations, and the store), the later ones reuse it, as ``up`` does. Each line ``up`` prints is timed as it arrives; the phases are the times since the command
started at which it printed that the server was up, that the three workers were registered, and that every
deployment was made (the lab is ready: runs can be started), and when the whole command (with its stop) ended.

Usage: python benchmarks/up.py [--runs 3] [--json] [--write BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import markdown_table, print_rows, provenance, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MN_PREFECT = str(Path(sys.executable).parent / "mn-prefect")
PHASES = {"server": "Prefect server up at", "workers": "  node gpu-2:", "ready": "deployed "}


def one_run(number: int, home: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MN_"))}
    env.update({"MN_PREFECT_HOME": home, "PREFECT_HOME": f"{home}/prefect-client",
                "DOCKER_HOST": f"unix://{home}/no-docker.sock", "COLUMNS": "200"})
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    seen: dict[str, float] = {}
    proc = subprocess.Popen([MN_PREFECT, "up", "--runs", "0", "--exit-when-done", "--port", "0"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        for phase, mark in PHASES.items():
            if phase not in seen and line.startswith(mark):
                seen[phase] = time.monotonic() - start
    proc.wait()
    total = time.monotonic() - start
    missing = [p for p in PHASES if p not in seen]
    if proc.returncode != 0 or missing:
        raise SystemExit(f"run {number}: `up` exited {proc.returncode}; never printed {missing}")
    return {"run": number, "lab": "new" if number == 1 else "reused", **{f"{p}_s": round(seen[p], 1) for p in PHASES},
            "with_stop_s": round(total, 1), "load_1min_before": round(load_before, 2)}


def markdown(rows: list[dict]) -> str:
    table = markdown_table(["run", "lab home", "server up s", "3 workers s", "ready s", "up to stopped s",
                            "load before"],
                           [[r["run"], r["lab"], r["server_s"], r["workers_s"], r["ready_s"], r["with_stop_s"],
                             r["load_1min_before"]] for r in rows])
    return "\n".join([provenance("up.py", f"{os.cpu_count()} cores"), "", *table])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", help="replace the up-ready section of this markdown file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mn-up-bench-") as home:
        rows = [one_run(n, home) for n in range(1, args.runs + 1)]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_rows("mn-prefect up: seconds to each phase", rows)
    if args.write:
        write_section(args.write, "up-ready", markdown(rows))


if __name__ == "__main__":
    main()
