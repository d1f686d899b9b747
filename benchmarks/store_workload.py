"""A plan-and-commit workload shared by the store benchmark and the contention tests.

Each process plays a placer: random requests (CPU, memory, GPUs by id, static and dynamic ports) against
a cluster too small for all of them, committing through the store and randomly releasing its own jobs. With
``sharing``, one GPU of each gpu-b node is in MIG mode with three slices, and requests also ask for slices and
for fractions of a GPU (docs/resources.md, "Sharing GPUs").
"""

from __future__ import annotations

import functools
import json
import random
import time
from typing import TYPE_CHECKING

from mn_prefect.model.node import NodeRecord
from mn_prefect.store import open_store

if TYPE_CHECKING:
    from mn_prefect.placement.placing import Placer
    from mn_prefect.scheduler import Ask

# Store mode imports only the store and the node record (above): benchmarks/store_compare.py runs this driver
# against older revisions of the code too, which lack the planner's newer modules. Placer mode imports the rest.


def _release_run(placer: Placer, job: str) -> int:
    from mn_prefect.model.bookings import FlowRun

    return placer.release(FlowRun(job), why="run_ended")


def _gpus(node: str, memories: list[int]) -> list[dict]:
    return [{"id": f"{node}-gpu{i}", "index": i, "vendor": "nvidia", "driver": "cuda", "memory_total_mb": m}
            for i, m in enumerate(memories)]


def _mig(devices: list[dict]) -> list[dict]:
    """The last GPU in MIG mode, cut into three 2g.10gb slices."""
    parent = devices[-1]
    parent["mig_mode"] = True
    return devices + [{"id": f"{parent['id']}-mig{n}", "index": parent["index"], "vendor": "nvidia", "driver": "cuda",
                       "memory_total_mb": 9984, "parent": parent["id"], "mig_profile": "2g.10gb"} for n in range(3)]


