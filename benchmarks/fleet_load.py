"""A fleet's load on the shared store: 200 nodes heartbeating and 100 placements a second, for 5 minutes.

What several machines put on the one store they share (docs/several-machines.md, "Running on several machines"): every
node's worker heartbeats once per ``--heartbeat-every`` seconds (the workers' default ``MN_HEARTBEAT_SECONDS``, 10), and
the placers book and release runs. This starts a real store server on loopback (PostgreSQL as a non-root user with
``fsync=on``, or redis-server), registers ``--nodes`` nodes (16 cores, 64 GB) and runs, each in its own process as on
separate machines:

- ``--beaters`` heartbeat processes, the nodes dealt out among them; node ``i`` is due at
  ``start + i * interval / nodes + k * interval`` (the beats spread evenly, as workers started at different times
  are). **Heartbeat lag** is how late a beat landed: the moment its ``store.heartbeat`` call returned, minus when
  it was due. A beater that falls behind beats at once to catch up, so the lag says how far behind it got.
- ``--placers`` placing processes, ``--rate`` placements a second between them, each a ``Placer`` (plan against
  its cached view, commit atomically, re-plan on conflict) as a worker keeps; each run (1 core, 1 GB) is released
  ``--hold`` seconds after it was booked. **Placement latency** is one ``Placer.place`` call, conflicts included.
- This process reads every node's last heartbeat every ``--sample`` seconds: the **oldest heartbeat** is the age
  of the stalest node at that moment, the figure the node-state sweep compares with ``MN_HEARTBEAT_TIMEOUT_SECONDS``
  (30 by default); a node past it would be taken for disconnected.

Printed: the rates achieved, heartbeat lag and call p50/p99/max, oldest heartbeat p50/p99/max (and how many samples
saw a node older than the timeout), placement and release p50/p99, conflicts re-planned and refusals.

Usage: python benchmarks/fleet_load.py [--backend postgresql|redis] [--seconds 300] [--nodes 200] [--rate 100]
       [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
import uuid
from collections import Counter, deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from report import print_rows, provenance, require_positive  # noqa: E402

from mn_prefect.model.node import NodeRecord  # noqa: E402
from mn_prefect.store import open_store  # noqa: E402

HEARTBEAT_TIMEOUT_S = 30.0  # MN_HEARTBEAT_TIMEOUT_SECONDS's default


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def wait_until(moment: float) -> None:
    """Sleep until ``moment`` (``time.time()`` seconds)."""
    if (left := moment - time.time()) > 0:
        time.sleep(left)


def ready_then_start(out, go, clock) -> tuple[float, float]:
    """Say this process is ready (imported, connected), wait for the go: (start, until) as ``time.time()``."""
    out.put(("ready",))
    go.wait()
    return clock[0], clock[1]


def beater(url: str, nodes: list[tuple[str, float]], interval: float, out, go, clock) -> None:
    """One heartbeat process: ``nodes`` are (name, phase); each beats at ``start + phase + k * interval``.
    Puts (lags, call latencies) in seconds on ``out``."""
    store = open_store(url)
    start, until = ready_then_start(out, go, clock)
    lags: list[float] = []
    calls: list[float] = []
    round_start = start
    while True:
        for name, phase in nodes:
            due = round_start + phase
            if due >= until:
                store.close()
                out.put(("beats", lags, calls))
                return
            wait_until(due)
            began = time.time()
            store.heartbeat(name, now=began)
            landed = time.time()
            lags.append(landed - due)
            calls.append(landed - began)
        round_start += interval


def placer(url: str, rate: float, hold_s: float, out, go, clock) -> None:
    """One placing process: ``rate`` placements a second (paced from ``start``), each released after ``hold_s``.
    Puts (placement latencies, release latencies, refusal reasons, re-plans) on ``out``."""
    from mn_prefect.model.resources import resource_request
    from mn_prefect.placement.placing import Placer
    from mn_prefect.scheduler import Ask

    store = open_store(url)
    place = Placer(store)
    request = resource_request({"cpu_cores": 1, "memory_mb": 1024})
    held: deque[tuple[float, str]] = deque()
    placed: list[float] = []
    released: list[float] = []
    refused: list[str] = []
    conflicts = 0
    start, until = ready_then_start(out, go, clock)

    def release_one() -> None:
        began = time.time()
        place.release(held.popleft()[1], why="run_ended")
        released.append(time.time() - began)

    n = 0
    while (due := start + n / rate) < until:
        wait_until(due)
        while held and time.time() - held[0][0] >= hold_s:
            release_one()
        job_id = str(uuid.uuid4())
        began = time.time()
        result = place.place(job_id, [Ask(agent_id=job_id, request=request)])
        placed.append(time.time() - began)
        conflicts += result.attempts - 1  # each round after the first re-planned after a conflict
        if not result.placed:
            conflict = result.commit.conflict if result.commit is not None else None
            refused.append(str(conflict) if conflict is not None else result.plan.reason or "refused")
        else:
            held.append((time.time(), job_id))
        n += 1
    while held:
        release_one()
    store.close()
    out.put(("placements", placed, released, refused, conflicts))


def oldest_heartbeat_s(store) -> float:
    """The age of the stalest node's last heartbeat, in seconds."""
    now = time.time()
    return max(now - (n.last_heartbeat or 0.0) for n in store.list_nodes())


