"""The same short flow under the host_local and the docker runtime driver, one run at a time.

A fresh local Prefect server, one mn worker (a 2-core node offering both drivers) and a real dockerd of its
own (as the tests start it: temporary data root, no bridge); the docker runs use the empty lab image with
this machine's Python mounted read-only. Runs alternate between the drivers, so both see the same machine.
Reports per driver the median and p95 of scheduled-to-running (the run's expected start to its start time)
and of the total (expected start to end).

Usage: python benchmarks/docker_driver.py [--runs 20] [--json] [--write BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
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
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from api import deploy_short, request  # noqa: E402
from docker_daemon import TOOLCHAIN_IMAGE, DockerDaemon  # noqa: E402
from report import markdown_table, provenance, report, write_section  # noqa: E402

from mn_prefect.drivers import docker as docker_io  # noqa: E402
from mn_prefect.local_lab import BIN, PrefectServer, start_worker, stop_process  # noqa: E402

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
NODE = {"name": "box", "cpu_cores": 2, "memory_mb": 8192}
VARIABLES = {"host_local": {"resources": {"cpu": 1, "memory_mb": 512}},
             "docker": {"image": TOOLCHAIN_IMAGE, "resources": {"runtime_driver": "docker", "cpu": 1, "memory_mb": 512}}}


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _p95(values: list[float]) -> float:
    return sorted(values)[max(0, int(len(values) * 0.95 + 0.5) - 1)]


def measure(runs: int, progress, task) -> list[dict]:
    home = Path(tempfile.mkdtemp(prefix="mn-bench-docker-"))
    daemon = DockerDaemon()
    server = worker = None
    try:
        daemon.build_toolchain_image()
        server = PrefectServer(home / "prefect")
        pool = "bench-drivers"
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", pool, "--type", "mn"], env=server.env,
                       check=True, capture_output=True)
        worker = start_worker(server.env, pool, NODE, f"sqlite:///{home / 'state.db'}", home, extra_env={
            **daemon.env, docker_io.TOOLCHAIN_VAR: ":".join(docker_io.default_toolchain())})
        client = httpx.Client(base_url=server.api_url, timeout=30)
        deployments = {driver: deploy_short(server.env, pool, driver, variables) for driver, variables in VARIABLES.items()}
        seen: dict[str, list[dict]] = {driver: [] for driver in VARIABLES}
        for i in range(runs * len(VARIABLES)):
            driver = list(VARIABLES)[i % len(VARIABLES)]
            run_id = request(client, "POST", f"/deployments/{deployments[driver]}/create_flow_run",
                             json={"parameters": {"i": i}}).json()["id"]
            deadline = time.monotonic() + 300
            while (data := request(client, "GET", f"/flow_runs/{run_id}").json())["state"]["type"] not in TERMINAL:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"run {run_id} ({driver}) did not finish; see {home}")
                time.sleep(0.1)
            seen[driver].append(data)
            progress.advance(task)
        rows = []
        for driver, done in seen.items():
            ok = [r for r in done if r["state"]["type"] == "COMPLETED"]
            to_running = [_ts(r["start_time"]) - _ts(r["expected_start_time"]) for r in ok]
            total = [_ts(r["end_time"]) - _ts(r["expected_start_time"]) for r in ok]
            rows.append({"driver": driver, "runs": len(done), "completed": len(ok),
                         "to_running_median_s": round(statistics.median(to_running), 2),
                         "to_running_p95_s": round(_p95(to_running), 2),
                         "total_median_s": round(statistics.median(total), 2), "total_p95_s": round(_p95(total), 2)})
        return rows
    finally:
        if worker is not None:
            stop_process(worker)
        if server is not None:
            server.stop()
        daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per driver")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write")
    args = parser.parse_args()
    with Progress(transient=True) as progress:
        task = progress.add_task("short runs, host_local and docker in turn", total=args.runs * len(VARIABLES))
        rows = measure(args.runs, progress, task)
    host, docker = rows
    added = {"to_running_median_s": round(docker["to_running_median_s"] - host["to_running_median_s"], 2),
             "total_median_s": round(docker["total_median_s"] - host["total_median_s"], 2)}
    report(args, f"{args.runs} short runs per driver, one at a time", rows, "docker_adds", added)
    if args.write:
        lines = markdown_table(
            ["driver", "runs", "completed", "scheduled->running median s", "p95 s", "total median s", "p95 s"],
            [list(r.values()) for r in rows]
            + [["**docker - host_local**", "", "", f"**{added['to_running_median_s']:+}**", "",
                f"**{added['total_median_s']:+}**", ""]])
        write_section(args.write, "docker-driver", provenance("docker_driver.py") + "\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
