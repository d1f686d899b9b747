"""The mn worker against Prefect's process worker: the same short flow runs through three workers of each.

For each worker type: a fresh local Prefect server, one pool, three workers each started with the same
``--limit`` (mn workers with mock inventories: two GPU nodes and a CPU node), one deployment of benchmarks/flows/short.py, N runs created at
once. Reports median and p95 scheduled-to-running latency (the run's expected start to its start time) and
the makespan (first expected start to last end), side by side.

Usage: python benchmarks/worker.py [--runs 60] [--json] [--write BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from api import deploy_short, request  # noqa: E402
from report import markdown_table, provenance, report, write_section  # noqa: E402

from mn_prefect.local_lab import BIN, PrefectServer, start_worker, stop_process  # noqa: E402

NODES = json.loads((ROOT / "deployments" / "mock-nodes.json").read_text())
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def measure(kind: str, runs: int, limit: int, progress, task) -> dict:
    home = Path(tempfile.mkdtemp(prefix=f"mn-bench-{kind}-"))
    server = PrefectServer(home / "prefect")
    workers = []
    try:
        pool = f"bench-{kind}"
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", pool, "--type", kind], env=server.env,
                       check=True, capture_output=True)
        for i in range(3):
            if kind == "mn":
                workers.append(start_worker(server.env, pool, NODES[i], f"sqlite:///{home / 'state.db'}", home,
                                            limit=limit))
            else:
                log = open(home / f"worker-{i}.log", "w")
                workers.append(subprocess.Popen(
                    [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process", "--name", f"p{i}",
                     "--limit", str(limit)],
                    env={**server.env, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "0"},
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        client = httpx.Client(base_url=server.api_url, timeout=30)
        deadline = time.monotonic() + 60
        while len(request(client, "POST", "/workers/filter".replace("/workers", f"/work_pools/{pool}/workers"),
                           json={}).json()) < 3:
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not come up")
            time.sleep(0.5)
        # The mn runs ask for one core each and spread, so they use all three workers as the process pool does.
        job_variables = {"resources": {"cpu": 1}, "strategy": "spread"} if kind == "mn" else {}
        deployment = deploy_short(server.env, pool, "short", job_variables)
        ids = [request(client, "POST", f"/deployments/{deployment}/create_flow_run", json={"parameters": {"i": i}})
               .json()["id"] for i in range(runs)]
        done: dict[str, dict] = {}
        while len(done) < runs:
            for run_id in ids:
                if run_id in done:
                    continue
                data = request(client, "GET", f"/flow_runs/{run_id}").json()
                if data["state"]["type"] in TERMINAL:
                    done[run_id] = data
                    progress.advance(task)
            time.sleep(0.5)
        latencies = [_ts(r["start_time"]) - _ts(r["expected_start_time"]) for r in done.values() if r["start_time"]]
        first = min(_ts(r["expected_start_time"]) for r in done.values())
        last = max(_ts(r["end_time"]) for r in done.values() if r["end_time"])
        completed = sum(r["state"]["type"] == "COMPLETED" for r in done.values())
        return {"worker": kind, "runs": runs, "completed": completed,
                "median_s": round(statistics.median(latencies), 2),
                "p95_s": round(sorted(latencies)[max(0, int(len(latencies) * 0.95) - 1)], 2),
                "makespan_s": round(last - first, 2)}
    finally:
        for worker in workers:
            stop_process(worker)
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--limit", type=int, default=4, help="concurrent runs per worker (both kinds)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write")
    args = parser.parse_args()
    rows = []
    with Progress(transient=True) as progress:
        for kind in ("process", "mn"):
            task = progress.add_task(f"{kind} workers", total=args.runs)
            rows.append(measure(kind, args.runs, args.limit, progress, task))
    process, mn = rows
    ratio = {"median": round(mn["median_s"] / max(process["median_s"], 1e-9), 2),
             "p95": round(mn["p95_s"] / max(process["p95_s"], 1e-9), 2),
             "makespan": round(mn["makespan_s"] / max(process["makespan_s"], 1e-9), 2)}
    report(args, f"{args.runs} short runs, three workers each, --limit {args.limit}", rows, "mn_over_process", ratio)
    if args.write:
        lines = markdown_table(
            ["worker", "runs", "completed", "median scheduled-to-running s", "p95 s", "makespan s"],
            [list(r.values()) for r in rows]
            + [["**mn / process**", "", "", f"**{ratio['median']}x**", f"**{ratio['p95']}x**",
                f"**{ratio['makespan']}x**"]])
        body = provenance("worker.py") + "\n\n" + "\n".join(lines)
        write_section(args.write, "worker", body)


if __name__ == "__main__":
    main()
