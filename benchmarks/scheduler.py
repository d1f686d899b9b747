"""Placement decisions per second for clusters of 10 to 10,000 nodes.

Mixed cluster: half CPU-only nodes of three sizes, half GPU nodes of four device types (NVIDIA A100 40 GB,
L4 24 GB, T4 16 GB, AMD MI210 64 GB); half of every node's CPU, memory and GPUs already booked.
Requests: CPU-only, one GPU with a memory minimum, two CUDA GPUs with a capability, a dynamic port.

Numbers per size:
- warm: a long-lived ClusterView, as a placer keeps between decisions: choose + book one agent.
- cold: the whole pure ``plan_job`` call, as the ``plan`` command runs it: build the view from node records
  and active placements, place, build the Placement with its env hints (explain=False). The same record
  objects each call, as the store's snapshots hand them out: what the scheduler derives per record and per list
  of records is memoised (scheduler/classes.py); the active placements are read anew every call.
- cold, first sight: the same call with those memos emptied before it (untimed), as for records never seen.
- store columns, first sight: the same call on the columns a store snapshot hands out (scheduler/columns.py: the
  nodes and what is held on them as arrays, each record derived once when it changed, built here untimed by the
  store's own ``snapshot_of`` from the usage and claims a commit writes), with the scheduler's memos emptied
  before each call; and the same with the memos kept (store columns, warm memos).

``--fleet sharing`` (docs/resources.md, "Sharing GPUs"): every node has 8 A100 80 GB GPUs; a quarter of the nodes have
them in MIG mode, each cut into 7 1g.10gb slices (64 devices a node); a quarter of every node's GPUs (or of a MIG node's
slices) already booked. Requests: one whole GPU, one with a 40 GB memory minimum (best fit across nodes), two slices, a
quarter of a GPU, half a GPU with 30 GB of its memory.

Usage: python benchmarks/scheduler.py [--sizes 10,100,1000,10000] [--fleet mixed|sharing] [--seconds 2] [--json]
       [--write BENCHMARKS.md] [--profile warm|cold|first|columns --sizes N]
Pinned to one CPU core. ``--profile`` runs one workload under cProfile and prints its top functions instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from rich.progress import Progress

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import print_rows, write_section  # noqa: E402

from mn_prefect.model.blueprint import parse_blueprint
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.scheduler import Ask, ClusterView, plan_job
from mn_prefect.scheduler.classes import forget
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.quotas import Queues
from mn_prefect.store.booking import NodeState, added, demand_by_node, snapshot_of

GPU_TYPES = [
    ("A100-40GB", "nvidia", "cuda", 40960, ["fp16", "bf16", "tf32"], 4),
    ("L4", "nvidia", "cuda", 24576, ["fp16", "bf16", "fp8"], 8),
    ("T4", "nvidia", "cuda", 16384, ["fp16"], 2),
    ("MI210", "amd", "rocm", 65536, ["fp16", "bf16"], 4),
]
CPU_SIZES = [(8, 32768), (32, 131072), (64, 262144)]


def make_nodes(count: int) -> list[NodeRecord]:
    nodes = []
    for i in range(count):
        if i % 2 == 0:
            cpu, mem = CPU_SIZES[(i // 2) % len(CPU_SIZES)]
            devices, caps = [], ["avx2"]
        else:
            model, vendor, driver, memory, caps, n = GPU_TYPES[(i // 2) % len(GPU_TYPES)]
            cpu, mem = 32, 131072
            devices = [{"id": f"node{i:05d}-gpu{j}", "index": j, "vendor": vendor, "driver": driver, "model": model,
                        "memory_total_mb": memory, "capabilities": caps} for j in range(n)]
            caps = ["avx2"]
        nodes.append(NodeRecord.model_validate({
            "name": f"node{i:05d}", "cpu_cores": cpu, "memory_mb": mem, "disk_mb": 500_000, "devices": devices,
            "capabilities": caps, "labels": {"rack": f"r{i % 4}"}, "host_paths": ["/data"],
        }))
    return nodes


def half_booked(nodes: list[NodeRecord]) -> list[Placement]:
    active = []
    for node in nodes:
        gpus = node.gpu_devices[: len(node.gpu_devices) // 2]
        active.append(Placement(
            agent_id=f"existing@{node.name}", node=node.name,
            resources={"cpu_cores": node.cpu_cores / 2, "memory_mb": node.memory_mb / 2, "gpu_count": len(gpus)},
            allocation={"devices": gpus, "ports": [{"label": "x", "port": 20000}]},
        ))
    return active


def sharing_nodes(count: int) -> list[NodeRecord]:
    nodes = []
    for i in range(count):
        mig = i % 4 == 0
        devices = []
        for j in range(8):
            gpu_id = f"node{i:05d}-gpu{j}"
            devices.append({"id": gpu_id, "index": j, "vendor": "nvidia", "driver": "cuda", "model": "A100-80GB",
                            "memory_total_mb": 81920, "capabilities": ["fp16", "bf16", "tf32"], "mig_mode": mig})
            if mig:
                devices += [{"id": f"MIG-{gpu_id}-{k}", "index": j, "vendor": "nvidia", "driver": "cuda",
                             "model": "A100-80GB", "memory_total_mb": 9984, "capabilities": ["fp16", "bf16", "tf32"],
                             "parent": gpu_id, "mig_profile": "1g.10gb"} for k in range(7)]
        nodes.append(NodeRecord.model_validate({
            "name": f"node{i:05d}", "cpu_cores": 64, "memory_mb": 524288, "disk_mb": 500_000, "devices": devices,
            "labels": {"rack": f"r{i % 4}"},
        }))
    return nodes


def quarter_booked(nodes: list[NodeRecord]) -> list[Placement]:
    active = []
    for node in nodes:
        slices = [d for d in node.devices if d.parent is not None]
        taken = slices[: len(slices) // 4] if slices else node.gpu_devices[:2]
        active.append(Placement(
            agent_id=f"existing@{node.name}", node=node.name,
            resources={"cpu_cores": node.cpu_cores / 4, "memory_mb": node.memory_mb / 4,
                       "gpu_count": 0 if slices else len(taken)},
            allocation={"devices": taken},
        ))
    return active


SHARING_REQUESTS = [
    {"cpu": 1, "memory_gb": 4, "gpu": 1},
    {"cpu": 1, "memory_gb": 4, "devices": [{"kind": "gpu", "min_memory_mb": 40000}]},
    {"cpu": 1, "memory_gb": 2, "devices": [{"kind": "gpu", "mig_profile": "1g.10gb", "count": 2}]},
    {"cpu": 1, "memory_gb": 2, "devices": [{"kind": "gpu", "shares": 0.25}]},
    {"cpu": 1, "memory_gb": 2, "devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": 30000}]},
]
FLEETS = {"mixed": (make_nodes, half_booked, None), "sharing": (sharing_nodes, quarter_booked, SHARING_REQUESTS)}

REQUESTS = [
    {"cpu": 2, "memory_gb": 4},
    {"cpu": 1, "memory_gb": 2, "ports": [{"label": "api"}]},
    {"cpu": 4, "memory_gb": 16, "devices": [{"kind": "gpu", "min_memory_mb": 20000}]},
    {"cpu": 8, "memory_gb": 32, "devices": [{"kind": "gpu", "driver": "cuda", "count": 2, "capabilities": ["bf16"]}]},
]


def store_columns(nodes, active):
    """The columns a store snapshot hands out with ``active`` booked: per node the usage and claims a commit writes
    (rounded as every backend rounds them), then the snapshot's own builder."""
    demands = demand_by_node(active)
    states = []
    for node in nodes:
        demand = demands.get(node.name)
        used = added({}, demand.add) if demand else {}
        held = {kind: set(keys) for kind, keys in demand.claim.items()} if demand else {}
        states.append(NodeState(record=node, used={k: v for k, v in used.items() if v}, held=held))
    return snapshot_of(states, Limits(), Queues.of([], []), group=f"benchmark-{len(nodes)}").columns


