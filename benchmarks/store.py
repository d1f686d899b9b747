"""Store throughput under contention: N placer processes plan and commit against one store.

Each process runs the shared workload (benchmarks/store_workload.py): random requests against a cluster
too small for all of them, committing with re-plans on conflict and randomly releasing its jobs.
Prints commits per second (successful commits over wall time, all processes), the conflict rate
(conflicting commit attempts / all commit attempts) and the independent checker's overbooking count.

The servers are started by this script on loopback (redis-server, PostgreSQL as a non-root user) unless
--url names one. Usage:
  python benchmarks/store.py --backend sqlite|redis|postgresql --processes N [--seconds 10] [--json]
  python benchmarks/store.py --all --write BENCHMARKS.md     (1 and 8 processes on every backend)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
from pathlib import Path

from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import store_workload  # noqa: E402
from report import print_rows, provenance, write_section  # noqa: E402

from mn_prefect.store import open_store  # noqa: E402
from mn_prefect.store.audit import audit  # noqa: E402


def _worker(args):
    url, worker, seconds, mode, nodes, barrier = args
    return store_workload.run_worker(url, worker, cycles=10**9, seed=worker, mode=mode, size=nodes, duration=seconds,
                                     ready=barrier.wait)


def measure(url: str, processes: int, seconds: float, nodes: int, mode: str) -> dict:
    """Every process imports, opens the store and waits at a barrier; then all measure for ``seconds``."""
    store_workload.prepare(url, nodes)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(processes) as pool:
        barrier = manager.Barrier(processes)
        results = pool.map(_worker, [(url, i, seconds, mode, nodes, barrier) for i in range(processes)])
    store = open_store(url)
    problems = audit(store.consistent_view())
    store.close()
    commits = sum(r["commits"] for r in results)
    conflicts = sum(r["conflicts"] for r in results)
    busiest = max(r["seconds"] for r in results)
    return {
        "processes": processes,
        "commits": commits,
        "commits_per_s": round(commits / busiest, 1),
        "releases_per_s": round(sum(r["releases"] for r in results) / busiest, 1),
        "conflict_rate": round(conflicts / max(commits + conflicts, 1), 4),
        "refused": sum(r["refused"] for r in results),
        "overbooking": len(problems),
        "seconds": round(busiest, 2),
    }


def serve(backend: str, stack):
    """A fresh server (or file) for one measurement; returns its URL."""
    import servers

    if backend == "sqlite":
        return f"sqlite:///{tempfile.mkdtemp(prefix='mn-bench-')}/state.db"
    if backend == "redis":
        server = servers.RedisServer(Path(tempfile.mkdtemp(prefix="mn-bench-redis-")))
        stack.append(server.stop)
        return f"redis://127.0.0.1:{server.port}/0"
    server = servers.PostgresServer()
    stack.append(server.cleanup)
    return server.url()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sqlite", "redis", "postgresql"], default="sqlite")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--nodes", type=int, default=24, help="cluster size (the contention tests use 3)")
    parser.add_argument("--mode", choices=["store", "placer"], default="store",
                        help="store: commit made-up bookings (the store's throughput); placer: plan each one first")
    parser.add_argument("--url", help="an existing store (default: start a fresh server)")
    parser.add_argument("--all", action="store_true", help="1 and 8 processes on every backend")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", help="replace the store section of this markdown file")
    args = parser.parse_args()
    runs = ([(b, n) for b in ("sqlite", "redis", "postgresql") for n in (1, 8)] if args.all
            else [(args.backend, args.processes)])
    rows = []
    with Progress(transient=True) as progress:
        task = progress.add_task("measuring", total=len(runs))
        for backend, processes in runs:
            stack: list = []
            try:
                url = args.url or serve(backend, stack)
                rows.append({"backend": backend, "mode": args.mode, **measure(url, processes, args.seconds, args.nodes, args.mode)})
            finally:
                for stop in reversed(stack):
                    stop()
            progress.advance(task)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_rows(f"store under contention ({args.seconds:g} s per run)", rows)
    if args.write:
        lines = ["| backend | mode | processes | commits/s | releases/s | conflict rate | refused | overbooking |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['backend']} | {r['mode']} | {r['processes']} | {r['commits_per_s']:,} | {r['releases_per_s']:,} | "
                  f"{r['conflict_rate']:.2%} | {r['refused']} | {r['overbooking']} |" for r in rows]
        body = provenance("store.py", f"{multiprocessing.cpu_count()} cores") + "\n\n" + "\n".join(lines)
        write_section(args.write, f"store-{args.mode}", body)


if __name__ == "__main__":
    main()
