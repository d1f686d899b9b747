"""How long the whole test suite takes as CI runs it (``bash .ci/run``), idle or with a busy-loop burner beside it.

Each run is ``bash .ci/run`` from the repository root: it installs what is missing (nothing, on a machine that ran
it once) and runs the README's test command. The time is the wall clock of the whole call; the counts are pytest's
summary line. ``--burner`` starts one process that spins on a core for the length of each run, as a busy
neighbour on a shared CI machine would.

Usage: python benchmarks/suite.py [--runs 1] [--burner] [--json] [--write BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from rich.live import Live
from rich.text import Text

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import markdown_table, print_rows, provenance, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^=* ?((?:\d+ \w+(?:, )?)+) in [\d.]+s", re.MULTILINE)
BURN = "while True: pass"


def counts(output: str) -> dict[str, int]:
    """pytest's last summary line (``1490 passed, 2 failed in ...``) as {outcome: count}; empty when none."""
    found = SUMMARY.findall(output)
    if not found:
        return {}
    return {word: int(number) for number, word in re.findall(r"(\d+) (\w+)", found[-1])}


def one_run(number: int, burner: bool, log: Path) -> dict:
    spinner = subprocess.Popen([sys.executable, "-c", BURN]) if burner else None
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    try:
        with open(log, "w") as out, Live(refresh_per_second=1) as live:
            proc = subprocess.Popen(["bash", ".ci/run"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "CI": "true"})
            while proc.poll() is None:
                live.update(Text(f"run {number}{' with the burner' if burner else ''}: "
                                 f"{time.monotonic() - start:,.0f} s"))
                time.sleep(1)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    seconds = time.monotonic() - start
    outcome = counts(log.read_text())
    return {"run": number, "burner": burner, "exit": proc.returncode, "seconds": round(seconds),
            "passed": outcome.get("passed", 0), "failed": outcome.get("failed", 0) + outcome.get("errors", 0)
            + outcome.get("error", 0), "skipped": outcome.get("skipped", 0), "load_1min_before": load_before,
            "log": str(log)}


def markdown(rows: list[dict]) -> str:
    table = markdown_table(["run", "burner", "exit", "wall s", "passed", "failed", "skipped"],
                           [[r["run"], "yes" if r["burner"] else "no", r["exit"], f"{r['seconds']:,}", r["passed"],
                             r["failed"], r["skipped"]] for r in rows])
    return "\n".join([provenance("suite.py", f"{os.cpu_count()} cores"), "", *table])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="runs one after another")
    parser.add_argument("--burner", action="store_true", help="a busy-loop process beside each run")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", help="replace this mode's suite section of this markdown file")
    args = parser.parse_args()
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"mn-suite-{int(time.time())}"
    logs.mkdir(parents=True)
    rows = [one_run(n, args.burner, logs / f"run-{n}.log") for n in range(1, args.runs + 1)]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_rows("the suite as CI runs it", rows)
    if args.write:
        write_section(args.write, "suite-burner" if args.burner else "suite-idle", markdown(rows))
    sys.exit(0 if all(r["exit"] == 0 for r in rows) else 1)


if __name__ == "__main__":
    main()