def warm_rate(nodes, active, asks, strategy, seconds):
    """Successful placements per second; when the cluster fills up it is reset to half booked, untimed."""
    view = ClusterView(nodes, active)
    placed = 0
    spent = 0.0
    while spent < seconds:
        start = time.perf_counter()
        full = False
        for _ in range(50):
            for ask in asks:
                choice, _ = view.place(ask, strategy)
                if choice is None:
                    full = True
                    break
                placed += 1
            if full:
                break
        spent += time.perf_counter() - start
        if full:
            view = ClusterView(nodes, active)
    return placed / spent


def cold_rate(nodes, active, blueprints, strategy, seconds, first_sight=False):
    """plan_job calls per second; ``first_sight``: the scheduler's memos are emptied before each call, untimed."""
    calls = 0
    spent = 0.0
    while spent < seconds:
        for bp in blueprints:
            if first_sight:
                forget()
            start = time.perf_counter()
            plan_job(bp, nodes, active, strategy=strategy, explain=False)
            spent += time.perf_counter() - start
            calls += 1
    return calls / spent


def measure(sizes, seconds, strategy, fleet="mixed"):
    build_nodes, booked, requests = FLEETS[fleet]
    requests = requests or REQUESTS
    asks = [Ask(agent_id=f"r{i}", request=resource_request(r)) for i, r in enumerate(requests)]
    blueprints = [parse_blueprint({"nodes": [{"node_id": "w", "resources": r}]})[0] for r in requests]
    rows = []
    with Progress(transient=True) as progress:
        task = progress.add_task("measuring", total=len(sizes))
        for size in sizes:
            nodes = build_nodes(size)
            active = booked(nodes)
            forget()
            build = time.perf_counter()
            view = ClusterView(nodes, active)
            build = time.perf_counter() - build
            warm = warm_rate(nodes, active, asks, strategy, seconds)
            cold = cold_rate(nodes, active, blueprints, strategy, seconds / 2)
            first = cold_rate(nodes, active, blueprints, strategy, seconds / 4, first_sight=True)
            columns = store_columns(nodes, active)
            columns_first = cold_rate(columns, (), blueprints, strategy, seconds / 4, first_sight=True)
            columns_warm = cold_rate(columns, (), blueprints, strategy, seconds / 4)
            forget()
            start = time.perf_counter()
            ClusterView(columns)
            columns_build = time.perf_counter() - start
            rows.append({"nodes": size, "classes": len(view.class_members), "warm_per_s": round(warm),
                         "warm_us": round(1e6 / warm, 1), "warm_ns_per_node": round(1e9 / warm / size, 1),
                         "cold_plans_per_s": round(cold, 1), "first_sight_plans_per_s": round(first, 1),
                         "view_build_ms": round(build * 1000, 2),
                         "columns_first_sight_plans_per_s": round(columns_first, 1),
                         "columns_warm_plans_per_s": round(columns_warm, 1),
                         "columns_view_build_ms": round(columns_build * 1000, 2)})
            progress.advance(task)
    return rows


