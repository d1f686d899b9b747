"""No run starves: a wide run behind a stream of narrow ones, with head-of-line holds and without (docs/simulator.md).

Fleet: two nodes of 4 GPUs each (32 cores, 128 GB). Trace (fixed seeds): a Poisson stream of 1-GPU runs of
300-900 s (uniform), deployment ``narrow`` (estimates learned from its completed runs), offered at 95% of the
GPUs for ``--hours``; and ``--wide`` 4-GPU runs of 1,800 s that declare ``max_runtime_s``, the first submitted
after 30 minutes and then one an hour. Each seed's trace is replayed with binpack, holds on and off
(``simulate(..., holds=(True, False))``, what ``mn-prefect simulate --holds both`` runs).

Targets (holds on), per seed:
- every wide run starts within the longest narrow run's duration + 60 s of its submission;
- GPU utilisation >= 95% of greedy's (holds off);
- the narrow runs' median wait <= 2x greedy's (an absolute 60 s of slack when greedy's median is 0).

The same again for a gang: 2 agents of 4 GPUs, all or nothing, on 3 nodes (a hold over 2 distinct nodes).

Then a sweep of the total load (narrow and wide work together, ``--loads``) over ``--sweep-seeds``: how many seeds
meet each target at each load.

Usage: python benchmarks/starvation.py [--seeds 1,2,3] [--hours 6] [--wide 1] [--loads 0.8,0.9] [--sweep-seeds 1,2]
       [--json] [--write BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from report import load_average, markdown_table, provenance, write_section  # noqa: E402

from mn_prefect.model.node import NodeRecord  # noqa: E402
from mn_prefect.simulate.engine import Result, simulate  # noqa: E402
from mn_prefect.simulate.trace import Trace, read_trace  # noqa: E402

GPUS_PER_NODE = 4
NODES = 2
NARROW = (300.0, 900.0)  # seconds, uniform
LOAD = 0.95
WIDE_DURATION = 1800.0
FIRST_WIDE = 1800.0
WIDE_EVERY = 3600.0
SLACK_S = 60.0
GANG, GANG_NODES = 2, 3  # the gang trace: 2 agents of 4 GPUs on 3 nodes


def fleet(nodes: int = NODES) -> list[NodeRecord]:
    return [NodeRecord.model_validate({
        "name": f"gpu-{n}", "cpu_cores": 32, "memory_mb": 131072, "disk_mb": 500_000,
        "devices": [{"id": f"gpu-{n}-{k}", "index": k, "kind": "gpu", "vendor": "nvidia", "driver": "cuda",
                     "model": "h100", "memory_total_mb": 81920, "memory_free_mb": 81920}
                    for k in range(GPUS_PER_NODE)]}) for n in range(nodes)]


def trace_lines(seed: int, hours: float, wide: int, nodes: int = NODES, gang: int = 1,
                total: float | None = None, bands: int = 1) -> list[str]:
    """The trace: narrow 1-GPU runs at LOAD of the GPUs of ``nodes`` nodes, and ``wide`` runs of ``gang`` agents of
    4 GPUs each (a gang of several is placed all or nothing, one agent a node). With ``total``, the narrow runs are
    offered at ``total`` less the wide runs' share, so that all the work together offers ``total`` of the GPUs.
    With ``bands`` > 1 the same narrow runs come from that many deployments, each of one band of durations
    (300-500, 500-700, 700-900 s for 3), so that each deployment's learned estimate is its own."""
    rng = random.Random(seed)
    load = LOAD
    if total is not None:
        load = total - wide * gang * GPUS_PER_NODE * WIDE_DURATION / (nodes * GPUS_PER_NODE * hours * 3600)
    rate = load * nodes * GPUS_PER_NODE / (sum(NARROW) / 2)
    lines, t, k = [], 0.0, 0
    while t < hours * 3600:
        duration = round(rng.uniform(*NARROW), 3)
        band = min(int((duration - NARROW[0]) * bands / (NARROW[1] - NARROW[0])), bands - 1)
        lines.append(json.dumps({"t": round(t, 3), "job": f"narrow-{k}", "duration": duration,
                                 "resources": {"cpu": 4, "memory": 8192, "gpu": 1},
                                 "deployment": "narrow" if bands == 1 else f"narrow-{band}"}))
        t += rng.expovariate(rate)
        k += 1
    for w in range(wide):
        lines.append(json.dumps({"t": FIRST_WIDE + w * WIDE_EVERY, "job": f"wide-{w}", "duration": WIDE_DURATION,
                                 "resources": {"cpu": 16, "memory": 32768, "gpu": GPUS_PER_NODE},
                                 "max_runtime_s": WIDE_DURATION, "deployment": "wide",
                                 **({"gang": gang} if gang > 1 else {})}))
    return lines


