"""Per-step overhead of a bundle run against a plain Prefect flow running the same three subprocesses.

Both run in this process against one local Prefect server (started here): the bundle as `mn-bundle-run` on
demo_dag_linear with --local's own SQLite store (each step placed, booked, staged, run, released), the plain
flow as three Prefect tasks each running the same worker.py with the same input files. Overhead per step =
(wall time - the workers' own time) / 3.

    python benchmarks/bundle.py --runs 10 --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from report import print_rows, provenance, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "examples" / "bundles" / "demo_dag_linear"
# The same program the bundle's `python3.11` resolves to (a pyenv shim costs ~100 ms a start on both sides).
PYTHON = shutil.which("python3.11") or sys.executable


def plain_flow(workdir: Path):
    from prefect import flow, task

    @task(name="plain-step")
    def step(name: str) -> float:
        started = time.perf_counter()
        subprocess.run([PYTHON, "worker.py"], cwd=workdir, capture_output=True, check=True,
                       env={**os.environ, "MN_WORKFLOW_STEP_ID": name, "MN_DEMO_ID": "demo_dag_linear"})
        return time.perf_counter() - started

    @flow(name="plain-three-steps")
    def three() -> float:
        return sum(step(n) for n in ("parse", "score", "report"))

    return three


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--write", help="BENCHMARKS.md to update")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="mn-bench-bundle-"))
    from mn_prefect.local_lab import PrefectServer

    server = PrefectServer(home / "prefect")
    os.environ.update({"PREFECT_API_URL": server.api_url, "MN_PREFECT_HOME": str(home / "mn"),
                       "PREFECT_LOGGING_LEVEL": "WARNING"})
    try:
        from mn_prefect.bundles.flows import bundle_run, local_store_url

        work = home / "plain"
        work.mkdir()
        (work / "worker.py").write_text((BUNDLE / "payloads" / "worker" / "worker.py").read_text())
        (work / "run_store.py").write_text((BUNDLE / "payloads" / "worker" / "run_store.py").read_text())
        plain = plain_flow(work)
        rows = {"plain": [], "bundle": []}
        for i in range(args.runs + 1):  # the first round warms imports and the server's caches
            started = time.perf_counter()
            own = plain()
            plain_total = time.perf_counter() - started
            started = time.perf_counter()
            out = bundle_run(str(BUNDLE), runs_root=str(home / "runs"), store_url=local_store_url())
            bundle_total = time.perf_counter() - started
            job = json.loads((Path(out["run_dir"]) / "mn_job.json").read_text())
            assert job["status"] == "completed", job
            if i:
                rows["plain"].append((plain_total, own))
                rows["bundle"].append((bundle_total, own))
        table = []
        for kind, samples in rows.items():
            totals = [t for t, _ in samples]
            overhead = [(t - w) / 3 * 1000 for t, w in samples]
            table.append({"flow": kind, "runs": len(samples), "median total s": round(statistics.median(totals), 3),
                          "median overhead per step ms": round(statistics.median(overhead), 1),
                          "p95 overhead per step ms": round(sorted(overhead)[int(0.95 * (len(overhead) - 1))], 1)})
        ratio = table[1]["median overhead per step ms"] / table[0]["median overhead per step ms"]
        print_rows("bundle run vs plain Prefect flow (3 steps)", table)
        print(f"per-step overhead ratio bundle/plain: {ratio:.2f} (target <= 1.5)")
        if args.write:
            lines = ["| flow | runs | median total s | median overhead per step ms | p95 overhead per step ms |",
                     "| --- | ---: | ---: | ---: | ---: |"]
            lines += [f"| {r['flow']} | {r['runs']} | {r['median total s']} | {r['median overhead per step ms']} | "
                      f"{r['p95 overhead per step ms']} |" for r in table]
            body = ("## Bundle runs: per-step overhead\n\n" +
                    provenance("bundle.py", f"{os.cpu_count()} cores", "one local Prefect server on SQLite") +
                    "\n\ndemo_dag_linear vs a plain flow running the same worker.py three times as tasks; overhead = "
                    "wall time minus the workers' own time, per step.\n\n" + "\n".join(lines) +
                    f"\n\nPer-step overhead ratio bundle/plain: **{ratio:.2f}** (target at most 1.5). The bundle's "
                    "extra work per step: plan and commit a booking in SQLite, stage a sandbox (copy the payload, "
                    "write four files), release the booking. Both sides pay Prefect's own per-run costs (a new "
                    "API client, the flow-run heartbeat thread joined at the end, up to 1 s). What took the ratio "
                    "from 2.2 to this: the step task's arguments are passed `quote()`d, so Prefect no longer walks "
                    "the whole bundle (manifest, specs) looking for futures on every task run. `mn-prefect "
                    "blueprint run examples/bundles/demo_dag_linear --local --json` against a running server, "
                    "the whole command with its imports: 5.5-6.6 s (4 runs).")
            write_section(args.write, "bundle-overhead", body)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
