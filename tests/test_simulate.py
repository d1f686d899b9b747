"""``mn-prefect simulate`` (docs/simulator.md), through the console script's entry point (tests/cli_runner.py), and as a
real subprocess where the output is a live terminal or a trace file."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cli_runner
import pytest

ROOT = Path(__file__).resolve().parents[1]
MN = shutil.which("mn-prefect", path=str(Path(sys.executable).parent)) or "mn-prefect"
MOCK = ROOT / "deployments" / "mock-nodes.json"
MOCK_MIG = ROOT / "deployments" / "mock-nodes-mig.json"


def run(*args, stdin=None, env=None, cwd=None):
    return cli_runner.run(args, input=stdin, env={"COLUMNS": "250", **(env or {})}, cwd=cwd, timeout=300)


def write(path: Path, content) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def jsonl(path: Path, jobs: list[dict]) -> Path:
    return write(path, "".join(json.dumps(j) + "\n" for j in jobs))


def simulate_json(nodes: Path, trace: Path, *extra) -> dict:
    result = run("simulate", "--nodes", nodes, "--trace", trace, "--json", *extra)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout)


def cpu_node(name: str, cores: int = 4) -> dict:
    return {"name": name, "cpu_cores": cores, "memory_mb": 8192, "disk_mb": 10000}


def gpu_node(name: str, gpus: int = 2) -> dict:
    devices = [{"id": f"{name}-gpu{k}", "index": k, "kind": "gpu", "vendor": "nvidia", "driver": "cuda",
                "memory_total_mb": 16384} for k in range(gpus)]
    return {"name": name, "cpu_cores": 8, "memory_mb": 32768, "disk_mb": 10000, "devices": devices}


def job(t, name, duration, **resources):
    return {"t": t, "job": name, "duration": duration, "resources": resources}


# -- the acceptance path -------------------------------------------------------------------------------------


def test_generate_then_simulate_against_the_mock_fleet(tmp_path):
    generated = run("simulate", "--generate", 1000, "--seed", 1)
    assert generated.returncode == 0, generated.stderr
    trace = write(tmp_path / "t.jsonl", generated.stdout)
    assert len(generated.stdout.splitlines()) == 1000
    result = run("simulate", "--nodes", MOCK, "--trace", trace)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for text in ("binpack", "spread", "placed", "wait p99", "GPU utilisation", "GPU fragmentation", "makespan"):
        assert text in result.stdout
    # The default mix has MIG requests, which mock-nodes.json cannot run: refused, and said why.
    assert "not runnable on any node" in result.stdout and "mig_profile" in result.stdout


def test_generate_is_deterministic_for_a_seed_and_mixes_every_kind():
    first, again, other = (run("simulate", "--generate", 2000, "--seed", s) for s in (7, 7, 8))
    assert first.returncode == 0 and first.stdout == again.stdout and first.stdout != other.stdout
    lines = [json.loads(line) for line in first.stdout.splitlines()]
    assert len(lines) == 2000 and len({j["job"] for j in lines}) == 2000
    times = [j["t"] for j in lines]
    assert times == sorted(times) and all(j["duration"] >= 1 for j in lines)
    devices = [d for j in lines for d in j["resources"].get("devices", [])]
    assert any("mig_profile" in d for d in devices) and any("shares" in d for d in devices)
    assert any("gpu" in j["resources"] for j in lines)
    assert any(set(j["resources"]) == {"cpu", "memory"} for j in lines)


def test_a_trace_generated_for_a_fleet_runs_entirely_on_it(tmp_path):
    generated = run("simulate", "--generate", 400, "--seed", 3, "--nodes", MOCK_MIG)
    assert generated.returncode == 0, generated.stderr
    assert "mig_profile" in generated.stdout and "shares" in generated.stdout
    data = simulate_json(MOCK_MIG, write(tmp_path / "t.jsonl", generated.stdout))
    for name in ("binpack", "spread"):
        result = data["strategies"][name]
        assert result["placed"] == 400 and result["refused"] == 0 and result["admission_refused"] == 0
        assert 0 < result["utilisation"]["gpu"] <= 1 and 0 < result["utilisation"]["cpu"] <= 1


# -- known answers -------------------------------------------------------------------------------------------


def test_waits_and_makespan_on_two_nodes_binpack_against_spread(tmp_path):
    """Two 4-core nodes. A and B (2 cores, 10 s) arrive together, C (4 cores, 5 s) at 1 s, D (1 core, 1 s) at 2 s.
    binpack stacks A and B on one node: C starts at once on the other, D waits for C (until 6 s).
    spread puts A and B on one node each: C waits for both (until 10 s); D backfills ahead of it at 2 s."""
    nodes = write(tmp_path / "nodes.json", [cpu_node("n1"), cpu_node("n2")])
    trace = jsonl(tmp_path / "t.jsonl", [job(0, "A", 10, cpu=2), job(0, "B", 10, cpu=2), job(1, "C", 5, cpu=4),
                                         job(2, "D", 1, cpu=1)])
    data = simulate_json(nodes, trace)
    binpack, spread = data["strategies"]["binpack"], data["strategies"]["spread"]
    assert binpack["placed"] == spread["placed"] == 4
    assert binpack["wait_s"] == {"mean": 1.0, "p50": 0.0, "p99": 4.0, "max": 4.0}
    assert spread["wait_s"] == {"mean": 2.25, "p50": 0.0, "p99": 9.0, "max": 9.0}
    assert binpack["makespan_s"] == 10.0 and spread["makespan_s"] == 15.0
    assert binpack["waited"] == 1 and spread["waited"] == 1
    assert binpack["queue"]["max"] == spread["queue"]["max"] == 1
    # 2*10 + 2*10 + 4*5 + 1*1 = 61 core-seconds over 8 cores.
    assert binpack["utilisation"]["cpu"] == pytest.approx(61 / 80)
    assert spread["utilisation"]["cpu"] == pytest.approx(61 / 120)
    assert binpack["queue"]["mean"] == pytest.approx(4 / 10) and spread["queue"]["mean"] == pytest.approx(9 / 15)
    assert binpack["events"] == spread["events"] == 8


def test_gpu_fragmentation_measured_on_a_constructed_case(tmp_path):
    """Two nodes with two GPUs each; two 1-GPU jobs, then a 2-GPU job at 1 s. spread leaves one free GPU on each
    node, so the 2-GPU job waits 9 s beside two stranded GPUs; binpack leaves a whole node free."""
    nodes = write(tmp_path / "nodes.json", [gpu_node("g1"), gpu_node("g2")])
    trace = jsonl(tmp_path / "t.jsonl", [job(0, "a", 10, gpu=1), job(0, "b", 10, gpu=1), job(1, "pair", 5, gpu=2)])
    data = simulate_json(nodes, trace)
    binpack, spread = data["strategies"]["binpack"], data["strategies"]["spread"]
    assert binpack["gpu_fragmentation"] == {"stranded_gpus_mean": 0.0, "share_of_gpus": 0.0,
                                            "stranded_gpus_while_waiting": 0.0, "gpu_waiting_s": 0.0}
    assert binpack["makespan_s"] == 10.0 and binpack["wait_s"]["max"] == 0.0
    assert spread["makespan_s"] == 15.0 and spread["wait_s"]["max"] == 9.0
    fragmentation = spread["gpu_fragmentation"]
    assert fragmentation["gpu_waiting_s"] == 9.0
    assert fragmentation["stranded_gpus_while_waiting"] == 2.0
    assert fragmentation["stranded_gpus_mean"] == pytest.approx(2 * 9 / 15)
    assert fragmentation["share_of_gpus"] == pytest.approx(2 * 9 / 15 / 4)
    # GPU-seconds: 10 + 10 + 2*5 = 30 over 4 GPUs.
    assert spread["utilisation"]["gpu"] == pytest.approx(30 / 60)


def test_fractions_and_mig_slices_count_as_parts_of_a_gpu(tmp_path):
    nodes = write(tmp_path / "nodes.json", json.loads(MOCK_MIG.read_text()))
    trace = jsonl(tmp_path / "t.jsonl", [
        job(0, "quarter", 10, devices=[{"kind": "gpu", "shares": 0.25, "memory_mb": 4096}]),
        job(0, "slices", 10, devices=[{"kind": "gpu", "mig_profile": "1g.10gb", "count": 2}]),
        job(0, "whole", 10, gpu=1),
    ])
    result = simulate_json(nodes, trace, "--strategy", "binpack")["strategies"]["binpack"]
    assert result["placed"] == 3 and result["makespan_s"] == 10.0
    # 0.25 + 2/7 + 1 GPUs busy for the whole span, over the fleet's 4 GPUs (a GPU in MIG mode is one of them).
    assert result["utilisation"]["gpu"] == pytest.approx((0.25 + 2 / 7 + 1) / 4)


def test_a_job_no_node_can_ever_take_is_refused_with_the_schedulers_reason(tmp_path):
    nodes = write(tmp_path / "nodes.json", [cpu_node("n1")])
    trace = jsonl(tmp_path / "t.jsonl", [job(0, "ok", 5, cpu=1), job(50, "huge", 5, cpu=64),
                                         job(2, "gpu", 5, gpu=1)])
    result = simulate_json(nodes, trace, "--strategy", "spread")["strategies"]["spread"]
    assert result["placed"] == 1 and result["refused"] == result["not_runnable"] == 2
    assert result["makespan_s"] == 5.0  # to the last completion, not to a refused arrival
    reasons = " ".join(result["refusals"])
    assert "insufficient cpu" in reasons and "gpu" in reasons


def test_jobs_wait_in_arrival_order_when_they_all_need_the_same(tmp_path):
    nodes = write(tmp_path / "nodes.json", [cpu_node("n1", cores=2)])
    trace = jsonl(tmp_path / "t.jsonl", [job(k, f"j{k}", 10, cpu=2) for k in range(4)])
    result = simulate_json(nodes, trace, "--strategy", "binpack")["strategies"]["binpack"]
    # Starts at 0, 10, 20, 30: waits 0, 9, 18, 27.
    assert result["wait_s"]["max"] == 27.0 and result["wait_s"]["mean"] == pytest.approx(54 / 4)
    assert result["makespan_s"] == 40.0 and result["queue"]["max"] == 3


def test_an_unsorted_trace_is_replayed_in_time_order_and_zero_durations_work(tmp_path):
    nodes = write(tmp_path / "nodes.json", [cpu_node("n1", cores=1)])
    # early runs 0..5; at 5 it completes first, zero takes the core and gives it back at that same instant, then late.
    trace = jsonl(tmp_path / "t.jsonl", [job(5, "zero", 0, cpu=1), job(0, "early", 5, cpu=1), job(5, "late", 1, cpu=1)])
    result = simulate_json(nodes, trace, "--strategy", "binpack")["strategies"]["binpack"]
    assert result["placed"] == 3 and result["wait_s"]["max"] == 0.0 and result["makespan_s"] == 6.0
    assert result["waited"] == 0 and result["queue"]["max"] == 1  # late queued for no time


def test_the_trace_may_come_from_standard_input(tmp_path):
    nodes = write(tmp_path / "nodes.json", [cpu_node("n1")])
    result = run("simulate", "--nodes", nodes, "--trace", "-", "--json", stdin=json.dumps(job(0, "a", 1, cpu=1)))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["strategies"]["binpack"]["placed"] == 1


# -- bad input -----------------------------------------------------------------------------------------------


BAD_TRACE = "\n".join([
    json.dumps(job(0, "a", 5, cpu=1)),
    "not json",
    json.dumps(job(-1, "b", 5, cpu=1)),
    json.dumps(job(1, "c", 5, cpu="abc")),
    "",
    json.dumps(job(1, "a", 5, cpu=1)),
    json.dumps({"t": 1, "job": "d", "duration": 1, "jobtype": "batch"}),
    json.dumps({"t": 2, "job": "e", "resources": {"devices": [{"kind": "gpu", "shares": 2}]}}),
    json.dumps(job(3, "f", 5, cpu=1)),
]) + "\n"


def test_bad_lines_are_skipped_and_reported_with_line_numbers_and_fields(tmp_path):
    nodes = write(tmp_path / "nodes.json", [cpu_node("n1")])
    trace = write(tmp_path / "t.jsonl", BAD_TRACE)
    result = run("simulate", "--nodes", nodes, "--trace", trace, "--json")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    data = json.loads(result.stdout)
    assert data["trace"]["jobs"] == 2 and data["trace"]["bad_lines"] == 6
    paths = {b["line"]: [e["path"] for e in b["errors"]] for b in data["trace"]["skipped"]}
    assert paths == {2: ["(line)"], 3: ["t"], 4: ["resources.cpu"], 6: ["job"], 7: ["jobtype"],
                     8: ["duration", "resources.devices[0].shares"]}
    assert data["strategies"]["binpack"]["placed"] == 2
    for text in ("6 bad trace line(s)", "line 2: (line): malformed JSON", "line 3: t: must not be negative",
                 "line 4: resources.cpu", "duplicate job id 'a' (first on line 1)", "line 7: jobtype: unknown key"):
        assert text in result.stderr
    table = run("simulate", "--nodes", nodes, "--trace", trace)
    assert table.returncode == 0 and "6 bad trace line(s) skipped" in table.stdout
    assert "... and 1 more" in table.stderr  # five are listed, all are counted


def test_strict_makes_a_bad_line_fatal(tmp_path):
    nodes = write(tmp_path / "nodes.json", [cpu_node("n1")])
    result = run("simulate", "--nodes", nodes, "--trace", write(tmp_path / "t.jsonl", BAD_TRACE), "--strict")
    assert result.returncode == 1
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert "nothing simulated (--strict)" in result.stderr and "line 8: duration: is required" in result.stderr
    good = jsonl(tmp_path / "good.jsonl", [job(0, "a", 1, cpu=1)])
    assert run("simulate", "--nodes", nodes, "--trace", good, "--strict").returncode == 0


@pytest.mark.parametrize("args, says", [
    (["--strategy", "fastest"], "unknown scheduler strategy 'fastest'"),
    (["--strategy", "binpack,binpack"], "named twice"),
    (["--plot", "out.pdf"], ".png (matplotlib) or .html"),
    (["--rate", "2"], "use it with --generate"),
])
def test_bad_usage_exits_2(tmp_path, args, says):
    nodes = write(tmp_path / "nodes.json", [cpu_node("n1")])
    trace = jsonl(tmp_path / "t.jsonl", [job(0, "a", 1, cpu=1)])
    result = run("simulate", "--nodes", nodes, "--trace", trace, *args, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert says in " ".join(result.stderr.split()) and "Traceback" not in result.stderr


def test_missing_inputs_and_mixed_modes_exit_2(tmp_path):
    nodes = write(tmp_path / "nodes.json", [cpu_node("n1")])
    trace = jsonl(tmp_path / "t.jsonl", [job(0, "a", 1, cpu=1)])
    for args in (["--nodes", nodes], ["--trace", trace], ["--nodes", nodes, "--trace", tmp_path / "missing.jsonl"],
                 ["--generate", 5, "--trace", trace], ["--generate", 5, "--json"], ["--generate", 5, "--rate", 0],
                 ["--nodes", write(tmp_path / "bad.json", [{"name": "x", "cpu_cores": -1}]), "--trace", trace]):
        result = run("simulate", *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr


# -- output --------------------------------------------------------------------------------------------------


def test_json_has_every_metric_per_strategy(tmp_path):
    nodes = write(tmp_path / "nodes.json", [cpu_node("n1")])
    data = simulate_json(nodes, jsonl(tmp_path / "t.jsonl", [job(0, "a", 1, cpu=1)]))
    assert set(data) == {"nodes", "trace", "plot", "strategies"}
    assert list(data["strategies"]) == ["binpack", "spread"]
    result = data["strategies"]["spread"]
    assert {"jobs", "placed", "refused", "not_runnable", "admission_refused", "waited", "wait_s", "queue",
            "utilisation", "gpu_fragmentation", "makespan_s", "events", "wall_s", "events_per_s",
            "refusals"} <= set(result)
    assert set(result["wait_s"]) == {"mean", "p50", "p99", "max"}
    assert set(result["utilisation"]) == {"cpu", "memory", "gpu"}


def test_plot_writes_a_png_and_a_self_contained_html_file(tmp_path):
    nodes = write(tmp_path / "nodes.json", [gpu_node("g1"), gpu_node("g2")])
    trace = jsonl(tmp_path / "t.jsonl", [job(0, "a", 10, gpu=1), job(0, "b", 10, gpu=1), job(1, "c", 5, gpu=2)])
    png, page = tmp_path / "out.png", tmp_path / "out.html"
    assert run("simulate", "--nodes", nodes, "--trace", trace, "--plot", png).returncode == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = run("simulate", "--nodes", nodes, "--trace", trace, "--plot", page, "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["plot"] == str(page)
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("<svg") == 4 and "<polyline" in html
    assert "<script" not in html and "src=" not in html  # nothing fetched


def test_a_png_plot_without_matplotlib_names_the_extra(tmp_path):
    blocker = tmp_path / "blocked" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is blocked in this test')\n")
    nodes = write(tmp_path / "nodes.json", [cpu_node("n1")])
    trace = jsonl(tmp_path / "t.jsonl", [job(0, "a", 1, cpu=1)])
    result = subprocess.run([sys.executable, "-m", "mn_prefect.cli.app", "simulate", "--nodes", str(nodes),
                             "--trace", str(trace), "--plot", str(tmp_path / "x.png")], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(blocker.parent)})
    assert result.returncode == 1 and "mn-prefect[plot]" in result.stderr and "Traceback" not in result.stderr
    html = subprocess.run([sys.executable, "-m", "mn_prefect.cli.app", "simulate", "--nodes", str(nodes),
                           "--trace", str(trace), "--plot", str(tmp_path / "x.html")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(blocker.parent)})
    assert html.returncode == 0, html.stderr


def test_a_progress_bar_shows_on_a_terminal(tmp_path):
    trace = write(tmp_path / "t.jsonl", run("simulate", "--generate", 3000, "--seed", 2).stdout)
    primary, replica = pty.openpty()
    process = subprocess.Popen([MN, "simulate", "--nodes", str(MOCK), "--trace", str(trace), "--json"],
                               stdout=subprocess.PIPE, stderr=replica, env={**os.environ, "COLUMNS": "120"})
    os.close(replica)
    seen = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([primary], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # the other end closed
                break
            if not chunk:
                break
            seen += chunk
        elif process.poll() is not None:
            break
    out, _ = process.communicate(timeout=60)
    os.close(primary)
    assert process.returncode == 0
    assert b"replaying with" in seen
    assert json.loads(out)["strategies"]["binpack"]["jobs"] == 3000  # stdout stays clean JSON
    piped = run("simulate", "--nodes", MOCK, "--trace", trace, "--json")
    assert "replaying" not in piped.stderr  # not a terminal: no bar