def figures(trace: Trace, result: Result) -> dict[str, float]:
    log = result.log
    assert log is not None
    wide_waits, narrow_waits, longest = [], [], 0.0
    for job, name in enumerate(trace.ids):
        started = log.started[job]
        wait = math.inf if math.isnan(started) else started - trace.times[job]
        if name.startswith("wide"):
            wide_waits.append(wait)
        else:
            narrow_waits.append(wait)
            longest = max(longest, trace.durations[job])
    return {"wide_wait_max_s": max(wide_waits, default=0.0), "narrow_wait_p50_s": statistics.median(narrow_waits),
            "util_gpu": result.util_gpu, "longest_narrow_s": longest, "holds_made": result.holds_made,
            "backfilled": result.backfilled}


def measure(seed: int, hours: float, wide: int, nodes: int = NODES, gang: int = 1,
            total: float | None = None, bands: int = 1) -> dict[str, object]:
    trace = read_trace(trace_lines(seed, hours, wide, nodes, gang, total, bands))
    on, off = simulate(fleet(nodes), trace, ("binpack",), holds=(True, False))
    a, b = figures(trace, on), figures(trace, off)
    # The same narrow stream with no wide run, holds on and off: what the holds themselves cost the narrow runs,
    # apart from the wide runs' own GPU-hours (which greedy never serves: its wide runs starve).
    alone = read_trace(trace_lines(seed, hours, 0, nodes, total=total, bands=bands))
    alone_on, alone_off = (figures(alone, r) for r in simulate(fleet(nodes), alone, ("binpack",), holds=(True, False)))
    bound = a["longest_narrow_s"] + SLACK_S
    checks = {"wide_within_bound": a["wide_wait_max_s"] <= bound,
              "util_at_least_95pct_of_greedy": a["util_gpu"] >= 0.95 * b["util_gpu"],
              "narrow_median_at_most_2x_greedy": a["narrow_wait_p50_s"] <= max(2 * b["narrow_wait_p50_s"], SLACK_S)}
    return {"seed": seed, "jobs": len(trace), "bound_s": round(bound, 1),
            "wide_wait_max_on_s": round(a["wide_wait_max_s"], 1), "wide_wait_max_off_s": round(b["wide_wait_max_s"], 1),
            "util_gpu_on": round(a["util_gpu"], 4), "util_gpu_off": round(b["util_gpu"], 4),
            "narrow_p50_on_s": round(a["narrow_wait_p50_s"], 1), "narrow_p50_off_s": round(b["narrow_wait_p50_s"], 1),
            "narrow_p50_no_wide_on_s": round(alone_on["narrow_wait_p50_s"], 1),
            "narrow_p50_no_wide_off_s": round(alone_off["narrow_wait_p50_s"], 1),
            "holds_made": a["holds_made"], "backfilled": a["backfilled"],
            "wall_on_s": round(on.wall_s, 3), "wall_off_s": round(off.wall_s, 3),
            "ok": all(checks.values()), "checks": checks}


def gang_section(rows: list[dict], args) -> str:
    lines = [f"### Gangs: {GANG} agents of 4 GPUs, all or nothing", "",
             f"The same stream on {GANG_NODES} nodes of {GPUS_PER_NODE} GPUs ({LOAD:.0%} of their GPUs), with "
             f"{args.wide} gang(s) of {GANG} 4-GPU agents of 1,800 s in place of the wide run: a hold over a set of "
             f"{GANG} distinct nodes, each drained. Same targets.", ""]
    lines += markdown_table(
        ["seed", "jobs", "gang wait max, on / off (s)", "bound (s)", "GPU util, on / off",
         "narrow p50 wait, on / off (s)", "narrow p50 wait with no gang, on / off (s)", "holds / backfilled",
         "targets"],
        [[r["seed"], r["jobs"], f"{r['wide_wait_max_on_s']:,} / {r['wide_wait_max_off_s']:,}", r["bound_s"],
          f"{100 * r['util_gpu_on']:.1f}% / {100 * r['util_gpu_off']:.1f}%",
          f"{r['narrow_p50_on_s']:,} / {r['narrow_p50_off_s']:,}",
          f"{r['narrow_p50_no_wide_on_s']:,} / {r['narrow_p50_no_wide_off_s']:,}",
          f"{r['holds_made']} / {r['backfilled']}", "met" if r["ok"] else "MISSED"] for r in rows])
    lines += ["", "As above, the narrow runs' extra wait is the gang's own 4 GPU-hours at 95% load (with no gang the "
                  "narrow median is the same with holds on and off); greedy never starts the gang while the stream "
                  "runs."]
    return "\n".join(lines)


