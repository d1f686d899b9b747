"""Reservations against Ray placement groups, side by side in one run: create, wait until ready, p99 latency.

The same simulated GPU cluster on both sides: 4 nodes of 64 CPU cores, 256 GiB of memory and 8 GPUs. The same
reservations: ``--count`` of them (500), one at a time, each timed from the request to the moment it holds its
capacity, all held until the end of the pass (they fit together: half a core and 512 MiB each, and a GPU for
every 16th).

- Ray 2.x: a local cluster of 4 nodes (``ray.cluster_utils.Cluster``: a head and three more raylets on this
  machine, fake GPUs), a placement group of one bundle per reservation (``PACK``), ready when ``pg.wait``
  returns (the GCS reports it placed; no task is run in it).
- mn-prefect: ``reservations.reserve`` (mn_prefect/placement/reservations.py: the record, the Placer's plan and
  commit, the record's nodes, the store's event, the replica check) on a redis-server started here; ready
  when it returns (the booking is committed).

Each side makes ``--count`` reservations in a pass, held until the pass ends and then released; the sides take
turns in ABBA order (``--passes`` 2: mn-prefect, Ray, Ray, mn-prefect), so a linear drift in the machine's load
falls on both alike, and each side is measured while the other holds nothing. The turns were once chunks of 50
with everything held to the end: a side's chunks then ran beside the other's holdings, and Ray's cluster works
in the background for every placement group it holds (``--interference`` measures what that costs mn-prefect).
Each runs in a process of its own: Ray's driver in
this one, mn-prefect in a child started before Ray (Ray's client threads would otherwise share its interpreter
lock); each times its own reservations. Ray is not a dependency of mn-prefect: install it
into the environment to measure it (``pip install ray``); ``--skip-ray`` measures mn-prefect alone. Usage:
  python benchmarks/reservations_ray.py [--count 500] [--passes 2] [--json] [--write BENCHMARKS.md]
  python benchmarks/reservations_ray.py --interference [--json] [--write BENCHMARKS.md]
  python benchmarks/reservations_ray.py --skip-ray --before REV [--passes 30 --count 100]   (this code against REV's)
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from report import load_average, markdown_table, provenance, report, worktree, write_section  # noqa: E402

NODES, CPUS, MEMORY_MB, GPUS = 4, 64, 256 * 1024, 8


def shape(i: int) -> dict:
    """Reservation ``i``: half a core and 512 MiB, and one GPU for every 16th."""
    return {"cpu": 0.5, "memory_mb": 512, "gpu": 1 if i % 16 == 0 else 0}


class MnSide:
    """mn-prefect's reservations on a fresh redis-server."""

    name = "mn-prefect (Redis)"

    def __init__(self) -> None:
        import servers

        from mn_prefect.model.node import NodeRecord
        from mn_prefect.store import open_store

        self.server = servers.RedisServer(Path(tempfile.mkdtemp(prefix="mn-bench-rsv-")))
        self.store = open_store(f"redis://127.0.0.1:{self.server.port}/0")
        for n in range(NODES):
            self.store.register_node(NodeRecord(
                name=f"gpu-{n}", cpu_cores=CPUS, memory_mb=MEMORY_MB, disk_mb=1_000_000,
                devices=[{"id": f"gpu-{n}-{g}", "index": g, "vendor": "nvidia", "driver": "cuda",
                          "memory_total_mb": 81920} for g in range(GPUS)]))
        self.held: list[str] = []

    def run_chunk(self, start: int, end: int) -> tuple[list[float], float]:
        return run_chunk(self, start, end)

    def reserve(self, i: int) -> None:
        from mn_prefect.model.resources import resource_request
        from mn_prefect.placement import reservations

        want = shape(i)
        request = resource_request({"cpu_cores": want["cpu"], "memory_mb": want["memory_mb"],
                                    **({"gpu": want["gpu"]} if want["gpu"] else {})})
        made = reservations.reserve(self.store, request, want, 3600)
        assert made.record is not None, made.plan.reason
        self.held.append(made.record.job_id)

    def release_all(self) -> None:
        from mn_prefect.placement import reservations

        for rid in self.held:
            reservations.release(self.store, rid, None)
        self.held = []

    def close(self) -> None:
        self.store.close()
        self.server.stop()


