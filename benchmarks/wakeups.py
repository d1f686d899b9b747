"""Event-driven wake-ups: how soon a waiting run goes once capacity frees.

``store``: per backend, a waiter process holds a change watcher (``store.changes()``) and a run that does not fit;
the main process releases the run that blocks it. Measured: the release call's start -> the waiter's commit of
its run returned (wall clock, same machine), over ``--trials`` trials; the waiter plans and commits on each
wake-up as a worker does (a fresh plan against the store, the atomic commit).

``prefect``: a real Prefect server and one real mn worker on a one-GPU node; ``--runs`` runs that each want the
GPU are created at once, so each waits for the one before it. Measured per consecutive pair, from the earlier
run's terminal state (its timestamp on the server): its booking released (the worker's log: the flow process
has exited), the next run Pending (the worker submitted it), the next run's process started (/proc, written by
benchmarks/flows/waited.py) and its flow code begun. Once with wake-ups on, once with MN_WAKEUPS=off (polls
only, every ``--query-seconds``, Prefect's default 10 s).

Usage:
  python benchmarks/wakeups.py store [--trials 50] [--backends sqlite,redis,postgresql] [--write BENCHMARKS.md]
  python benchmarks/wakeups.py prefect [--runs 16] [--query-seconds 10] [--write BENCHMARKS.md]
  python benchmarks/wakeups.py commits --backend B --revisions REV,REV,... [--flush-ms 2] [--write BENCHMARKS.md]

``commits``: what announcing costs the commits: benchmarks/store.py (8 committing processes) of each revision
named, on one server (PostgreSQL's commit flush made to take ``--flush-ms``, commit_delay).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from report import markdown_table, provenance, write_section  # noqa: E402
from store import serve  # noqa: E402  (a fresh server or file per measurement, as the store benchmark starts them)

from mn_prefect.model.node import NodeRecord  # noqa: E402
from mn_prefect.model.resources import resource_request  # noqa: E402
from mn_prefect.placement.placing import place_and_commit  # noqa: E402
from mn_prefect.scheduler import Ask  # noqa: E402
from mn_prefect.store import open_store  # noqa: E402

WHOLE_NODE = Ask(agent_id="w", request=resource_request({"cpu_cores": 4}))


def load() -> str:
    """The machine's load averages (1, 5, 15 min): the machine is shared."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- in the store ---------------------------------------------------------------------------------------------

def waiter(url: str, line) -> None:
    """For each job id it is sent: try to place it, and on every change the watcher reports try again; say
    "waiting" after the first refusal and the time of the commit that placed it."""
    store = open_store(url)
    watcher = store.changes(node="n")
    try:
        while (job := line.recv()) is not None:
            said = False
            while not place_and_commit(store, job, [WHOLE_NODE]).placed:
                if not said:
                    line.send("waiting")
                    said = True
                watcher.wait(1.0)
            line.send(time.time())
    finally:
        watcher.close()
        store.close()


def store_trials(url: str, trials: int) -> list[float]:
    """Release -> the waiter's commit, in ms, ``trials`` times."""
    store = open_store(url)
    store.register_node(NodeRecord.model_validate({"name": "n", "cpu_cores": 4, "memory_mb": 8192}))
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    process = ctx.Process(target=waiter, args=(url, theirs), daemon=True)
    process.start()
    out = []
    try:
        for trial in range(trials):
            assert place_and_commit(store, f"holder-{trial}", [WHOLE_NODE]).placed
            mine.send(f"waiting-{trial}")
            assert mine.recv() == "waiting"
            time.sleep(random.uniform(0.05, 0.15))  # the waiter is in its wait, at a random point of SQLite's poll
            released_at = time.time()
            store.release(f"holder-{trial}")
            out.append((mine.recv() - released_at) * 1000)
            store.release(f"waiting-{trial}")
    finally:
        mine.send(None)
        process.join(10)
        store.close()
    return out


def in_store(args) -> None:
    rows = []
    for backend in args.backends.split(","):
        stack: list = []
        try:
            before = load()
            ms = store_trials(serve(backend, stack), args.trials)
            rows.append([backend, len(ms), f"{statistics.median(ms):.1f}", f"{percentile(ms, 0.95):.1f}",
                         f"{max(ms):.1f}", before])
            print(rows[-1], flush=True)
        finally:
            for stop in reversed(stack):
                stop()
    table = markdown_table(["backend", "trials", "median ms", "p95 ms", "max ms", "load (1, 5, 15 min) before"], rows)
    print("\n".join(table))
    if args.write:
        body = provenance("wakeups.py", f"{multiprocessing.cpu_count()} cores") + "\n\n" + "\n".join(table)
        write_section(args.write, "wakeups-store", body)


