"""The mn worker against Prefect's process worker: one run at a time through each, on an otherwise idle setup.

Each setup is a fresh local Prefect server (SQLite) with one pool and ONE worker: ``process`` (Prefect's
process worker), ``mn`` (the mn worker, a mock CPU node, its own SQLite store; cold starts, ``warm_start: false``),
``mn-warm`` (the same with ``warm_start: true``: runs forked from the worker's warm launcher) and
``mn-wakeups-off`` (``mn`` with MN_WAKEUPS=off). Every worker is started with the same polling settings (PREFECT_WORKER_QUERY_SECONDS,
PREFECT_WORKER_PREFETCH_SECONDS, no ``--limit``). All setups are up at once and the runs are interleaved: round
i creates one run of benchmarks/flows/short.py on each setup in turn (the order rotated every round, so that no
setup always goes first), waiting for each run to end before creating the next. A warm-up round is not counted.

Measured per run, from the server's own timestamps: scheduled->running (start_time - expected_start_time),
scheduled->completed (end_time - expected_start_time), and from the run's state history where the time goes:
Scheduled->Pending (the poll wait, plus placement for mn), Pending->Submitting (the job configuration, the
worker's labels on the run, for mn its booking read back), Submitting->Running (the flow process's start-up until
its engine proposes Running), Running->Completed (the flow and its engine); the worker process's own CPU
time over the counted rounds, per run (its idle polls between runs included; the flow processes not); and the
flow processes' CPU per run: what the worker's waited-for children used over the counted rounds (a cold start's
interpreters) plus what its warm launchers and their waited-for children (the keepers and the runs they forked)
used, from /proc.

Then ``--first-line-runs`` rounds (after a warm-up round of their own) of benchmarks/flows/probe.py's
``numpy_first``, whose first line imports numpy: from the run's Submitting state (the worker starting its flow
process) to that line done. ``mn-warm`` deploys it with ``preload: [numpy]``, so its launcher imported numpy
before the run; the others import it in the run.

Usage: python benchmarks/worker.py [--runs 30] [--setups process,mn,mn-wakeups-off] [--first-line-runs 10]
                                   [--query-seconds 1] [--prefetch-seconds 0] [--pause 1] [--json]
                                   [--write BENCHMARKS.md] [--section worker]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from api import deploy_short, request  # noqa: E402
from report import markdown_table, provenance, report, write_section  # noqa: E402

from mn_prefect.local_lab import BIN, PrefectServer, start_worker, stop_processes  # noqa: E402

CPU_NODE = next(node for node in json.loads((ROOT / "deployments" / "mock-nodes.json").read_text())
                if not node.get("devices"))
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
SETUPS = ("process", "mn", "mn-warm", "mn-wakeups-off")
RUN_TIMEOUT_S = 120.0
# The states a run passes through, by name: the worker's poll and placement end in Pending; its configuration,
# labels and (for mn) store reads end in Submitting; the flow process's start-up ends in Running.
PHASES = ("Scheduled", "Pending", "Submitting", "Running", "Completed")
PHASE_KEYS = [f"{a.lower()}_to_{b.lower()}" for a, b in pairwise(PHASES)]
# After each warm-up run: an mn-warm worker's first run (of each preload list) starts cold and starts the
# launcher, which then imports Prefect (and numpy) before it is ready for the counted runs.
WARM_UP_PAUSE_S = 10.0
POLL_S = 0.1  # how often the benchmark reads a run's state while it waits for its end


@dataclass
class Setup:
    """One Prefect server, one pool, one worker, one deployment; the timings of its runs."""

    label: str
    server: PrefectServer
    worker: subprocess.Popen
    client: httpx.Client
    probe_dir: Path
    deployment: str = ""
    first_line_deployment: str = ""
    timings: list[dict[str, float]] = field(default_factory=list)
    failed: int = 0
    cpu_s: float = 0.0  # the worker process's own CPU time over the counted rounds, idle polls included
    flow_cpu_s: float = 0.0  # the flow processes' CPU time over the counted rounds (cold and warm)
    first_lines: list[float] = field(default_factory=list)  # Submitting -> numpy_first's first line done, seconds


def _stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields from the third (state) on."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far, from /proc (Linux); its children not included."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _launchers(worker_pid: int) -> list[int]:
    """The warm launchers the worker ``worker_pid`` started (its children running mn_prefect's warm_launcher)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int(_stat(entry.name)[1]) == worker_pid and b"warm_launcher" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def flow_cpu_seconds(worker_pid: int) -> dict[int, float]:
    """The flow processes' CPU so far, by the process that accounts for it: the worker's waited-for children
    (cold starts; key: the worker's pid) and each warm launcher's own time plus its waited-for children's (the
    keepers, and the runs each keeper waited for)."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = _stat(worker_pid)
    spent = {worker_pid: (int(fields[13]) + int(fields[14])) / tick}
    for pid in _launchers(worker_pid):
        try:
            fields = _stat(pid)
        except OSError:
            continue
        spent[pid] = sum(int(x) for x in fields[11:15]) / tick
    return spent


def _spent_since(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU between two ``flow_cpu_seconds`` readings: a launcher started in between counts in full, one that
    ended in between (its children then counted nowhere) is a restart the benchmark reports as an error."""
    gone = before.keys() - after.keys()
    if gone:
        raise RuntimeError(f"warm launcher(s) {sorted(gone)} ended during the counted rounds: the flow CPU per run "
                           "would miss what they used")
    return sum(after[pid] - before.get(pid, 0.0) for pid in after)


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def load() -> str:
    """The machine's load averages (1, 5, 15 min): the machine is shared."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile ``q`` (0..1) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_setup(label: str, home: Path, polling: dict[str, str], first_line: bool) -> Setup:
    """A fresh server, the pool of the setup's worker type, its one worker (registered) and the deployments."""
    kind = "process" if label == "process" else "mn"
    server = PrefectServer(home / "prefect")
    pool = f"bench-{label}"
    subprocess.run([str(BIN / "prefect"), "work-pool", "create", pool, "--type", kind], env=server.env, check=True,
                   capture_output=True)
    if kind == "mn":
        extra = {**polling, "MN_WAKEUPS": "off" if label == "mn-wakeups-off" else "on"}
        worker = start_worker(server.env, pool, CPU_NODE, f"sqlite:///{home / 'state.db'}", home, extra_env=extra)
    else:
        log = open(home / "worker-process.log", "w")
        worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process",
                                   "--name", "process"], env={**server.env, **polling}, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    setup = Setup(label, server, worker, httpx.Client(base_url=server.api_url, timeout=30), home / "probe")
    setup.probe_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 90
    while not request(setup.client, "POST", f"/work_pools/{pool}/workers/filter", json={}).json():
        if worker.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {label} worker did not come up; see {home}")
        time.sleep(0.3)
    # The mn run asks for one core: the CPU node has room for it, as the process worker's machine does.
    variables: dict = {"resources": {"cpu": 1}, "warm_start": label == "mn-warm"} if kind == "mn" else {}
    setup.deployment = deploy_short(server.env, pool, "short", variables)
    if first_line:
        preload = {"preload": ["numpy"]} if label == "mn-warm" else {}
        setup.first_line_deployment = deploy_short(
            server.env, pool, "numpy-first", {**variables, **preload, "env": {"MN_BENCH_PROBE_DIR": str(setup.probe_dir)}},
            entrypoint="probe.py:numpy_first")
    return setup


