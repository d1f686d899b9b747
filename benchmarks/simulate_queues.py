"""Three teams on one GPU fleet, replayed under FIFO, fair share, and fair share with preemption.

The fleet: 8 nodes of 4 GPUs (32 GPUs). The trace (seeded): team ``batch`` submits a day of work at once (640
one-GPU jobs of 30 to 90 minutes, preemptible); teams ``research`` and ``interactive`` submit steadily over the
same hours (Poisson arrivals, one-GPU jobs of 10 to 30 minutes and 2 to 10 minutes; interactive has priority 10).
Each team's queue has a quota of a third of the fleet in one cohort, so each may borrow what the others leave.

Run: ``python benchmarks/simulate_queues.py`` (prints the table; ``--json`` for the figures; ``--write`` puts them
in BENCHMARKS.md between its simulate-queues markers).
"""

from __future__ import annotations

import json
import platform
import random
import re
import sys
import time
from pathlib import Path

from mn_prefect.model.node import NodeRecord
from mn_prefect.model.queues import QueueSpec
from mn_prefect.simulate.fair import POLICIES, replay_queues
from mn_prefect.simulate.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]


def fleet() -> list[NodeRecord]:
    return [NodeRecord(name=f"gpu-{i}", cpu_cores=32, memory_mb=262144, disk_mb=1_000_000,
                       devices=[{"id": f"gpu-{i}-{k}", "index": k, "kind": "gpu", "vendor": "nvidia", "driver": "cuda",
                                 "model": "NVIDIA A100", "memory_total_mb": 81920} for k in range(4)])
            for i in range(8)]


QUEUES = [QueueSpec(name="batch", quota={"gpu": 11}, cohort="fleet", weight=1),
          QueueSpec(name="research", quota={"gpu": 11}, cohort="fleet", weight=1),
          QueueSpec(name="interactive", quota={"gpu": 10}, cohort="fleet", weight=1, priority=10)]


def trace_lines(seed: int = 1, hours: float = 20.0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(640):
        lines.append({"t": rng.uniform(0, 60), "job": f"b{i}", "duration": rng.uniform(1800, 5400),
                      "resources": {"gpu": 1, "cpu": 4}, "queue": "batch", "preemptible": True})
    for team, mean_gap, low, high in (("research", 300.0, 600, 1800), ("interactive", 240.0, 120, 600)):
        t, n = 0.0, 0
        while t < hours * 3600:
            t += rng.expovariate(1.0 / mean_gap)
            lines.append({"t": t, "job": f"{team[0]}{n}", "duration": rng.uniform(low, high),
                          "resources": {"gpu": 1, "cpu": 2}, "queue": team})
            n += 1
    lines.sort(key=lambda line: line["t"])
    return [json.dumps(line) for line in lines]


def run() -> dict:
    trace = read_trace(trace_lines())
    results = {policy: replay_queues(fleet(), trace, QUEUES, policy, half_life_s=3600) for policy in POLICIES}
    fifo, fair = results["fifo"], results["fair"]
    return {
        "machine": f"{platform.machine()}, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}",
        "jobs": len(trace),
        "results": {p: r.as_dict() for p, r in results.items()},
        "research_p95_cut": fifo.queues["research"].wait_p95 / max(fair.queues["research"].wait_p95, 1e-9),
        "interactive_p95_cut": fifo.queues["interactive"].wait_p95 / max(fair.queues["interactive"].wait_p95, 1e-9),
        "fair_utilisation_vs_fifo": fair.util_gpu / fifo.util_gpu,
        "preempt_utilisation_vs_fifo": results["preempt"].util_gpu / fifo.util_gpu,
    }


def table(doc: dict) -> str:
    rows = ["| policy | GPU utilisation | makespan | queue | jobs | wait p50 | wait p95 | mean slowdown | "
            "preempted | Jain |", "|---|---|---|---|---|---|---|---|---|---|"]
    for policy, r in doc["results"].items():
        for k, (queue, q) in enumerate(r["queues"].items()):
            head = (f"{policy} | {r['utilisation']['gpu']:.1%} | {r['makespan_s'] / 3600:.1f} h" if k == 0
                    else " | | ")
            jain = f"{r['jain']:.3f}" if k == 0 else ""
            rows.append(f"| {head} | {queue} | {q['jobs']} | {q['wait_s']['p50'] / 60:.1f} min | "
                        f"{q['wait_s']['p95'] / 60:.1f} min | {q['slowdown_mean']:.2f} | {q['preempted']} | {jain} |")
    return "\n".join(rows)


if __name__ == "__main__":
    doc = run()
    text = (f"Command: `python benchmarks/simulate_queues.py --write` ({doc['machine']}, {doc['jobs']} jobs)\n\n"
            + table(doc) + f"\n\nFair share cuts research's p95 wait {doc['research_p95_cut']:.1f}x and interactive's "
            f"{doc['interactive_p95_cut']:.1f}x, at {doc['fair_utilisation_vs_fifo']:.1%} of FIFO's GPU utilisation "
            f"({doc['preempt_utilisation_vs_fifo']:.1%} with preemption, which loses the evicted jobs' work).")
    if "--json" in sys.argv:
        print(json.dumps(doc, indent=2))
    else:
        print(text)
    if "--write" in sys.argv:
        path = ROOT / "BENCHMARKS.md"
        body = path.read_text()
        block = f"<!-- simulate-queues:start -->\n{text}\n<!-- simulate-queues:end -->"
        body = re.sub(r"<!-- simulate-queues:start -->.*<!-- simulate-queues:end -->", lambda _: block, body,
                      flags=re.S)
        path.write_text(body)