# -- through Prefect ------------------------------------------------------------------------------------------

def _at(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _released(log: Path) -> dict[str, float]:
    """When the worker released each run's booking, from its log (local HH:MM:SS.mmm, today)."""
    out = {}
    for line in log.read_text().splitlines():
        if "released the booking of run " in line:
            clock = datetime.strptime(line.split(" | ")[0].strip(), "%H:%M:%S.%f").time()
            out[line.split("released the booking of run ")[1].split()[0]] = datetime.combine(date.today(),
                                                                                              clock).timestamp()
    return out


def deploy(lab, job_variables: dict) -> str:
    from prefect.flows import Flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: lab.server.api_url}):
        flow = Flow.from_source(source=str(ROOT / "benchmarks" / "flows"), entrypoint="waited.py:waited")
        return str(flow.deploy(name="waited", work_pool_name="mn-lab", job_variables=job_variables,
                               print_next_steps=False))


def chain(wakeups: str, runs: int, query_seconds: float) -> dict[str, Any]:
    """One lab, one GPU node, ``runs`` runs each waiting for the one before; per consecutive pair, seconds from
    the earlier run's terminal state to: its booking released, the next run Pending, its process, its flow code."""
    from builders import gpu
    from lab import Lab

    node = {"name": "bench-gpu", "cpu_cores": 4, "memory_mb": 8192, "devices": [gpu("B0", 0)]}
    lab = Lab(Path(tempfile.mkdtemp(prefix="mn-bench-wakeups-lab-")), fleet=[node],
              worker_env={"MN_WAKEUPS": wakeups, "PREFECT_WORKER_QUERY_SECONDS": str(query_seconds)})
    try:
        before = load()
        deployment = deploy(lab, {"resources": {"gpu": 1}})
        ids = [lab.run(deployment, seconds=1) for _ in range(runs)]
        for run in ids:
            lab.wait(run, timeout=120 + 3 * query_seconds * runs)
        time.sleep(1)  # the last release reaches the log
        released = _released(lab.home / "worker-bench-gpu.log")
        facts = []
        for run in ids:
            states = lab.http.get("/flow_run_states/", params={"flow_run_id": run}).json()
            by_type = {s["type"]: _at(s["timestamp"]) for s in states}
            started = json.loads((lab.out / f"{run}.started").read_text())
            facts.append({"end": by_type["COMPLETED"], "released": released.get(run), "pending": by_type["PENDING"],
                          **started})
        facts.sort(key=lambda f: f["process"])
        pairs = list(zip(facts, facts[1:], strict=False))
        gaps = {name: [b[key] - a["end"] for a, b in pairs] for name, key in
                (("pending", "pending"), ("process", "process"), ("flow", "flow"))}
        gaps["released"] = [a["released"] - a["end"] for a, _ in pairs if a["released"] is not None]
        return {"pairs": len(pairs), **gaps, "load_before": before, "load_after": load()}
    finally:
        lab.stop()


def through_prefect(args) -> None:
    rows = []
    for wakeups in ("on", "off"):
        result = chain(wakeups, args.runs, args.query_seconds)
        rows.append(["wake-ups on" if wakeups == "on" else "polls only (MN_WAKEUPS=off)", result["pairs"],
                     *(f"{statistics.median(result[k]):.2f}" for k in ("released", "pending", "process")),
                     f"{percentile(result['process'], 0.95):.2f}", f"{statistics.median(result['flow']):.2f}",
                     f"{result['load_before']} / {result['load_after']}"])
        print(rows[-1], flush=True)
    table = markdown_table(["worker", "pairs", "released, median s", "Pending, median s", "process started, median s",
                            "p95 s", "flow code, median s", "load (1, 5, 15 min) before / after"], rows)
    print("\n".join(table))
    if args.write:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        body = (provenance("wakeups.py", f"{multiprocessing.cpu_count()} cores",
                           f"PREFECT_WORKER_QUERY_SECONDS={args.query_seconds:g}")
                + f"\n\n`uptime` after: {uptime}\n\n" + "\n".join(table))
        write_section(args.write, "wakeups-prefect", body)


