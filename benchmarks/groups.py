"""Does a saturated resource group slow another one on the same store? (docs/operating.md, "Resource groups")

Group B's placer (one process, ``Placer(group="b")``) places and releases small runs as fast as it can:
placements per second and the p50/p99 latency of its commits (``commit_plan``, the store's atomic step).
Measured three ways, rounds alternating:
  - ``B alone``: nobody else writes to the store;
  - ``B, A saturated``: N committer processes place and release in group A as fast as they can, colliding
    with each other (re-plans on conflict), on the same store;
  - ``no groups``: the same N+1 processes with no groups, every placer planning against every node (what
    groups replace): B's conflicts show what it would share with A.
B's conflicts with groups must be 0: no commit in A touches a node of B. On 2 cores, B's process is pinned to
one core and A's committers to the other (the store's servers are not pinned), so B does not share its core
with A; what it loses is the store's shared step (SQLite's one writer, Redis's one thread) and the server's CPU.

Usage:
  python benchmarks/groups.py --backend sqlite|redis|postgresql [--committers 3] [--seconds 6] [--rounds 3] [--json]
  python benchmarks/groups.py --all [--write /tmp/groups_bench.md]      (every backend)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from report import markdown_table, print_rows, provenance  # noqa: E402
from store import serve  # noqa: E402  (benchmarks/store.py: a fresh store file or server per measurement)

from mn_prefect.model.bookings import FlowRun  # noqa: E402
from mn_prefect.model.node import NodeRecord  # noqa: E402
from mn_prefect.model.resources import resource_request  # noqa: E402
from mn_prefect.placement.placing import Placer  # noqa: E402
from mn_prefect.scheduler import Ask  # noqa: E402
from mn_prefect.store import open_store  # noqa: E402
from mn_prefect.store.audit import audit  # noqa: E402

NODES_PER_GROUP = 3


def nodes(group: str) -> list[NodeRecord]:
    """Three nodes of 8 cores and two GPUs each: small enough that A's committers collide all the time."""
    return [NodeRecord(name=f"{group}-{i}", group=group, cpu_cores=8, memory_mb=16384, disk_mb=100_000,
                       dynamic_port_range=(30000, 30015),
                       devices=[{"id": f"{group}-{i}-gpu{g}", "index": g, "vendor": "nvidia", "driver": "cuda",
                                 "memory_total_mb": 24576} for g in range(2)])
            for i in range(NODES_PER_GROUP)]


def prepare(url: str, grouped: bool) -> None:
    store = open_store(url)
    for group in ("a", "b"):
        store.create_group(group)
        for record in nodes(group):
            store.register_node(record if grouped else record.model_copy(update={"group": "default"}))
    store.close()


def ask(rng: random.Random) -> Ask:
    raw: dict = {"cpu_cores": rng.choice([0.5, 1, 2]), "memory_mb": rng.choice([256, 1024])}
    if rng.random() < 0.3:
        raw["gpu"] = 1
    if rng.random() < 0.3:
        raw["ports"] = [{"label": "dyn"}]
    return Ask(agent_id="run", request=resource_request(raw))


class TimedStore:
    """The store with each commit_plan timed (seconds) and its refusals counted (another placer booked first),
    everything else passed through."""

    def __init__(self, store):
        self.store = store
        self.latencies: list[float] = []
        self.conflicts = 0

    def commit_plan(self, *args, **kwargs):
        start = time.perf_counter()
        result = self.store.commit_plan(*args, **kwargs)
        self.latencies.append(time.perf_counter() - start)
        self.conflicts += not result.ok
        return result

    def __getattr__(self, name):
        return getattr(self.store, name)


