"""The simulator's head-of-line holds (docs/simulator.md): a wide job no longer starves; backfill by estimates."""

from __future__ import annotations

import json
from pathlib import Path

from mn_prefect.model.node import NodeRecord
from mn_prefect.simulate.engine import simulate
from mn_prefect.simulate.trace import read_trace
from tests.test_simulate import gpu_node, jsonl, run, simulate_json, write


def nodes(count: int = 2, gpus: int = 2) -> list[NodeRecord]:
    return [NodeRecord.model_validate(gpu_node(f"g{k}", gpus)) for k in range(count)]


def narrow_stream(until: float, **extra: object) -> list[dict]:
    """Two 1-GPU jobs of 100 s every 50 s on one 2-GPU node: it never has both GPUs free at once."""
    out = [{"t": 0, "job": "n0", "duration": 100, "resources": {"gpu": 1}, **extra}]
    t, k = 50.0, 1
    while t < until:
        out.append({"t": t, "job": f"n{k}", "duration": 100, "resources": {"gpu": 1}, **extra})
        t, k = t + 50, k + 1
    return out


def replay(lines: list[dict], holds: tuple[bool, ...], count: int = 1):
    trace = read_trace([json.dumps(line) for line in lines])
    return trace, simulate(nodes(count), trace, ("binpack",), holds=holds)


def test_with_holds_the_wide_job_starts_within_one_narrow_run_without_it_starves() -> None:
    lines = narrow_stream(2000, deployment="narrow") + [{"t": 60, "job": "wide", "duration": 100,
                                                         "resources": {"gpu": 2}}]
    trace, (on, off) = replay(lines, (True, False))
    assert on.widest["gpus"] == 2 and on.widest["wait_max"] <= 100 + 60
    assert off.widest["wait_max"] > 1800
    assert on.holds_made >= 1


def test_backfill_only_with_a_known_estimate_ending_before_the_hold() -> None:
    # g0 runs a 1-GPU job until 1000 (declared); the wide job holds g0 from 10, expected at 1000. A short job with
    # a declared estimate backfills on the free GPU; one without an estimate, or too long, waits.
    lines = [{"t": 0, "job": "long", "duration": 1000, "resources": {"gpu": 1}, "max_runtime_s": 1000},
             {"t": 10, "job": "wide", "duration": 10, "resources": {"gpu": 2}, "max_runtime_s": 10},
             {"t": 20, "job": "short", "duration": 100, "resources": {"gpu": 1}, "max_runtime_s": 100},
             {"t": 400, "job": "unknown", "duration": 100, "resources": {"gpu": 1}},
             {"t": 500, "job": "too-long", "duration": 600, "resources": {"gpu": 1}, "max_runtime_s": 600}]
    trace, (on,) = replay(lines, (True,))
    started = {name: on.log.started[k] for k, name in enumerate(trace.ids)}
    assert started["short"] == 20 and on.backfilled == 1
    assert started["wide"] == 1000 and started["unknown"] == 1010 and started["too-long"] == 1010


def test_a_job_that_never_fits_gets_no_hold() -> None:
    lines = [{"t": 0, "job": "huge", "duration": 10, "resources": {"gpu": 8}},
             {"t": 1, "job": "small", "duration": 10, "resources": {"gpu": 1}}]
    _, (on,) = replay(lines, (True,))
    assert on.not_runnable == 1 and on.holds_made == 0 and on.placed == 1


def test_jobs_out_writes_a_line_per_job_and_replay(tmp_path: Path) -> None:
    fleet = write(tmp_path / "nodes.json", [gpu_node("g0", 2)])
    trace = jsonl(tmp_path / "t.jsonl", [{"t": 0, "job": "a", "duration": 5, "resources": {"gpu": 2}},
                                         {"t": 1, "job": "b", "duration": 5, "resources": {"gpu": 1}}])
    out = tmp_path / "jobs.jsonl"
    result = run("simulate", "--nodes", str(fleet), "--trace", str(trace), "--strategy", "binpack", "--holds",
                 "both", "--jobs-out", str(out))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(x["job"], x["holds"]) for x in lines] == [("a", True), ("b", True), ("a", False), ("b", False)]
    assert lines[1] == {"job": "b", "strategy": "binpack", "policy": "fifo", "holds": True, "submitted": 1.0,
                        "started": 5.0, "ended": 10.0, "wait_s": 4.0, "nodes": ["g0"]}


def test_both_gives_each_strategy_its_on_and_off_reports(tmp_path: Path) -> None:
    fleet = write(tmp_path / "nodes.json", [gpu_node("g0", 2)])
    trace = jsonl(tmp_path / "t.jsonl", [{"t": 0, "job": "a", "duration": 5, "resources": {"gpu": 1}}])
    report = simulate_json(fleet, trace, "--holds", "both")
    for strategy in ("binpack", "spread"):
        both = report["strategies"][strategy]["holds"]
        assert both["on"]["holds"] == "on" and both["off"]["holds"] == "off"
        assert both["on"]["widest"] == {"gpus": 1, "jobs": 1, "wait_max": 0.0}
    assert simulate_json(fleet, trace, "--holds", "off")["strategies"]["binpack"]["holds"] == "off"


def test_a_bad_max_runtime_is_refused_naming_the_field() -> None:
    trace = read_trace([json.dumps({"t": 0, "job": "a", "duration": 5, "max_runtime_s": bad}) for bad in (0, -1, "x")]
                       + [json.dumps({"t": 0, "job": "d", "duration": 5, "deployment": ""})])
    assert len(trace) == 0 and trace.bad_count == 4
    assert [p.path for bad in trace.bad for p in bad.problems] == ["max_runtime_s"] * 3 + ["deployment"]
