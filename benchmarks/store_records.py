"""The SQL store's record paths (jobs, events, leases, nodes) on two versions of the code, side by side.

Times each store call over ``--ops`` calls, in µs per call (wall clock and this process's CPU), on SQLite (a
temporary file, WAL) and PostgreSQL (a server this script starts on loopback, as benchmarks/store.py does).
With ``--before REV`` the script checks REV out into a temporary worktree (or takes a directory holding another
copy of the code: ``--before DIR``, and ``--after DIR`` in place of this checkout) and runs one measurement per
code version alternately, ``--rounds`` times per backend (the order flips every round, each run on a fresh file or
database), and reports each side's median and the median of the per-round ratios after/before: on a shared
machine the two runs of a round are neighbours in time, so the ratio cancels most of the drift. Usage:
  python benchmarks/store_records.py --before REV|DIR [--after DIR] [--ops 2000] [--rounds 5] [--backend sqlite]
                                     [--write BENCHMARKS.md]
  python benchmarks/store_records.py --tree PATH --url URL [--ops 2000]   (one run of the code in PATH, as JSON)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("sqlite", "postgresql")
NODES = 24


def run_once(tree: Path, url: str, ops: int) -> dict:
    """Every operation ``ops`` times against a fresh store, with the code in ``tree``: {op: [wall µs, CPU µs]}."""
    sys.path.insert(0, str(tree))
    from mn_prefect.model.node import NodeRecord
    from mn_prefect.store import open_store
    from mn_prefect.store.base import Event, JobRecord

    store = open_store(url)
    for i in range(NODES):
        store.register_node(NodeRecord(name=f"node-{i:02d}", cpu_cores=8, memory_mb=16384, disk_mb=100_000))
    spec = {"kind": "run", "flow": "etl", "parameters": {"day": "2026-11-23", "limit": 500}, "agents": ["a", "b"]}
    job_ids = [f"job-{i}" for i in range(ops)]
    event = Event(kind="job.committed", node="node-03", job_id="job-7", reason="bench", data={"agents": 2})
    lease = store.acquire_lease("placer", "bench", 60.0)
    assert lease is not None
    calls = {
        "put_job": lambda i: store.put_job(JobRecord(job_id=job_ids[i], name="etl", job_type="run", spec=spec)),
        "get_job": lambda i: store.get_job(job_ids[i]),
        "record_event": lambda i: store.record_event(event),
        "events(limit=50)": lambda i: store.events(limit=50),
        "acquire_lease": lambda i: store.acquire_lease("placer", "bench", 60.0),
        "renew_lease": lambda i: store.renew_lease(lease, 60.0),
        "list_nodes": lambda i: store.list_nodes(),
        "get_node": lambda i: store.get_node("node-05"),
        "heartbeat": lambda i: store.heartbeat("node-05"),
        "get_limits": lambda i: store.get_limits(),
    }
    for call in calls.values():  # warm: connections, compiled statements, parsed records
        for i in range(20):
            call(i)
    out = {}
    for name, call in calls.items():
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(ops):
            call(i)
        out[name] = [(time.perf_counter() - wall) / ops * 1e6, (time.process_time() - cpu) / ops * 1e6]
    assert store.get_job(job_ids[-1]) is not None and len(store.events(limit=50)) == 50
    store.close()
    import mn_prefect

    out["code"] = mn_prefect.__file__
    return out


def measure(tree: Path, url: str, ops: int) -> dict:
    result = subprocess.run([sys.executable, __file__, "--tree", str(tree), "--url", url, "--ops", str(ops)],
                            capture_output=True, text=True, check=True)
    answer = json.loads(result.stdout)
    assert answer.pop("code").startswith(str(tree)), "the run imported another tree's code"
    return answer


def fresh_database(postgres, name: str) -> str:
    """A new database without the wait for the WAL flush on commit (``synchronous_commit=off``): with it, a
    write's 1-5 ms of fsync on this VM would drown the client-side cost this benchmark compares."""
    import psycopg

    url = postgres.create_database(name)
    with psycopg.connect(postgres.url(), autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    return url


def compare(args) -> list[dict]:
    sys.path[:0] = [str(ROOT / "tests")]
    import servers

    after_tree = Path(args.after).resolve() if args.after else ROOT
    if Path(args.before).is_dir():
        revision, worktree, made = args.before, Path(args.before).resolve(), False
    else:
        revision = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout.strip()
        worktree, made = Path(tempfile.mkdtemp(prefix="mn-before-")) / "tree", True
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), revision], cwd=ROOT, check=True,
                       capture_output=True)
    scratch = Path(tempfile.mkdtemp(prefix="mn-records-"))
    postgres = servers.PostgresServer() if "postgresql" in args.backends else None
    samples: dict[tuple[str, str], list[dict]] = {}
    try:
        for round_no in range(args.rounds):
            for backend in args.backends:
                sides = [("before", worktree), ("after", after_tree)]
                for side, tree in sides if round_no % 2 == 0 else reversed(sides):
                    name = f"r{round_no}_{side}"
                    url = f"sqlite:///{scratch / name}.db" if backend == "sqlite" else fresh_database(postgres, name)
                    samples.setdefault((backend, side), []).append(measure(tree, url, args.ops))
                    print(f"round {round_no + 1}/{args.rounds} {backend} {side}", file=sys.stderr)
    finally:
        if postgres is not None:
            postgres.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)
        if made:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    rows = []
    for backend in args.backends:
        before, after = samples[(backend, "before")], samples[(backend, "after")]
        for op in before[0]:
            rows.append({
                "backend": backend, "operation": op, "before": revision,
                "before_us": round(statistics.median(r[op][0] for r in before), 1),
                "after_us": round(statistics.median(r[op][0] for r in after), 1),
                "ratios": [round(a[op][0] / b[op][0], 3) for a, b in zip(after, before, strict=True)],
                "cpu_before_us": round(statistics.median(r[op][1] for r in before), 1),
                "cpu_after_us": round(statistics.median(r[op][1] for r in after), 1),
                "cpu_ratios": [round(a[op][1] / b[op][1], 3) for a, b in zip(after, before, strict=True)],
            })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| backend | operation | before µs/op | after µs/op | after/before per round | median ratio | "
             "CPU µs/op before → after | CPU ratio (median) |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['backend']} | {r['operation']} | {r['before_us']:,} | {r['after_us']:,} | "
              f"{' / '.join(f'{x:.2f}' for x in r['ratios'])} | {statistics.median(r['ratios']):.3f} | "
              f"{r['cpu_before_us']:,} → {r['cpu_after_us']:,} | {statistics.median(r['cpu_ratios']):.3f} |"
              for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="the git revision (or a directory with the code) to compare with")
    parser.add_argument("--after", help="a directory with the code to measure as 'after' (default: this checkout)")
    parser.add_argument("--tree", help="one run: the code in this tree (prints JSON)")
    parser.add_argument("--url", help="one run: the store to run against")
    parser.add_argument("--ops", type=int, default=2000, help="calls per operation per run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", action="append", choices=BACKENDS, dest="backends", help="default: both")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", help="replace the store-records section of this markdown file")
    args = parser.parse_args()
    if args.tree:
        print(json.dumps(run_once(Path(args.tree).resolve(), args.url, args.ops)))
        return
    if not args.before:
        parser.error("--before REV (or --tree PATH --url URL for one run)")
    args.backends = args.backends or list(BACKENDS)
    rows = compare(args)
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    if args.write:
        sys.path[:0] = [str(ROOT / "benchmarks")]
        from report import provenance, write_section

        body = provenance("store_records.py", f"{multiprocessing.cpu_count()} cores") + "\n\n" + table(rows)
        write_section(args.write, "store-records", body)


if __name__ == "__main__":
    main()