def sweep(args) -> list[dict]:
    """Each target, per total load (narrow and wide work together), over ``--sweep-seeds``: how many seeds meet it."""
    seeds = [int(s) for s in args.sweep_seeds.split(",") if s.strip()]
    rows = []
    for total in (float(x) for x in args.loads.split(",") if x.strip()):
        for label, nodes, gang in (("wide", NODES, 1), (f"gang of {GANG}", GANG_NODES, GANG)):
            results = [measure(seed, args.hours, args.wide, nodes, gang, total) for seed in seeds]
            rows.append({"total_load": total, "work": label, "seeds": len(seeds),
                         **{name: sum(r["checks"][name] for r in results) for name in results[0]["checks"]},
                         "narrow_p50_on_s": [r["narrow_p50_on_s"] for r in results],
                         "narrow_p50_off_s": [r["narrow_p50_off_s"] for r in results],
                         "wide_wait_max_on_s": [r["wide_wait_max_on_s"] for r in results],
                         "bound_s": [r["bound_s"] for r in results]})
    return rows


def sweep_section(rows: list[dict], args) -> str:
    lines = ["### Where the targets hold: total load", "",
             f"The same traces with the narrow runs offered at the total load less the wide work's share (so that "
             f"all the work together offers the total), seeds {args.sweep_seeds}: how many seeds meet each target "
             "with holds on.", ""]
    lines += markdown_table(
        ["total load", "work", "wide within bound", "util >= 95% of greedy", "narrow p50 <= 2x greedy",
         "narrow p50 wait on / off per seed (s)", "wide wait max on per seed (s)"],
        [[f"{r['total_load']:.0%}", r["work"], f"{r['wide_within_bound']}/{r['seeds']}",
          f"{r['util_at_least_95pct_of_greedy']}/{r['seeds']}", f"{r['narrow_median_at_most_2x_greedy']}/{r['seeds']}",
          ", ".join(f"{a:,.0f}/{b:,.0f}" for a, b in zip(r["narrow_p50_on_s"], r["narrow_p50_off_s"], strict=True)),
          ", ".join(f"{w:,.0f}" for w in r["wide_wait_max_on_s"])] for r in rows])
    lines += ["", "The higher the load, the fewer seeds meet the targets: less spare capacity is left to pay for "
                  "the wide work. Where the narrow median target is missed, greedy never starts the wide work "
                  "(it starves until the stream ends), so greedy's narrow runs never pay for it; with holds the wide "
                  "work's GPU-hours, and the drain before it, come out of the few spare GPUs, and the narrow runs "
                  "queued behind them wait. Narrow runs queued ahead of a wide run make no hold (what one booking "
                  "frees lets each start), so the wide run's hold forms when it is submitted, not once they have "
                  "all started. More holds per pool (`max_holds` 2 or 3) made both worse in these traces "
                  "(a held GPU idles until its run's turn)."]
    return "\n".join(lines)


def backfill_rows(args) -> list[dict]:
    """Backfill at work: five wide runs (hourly) at 95% total load, the narrow runs under one deployment and under
    three of their own duration bands (so that the short band's learned estimate fits a draining node's gap)."""
    seeds = [int(s) for s in args.sweep_seeds.split(",") if s.strip()]
    rows = []
    for bands in (1, 3):
        results = [measure(seed, args.hours, 5, NODES, 1, 0.95, bands) for seed in seeds]
        rows.append({"bands": bands, "backfilled": [r["backfilled"] for r in results],
                     "narrow_p50_on_s": [r["narrow_p50_on_s"] for r in results],
                     "narrow_p50_off_s": [r["narrow_p50_off_s"] for r in results],
                     "util_gpu_on": [r["util_gpu_on"] for r in results],
                     "wide_wait_max_on_s": [r["wide_wait_max_on_s"] for r in results]})
    return rows


