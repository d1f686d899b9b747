"""The events path at scale (issue 6/7, "Scale"): does it keep up with 1,000 nodes and 50 placements a second?

One process plays the fleet's store traffic against a real store and a real Prefect server (started here on
loopback): ``--nodes`` (1,000) registered nodes heartbeat through ``store.heartbeat`` once per
``--heartbeat-every`` (10 s), spread evenly (100 beats/s), while a ``Placer`` places ``--rate`` (50) runs a second
and releases each after ``--hold`` seconds. After each commit and release it emits what the worker emits
(``visibility.emit_placement``: ``mn.placement.created`` and the older ``committed``, ``released``), through
mn_prefect.events, whose one thread posts them to the server in batches. Every ``--sample`` (10) seconds the
emitter's backlog (events queued or being posted) is read.

Printed: backlog at start, end and max, events queued and posted per second, dropped and failed, heartbeat and
placement p50/p99 latency (ms), the rates achieved, the time to drain what is left at the end, and whether the
backlog grew: the least-squares trend of the samples over the run adds more than one batch (``events.BATCH``),
or any event was dropped.

Usage: python benchmarks/events_scale.py [--seconds 300] [--backend sqlite|redis] [--json]
"""

from __future__ import annotations

import argparse
import contextvars
import json
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from report import print_rows, provenance, require_positive  # noqa: E402

from mn_prefect import events  # noqa: E402
from mn_prefect.local_lab import PrefectServer  # noqa: E402
from mn_prefect.model.node import NodeRecord  # noqa: E402
from mn_prefect.model.resources import resource_request  # noqa: E402
from mn_prefect.placement.placing import Placer  # noqa: E402
from mn_prefect.scheduler import Ask  # noqa: E402
from mn_prefect.store import open_store  # noqa: E402
from mn_prefect.store.base import ClusterStore  # noqa: E402
from mn_prefect.worker import visibility  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def trend_per_s(samples: list[tuple[float, int]]) -> float:
    """The least-squares slope of backlog over time, in events per second."""
    if len(samples) < 2:
        return 0.0
    mean_t = sum(t for t, _ in samples) / len(samples)
    mean_b = sum(b for _, b in samples) / len(samples)
    spread = sum((t - mean_t) ** 2 for t, _ in samples)
    return sum((t - mean_t) * (b - mean_b) for t, b in samples) / spread if spread else 0.0


def paced(rate: float, until: float, stop: threading.Event):
    """Yield ``rate`` times a second until ``until`` (monotonic); behind schedule, it yields at once to catch up."""
    start, n = time.monotonic(), 0
    while not stop.is_set():
        due = start + n / rate
        if due >= until:
            return
        if (wait := due - time.monotonic()) > 0:
            time.sleep(wait)
        yield
        n += 1


def heartbeats(store: ClusterStore, names: list[str], rate: float, until: float, stop: threading.Event,
               latencies: list[float]) -> None:
    """What the nodes' workers do: each beats once per ``len(names) / rate`` seconds, spread evenly."""
    for n, _ in enumerate(paced(rate, until, stop)):
        began = time.perf_counter()
        store.heartbeat(names[n % len(names)])
        latencies.append(time.perf_counter() - began)


def placements(store: ClusterStore, rate: float, hold_s: float, until: float, stop: threading.Event,
               latencies: list[float], refused: list[str]) -> int:
    """What placing workers do: place a 1-core run, announce it; release each after ``hold_s``, announce that."""
    placer = Placer(store)
    live: deque[tuple[float, str, str]] = deque()  # (placed at, job id, node)
    released = 0

    def release(job_id: str, node: str) -> None:
        nonlocal released
        if placer.release(job_id, why="run_ended"):
            visibility.emit_placement(visibility.RELEASED, job_id, node, {"reason": "the run is Completed"})
            released += 1

    for _ in paced(rate, until, stop):
        while live and time.monotonic() - live[0][0] >= hold_s:
            release(*live.popleft()[1:])
        job_id = str(uuid.uuid4())  # a plain run is booked under its flow run's id
        began = time.perf_counter()
        result = placer.place(job_id, [Ask(agent_id=job_id, request=resource_request({"cpu_cores": 1,
                                                                                      "memory_mb": 1024}))])
        latencies.append(time.perf_counter() - began)
        if result.commit is None or not result.commit.ok:
            refused.append(result.plan.reason or "refused")
            continue
        placement = result.plan.placements[0]
        visibility.emit_placement(visibility.COMMITTED, job_id, placement.node, visibility.summary(placement))
        live.append((time.monotonic(), job_id, placement.node))
    while live:
        release(*live.popleft()[1:])
    return released


def server_count(api_url: str, since: str) -> int | None:
    """How many mn.placement.* events the server holds since ``since`` (None when it cannot say)."""
    import httpx

    body = {"filter": {"event": {"prefix": ["mn.placement."]}, "occurred": {"since": since}}}
    try:
        response = httpx.post(f"{api_url}/events/count-by/event", json=body, timeout=60)
        response.raise_for_status()
        return sum(int(row["count"]) for row in response.json())
    except Exception:
        return None


