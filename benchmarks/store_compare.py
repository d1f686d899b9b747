"""The store benchmark on two versions of the code, side by side in one run (same machine, same load).

Checks out ``--before`` (a git revision) into a temporary worktree, gives it this tree's benchmark driver
(benchmarks/store.py, store_workload.py, report.py and tests/servers.py: the same measurement, only the code
under test differs) and runs the driver in each tree alternately, ``--rounds`` times per backend (the order
flips every round so drift in the machine's load falls on both), each on a fresh server. Reports the median
commits/s of each side (and what a process sent its store per commit and per release: store.py's
``_count_trips``), and the median of the per-round ratios after/before (each round's two runs are
neighbours in time, so the ratio cancels most of a shared machine's drift). Usage:
  python benchmarks/store_compare.py --before REV [--processes 8] [--seconds 10] [--rounds 3] [--write BENCHMARKS.md
      [--section store-compare]]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

from report import load_average, print_rows, provenance, worktree, write_section  # noqa: E402

BACKENDS = ("sqlite", "redis", "postgresql")
DRIVER = ("benchmarks/store.py", "benchmarks/store_workload.py", "benchmarks/report.py", "tests/servers.py")


def measure(tree: Path, backend: str, processes: int, seconds: float) -> dict:
    out = subprocess.run([sys.executable, str(tree / "benchmarks" / "store.py"), "--backend", backend, "--processes",
                          str(processes), "--seconds", str(seconds), "--json"],
                         cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", action="append", choices=BACKENDS, help="default: all three")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", help="replace the --section section of this markdown file")
    parser.add_argument("--section", default="store-compare", help="the section's marker (default: store-compare)")
    args = parser.parse_args()
    backends = args.backend or list(BACKENDS)
    load_before = load_average()
    revision = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    samples: dict[tuple[str, str], list[dict]] = {}
    with worktree(ROOT, revision) as before, Progress(transient=True) as progress:
        for driver in DRIVER:
            shutil.copyfile(ROOT / driver, before / driver)
        task = progress.add_task("measuring", total=len(backends) * args.rounds * 2)
        for round_no in range(args.rounds):
            for backend in backends:
                sides = [("before", before), ("after", ROOT)]
                for side, tree in sides if round_no % 2 == 0 else reversed(sides):
                    samples.setdefault((backend, side), []).append(measure(tree, backend, args.processes, args.seconds))
                    progress.advance(task)
    rows = []
    for backend in backends:
        ratios = [a["commits_per_s"] / b["commits_per_s"]
                  for a, b in zip(samples[(backend, "after")], samples[(backend, "before")], strict=True)]
        for side, rev in (("before", revision), ("after", head)):
            runs = samples[(backend, side)]
            rows.append({"backend": backend, "code": f"{side} ({rev})", "processes": args.processes,
                         "commits_per_s": round(statistics.median(r["commits_per_s"] for r in runs), 1),
                         "runs": " / ".join(f"{r['commits_per_s']:,.0f}" for r in runs),
                         "after_over_before": round(statistics.median(ratios), 3) if side == "after" else None,
                         "conflict_rate": round(statistics.median(r["conflict_rate"] for r in runs), 4),
                         "trips_per_commit": statistics.median(r["trips_per_commit"] for r in runs),
                         "trips_per_release": statistics.median(r["trips_per_release"] for r in runs),
                         "overbooking": sum(r["overbooking"] for r in runs)})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_rows(f"store before/after ({args.seconds:g} s per run, median of {args.rounds})", rows)
    if args.write:
        lines = ["| backend | code | processes | commits/s (median) | runs | after/before (median of rounds) | "
                 "conflict rate | trips per commit | trips per release | overbooking |",
                 "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['backend']} | {r['code']} | {r['processes']} | {r['commits_per_s']:,} | {r['runs']} | "
                  f"{'' if r['after_over_before'] is None else format(r['after_over_before'], '.3f')} | "
                  f"{r['conflict_rate']:.2%} | {r['trips_per_commit']:g} | {r['trips_per_release']:g} | "
                  f"{r['overbooking']} |" for r in rows]
        body = provenance("store_compare.py", f"{multiprocessing.cpu_count()} cores",
                          f"load average {load_before} before, {load_average()} after") + "\n\n" + "\n".join(lines)
        write_section(args.write, args.section, body)


if __name__ == "__main__":
    main()