def phases(states: list[dict]) -> dict[str, float]:
    """Seconds between the first state of each name in a run's history: where its time went."""
    first: dict[str, float] = {}
    for state in sorted(states, key=lambda s: s["timestamp"]):
        first.setdefault(state["name"], _ts(state["timestamp"]))
    if not set(PHASES) <= first.keys():
        return {}
    return {key: first[b] - first[a] for key, (a, b) in zip(PHASE_KEYS, pairwise(PHASES), strict=True)}


def one_run(setup: Setup, i: int, deployment: str = "") -> dict[str, float] | None:
    """Create one run (of the setup's short deployment, or of ``deployment``), wait for its end; its timings (None
    when it did not complete), with ``first_line_s`` for a numpy_first run."""
    run_id = request(setup.client, "POST", f"/deployments/{deployment or setup.deployment}/create_flow_run",
                     json={"parameters": {"i": i}}).json()["id"]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        run = request(setup.client, "GET", f"/flow_runs/{run_id}").json()
        if run["state"]["type"] in TERMINAL:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{setup.label}: run {run_id} did not end within {RUN_TIMEOUT_S} s")
        time.sleep(POLL_S)
    if run["state"]["type"] != "COMPLETED" or not run["start_time"] or not run["end_time"]:
        return None
    states = request(setup.client, "GET", "/flow_run_states/", params={"flow_run_id": run_id}).json()
    expected = _ts(run["expected_start_time"])
    timings = {"scheduled_to_running": _ts(run["start_time"]) - expected,
               "scheduled_to_completed": _ts(run["end_time"]) - expected, **phases(states)}
    probe = setup.probe_dir / f"{run_id}.json"
    if probe.exists():
        submitting = min(_ts(s["timestamp"]) for s in states if s["name"] == "Submitting")
        timings["first_line_s"] = json.loads(probe.read_text())["first_line"] - submitting
    return timings