def run(args, work: Path) -> dict:
    from datetime import UTC, datetime

    from prefect.settings import PREFECT_API_URL, temporary_settings

    redis = None
    if args.backend == "redis":
        from servers import RedisServer

        redis = RedisServer(work / "redis")
        url = f"redis://127.0.0.1:{redis.port}/0"
    else:
        url = f"sqlite:///{work / 'state.db'}"
    server = PrefectServer(work / "prefect")
    try:
        setup = open_store(url)
        names = [f"scale-{i:04d}" for i in range(args.nodes)]
        for name in names:
            setup.register_node(NodeRecord(name=name, cpu_cores=16, memory_mb=65536, disk_mb=100_000))
            setup.heartbeat(name)
        setup.close()
        since = datetime.now(UTC).isoformat()
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            import prefect.client.orchestration  # noqa: F401  (imported before the clock starts, as in a worker)

            return measure(args, url, names, server.api_url, since)
    finally:
        server.stop()
        if redis is not None:
            redis.stop()


def measure(args, url: str, names: list[str], api_url: str, since: str) -> dict:
    emitter = events.emitter()
    stop = threading.Event()
    beat_lat: list[float] = []
    place_lat: list[float] = []
    refused: list[str] = []
    released: list[int] = []
    beat_store, place_store = open_store(url), open_store(url)  # one connection per worker thread, as per process
    started = time.monotonic()
    until = started + args.seconds
    # Each thread in a copy of this context: the Prefect settings (the server) the events go to come along.
    threads = [threading.Thread(target=contextvars.copy_context().run, name="heartbeats",
                                args=(heartbeats, beat_store, names, args.nodes / args.heartbeat_every, until, stop,
                                      beat_lat)),
               threading.Thread(target=contextvars.copy_context().run, name="placements",
                                args=(lambda: released.append(placements(place_store, args.rate, args.hold, until,
                                                                         stop, place_lat, refused)),))]
    for thread in threads:
        thread.start()
    samples: list[tuple[float, int]] = []
    try:
        while True:  # the last sample at the end of the load, before the runs still held are released at once
            now = time.monotonic()
            samples.append((now - started, emitter.pending))  # queued or being posted: the backlog
            print(f"  t={now - started:5.0f} s backlog={emitter.pending} sent={emitter.sent}", file=sys.stderr)
            if now >= until:
                break
            time.sleep(min(args.sample, until - now))
        sent_in_run = emitter.sent
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    elapsed = samples[-1][0]
    drain_began = time.monotonic()
    left = emitter.flush(120)
    drained_s = time.monotonic() - drain_began
    beat_store.close()
    place_store.close()
    time.sleep(2)  # the server writes what it took in the background
    backlogs = [b for _, b in samples]
    trend = trend_per_s(samples)
    return {
        "backend": args.backend, "nodes": args.nodes, "seconds": round(elapsed, 1),
        "heartbeats_per_s": round(len(beat_lat) / elapsed, 1), "placements_per_s": round(len(place_lat) / elapsed, 1),
        "releases": released[0] if released else 0, "refused": len(refused),
        "events_sent_per_s": round(sent_in_run / elapsed, 1), "events_sent": emitter.sent,
        "dropped": emitter.dropped, "failed": emitter.failed, "on_server": server_count(api_url, since),
        "backlog_start": backlogs[0], "backlog_end": backlogs[-1], "backlog_max": max(backlogs),
        "backlog_trend_per_s": round(trend, 3), "left_after_drain": left, "drain_s": round(drained_s, 2),
        "heartbeat_p50_ms": round(percentile(beat_lat, 0.5) * 1000, 2),
        "heartbeat_p99_ms": round(percentile(beat_lat, 0.99) * 1000, 2),
        "placement_p50_ms": round(percentile(place_lat, 0.5) * 1000, 2),
        "placement_p99_ms": round(percentile(place_lat, 0.99) * 1000, 2),
        "backlog_grew": "yes" if trend * elapsed > events.BATCH or emitter.dropped > 0 else "no",
        "samples": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300, help="how long the load runs (s)")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--heartbeat-every", type=float, default=10, help="each node's heartbeat interval (s)")
    parser.add_argument("--rate", type=float, default=50, help="placements per second")
    parser.add_argument("--hold", type=float, default=10, help="seconds each placement is held before release")
    parser.add_argument("--sample", type=float, default=10, help="seconds between backlog samples")
    parser.add_argument("--backend", choices=["sqlite", "redis"], default="sqlite")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    require_positive(parser, args, "seconds", "nodes", "heartbeat_every", "rate", "hold", "sample")
    with tempfile.TemporaryDirectory(prefix="mn-events-scale-") as work:
        result = run(args, Path(work))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    samples = result.pop("samples")
    print_rows("events path at scale", [{"figure": key, "value": value} for key, value in result.items()])
    print("backlog samples (s, events): " + ", ".join(f"{t:.0f}:{b}" for t, b in samples))
    print(provenance("events_scale.py", f"{args.backend} store", "Prefect server on the same machine"))


if __name__ == "__main__":
    main()
