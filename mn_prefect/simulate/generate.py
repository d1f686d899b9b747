"""Synthetic traces for the simulator (``mn-prefect simulate --generate N --seed S``).

Poisson arrivals (exponential gaps, ``rate`` jobs a second) and exponential durations (mean ``mean_duration``
seconds, at least 1 s), each job drawing one request from a fixed mix: 55% CPU-only (0.5 to 8 cores), 20% whole
GPUs (one, two, or one with a 20 GB memory minimum), 10% MIG slices (one or two of a profile), 15% fractions of
one GPU (a quarter with 4 GB, a half with 8 GB). The same N, seed and options always give the same trace.

Without nodes, the mix is written for the mock fleets of deployments/ (MIG slices of profile ``1g.10gb``, which
only ``mock-nodes-mig.json`` has: against ``mock-nodes.json`` those jobs are refused as not runnable) and the
rate is one job every 40 s. With nodes, every request is one the fleet can run (the scheduler is asked against
the empty fleet; MIG requests use the fleet's own profiles), the classes with nothing left drop out of the mix,
and the default rate offers 80% of the fleet's bottleneck (CPU, memory or GPUs) over time.
"""

from __future__ import annotations

import bisect
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass

from mn_prefect.model.node import NodeRecord
from mn_prefect.model.resources import resource_request
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.view import ClusterView

DEFAULT_RATE = 1 / 40  # jobs a second without a fleet to size it
DEFAULT_DURATION = 300.0
TARGET_LOAD = 0.8
DEFAULT_MIG_PROFILE = "1g.10gb"


@dataclass(frozen=True)
class Kind:
    """A class of requests in the mix, with its share and its requests (each with a weight within the class)."""

    name: str
    share: float
    requests: tuple[tuple[dict, float], ...]


def _mix(mig_profiles: list[str]) -> list[Kind]:
    mig: list[tuple[dict, float]] = []
    for profile in mig_profiles:
        for count, weight in ((1, 3.0), (2, 1.0)):
            mig.append(({"cpu": 2, "memory": 8192, "devices": [{"kind": "gpu", "mig_profile": profile,
                                                                 "count": count}]}, weight / len(mig_profiles)))
    return [
        Kind("cpu", 0.55, (({"cpu": 0.5, "memory": 1024}, 3.0), ({"cpu": 1, "memory": 2048}, 4.0),
                           ({"cpu": 2, "memory": 4096}, 4.0), ({"cpu": 4, "memory": 8192}, 2.0),
                           ({"cpu": 8, "memory": 32768}, 1.0))),
        Kind("gpu", 0.20, (({"cpu": 4, "memory": 16384, "gpu": 1}, 6.0), ({"cpu": 8, "memory": 32768, "gpu": 2}, 1.0),
                           ({"cpu": 4, "memory": 16384, "devices": [{"kind": "gpu", "min_memory_mb": 20000}]}, 2.0))),
        Kind("mig", 0.10, tuple(mig)),
        Kind("fraction", 0.15, (({"cpu": 1, "memory": 4096, "devices": [{"kind": "gpu", "shares": 0.25,
                                                                          "memory_mb": 4096}]}, 2.0),
                                ({"cpu": 2, "memory": 8192, "devices": [{"kind": "gpu", "shares": 0.5,
                                                                          "memory_mb": 8192}]}, 1.0))),
    ]


def _demand(raw: dict) -> tuple[float, float, float]:
    """CPU cores, memory MB and GPUs (slices and fractions as parts of one) of a request in the mix."""
    gpu = float(raw.get("gpu", 0))
    for device in raw.get("devices", []):
        if "shares" in device:
            gpu += device["shares"]
        elif "mig_profile" in device:
            gpu += device["count"] * int(device["mig_profile"].split("g.")[0][-1]) / 7
        else:
            gpu += device.get("count", 1)
    return float(raw.get("cpu", 0)), float(raw.get("memory", 0)), gpu


def plan_mix(nodes: list[NodeRecord] | None) -> list[Kind]:
    """The mix, kept to what ``nodes`` can run when given."""
    if nodes is None:
        return _mix([DEFAULT_MIG_PROFILE])
    profiles = sorted({d.mig_profile for n in nodes for d in n.devices if d.mig_profile})
    view = ClusterView(nodes)
    kinds = []
    for kind in _mix(profiles):
        kept = []
        for raw, weight in kind.requests:
            choice, _ = view.place(Ask(agent_id="probe", request=resource_request(raw)), "binpack")
            if choice is not None:
                assert choice.token is not None
                view.unbook(choice.token)
                kept.append((raw, weight))
        if kept:
            kinds.append(Kind(kind.name, kind.share, tuple(kept)))
    return kinds


def fleet_rate(nodes: list[NodeRecord], kinds: list[Kind], mean_duration: float) -> float:
    """Arrivals a second that offer TARGET_LOAD of the fleet's bottleneck dimension."""
    ok = [n for n in nodes if n.schedulable]
    capacity = (sum(n.cpu_cores for n in ok), sum(n.memory_mb for n in ok), float(sum(len(n.gpu_devices) for n in ok)))
    total = sum(k.share for k in kinds)
    per_job = [0.0, 0.0, 0.0]
    for kind in kinds:
        weights = sum(w for _, w in kind.requests)
        for raw, weight in kind.requests:
            for d, amount in enumerate(_demand(raw)):
                per_job[d] += kind.share / total * weight / weights * amount
    rates = [TARGET_LOAD * cap / (need * mean_duration) for cap, need in zip(capacity, per_job, strict=True)
             if need > 0 and cap > 0]
    return min(rates) if rates else DEFAULT_RATE


def generate(count: int, seed: int, *, nodes: list[NodeRecord] | None = None, rate: float | None = None,
             mean_duration: float = DEFAULT_DURATION) -> Iterator[str]:
    """``count`` trace lines (without newlines)."""
    kinds = plan_mix(nodes)
    if not kinds:
        raise ValueError("no node of the fleet can run any request of the mix (CPU-only, whole GPUs, MIG slices, "
                         "fractions): is every node unhealthy, ineligible or tiny?")
    if rate is None:
        rate = fleet_rate(nodes, kinds, mean_duration) if nodes is not None else DEFAULT_RATE
    texts: list[str] = []
    cumulative: list[float] = []
    total = 0.0
    shares = sum(k.share for k in kinds)
    for kind in kinds:
        weights = sum(w for _, w in kind.requests)
        for raw, weight in kind.requests:
            total += kind.share / shares * weight / weights
            texts.append(json.dumps(raw, separators=(",", ":")))
            cumulative.append(total)
    rng = random.Random(seed)
    width = max(6, len(str(count)))
    t = 0.0
    for k in range(count):
        t += rng.expovariate(rate)
        duration = max(1.0, rng.expovariate(1.0 / mean_duration))
        pick = min(bisect.bisect_left(cumulative, rng.random() * total), len(texts) - 1)
        yield (f'{{"t":{round(t, 3)!r},"job":"job-{k + 1:0{width}d}","duration":{round(duration, 3)!r},'
               f'"resources":{texts[pick]}}}')
