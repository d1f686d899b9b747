"""Store throughput under contention: N placer processes plan and commit against one store.

Each process runs the shared workload (benchmarks/store_workload.py): random requests against a cluster
too small for all of them, committing with re-plans on conflict and randomly releasing its jobs.
Prints commits per second (successful commits over wall time, all processes), the conflict rate
(conflicting commit attempts / all commit attempts) and the independent checker's overbooking count.

The servers are started by this script on loopback (redis-server, PostgreSQL as a non-root user) unless
--url names one. With ``--events`` each process also does what the worker does after each commit and release:
emit its events (``mn.placement.created`` and the older ``committed``, ``released``: mn_prefect.events). Where
they go: ``on``, a Prefect server this script starts; ``sink``, an endpoint that takes each batch at once (the
cost inside the committing process alone, without a Prefect server's work on the same cores); ``unreachable``,
an address that accepts connections and never answers (a hung server); ``off``, nowhere, as in a process with no
PREFECT_API_URL (the emit calls return at once). Without ``--events`` no emit call is made. Usage:
  python benchmarks/store.py --backend sqlite|redis|postgresql --processes N [--seconds 10] [--json]
  python benchmarks/store.py --all --write BENCHMARKS.md     (1 and 8 processes on every backend)
  python benchmarks/store.py --events-compare --write BENCHMARKS.md     (each --events, 1 and 8 processes)
  python benchmarks/store.py --events-paired --write BENCHMARKS.md      (one process, with and without, interleaved)
  python benchmarks/store.py --backend postgresql --statements   (and the server's time by statement)

``--events-paired`` is the steadier figure on a shared machine: one process commits and releases in chunks of
300 jobs, alternately emitting and not, 16 chunks each, and reports the medians and the median of the paired
ratios, for each place the events go.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import store_workload  # noqa: E402
from report import print_rows, provenance, write_section  # noqa: E402

from mn_prefect.store import open_store  # noqa: E402
from mn_prefect.store.audit import audit  # noqa: E402


class _Announcing:
    """The store, emitting the events the worker emits after each commit and release (``mn.placement.created``
    and the older ``committed``, ``released``: visibility.emit_placement, in the committing process, after the
    commit returns)."""

    def __init__(self, store):
        self._store = store
        self._nodes: dict[str, str] = {}

    def __getattr__(self, name):
        return getattr(self._store, name)

    def commit_plan(self, job_id, placements, **kwargs):
        from mn_prefect.worker import visibility

        result = self._store.commit_plan(job_id, placements, **kwargs)
        if result.ok:
            placement = (result.placements or placements)[0]
            self._nodes[job_id] = placement.node
            visibility.emit_placement(visibility.COMMITTED, job_id, placement.node, visibility.summary(placement))
        return result

    def release(self, job_id, **kwargs):
        from mn_prefect.worker import visibility

        released = self._store.release(job_id, **kwargs)
        if released:
            visibility.emit_placement(visibility.RELEASED, job_id, self._nodes.pop(job_id, "?"), {"reason": "over"})
        return released


class _Counting:
    """The store, counting what each commit and release sends it (``_count_trips``)."""

    def __init__(self, store, trips: list[int], stats: dict):
        self._store, self._trips, self._stats = store, trips, stats

    def __getattr__(self, name):
        return getattr(self._store, name)

    def _counted(self, what: str, call, *args, **kwargs):
        before = self._trips[0]
        try:
            return call(*args, **kwargs)
        finally:
            self._stats[f"{what}_calls"] += 1
            self._stats[f"{what}_trips"] += self._trips[0] - before

    def commit_plan(self, job_id, placements, **kwargs):
        return self._counted("commit", self._store.commit_plan, job_id, placements, **kwargs)

    def release(self, job_id, **kwargs):
        return self._counted("release", self._store.release, job_id, **kwargs)


def _count_trips() -> list[int]:
    """A counter of what this process sends its store, the same way for every version of the code: Redis
    requests (each a ``sendall`` on a socket: one round trip), PostgreSQL statements through psycopg's cursors
    or the commit path's prepared calls (each a round trip), and the statements SQLite runs (calls into the
    library in this process: no network, but each is work done while the write lock is held)."""
    import sqlite3

    trips = [0]

    def counted(fn):
        def call(*args, **kwargs):
            trips[0] += 1
            return fn(*args, **kwargs)
        return call

    def statement(_sql):
        trips[0] += 1

    socket.socket.sendall = counted(socket.socket.sendall)
    connect = sqlite3.connect

    def traced(*args, **kwargs):
        conn = connect(*args, **kwargs)
        conn.set_trace_callback(statement)
        return conn

    sqlite3.connect = sqlite3.dbapi2.connect = traced  # SQLAlchemy connects through sqlite3.dbapi2
    try:
        import psycopg

        for cls, names in ((psycopg.Cursor, ("execute", "executemany")), (psycopg.Connection, ("commit",))):
            for name in names:
                setattr(cls, name, counted(getattr(cls, name)))
        from mn_prefect.store import pg_line

        for name in ("run",):  # what waits for an answer (an announcement sent without waiting is no trip)
            if hasattr(pg_line, name):
                setattr(pg_line, name, counted(getattr(pg_line, name)))
    except ImportError:  # a version of the code without the module
        pass
    return trips


def _worker(args):
    url, worker, seconds, mode, nodes, barrier, events_to = args
    trips = _count_trips()
    counts = dict.fromkeys(("commit_calls", "commit_trips", "release_calls", "release_trips"), 0)
    store_workload.open_store = lambda u: _Counting(open_store(u), trips, counts)
    if events_to is not None:
        import prefect.client.orchestration  # noqa: F401  (imported before the clock starts, as in a worker)

        from mn_prefect import events
        from mn_prefect.worker import visibility  # noqa: F401

        events.emit("mn.benchmark.ready", events.node("none"))  # Prefect's settings read, the thread started
        store_workload.open_store = lambda u: _Announcing(_Counting(open_store(u), trips, counts))
    stats = store_workload.run_worker(url, worker, cycles=10**9, seed=worker, mode=mode, size=nodes,
                                      duration=seconds, ready=barrier.wait)
    stats.update(counts)
    if events_to is not None:  # after the clock stopped: what got out, what was dropped
        emitter = events.emitter()
        stats["events_left"] = emitter.flush(30)
        stats.update(events_sent=emitter.sent, events_dropped=emitter.dropped, events_failed=emitter.failed)
    return stats


def measure(url: str, processes: int, seconds: float, nodes: int, mode: str, events: str | None = None) -> dict:
    """Every process imports, opens the store and waits at a barrier; then all measure for ``seconds``."""
    store_workload.prepare(url, nodes)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(processes) as pool:
        barrier = manager.Barrier(processes)
        results = pool.map(_worker, [(url, i, seconds, mode, nodes, barrier, events) for i in range(processes)])
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
        # what a process sent its store per commit attempt and per release (_count_trips says what is counted)
        "trips_per_commit": _per(results, "commit"),
        "trips_per_release": _per(results, "release"),
        **({"events": events, **{k: sum(r[k] for r in results) for k in
                                 ("events_sent", "events_dropped", "events_failed", "events_left")}}
           if events is not None else {}),
    }


def _per(results: list[dict], what: str) -> float:
    return round(sum(r[f"{what}_trips"] for r in results) / max(sum(r[f"{what}_calls"] for r in results), 1), 2)


class _Sink(BaseHTTPRequestHandler):
    """Takes a batch of events and answers 204 at once (and, like a server without CSRF protection, 404 to the
    client's CSRF token request)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def paired(url: str, nodes: int, events_to: str, rounds: int = 16, chunk: int = 300) -> dict:
    """Milliseconds per job (commit, then release), with and without emitting, interleaved in one process."""
    import random
    import statistics
    import time

    import prefect.client.orchestration  # noqa: F401

    from mn_prefect import events

    store_workload.prepare(url, nodes)
    plain = open_store(url)
    announcing = _Announcing(plain)
    cluster = store_workload.cluster(nodes)
    rng = random.Random(1)
    events.emit("mn.benchmark.ready", events.node("none"))

    def run(store, n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            job = f"{time.time_ns()}-{i}"
            if store.commit_plan(job, [store_workload.random_booking(rng, cluster)]).ok:
                store.release(job)
        return (time.perf_counter() - start) / n * 1000

    off, on = [], []
    for _ in range(rounds):
        off.append(run(plain, chunk))
        on.append(run(announcing, chunk))
    emitter = events.emitter()
    left = emitter.flush(30)
    plain.close()
    return {"events": events_to, "ms_per_job_off": round(statistics.median(off), 3),
            "ms_per_job_on": round(statistics.median(on), 3),
            "paired_ratio": round(statistics.median([b / a for a, b in zip(off, on, strict=True)]), 3),
            "events_sent": emitter.sent, "events_dropped": emitter.dropped, "events_failed": emitter.failed + left}


def prefect_for_events(events: str | None, stack) -> None:
    """Point PREFECT_API_URL (inherited by the spawned processes) where ``events`` says: nowhere (off), a
    Prefect server started here (on), or a socket that accepts and never answers (unreachable)."""
    os.environ.pop("PREFECT_API_URL", None)
    if events == "on":
        from mn_prefect.local_lab import PrefectServer

        server = PrefectServer(Path(tempfile.mkdtemp(prefix="mn-bench-prefect-")))
        stack.append(server.stop)
        os.environ["PREFECT_API_URL"] = server.api_url
    elif events == "sink":
        sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
        threading.Thread(target=sink.serve_forever, daemon=True).start()
        stack.append(sink.shutdown)
        os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{sink.server_address[1]}/api"
    elif events == "unreachable":
        hung = socket.socket()
        hung.bind(("127.0.0.1", 0))
        hung.listen(1024)  # the kernel completes connections; nothing ever reads them
        stack.append(hung.close)
        os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{hung.getsockname()[1]}/api"


def serve(backend: str, stack, statements: bool = False):
    """A fresh server (or file) for one measurement; returns its URL. ``statements``: PostgreSQL counts the time of
    every statement, those inside the store's functions too (pg_stat_statements, ``statement_times``)."""
    import servers

    if backend == "sqlite":
        return f"sqlite:///{tempfile.mkdtemp(prefix='mn-bench-')}/state.db"
    if backend == "redis":
        server = servers.RedisServer(Path(tempfile.mkdtemp(prefix="mn-bench-redis-")))
        stack.append(server.stop)
        return f"redis://127.0.0.1:{server.port}/0"
    server = servers.PostgresServer(settings={"shared_preload_libraries": "pg_stat_statements",
                                              "pg_stat_statements.track": "all"} if statements else None)
    stack.append(server.cleanup)
    if statements:
        import psycopg

        with psycopg.connect(server.url(), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")
    return server.url()


def statement_times(url: str, commits: int, top: int = 14) -> list[dict]:
    """The statements that took the server's time in a run (``serve(statements=True)``), nested ones included: calls,
    mean microseconds, and total microseconds per successful commit. Wall time in the server: under contention it
    includes waits for locks and for a core."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT calls, total_exec_time, regexp_replace(query, '\\s+', ' ', 'g') FROM "
                            "pg_stat_statements WHERE calls >= %s AND query NOT LIKE 'CREATE%%' "
                            "ORDER BY total_exec_time DESC LIMIT %s", (max(commits // 20, 1), top)).fetchall()
    return [{"statement": text[:90], "calls": calls, "mean_us": round(total * 1000 / calls, 1),
             "us_per_commit": round(total * 1000 / max(commits, 1), 1)} for calls, total, text in rows]


def events_paired(args) -> None:
    """Each place events go, in a fresh store and a process of its own (one emitter per process)."""
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for events_to in ("sink", "on", "unreachable"):
        stack: list = []
        try:
            prefect_for_events(events_to, stack)
            url = args.url or serve(args.backend, stack)
            with ctx.Pool(1) as pool:
                rows.append({"backend": args.backend, **pool.apply(paired, (url, args.nodes, events_to))})
        finally:
            for stop in reversed(stack):
                stop()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_rows("one process, jobs with and without emitting, interleaved", rows)
    if args.write:
        lines = ["| backend | events go to | ms per job, not emitting | ms per job, emitting | paired ratio | "
                 "events sent | dropped | failed |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['backend']} | {r['events']} | {r['ms_per_job_off']} | {r['ms_per_job_on']} | "
                  f"{r['paired_ratio']:.2f} | {r['events_sent']:,} | {r['events_dropped']:,} | {r['events_failed']:,} |"
                  for r in rows]
        body = provenance("store.py", f"{multiprocessing.cpu_count()} cores") + "\n\n" + "\n".join(lines)
        write_section(args.write, f"store-events-paired-{args.backend}", body)


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
    parser.add_argument("--events", choices=["off", "on", "sink", "unreachable"],
                        help="emit the worker's placement events: off, to a Prefect server (on), to an endpoint that "
                             "takes them at once (sink), to a hung server (unreachable)")
    parser.add_argument("--events-paired", action="store_true",
                        help="--backend, one process: jobs with and without emitting, interleaved (sink, on, "
                             "unreachable)")
    parser.add_argument("--events-compare", action="store_true",
                        help="--backend with events off, sink, on and unreachable, 1 and 8 processes")
    parser.add_argument("--statements", action="store_true",
                        help="postgresql: also report the statements that took the server's time (pg_stat_statements)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", help="replace the store section of this markdown file")
    args = parser.parse_args()
    if args.events_paired:
        events_paired(args)
        return
    if args.events_compare:
        runs = [(args.backend, n, e) for e in ("off", "sink", "on", "unreachable") for n in (1, 8)]
    elif args.all:
        runs = [(b, n, args.events) for b in ("sqlite", "redis", "postgresql") for n in (1, 8)]
    else:
        runs = [(args.backend, args.processes, args.events)]
    rows = []
    with Progress(transient=True) as progress:
        task = progress.add_task("measuring", total=len(runs))
        for backend, processes, events in runs:
            stack: list = []
            try:
                prefect_for_events(events, stack)
                statements = args.statements and backend == "postgresql" and not args.url
                url = args.url or serve(backend, stack, statements)
                rows.append({"backend": backend, "mode": args.mode,
                             **measure(url, processes, args.seconds, args.nodes, args.mode, events)})
                if statements:
                    rows[-1]["statements"] = statement_times(url, rows[-1]["commits"])
            finally:
                for stop in reversed(stack):
                    stop()
            progress.advance(task)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_rows(f"store under contention ({args.seconds:g} s per run)",
                   [{k: v for k, v in r.items() if k != "statements"} for r in rows])
        for r in rows:
            if r.get("statements"):
                print_rows(f"{r['backend']}, {r['processes']} processes: the server's time by statement", r["statements"])
    if args.write and args.events_compare:
        lines = ["| backend | mode | processes | events | commits/s | releases/s | events sent | dropped | failed |",
                 "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['backend']} | {r['mode']} | {r['processes']} | {r.get('events', 'off')} | "
                  f"{r['commits_per_s']:,} | {r['releases_per_s']:,} | {r.get('events_sent', 0):,} | "
                  f"{r.get('events_dropped', 0):,} | {r.get('events_failed', 0) + r.get('events_left', 0):,} |"
                  for r in rows]
        body = provenance("store.py", f"{multiprocessing.cpu_count()} cores") + "\n\n" + "\n".join(lines)
        write_section(args.write, f"store-events-{args.backend}-{args.mode}", body)
    elif args.write:
        lines = ["| backend | mode | processes | commits/s | releases/s | conflict rate | refused | overbooking |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['backend']} | {r['mode']} | {r['processes']} | {r['commits_per_s']:,} | {r['releases_per_s']:,} | "
                  f"{r['conflict_rate']:.2%} | {r['refused']} | {r['overbooking']} |" for r in rows]
        body = provenance("store.py", f"{multiprocessing.cpu_count()} cores") + "\n\n" + "\n".join(lines)
        write_section(args.write, f"store-{args.mode}", body)


if __name__ == "__main__":
    main()