def summarise(setup: Setup) -> dict:
    """Median and p95 of each measure over the setup's completed runs (seconds)."""
    row: dict = {"setup": setup.label, "completed": len(setup.timings), "failed": setup.failed}
    for key in ("scheduled_to_running", "scheduled_to_completed"):
        values = [t[key] for t in setup.timings]
        row[f"{key}_median_s"] = round(statistics.median(values), 2)
        row[f"{key}_p95_s"] = round(percentile(values, 0.95), 2)
    for key in PHASE_KEYS:
        values = [t[key] for t in setup.timings if key in t]
        row[f"{key}_median_s"] = round(statistics.median(values), 2) if values else None
        row[f"{key}_p95_s"] = round(percentile(values, 0.95), 2) if values else None
    row["worker_cpu_s_per_run"] = round(setup.cpu_s / max(len(setup.timings) + setup.failed, 1), 3)
    row["flow_cpu_s_per_run"] = round(setup.flow_cpu_s / max(len(setup.timings) + setup.failed, 1), 3)
    row["first_line_runs"] = len(setup.first_lines)
    row["first_line_median_s"] = round(statistics.median(setup.first_lines), 3) if setup.first_lines else None
    row["first_line_p95_s"] = round(percentile(setup.first_lines, 0.95), 3) if setup.first_lines else None
    return row


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    """Each mn setup over the process worker, on the medians and the p95s."""
    base = rows["process"]
    keys = [f"{m}_{s}_s" for m in ("scheduled_to_running", "scheduled_to_completed") for s in ("median", "p95")]
    keys += ["submitting_to_running_median_s", "flow_cpu_s_per_run", "first_line_median_s"]
    return {f"{label}/{key}": round(row[key] / max(base[key], 1e-9), 2)
            for label, row in rows.items() if label != "process" for key in keys
            if row.get(key) is not None and base.get(key) is not None}


def run_rounds(setups: list[Setup], runs: int, pause_s: float) -> None:
    """One warm-up round, then ``runs`` rounds of one run per setup, the order rotated each round; ``pause_s``
    after each run, so that its worker's clean-up (the flow process's exit, the mn release) is not timed with the
    next run of another setup."""
    with Progress(console=Console(stderr=True)) as progress:  # stdout is for the figures (--json)
        task = progress.add_task("runs, one at a time", total=runs * len(setups))
        flow_cpu: dict[str, dict[int, float]] = {}
        for i in range(-1, runs):
            if i == 0:
                for setup in setups:
                    setup.cpu_s = -cpu_seconds(setup.worker.pid)
                    flow_cpu[setup.label] = flow_cpu_seconds(setup.worker.pid)
            shift = max(i, 0) % len(setups)
            for setup in setups[shift:] + setups[:shift]:
                timings = one_run(setup, i)
                time.sleep(pause_s if i >= 0 else max(pause_s, WARM_UP_PAUSE_S))
                if i < 0:
                    continue
                if timings is None:
                    setup.failed += 1
                else:
                    setup.timings.append(timings)
                progress.advance(task)
    for setup in setups:
        setup.cpu_s += cpu_seconds(setup.worker.pid)
        if runs > 0:
            setup.flow_cpu_s = _spent_since(flow_cpu[setup.label], flow_cpu_seconds(setup.worker.pid))


def first_line_rounds(setups: list[Setup], runs: int, pause_s: float) -> None:
    """One warm-up round (an mn-warm run starts its numpy launcher), then ``runs`` rounds of numpy_first per setup,
    the order rotated each round."""
    with Progress(console=Console(stderr=True)) as progress:
        task = progress.add_task("first-line runs, one at a time", total=runs * len(setups))
        for i in range(-1, runs):
            shift = max(i, 0) % len(setups)
            for setup in setups[shift:] + setups[:shift]:
                timings = one_run(setup, i, setup.first_line_deployment)
                time.sleep(pause_s if i >= 0 else max(pause_s, WARM_UP_PAUSE_S))
                if i >= 0 and timings is not None and "first_line_s" in timings:
                    setup.first_lines.append(timings["first_line_s"])
                    progress.advance(task)


