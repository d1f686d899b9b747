"""The scheduling simulator's speed: trace events replayed per second at 1,000 nodes (docs/simulator.md).

Fleet: the five mock node shapes of deployments/ (mock-nodes.json: two GPU nodes and a CPU node;
mock-nodes-mig.json: an A100 node with one GPU cut into seven 1g.10gb MIG slices, and an L4 node) repeated
to ``--nodes`` nodes with their own names and device ids. Trace: ``mn-prefect simulate --generate N --seed 1
--nodes FLEET`` (Poisson arrivals at 80% of the fleet's bottleneck; CPU, whole-GPU, MIG and fractional requests).
A case ``N@RATE`` generates at RATE arrivals a second instead (more than the fleet keeps up with: a queue
builds, and every release triggers a scan of it). Each case runs the command as a user does, ``mn-prefect simulate --nodes FLEET --trace TRACE --json``
(both strategies, one after the other, in one process pinned to one core), and reads its timings:

- events = arrivals + completions replayed (two per job that starts, one per refused job);
- replay CPU s / events per CPU s per strategy: the replay loop alone (``cpu_s`` in the JSON: processor time,
  which a machine shared with other work does not inflate; ``wall_s`` is beside it);
- command CPU s / wall s: the whole command, reading and checking the trace and both replays included.

Target: one million trace events (jobs) on 1,000 nodes in under 5 minutes on one core.

Usage: python benchmarks/simulate.py [--cases 100000,1000000,100000@20] [--nodes 1000] [--json]
       [--write BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import markdown_table, provenance, report, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MOCKS = (ROOT / "deployments" / "mock-nodes.json", ROOT / "deployments" / "mock-nodes-mig.json")


def fleet(count: int) -> list[dict]:
    """``count`` nodes cycling through the mock shapes, each with its own name and device ids."""
    shapes = [node for path in MOCKS for node in json.loads(path.read_text())]
    nodes = []
    for i in range(count):
        node = copy.deepcopy(shapes[i % len(shapes)])
        node["name"] = f"{node['name']}-{i:05d}"
        for device in node.get("devices", []):
            device["id"] = f"{device['id']}-{i:05d}"
            if device.get("parent"):
                device["parent"] = f"{device['parent']}-{i:05d}"
        nodes.append(node)
    return nodes


def mn_prefect() -> list[str]:
    exe = Path(sys.executable).with_name("mn-prefect")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "mn_prefect.cli.app"]


def pinned(command: list[str]) -> list[str]:
    """The command on one core (``taskset`` where there is one)."""
    if sys.platform.startswith("linux") and subprocess.run(["which", "taskset"], capture_output=True).returncode == 0:
        core = sorted(os.sched_getaffinity(0))[0]
        return ["taskset", "-c", str(core), *command]
    return command


def measure(case: str, nodes_file: Path, workdir: Path) -> dict:
    jobs, _, rate = case.partition("@")
    trace = workdir / f"trace-{jobs}-{rate or 'fleet'}.jsonl"
    started = time.perf_counter()
    with trace.open("w") as out:
        subprocess.run([*mn_prefect(), "simulate", "--generate", jobs, "--seed", "1", "--nodes", str(nodes_file),
                        *(["--rate", rate] if rate else [])], stdout=out, check=True)
    generated = time.perf_counter() - started
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(pinned([*mn_prefect(), "simulate", "--nodes", str(nodes_file), "--trace", str(trace),
                                  "--json", "--no-progress"]), capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    data = json.loads(done.stdout)
    row: dict = {"jobs": int(jobs), "rate": rate or "fleet", "generate s": round(generated, 1)}
    for name, result in data["strategies"].items():
        row[f"{name} events"] = result["events"]
        row[f"{name} cpu s"] = result["cpu_s"]
        row[f"{name} events/cpu s"] = int(result["events"] / result["cpu_s"]) if result["cpu_s"] else 0
        row[f"{name} waited"] = result["waited"]
        row[f"{name} wait p99 s"] = round(result["wait_s"]["p99"], 1)
    row["command cpu s"] = round(cpu, 1)
    row["command wall s"] = round(wall, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="100000,1000000,100000@20",
                        help="trace sizes (jobs), comma-separated; N@RATE for RATE arrivals a second")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", metavar="BENCHMARKS.md", help="write the table into this file's simulate section")
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        nodes_file = workdir / "nodes.json"
        nodes_file.write_text(json.dumps(fleet(args.nodes)))
        rows = [measure(case, nodes_file, workdir) for case in cases]
    slowest = max(row["command cpu s"] for row in rows)
    report(args, f"simulate at {args.nodes:,} nodes", rows, "slowest command cpu s", {"seconds": slowest})
    if args.write:
        header = ["jobs (trace lines)", "arrivals/s", "strategy", "events replayed", "replay CPU s", "events/CPU s",
                  "jobs that waited", "wait p99 s", "command CPU s (both)", "command wall s"]
        table = []
        for row in rows:
            for name in ("binpack", "spread"):
                if f"{name} events" in row:
                    table.append([f"{row['jobs']:,}", row["rate"], name, f"{row[f'{name} events']:,}",
                                  row[f"{name} cpu s"], f"{row[f'{name} events/cpu s']:,}",
                                  f"{row[f'{name} waited']:,}", row[f"{name} wait p99 s"], row["command cpu s"],
                                  row["command wall s"]])
        body = "\n".join([provenance("simulate.py", f"{args.nodes:,} nodes", "one core"), "",
                          *markdown_table(header, table)])
        write_section(args.write, "simulate", body)


if __name__ == "__main__":
    main()