def cluster(size: int = 3, sharing: bool = False) -> list[NodeRecord]:
    """``size`` 3 (the default): two GPU nodes with two GPUs each and one CPU node, small enough that
    processes collide all the time. Larger sizes repeat that pattern (gpu-a, gpu-b, cpu-a, gpu-a1...)."""
    nodes = []
    for i in range(size):
        suffix = "" if i < 3 else str(i // 3)
        kind = ("gpu-a", "gpu-b", "cpu-a")[i % 3] + suffix
        if i % 3 == 2:
            nodes.append(NodeRecord(name=kind, cpu_cores=4, memory_mb=8192, disk_mb=100_000,
                                    dynamic_port_range=(30000, 30015)))
        else:
            memories = [16384, 40960] if i % 3 == 0 else [24576, 24576]
            devices = _gpus(kind, memories)
            nodes.append(NodeRecord(name=kind, cpu_cores=8, memory_mb=16384, disk_mb=100_000,
                                    devices=_mig(devices) if sharing and i % 3 == 1 else devices,
                                    dynamic_port_range=(30000, 30015)))
    return nodes


DEVICE_IDS = ["gpu-a-gpu0", "gpu-a-gpu1", "gpu-b-gpu0", "gpu-b-gpu1"]
STATIC_PORTS = [{"label": "api", "port": 8000}, {"label": "grpc", "port": 8000, "protocol": "grpc"},
                {"label": "metrics", "port": 9100, "protocol": "http"}, {"label": "dns", "port": 5353, "protocol": "udp"}]


# With ``queues``: every job is placed from one of three queues, two sharing a cohort, all with quotas smaller
# than the cluster, so commits contend on the queues' accounts as much as on the nodes.
QUEUE_SETTINGS = [{"name": "qa", "quota": {"gpu": 1, "cpu": 2}, "cohort": "x"},
                  {"name": "qb", "quota": {"gpu": 1}, "borrow": {"gpu": 1}, "cohort": "x"},
                  {"name": "qc", "quota": {"cpu": 2, "memory": 2048}}]
QUEUE_NAMES = [q["name"] for q in QUEUE_SETTINGS]


def queue_specs() -> list:
    from mn_prefect.model.queues import QueueSpec

    return [QueueSpec(**q) for q in QUEUE_SETTINGS]


def random_ask(rng: random.Random, name: str, sharing: bool = False) -> Ask:
    from mn_prefect.model.resources import resource_request
    from mn_prefect.scheduler import Ask

    raw: dict = {"cpu_cores": rng.choice([0.25, 0.5, 1, 2]), "memory_mb": rng.choice([128, 512, 1024, 2048])}
    roll = rng.random()
    if roll < 0.25:
        raw["devices"] = [{"ids": [rng.choice(DEVICE_IDS)]}]
    elif roll < 0.45:
        raw["gpu"] = 1
    elif sharing and roll < 0.6:
        raw["devices"] = [{"kind": "gpu", "mig_profile": "2g.10gb", "count": rng.choice([1, 1, 2])}]
    elif sharing and roll < 0.85:
        fraction = {"kind": "gpu", "shares": rng.choice([0.25, 0.3, 0.5])}
        if rng.random() < 0.5:
            fraction["memory_mb"] = rng.choice([2048, 6000, 12000])
        raw["devices"] = [fraction]
    ports = []
    if rng.random() < 0.3:
        ports.append(dict(rng.choice(STATIC_PORTS)))
    if rng.random() < 0.4:
        ports.append({"label": "dyn"})
    if ports:
        raw["ports"] = ports
    return Ask(agent_id=name, request=resource_request(raw))


def random_booking(rng: random.Random, nodes: list[NodeRecord]):
    """A placement made up directly (no planner): what a placer would send, collisions included."""
    from mn_prefect.model.placement import Placement

    node = rng.choice(nodes)
    allocation: dict = {}
    gpus = node.gpu_devices
    if gpus and rng.random() < 0.5:
        allocation["devices"] = [rng.choice(gpus)]
    ports = []
    if rng.random() < 0.3:
        ports.append(dict(rng.choice(STATIC_PORTS)))
    if rng.random() < 0.4:
        low, high = node.dynamic_port_range
        ports.append({"label": "dyn", "port": rng.randint(low, high), "dynamic": True})
    if ports:
        allocation["ports"] = ports
    return Placement(agent_id="a", node=node.name,
                     resources={"cpu_cores": rng.choice([0.25, 0.5, 1]), "memory_mb": rng.choice([128, 512, 1024]),
                                "gpu_count": len(allocation.get("devices", []))},
                     allocation=allocation)


def run_worker(url: str, worker: int, cycles: int, seed: int, *, mode: str = "placer", size: int = 3,
               release_p: float = 0.45, duration: float | None = None, ready=None, sharing: bool = False,
               queues: bool = False) -> dict:
    """Run ``cycles`` rounds (or until ``duration`` seconds) and return counters.

    mode "placer": plan each job with the scheduler (``Placer``) and commit; "store": commit made-up
    bookings straight to the store (measures the store, not the planner). ``ready``, if given, is called once
    the store is open, before the clock starts (a barrier: every process starts measuring at once, none
    while others still import and connect).
    """
    rng = random.Random(seed)
    store = open_store(url)
    if mode != "store":
        from mn_prefect.placement.placing import Placer
        from mn_prefect.scheduler.quotas import RunQueue

        placer = Placer(store)
    if ready is not None:
        ready()
    nodes = cluster(size)
    # The bookings stand for flow runs: the placer releases through their owner's rule, as every release does.
    release = store.release if mode == "store" else functools.partial(_release_run, placer)
    mine: list[str] = []
    stats = {"worker": worker, "cycles": 0, "commits": 0, "conflicts": 0, "refused": 0, "releases": 0,
             "shared_commits": 0, "quota_refused": 0}
    start = time.perf_counter()
    for cycle in range(cycles):
        if duration is not None and time.perf_counter() - start > duration:
            break
        stats["cycles"] += 1
        if mine and (rng.random() < release_p or len(mine) > 6):
            stats["releases"] += release(mine.pop(rng.randrange(len(mine)))) > 0
            continue
        job = f"w{worker}-c{cycle}"
        if mode == "store":
            placed = store.commit_plan(job, [random_booking(rng, nodes)]).ok
            stats["conflicts"] += not placed
        else:
            asks = [random_ask(rng, "a", sharing)] + ([random_ask(rng, "b", sharing)] if rng.random() < 0.2 else [])
            queue = RunQueue(rng.choice(QUEUE_NAMES)) if queues else None
            result = placer.place(job, asks, queue=queue)
            placed = result.placed
            stats["quota_refused"] += (result.plan.reason or "").startswith("quota:")
            stats["conflicts"] += result.attempts - 1 + (0 if placed or result.commit is None else 1)
            stats["refused"] += not placed
            if placed and any(p.allocation.shares or any(d.parent for d in p.allocation.devices)
                              for p in result.plan.placements):
                stats["shared_commits"] += 1  # a fraction of a GPU or a MIG slice
        if placed:
            stats["commits"] += 1
            mine.append(job)
    stats["seconds"] = time.perf_counter() - start
    stats["live_jobs"] = mine
    store.close()
    return stats


def prepare(url: str, size: int = 3, sharing: bool = False, queues: bool = False) -> None:
    store = open_store(url)
    for node in cluster(size, sharing):
        store.register_node(node)
    for spec in queue_specs() if queues else ():
        store.set_queue(spec)
    store.close()


if __name__ == "__main__":  # python benchmarks/store_workload.py URL WORKER CYCLES SEED [sharing] [queues]
    import sys

    url, worker, cycles, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(run_worker(url, worker, cycles, seed, sharing="sharing" in sys.argv[5:],
                                queues="queues" in sys.argv[5:])))