def profile(workload, size, seconds, strategy, fleet, top=15):
    """Run one workload under cProfile and print its top functions by own time."""
    import cProfile
    import pstats

    build_nodes, booked, requests = FLEETS[fleet]
    requests = requests or REQUESTS
    nodes = build_nodes(size)
    active = booked(nodes)
    asks = [Ask(agent_id=f"r{i}", request=resource_request(r)) for i, r in enumerate(requests)]
    blueprints = [parse_blueprint({"nodes": [{"node_id": "w", "resources": r}]})[0] for r in requests]
    profiler = cProfile.Profile()
    if workload == "warm":
        warm_rate(nodes, active, asks, strategy, 0.2)  # classes and rankings in place, as a placer keeps them
        profiler.enable()
        warm_rate(nodes, active, asks, strategy, seconds)
    elif workload == "columns":
        columns = store_columns(nodes, active)
        profiler.enable()
        cold_rate(columns, (), blueprints, strategy, seconds, first_sight=True)
    else:
        profiler.enable()
        cold_rate(nodes, active, blueprints, strategy, seconds, first_sight=workload == "first")
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)


def markdown(rows, command, strategy):
    lines = [
        "| nodes | node classes | warm decisions/s | µs/decision | ns/decision/node | cold plan_job/s (records, memos kept)"
        " | cold, first sight /s (records, memos emptied) | store columns, first sight /s (memos emptied)"
        " | store columns /s (memos kept) | first view build ms (records) | first view build ms (store columns) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['nodes']:,} | {r['classes']} | {r['warm_per_s']:,} | {r['warm_us']} | {r['warm_ns_per_node']} |"
                     f" {r['cold_plans_per_s']:,} | {r['first_sight_plans_per_s']:,} |"
                     f" {r['columns_first_sight_plans_per_s']:,} | {r['columns_warm_plans_per_s']:,} |"
                     f" {r['view_build_ms']} | {r['columns_view_build_ms']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000,10000")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--strategy", default="binpack", choices=["binpack", "spread"])
    parser.add_argument("--fleet", default="mixed", choices=sorted(FLEETS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", help="replace the scheduler section of this markdown file")
    parser.add_argument("--profile", choices=["warm", "cold", "first", "columns"],
                        help="profile one workload (the first of --sizes) with cProfile and print the top functions")
    args = parser.parse_args()
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    except (AttributeError, OSError):
        pass
    if args.profile:
        profile(args.profile, int(args.sizes.split(",")[0]), args.seconds, args.strategy, args.fleet)
        return
    load_before = os.getloadavg()
    rows = measure([int(s) for s in args.sizes.split(",")], args.seconds, args.strategy, args.fleet)
    load = f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after, {os.cpu_count()} cores"
    if args.json:
        print(json.dumps({"strategy": args.strategy, "python": platform.python_version(), "rows": rows}, indent=2))
    else:
        print_rows(f"scheduler ({args.strategy}, one core)", rows)
    if args.write:
        command = "python benchmarks/scheduler.py " + " ".join(sys.argv[1:])
        body = (f"Command: `{command}` ({platform.machine()}, Python {platform.python_version()}, one core, "
                f"strategy {args.strategy}, fleet {args.fleet}, {time.strftime('%Y-%m-%d')}; {load})\n\n"
                f"{markdown(rows, command, args.strategy)}")
        write_section(args.write, "scheduler" if args.fleet == "mixed" else f"scheduler-{args.fleet}", body)


if __name__ == "__main__":
    main()