def placer_loop(url: str, name: str, group: str | None, seconds: float, cpu: int | None, barrier) -> dict:
    """Place and release as fast as possible for ``seconds`` (after everyone is ready): counters, latencies."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    rng = random.Random(name)
    timed = TimedStore(open_store(url))
    placer = Placer(timed, group=group)  # type: ignore[arg-type]  # a pass-through proxy of the store
    held: list[str] = []
    counts = {"placed": 0, "refused": 0}
    placer.refresh()
    barrier.wait()
    start = time.perf_counter()
    cycle = 0
    while time.perf_counter() - start < seconds:
        cycle += 1
        if held and (rng.random() < 0.45 or len(held) > 6):
            placer.release(FlowRun(held.pop(rng.randrange(len(held)))), why="run_ended")
            continue
        result = placer.place(f"{name}-{cycle}", [ask(rng)])
        if result.placed:
            counts["placed"] += 1
            held.append(f"{name}-{cycle}")
        else:
            counts["refused"] += 1
    elapsed = time.perf_counter() - start
    for job in held:
        placer.release(FlowRun(job), why="run_ended")
    timed.store.close()
    return {**counts, "conflicts": timed.conflicts, "seconds": elapsed, "latencies": timed.latencies}


def _run(args):
    return placer_loop(*args)


def measure(url: str, mode: str, committers: int, seconds: float) -> dict:
    """One round: B's figures in ``mode`` (alone | saturated | shared), and A's commits per second."""
    a_count = 0 if mode == "alone" else committers
    two_cores = (os.cpu_count() or 1) >= 2
    jobs = [(url, "b", None if mode == "shared" else "b", seconds, 0 if two_cores else None)]
    jobs += [(url, f"a{i}", None if mode == "shared" else "a", seconds, 1 if two_cores else None)
             for i in range(a_count)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(len(jobs)) as pool:
        barrier = manager.Barrier(len(jobs))
        results = pool.map(_run, [(*job, barrier) for job in jobs])
    b, a = results[0], results[1:]
    lat = sorted(b["latencies"])
    return {
        "b_placements_per_s": b["placed"] / b["seconds"],
        "b_commit_p50_ms": 1000 * statistics.median(lat),
        "b_commit_p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "b_conflicts": b["conflicts"],
        "a_placements_per_s": sum(r["placed"] / r["seconds"] for r in a),
        "a_conflicts": sum(r["conflicts"] for r in a),
    }


LABELS = {"alone": "B alone", "saturated": "B, A saturated", "shared": "no groups (B and A share every node)"}


def bench(backend: str, committers: int, seconds: float, rounds: int) -> list[dict]:
    """Medians over ``rounds`` of each mode, modes alternating within a round (the machine's load drifts)."""
    by_mode: dict[str, list[dict]] = {m: [] for m in LABELS}
    stack: list = []
    try:
        for _ in range(rounds):
            for mode in LABELS:
                url = serve(backend, stack)
                prepare(url, grouped=mode != "shared")
                by_mode[mode].append(measure(url, mode, committers, seconds))
                store = open_store(url)
                problems = audit(store.consistent_view())
                store.close()
                assert not problems, problems
    finally:
        for stop in reversed(stack):
            stop()
    rows = []
    for mode, results in by_mode.items():
        row: dict = {"backend": backend, "case": LABELS[mode], "a_committers": 0 if mode == "alone" else committers}
        for key in results[0]:
            value = statistics.median(r[key] for r in results)
            row[key] = round(value, 2) if isinstance(value, float) else value
        rows.append(row)
    return rows


def markdown(rows: list[dict], committers: int, seconds: float, rounds: int) -> str:
    header = ["backend", "case", "B placements/s", "B commit p50 ms", "B commit p99 ms", "B conflicts",
              "A placements/s", "A conflicts"]
    body = [[r["backend"], r["case"], r["b_placements_per_s"], r["b_commit_p50_ms"], r["b_commit_p99_ms"],
             r["b_conflicts"], r["a_placements_per_s"] if r["a_committers"] else "-",
             r["a_conflicts"] if r["a_committers"] else "-"] for r in rows]
    lines = ["### Resource groups: a saturated group and its neighbour", "",
             f"One placer in group B, {committers} committer processes saturating group A on the same store; "
             f"{seconds:g} s per case, median of {rounds} rounds, cases alternating. Conflicts are commits refused "
             "because another placer booked first (each re-planned).", "", *markdown_table(header, body), "",
             provenance("groups.py", f"{os.cpu_count()} cores, B pinned to one, A's committers to the other")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["sqlite", "redis", "postgresql"], default="sqlite")
    parser.add_argument("--all", action="store_true", help="every backend")
    parser.add_argument("--committers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", help="Write the Markdown table to this file.")
    args = parser.parse_args()
    backends = ["sqlite", "redis", "postgresql"] if args.all else [args.backend]
    rows = [row for backend in backends for row in bench(backend, args.committers, args.seconds, args.rounds)]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_rows("group B's placements beside a saturated group A", rows)
    text = markdown(rows, args.committers, args.seconds, args.rounds)
    print(text)
    if args.write:
        Path(args.write).write_text(text + "\n")


if __name__ == "__main__":
    main()