# -- what announcing costs PostgreSQL's commits --------------------------------------------------------------

def _trees(revisions: str) -> dict[str, Path]:
    """Each revision's files (``git archive``), to run its benchmarks/store.py against its own code."""
    trees = {}
    for revision in revisions.split(","):
        tree = Path(tempfile.mkdtemp(prefix="mn-bench-rev-"))
        archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        trees[revision] = tree
    return trees


def _commit_server(backend: str, flush_ms: float, stack: list):
    """A function giving a fresh, empty store URL on one server for each run."""
    import servers

    if backend == "sqlite":
        return lambda name: f"sqlite:///{tempfile.mkdtemp(prefix='mn-bench-')}/state.db"
    if backend == "redis":
        server = servers.RedisServer(Path(tempfile.mkdtemp(prefix="mn-bench-redis-")))
        stack.append(server.stop)
        return lambda name: f"redis://127.0.0.1:{server.port}/0?prefix={name}:"
    import psycopg

    pg = servers.PostgresServer()
    stack.append(pg.cleanup)
    with psycopg.connect(pg.url(), autocommit=True) as conn:  # every commit's flush takes flush_ms
        conn.execute(f"ALTER SYSTEM SET commit_delay = {int(flush_ms * 1000)}")
        conn.execute("ALTER SYSTEM SET commit_siblings = 0")
        conn.execute("SELECT pg_reload_conf()")
    return pg.create_database


def commits(args) -> None:
    """benchmarks/store.py (8 committing processes, 8 s) of each of ``--revisions`` on one server, interleaved
    ``--repeats`` times. On PostgreSQL each commit's WAL flush is made to take ``--flush-ms`` (commit_delay: a disk
    that really syncs; on this machine's disk a flush is nearly free)."""
    trees = _trees(args.revisions)
    results: dict[str, list[float]] = {revision: [] for revision in trees}
    stack: list = []
    try:
        fresh = _commit_server(args.backend, args.flush_ms, stack)
        for rep in range(args.repeats):
            for i, (revision, tree) in enumerate(trees.items()):
                out = subprocess.run([sys.executable, "benchmarks/store.py", "--backend", args.backend, "--processes",
                                      "8", "--seconds", "8", "--url", fresh(f"r{rep}_{i}"), "--json"], cwd=tree,
                                     capture_output=True, text=True, check=True).stdout
                row = json.loads(out)
                results[revision].append((row[0] if isinstance(row, list) else row)["commits_per_s"])
                print(rep, revision, results[revision][-1], load(), flush=True)
    finally:
        for stop in reversed(stack):
            stop()
    table = markdown_table(["revision", "commits/s (each run)", "median"],
                           [[r, ", ".join(f"{x:.0f}" for x in v), f"{statistics.median(v):.0f}"]
                            for r, v in results.items()])
    print("\n".join(table))
    if args.write:
        body = (provenance("wakeups.py", f"{multiprocessing.cpu_count()} cores", f"load after {load()}")
                + "\n\n" + "\n".join(table))
        write_section(args.write, f"wakeups-commits-{args.backend}", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    store = sub.add_parser("store", help="release -> the waiting run committed, per backend")
    store.add_argument("--trials", type=int, default=50)
    store.add_argument("--backends", default="sqlite,redis,postgresql")
    store.add_argument("--write", help="replace this benchmark's table in this markdown file")
    prefect = sub.add_parser("prefect", help="a run's end -> the next run submitted and started, wake-ups on and off")
    prefect.add_argument("--runs", type=int, default=16)
    prefect.add_argument("--query-seconds", type=float, default=10.0)
    prefect.add_argument("--write", help="replace this benchmark's table in this markdown file")
    commits_ = sub.add_parser("commits", help="commits/s of several revisions on one backend")
    commits_.add_argument("--backend", choices=["sqlite", "redis", "postgresql"], default="postgresql")
    commits_.add_argument("--revisions", required=True, help="comma-separated git revisions")
    commits_.add_argument("--flush-ms", type=float, default=2.0, help="PostgreSQL's commit flush (commit_delay)")
    commits_.add_argument("--repeats", type=int, default=3)
    commits_.add_argument("--write", help="replace this benchmark's table in this markdown file")
    args = parser.parse_args()
    {"store": in_store, "prefect": through_prefect, "commits": commits}[args.what](args)


if __name__ == "__main__":
    main()