class RaySide:
    """Ray placement groups on a local 4-node cluster."""

    name = "Ray placement groups"

    def __init__(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.ray = ray
        self.version = ray.__version__
        node = {"num_cpus": CPUS, "num_gpus": GPUS, "memory": MEMORY_MB * 2**20, "object_store_memory": 80 * 2**20}
        self.cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        for _ in range(NODES - 1):
            self.cluster.add_node(**node)
        ray.init(address=self.cluster.address, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
        self.cluster.wait_for_nodes()
        assert len([n for n in ray.nodes() if n["Alive"]]) == NODES
        self.held: list = []

    def run_chunk(self, start: int, end: int) -> tuple[list[float], float]:
        return run_chunk(self, start, end)

    def reserve(self, i: int) -> None:
        from ray.util.placement_group import placement_group

        want = shape(i)
        bundle = {"CPU": want["cpu"], "memory": want["memory_mb"] * 2**20, **({"GPU": want["gpu"]} if want["gpu"] else {})}
        group = placement_group([bundle], strategy="PACK")
        assert group.wait(60), f"placement group {i} not ready in 60 s"
        self.held.append(group)

    def release_all(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.held:
            remove_placement_group(group)
        self.held = []
        deadline = time.monotonic() + 30  # until the cluster has its capacity back: the next turn starts on a
        while time.monotonic() < deadline:  # settled cluster (not timed)
            if self.ray.available_resources().get("CPU", 0) >= NODES * CPUS - 1e-6:
                break
            time.sleep(0.05)

    def close(self) -> None:
        self.ray.shutdown()
        self.cluster.shutdown()


def run_chunk(side, start: int, end: int) -> tuple[list[float], float]:
    """Reservations ``start`` to ``end`` (excluded) one at a time: each one's seconds, and the chunk's."""
    latencies = []
    began = time.perf_counter()
    for i in range(start, end):
        t = time.perf_counter()
        side.reserve(i)
        latencies.append(time.perf_counter() - t)
    return latencies, time.perf_counter() - began


def _serve(conn, root: str | None = None) -> None:
    """The mn-prefect side in a process of its own: the commands of ``ProcessSide``, answered on ``conn``; with
    ``root``, the mn-prefect of that checkout (imported from there: nothing of it is imported before this)."""
    if root is not None:
        sys.path[:0] = [root]
    side = MnSide()
    try:
        while True:
            command, *args = conn.recv()
            if command == "chunk":
                conn.send(side.run_chunk(*args))
            elif command == "release":
                side.release_all()
                conn.send(None)
            else:
                break
    finally:
        side.close()
        conn.send(None)


class ProcessSide:
    """``MnSide`` in a process of its own (started before Ray): Ray's driver lives in this one, and its threads
    (gRPC, the core worker's event loop) take this interpreter's lock now and then; a reservation timed beside
    them would pay for Ray's client. The child times its own chunks, so the pipe costs nothing measured."""

    def __init__(self, root: Path | None = None, name: str = MnSide.name) -> None:
        self.name = name
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, str(root) if root else None), daemon=True)
        self.process.start()

    def run_chunk(self, start: int, end: int) -> tuple[list[float], float]:
        self.conn.send(("chunk", start, end))
        return self.conn.recv()

    def release_all(self) -> None:
        self.conn.send(("release",))
        self.conn.recv()

    def close(self) -> None:
        self.conn.send(("close",))
        self.conn.recv()
        self.process.join(30)


def measure(sides: list, count: int, passes: int, warmup: int = 20) -> list[dict]:
    """Each side makes ``warmup`` reservations (released again), then ``passes`` passes of ``count``, each released
    before the next side's turn, in ABBA order."""
    for side in sides:
        side.run_chunk(1, warmup + 1)
        side.release_all()
    latencies: dict[str, list[float]] = {side.name: [] for side in sides}
    busy: dict[str, float] = {side.name: 0.0 for side in sides}
    for turn in range(passes):
        for side in sides if turn % 2 == 0 else reversed(sides):
            times, seconds = side.run_chunk(0, count)
            side.release_all()
            latencies[side.name] += times
            busy[side.name] += seconds
    return [row(side.name, latencies[side.name], busy[side.name]) for side in sides]


def row(name: str, latencies: list[float], busy: float) -> dict:
    ms = sorted(x * 1000 for x in latencies)
    return {"system": name, "reservations": len(ms), "per_s": round(len(ms) / busy, 1),
            "p50_ms": round(statistics.median(ms), 3), "p99_ms": round(ms[int(len(ms) * 0.99) - 1], 3),
            "max_ms": round(ms[-1], 3)}


def interference(count: int, rounds: int = 2) -> list[dict]:
    """mn-prefect's ``count`` reservations (each pass released after) with no Ray cluster, beside Ray's idle
    cluster holding nothing, and beside it holding ``count`` placement groups: what a neighbour's holdings cost."""
    mn = ProcessSide()
    ray = None
    rows = []

    def passes(label: str) -> None:
        times: list[float] = []
        busy = 0.0
        for _ in range(rounds):
            lat, seconds = mn.run_chunk(0, count)
            mn.release_all()
            times += lat
            busy += seconds
        rows.append(row(f"mn-prefect, {label}", times, busy))

    try:
        mn.run_chunk(1, 21)
        mn.release_all()
        passes("no Ray cluster")
        ray = RaySide()
        ray.run_chunk(1, 21)
        ray.release_all()
        passes("beside Ray holding nothing")
        ray.run_chunk(0, count)
        passes(f"beside Ray holding {count} placement groups")
        ray.release_all()
        passes("beside Ray after it released them")
    finally:
        if ray is not None:
            ray.close()
        mn.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--passes", type=int, default=2, help="passes per side, in ABBA order (default 2)")
    parser.add_argument("--interference", action="store_true",
                        help="mn-prefect alone, beside Ray's idle cluster, and beside it holding --count groups")
    parser.add_argument("--skip-ray", action="store_true", help="measure mn-prefect alone")
    parser.add_argument("--before", help="also measure the mn-prefect of this git revision (a temporary worktree), "
                                         "taking turns with this tree's")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", help="replace the reservations-ray section (reservations-ray-before with --before, "
                                        "reservations-ray-interference with --interference) of this markdown file")
    args = parser.parse_args()
    load_before = load_average()
    if args.interference:
        from importlib.metadata import version

        rows = interference(args.count)
        summary = {"load_before": load_before, "load_after": load_average(), "ray": f"Ray {version('ray')}"}
        publish(args, f"{args.count} reservations, twice, in each setting", rows, summary,
                "reservations-ray-interference")
        return
    sides: list = []
    ray_note = ""
    with contextlib.ExitStack() as stack:
        before = stack.enter_context(worktree(ROOT, args.before)) if args.before else None
        try:
            sides.append(ProcessSide())
            if before is not None:
                sides.append(ProcessSide(before, f"mn-prefect at {args.before}"))
            if not args.skip_ray:
                try:
                    sides.append(RaySide())
                    ray_note = f"Ray {sides[-1].version}"
                except ImportError:
                    ray_note = "Ray not installed (pip install ray): mn-prefect alone"
            rows = measure(sides, args.count, args.passes)
        finally:
            for side in sides:
                side.close()
    by_name = {r["system"]: r for r in rows}
    mn, ray = by_name[MnSide.name], by_name.get(RaySide.name)
    summary = {"load_before": load_before, "load_after": load_average(), "ray": ray_note or "Ray skipped"}
    if ray is not None:
        summary.update(rate_over_ray=round(mn["per_s"] / ray["per_s"], 2), p99_over_ray=round(mn["p99_ms"] / ray["p99_ms"], 3))
    if before is not None:
        summary.update(rate_over_before=round(mn["per_s"] / by_name[sides[1].name]["per_s"], 3))
    publish(args, f"{args.count} reservations a pass, one at a time, {args.passes} passes each, on {NODES} GPU nodes",
            rows, summary, "reservations-ray-before" if before is not None else "reservations-ray")


def publish(args, title: str, rows: list[dict], summary: dict, section: str) -> None:
    """The rows for people or programs (``report``), and with ``--write`` as a table in the markdown file."""
    report(args, title, rows, "summary", summary)
    if not args.write:
        return
    lines = markdown_table(["system", "reservations", "created and ready per s", "p50 ms", "p99 ms", "max ms"],
                           [[r["system"], r["reservations"], f"{r['per_s']:,}", r["p50_ms"], r["p99_ms"], r["max_ms"]]
                            for r in rows])
    if "rate_over_ray" in summary:
        lines.append(f"\nmn-prefect over Ray: {summary['rate_over_ray']}x the rate, p99 "
                     f"{summary['p99_over_ray']:.3f} of Ray's.")
    if "rate_over_before" in summary:
        lines.append(f"\nThis tree over {args.before}: {summary['rate_over_before']}x the rate.")
    body = (provenance("reservations_ray.py", f"{multiprocessing.cpu_count()} cores", summary["ray"],
                       f"load average {summary['load_before']} before, {summary['load_after']} after")
            + "\n\n" + "\n".join(lines))
    write_section(args.write, section, body)


if __name__ == "__main__":
    main()