def backfill_section(rows: list[dict], args) -> str:
    lines = ["### Backfill: estimates per deployment", "",
             f"Five wide runs (hourly from 30 min) at 95% total load, seeds {args.sweep_seeds}: the narrow runs of "
             "300-900 s under one deployment, and the same runs under three deployments of their own duration "
             "bands (300-500, 500-700, 700-900 s: flows whose typical runtimes differ). A run backfills a draining "
             "node only when its learned estimate ends before the hold's expected start.", ""]
    lines += markdown_table(
        ["deployments", "backfilled per seed", "narrow p50 wait on / off per seed (s)", "GPU util on per seed",
         "wide wait max on per seed (s)"],
        [[r["bands"], ", ".join(str(b) for b in r["backfilled"]),
          ", ".join(f"{a:,.0f}/{b:,.0f}" for a, b in zip(r["narrow_p50_on_s"], r["narrow_p50_off_s"], strict=True)),
          ", ".join(f"{100 * u:.1f}%" for u in r["util_gpu_on"]),
          ", ".join(f"{w:,.0f}" for w in r["wide_wait_max_on_s"])] for r in rows])
    lines += ["", "With one deployment every narrow run's estimate is the p90 of 300-900 s, longer than any gap a "
                  "draining node leaves, so nothing backfills; with estimates per deployment the short band's runs "
                  "fill some of the gaps. Backfill stays rare here: a hold stands only while one node drains for a "
                  "wide run (at most a narrow run's length, five times in six hours)."]
    return "\n".join(lines)


def section(rows: list[dict], args) -> str:
    lines = ["## No run starves: head-of-line holds with backfill", "",
             provenance("starvation.py", f"load average {load_average()}"), "",
             f"Two nodes of {GPUS_PER_NODE} GPUs; 1-GPU runs of 300-900 s offered at {LOAD:.0%} of the GPUs for "
             f"{args.hours:g} h; {args.wide} 4-GPU runs of 1,800 s (the first after 30 min, then hourly). Binpack; "
             "holds on beside the greedy baseline (holds off). Target: every wide run starts within the longest "
             "narrow run + 60 s; GPU utilisation >= 95% of greedy's; narrow median wait <= 2x greedy's.", ""]
    lines += markdown_table(
        ["seed", "jobs", "wide wait max, on / off (s)", "bound (s)", "GPU util, on / off", "narrow p50 wait, on / off (s)",
         "narrow p50 wait with no wide run, on / off (s)", "holds / backfilled", "targets"],
        [[r["seed"], r["jobs"], f"{r['wide_wait_max_on_s']:,} / {r['wide_wait_max_off_s']:,}", r["bound_s"],
          f"{100 * r['util_gpu_on']:.1f}% / {100 * r['util_gpu_off']:.1f}%",
          f"{r['narrow_p50_on_s']:,} / {r['narrow_p50_off_s']:,}",
          f"{r['narrow_p50_no_wide_on_s']:,} / {r['narrow_p50_no_wide_off_s']:,}",
          f"{r['holds_made']} / {r['backfilled']}",
          "met" if r["ok"] else "MISSED"] for r in rows])
    lines += ["", "Trade-off: a hold keeps GPUs idle while the node drains (only runs known to end before the "
                  "hold's expected start backfill), so utilisation dips a little and narrow runs wait a little "
                  "longer; in exchange the wide runs start within one narrow run's length instead of starving.", "",
              "Where the narrow median target is missed, the holds are not what costs it: the same narrow stream with "
              "no wide run waits the same with holds on and off (the column before last). The excess is the wide "
              "runs' own GPU-hours, served at 95% load, which greedy never serves (its wide runs wait until the "
              "stream ends). Backfill stays near 0 here: a narrow run's learned estimate (p90 of 300-900 s) is longer "
              "than the time left before a draining node's hold starts (see \"Backfill\" below)."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--hours", type=float, default=6.0)
    parser.add_argument("--wide", type=int, default=1)
    parser.add_argument("--loads", default="0.80,0.85,0.90,0.95",
                        help="total loads of the sweep (narrow and wide work together); empty to skip it")
    parser.add_argument("--sweep-seeds", default="1,2,3,4,5")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", metavar="BENCHMARKS.md")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    rows = [measure(seed, args.hours, args.wide) for seed in seeds]
    gangs = [measure(seed, args.hours, args.wide, GANG_NODES, GANG) for seed in seeds]
    swept = sweep(args) if args.loads.strip() else []
    backfills = backfill_rows(args) if args.loads.strip() else []
    ok = all(r["ok"] for r in rows + gangs)
    if args.json:
        print(json.dumps({"rows": rows, "gangs": gangs, "sweep": swept, "backfill": backfills, "ok": ok}, indent=2))
    else:
        for label, table in (("wide", rows), (f"gang of {GANG}", gangs)):
            for r in table:
                print(label, {k: v for k, v in r.items() if k != "checks"}, r["checks"])
        for r in swept:
            print("sweep", r)
        print("targets:", "met" if ok else "MISSED")
    if args.write:
        write_section(args.write, "starvation", section(rows, args) + "\n\n" + gang_section(gangs, args)
                      + ("\n\n" + sweep_section(swept, args) if swept else "")
                      + ("\n\n" + backfill_section(backfills, args) if backfills else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