def start_store(backend: str, work: Path):
    """A fresh store server on loopback: (its URL, a function that stops it)."""
    import servers

    if backend == "redis":
        redis = servers.RedisServer(work / "redis", appendonly=True)
        return f"redis://127.0.0.1:{redis.port}/0", redis.stop
    pg = servers.PostgresServer()
    return pg.create_database("fleet"), pg.cleanup


def register(url: str, count: int) -> list[str]:
    store = open_store(url)
    names = [f"fleet-{i:03d}" for i in range(count)]
    for name in names:
        store.register_node(NodeRecord(name=name, cpu_cores=16, memory_mb=65536, disk_mb=100_000))
        store.heartbeat(name)
    store.close()
    return names


def run(args, work: Path) -> dict:
    url, stop_store = start_store(args.backend, work)
    try:
        names = register(url, args.nodes)
        return measure(args, url, names)
    finally:
        stop_store()


def measure(args, url: str, names: list[str]) -> dict:
    context = multiprocessing.get_context("spawn")
    out, go, clock = context.Queue(), context.Event(), context.Array("d", 2)
    spacing = args.heartbeat_every / len(names)
    deal = [[(name, i * spacing) for i, name in enumerate(names) if i % args.beaters == b] for b in range(args.beaters)]
    procs = [context.Process(target=beater, args=(url, nodes, args.heartbeat_every, out, go, clock))
             for nodes in deal]
    procs += [context.Process(target=placer, args=(url, args.rate / args.placers, args.hold, out, go, clock))
              for _ in range(args.placers)]
    for proc in procs:
        proc.start()
    for _ in procs:
        assert out.get(timeout=300)[0] == "ready"
    start = time.time() + 1.0
    until = start + args.seconds
    clock[0], clock[1] = start, until
    go.set()
    store = open_store(url)
    oldest: list[float] = []
    wait_until(start)
    while time.time() < until:
        if time.time() >= start + args.heartbeat_every:  # from when every node has beaten once under the load
            oldest.append(oldest_heartbeat_s(store))
            print(f"  t={time.time() - start:5.0f} s oldest heartbeat {oldest[-1]:.2f} s", file=sys.stderr)
        time.sleep(min(args.sample, max(0.0, until - time.time())))
    store.close()
    results = [out.get(timeout=args.seconds + 300) for _ in procs]
    for proc in procs:
        proc.join(60)
    lags = [x for r in results if r[0] == "beats" for x in r[1]]
    calls = [x for r in results if r[0] == "beats" for x in r[2]]
    placed = [x for r in results if r[0] == "placements" for x in r[1]]
    released = [x for r in results if r[0] == "placements" for x in r[2]]
    refused = [reason for r in results if r[0] == "placements" for reason in r[3]]
    replans = sum(r[4] for r in results if r[0] == "placements")

    def ms(values: list[float], q: float) -> float:
        return round(percentile(values, q) * 1000, 1)

    return {
        "backend": args.backend, "nodes": len(names), "seconds": args.seconds,
        "heartbeats_per_s": round(len(lags) / args.seconds, 1),
        "heartbeats_scheduled_per_s": round(len(names) / args.heartbeat_every, 1),
        "placements_per_s": round(len(placed) / args.seconds, 1), "releases": len(released), "refused": len(refused),
        "replans_after_conflict": replans,
        "heartbeat_lag_p50_ms": ms(lags, 0.5), "heartbeat_lag_p99_ms": ms(lags, 0.99),
        "heartbeat_lag_max_ms": ms(lags, 1.0),
        "heartbeat_call_p50_ms": ms(calls, 0.5), "heartbeat_call_p99_ms": ms(calls, 0.99),
        "oldest_heartbeat_p50_s": round(percentile(oldest, 0.5), 2),
        "oldest_heartbeat_p99_s": round(percentile(oldest, 0.99), 2),
        "oldest_heartbeat_max_s": round(max(oldest), 2) if oldest else None,
        "samples_past_timeout": sum(1 for age in oldest if age > HEARTBEAT_TIMEOUT_S), "samples": len(oldest),
        "placement_p50_ms": ms(placed, 0.5), "placement_p99_ms": ms(placed, 0.99), "placement_max_ms": ms(placed, 1.0),
        "release_p50_ms": ms(released, 0.5), "release_p99_ms": ms(released, 0.99),
        "refusal_reasons": "; ".join(f"{n} x {why}" for why, n in Counter(refused).most_common(3)) or "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["postgresql", "redis"], default="postgresql")
    parser.add_argument("--seconds", type=float, default=300, help="how long the load runs (s); recorded runs: 300")
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--heartbeat-every", type=float, default=10, help="each node's heartbeat interval (s)")
    parser.add_argument("--rate", type=float, default=100, help="placements per second, all placers together")
    parser.add_argument("--hold", type=float, default=2, help="seconds each placement is held before its release")
    parser.add_argument("--beaters", type=int, default=4, help="heartbeat processes (the nodes dealt among them)")
    parser.add_argument("--placers", type=int, default=4, help="placing processes (the rate split among them)")
    parser.add_argument("--sample", type=float, default=2, help="seconds between readings of the oldest heartbeat")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    require_positive(parser, args, "seconds", "nodes", "heartbeat_every", "rate", "hold", "beaters", "placers", "sample")
    with tempfile.TemporaryDirectory(prefix="mn-fleet-load-") as work:
        result = run(args, Path(work))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print_rows("a fleet's load on the store", [{"figure": key, "value": value} for key, value in result.items()])
    print(provenance("fleet_load.py", f"{args.backend} store on loopback", f"{args.beaters} heartbeat and "
                     f"{args.placers} placing processes"))


if __name__ == "__main__":
    main()
