"""Gangs in the simulator (mn_prefect/simulate): a trace line's ``gang`` makes the job that many agents, each asking
``resources``, placed all or nothing as a multi-agent job is; with holds, held on a set of distinct nodes. A gang
of two 4-GPU agents behind a stream of 1-GPU runs on three 4-GPU nodes starves greedily and starts once two nodes
drain with holds; a gang wider than the fleet is refused on arrival; bad values name the field."""

from __future__ import annotations

import json
import math
import random

import pytest

from mn_prefect.model.node import NodeRecord
from mn_prefect.simulate.engine import simulate
from mn_prefect.simulate.trace import read_trace


def fleet(nodes: int = 3) -> list[NodeRecord]:
    return [NodeRecord.model_validate({
        "name": f"g{n}", "cpu_cores": 32, "memory_mb": 131072,
        "devices": [{"id": f"g{n}-{k}", "index": k, "kind": "gpu", "vendor": "nvidia", "driver": "cuda",
                     "model": "h100", "memory_total_mb": 81920, "memory_free_mb": 81920} for k in range(4)]})
        for n in range(nodes)]


def stream(seed: int = 1, hours: float = 4.0) -> list[dict]:
    """1-GPU runs of 300-900 s offered at 95% of 12 GPUs, estimates learned from their deployment."""
    rng, t, k, lines = random.Random(seed), 0.0, 0, []
    rate = 0.95 * 12 / 600.0
    while t < hours * 3600:
        lines.append({"t": round(t, 3), "job": f"n{k}", "duration": round(rng.uniform(300, 900), 3),
                      "resources": {"cpu": 2, "gpu": 1}, "deployment": "narrow"})
        t, k = t + rng.expovariate(rate), k + 1
    return lines


GANG = {"t": 1800.0, "job": "gang", "duration": 1200.0, "resources": {"cpu": 8, "gpu": 4}, "gang": 2,
        "max_runtime_s": 1200.0}


def replay(lines: list[dict], nodes: int = 3):
    trace = read_trace([json.dumps(line) for line in lines])
    on, off = simulate(fleet(nodes), trace, ("binpack",), holds=(True, False))
    return trace, on, off


def wait_of(trace, result, job: str) -> float:
    started = result.log.started[trace.ids.index(job)]
    return math.inf if math.isnan(started) else started - trace.times[trace.ids.index(job)]


def test_a_gang_behind_a_stream_starves_greedily_and_starts_with_holds_on_two_distinct_nodes():
    lines = stream() + [GANG]
    trace, on, off = replay(lines)
    longest = max(line["duration"] for line in lines if line["job"] != "gang")
    assert wait_of(trace, on, "gang") <= longest + 60  # two nodes drained: each held node's runs end within it
    assert wait_of(trace, off, "gang") > 4 * longest  # greedy: eight GPUs of two nodes are never free at once
    assert on.holds_made >= 1 and on.admission_refused == 0 and off.admission_refused == 0
    assert on.not_runnable == off.not_runnable == 0


def test_a_gang_of_one_is_the_job_itself():
    single = dict(GANG, gang=1, job="gang")
    plain = {k: v for k, v in single.items() if k != "gang"}
    one = replay(stream(hours=1) + [single])
    other = replay(stream(hours=1) + [plain])
    assert [r.log.started.tolist() for r in one[1:]] == [r.log.started.tolist() for r in other[1:]]


def test_a_gang_wider_than_the_fleet_is_refused_on_arrival():
    trace, on, off = replay([dict(GANG, gang=4)], nodes=3)  # four 4-GPU agents, three 4-GPU nodes
    assert on.not_runnable == off.not_runnable == 1
    assert math.isnan(on.log.started[0])


@pytest.mark.parametrize(("gang", "job_type", "message"), [
    (0, "batch", "between 1 and 1024"), (2000, "batch", "between 1 and 1024"), ("two", "batch", "an integer"),
    (2, "system", "no gang")])
def test_a_bad_gang_names_the_field(gang, job_type, message):
    trace = read_trace([json.dumps(dict(GANG, gang=gang, job_type=job_type))])
    [bad] = trace.bad
    assert len(trace) == 0 and bad.problems[0].path == "gang" and message in bad.problems[0].message