def markdown(rows: dict[str, dict], ratio: dict[str, float], polling: dict[str, str], before: str,
             after: str) -> str:
    """The figures, the ratios to the process worker and, in a second table, the phases' median and p95."""
    measures = ["scheduled_to_running_median_s", "scheduled_to_running_p95_s", "scheduled_to_completed_median_s",
                "scheduled_to_completed_p95_s"]
    extra = ["flow_cpu_s_per_run", "first_line_median_s"]

    def over(label: str, key: str) -> str:
        return f"**{ratio[f'{label}/{key}']}x**" if f"{label}/{key}" in ratio else ""

    figures = markdown_table(
        ["setup", "completed", "sched->running median s", "p95 s", "sched->completed median s", "p95 s",
         "worker CPU s / run", "flow CPU s / run", "submitting->first line (numpy) median s"],
        [[r["setup"], r["completed"], *(r[m] for m in measures), r["worker_cpu_s_per_run"],
          *("" if r.get(m) is None else r[m] for m in extra)] for r in rows.values()]
        + [[f"**{label} / process**", "", *(over(label, m) for m in measures), "", *(over(label, m) for m in extra)]
           for label in rows if label != "process"])
    breakdown = markdown_table(
        ["setup", *(f"{key.replace('_to_', '->')} median / p95 s" for key in PHASE_KEYS)],
        [[r["setup"], *(f"{r[f'{key}_median_s']} / {r[f'{key}_p95_s']}" for key in PHASE_KEYS)]
         for r in rows.values()])
    settings = ", ".join(f"{k}={v}" for k, v in polling.items())
    return "\n".join([provenance("worker.py", settings), "",
                      f"Load averages (1, 5, 15 min) of the shared 2-core machine: before {before}; after {after}.",
                      "", *figures, "", "Where the time goes (the runs' state history):", "", *breakdown])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="counted runs per setup (after one warm-up run each)")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, from {', '.join(SETUPS)}")
    parser.add_argument("--query-seconds", default="1", help="PREFECT_WORKER_QUERY_SECONDS of every worker")
    parser.add_argument("--prefetch-seconds", default="0", help="PREFECT_WORKER_PREFETCH_SECONDS of every worker")
    parser.add_argument("--first-line-runs", type=int, default=10,
                        help="counted numpy_first runs per setup (after one warm-up run each); 0: none")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds of quiet after each run")
    parser.add_argument("--json", action="store_true", help="the rows, the ratios and every run's timings as JSON")
    parser.add_argument("--write")
    parser.add_argument("--section", default="worker", help="the marker of the section --write replaces")
    args = parser.parse_args()
    labels = [s.strip() for s in args.setups.split(",") if s.strip()]
    if "process" not in labels or not set(labels) <= set(SETUPS):
        parser.error(f"--setups: process and any of {', '.join(SETUPS[1:])}")
    polling = {"PREFECT_WORKER_QUERY_SECONDS": args.query_seconds,
               "PREFECT_WORKER_PREFETCH_SECONDS": args.prefetch_seconds}
    home = Path(tempfile.mkdtemp(prefix="mn-bench-worker-"))
    setups: list[Setup] = []
    before = load()
    try:
        for label in labels:
            setups.append(start_setup(label, home / label, polling, args.first_line_runs > 0))
        run_rounds(setups, args.runs, args.pause)
        if args.first_line_runs > 0:
            first_line_rounds(setups, args.first_line_runs, args.pause)
    finally:
        stop_processes([s.worker for s in setups])
        for setup in setups:
            setup.server.stop()
    after = load()
    rows = {s.label: summarise(s) for s in setups}
    ratio = ratios(rows)
    if args.json:
        print(json.dumps({"rows": list(rows.values()), "over_process": ratio, "load_before": before,
                          "load_after": after, "polling": polling, "runs": {s.label: s.timings for s in setups}}))
    else:
        report(args, f"{args.runs} short runs one at a time per setup, load {before} -> {after}",
               list(rows.values()), "over_process", ratio)
    if args.write:
        write_section(args.write, args.section, markdown(rows, ratio, polling, before, after))


if __name__ == "__main__":
    main()
