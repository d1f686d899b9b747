"""Bad input on the command line: each gets a clear error naming the field or argument, exits non-zero and
leaves the store as it was. Through the console script's entry point (tests/cli_runner.py), against a real
SQLite store file; and the counts and listings those commands show, checked against what really ran."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import cli_runner
import pytest
from builders import agent, gpu, node
from bundle_builders import _Done, step, write_bundle

from mn_prefect.bundles.bundle import load_bundle
from mn_prefect.bundles.process import run_launch
from mn_prefect.bundles.runner import BundleRun, run_environment
from mn_prefect.cli.render import steps_table
from mn_prefect.drivers.launchers import this_node
from mn_prefect.model.hints import env_hints
from mn_prefect.model.issues import InvalidInput, Issues
from mn_prefect.model.resources import parse_resources, resource_request
from mn_prefect.model.scalars import read_int, read_number
from mn_prefect.placement.job_state import JobState
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store
from mn_prefect.store.records import ReservationRecord, StepSummary, WorkflowRecord, list_records, put_record

ROOT = Path(__file__).resolve().parents[1]
MN = str(Path(sys.executable).parent / "mn-prefect")
BUNDLES = ROOT / "examples" / "bundles"
BLUEPRINTS = ROOT / "examples" / "blueprints"


def mn(*args, home: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MN_"))}
    env.update(COLUMNS="250", PREFECT_API_URL="")
    if home is not None:
        env.update(HOME=str(home), MN_PREFECT_HOME=str(home / ".mn-prefect"), PREFECT_HOME=str(home / ".prefect"))
    return cli_runner.run(args, env=env, whole_env=True)


@pytest.fixture
def url(tmp_path) -> str:
    """A real SQLite store file with one GPU node and one CPU node."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    store.register_node(node("g1", cpu=16, memory=65536, devices=[gpu("GPU-0", 0), gpu("GPU-1", 1)]))
    store.register_node(node("c1", cpu=4, memory=8192))
    store.close()
    return url


def contents(url: str) -> tuple:
    """Everything a reservation could have written: job records, bookings, events."""
    store = open_store(url)
    try:
        return ([(j.job_id, j.job_type, j.status) for j in store.list_jobs()], store.active_jobs(),
                [(e.kind, e.job_id) for e in store.events(limit=1000)])
    finally:
        store.close()


def json_error(result: subprocess.CompletedProcess) -> dict:
    doc = json.loads(result.stdout)
    assert set(doc) == {"error", "field", "errors"}, doc
    assert doc["errors"][0] == {"path": doc["field"], "message": doc["error"]}
    return doc


# -- 1. reservations read requests with the parser every resource request uses ------------------------------------

def test_reserve_reads_resources_with_the_same_parser_as_every_request(url, tmp_path):
    # Aliases and units as job_variables.resources and plan --request take them: memory_gb (GB), a bare cpu
    # above 64 is millicores, gpus: the same request, placed the same way.
    text = '{"cpu": 8000, "memory_gb": 32, "gpus": 2}'
    checked = mn("reserve", "--resources", text, "--for", "2h", "--check", "--json", "--store-url", url)
    planned = mn("plan", "--request", text, "--store-url", url)
    assert checked.returncode == 0 and planned.returncode == 0, checked.stderr + planned.stderr
    [held] = json.loads(checked.stdout)["placements"]
    [plan] = json.loads(planned.stdout)["placements"]
    assert held["node"] == plan["node"] == "g1"
    assert held["resources"] == plan["resources"]
    assert (held["resources"]["cpu_cores"], held["resources"]["memory_mb"], held["resources"]["gpu_count"]) \
        == (8, 32 * 1024, 2)
    # From a file too (@file.json), and booked: the record keeps the request as given.
    request_file = tmp_path / "request.json"
    request_file.write_text(text)
    booked = mn("reserve", "--resources", f"@{request_file}", "--for", "2h", "--json", "--store-url", url)
    assert booked.returncode == 0, booked.stderr
    assert json.loads(booked.stdout)["reservation"]["resources"] == json.loads(text)
    # What no resource request accepts, a reservation refuses the same way: a size with a unit the grammar does not
    # know (model/amounts.py), named at the field, exit 1, nothing written.
    before = contents(url)
    for value in ("32Q", "512Mx"):
        refused = mn("reserve", "--resources", json.dumps({"memory": value}), "--for", "2h", "--json",
                     "--store-url", url)
        planned = mn("plan", "--request", json.dumps({"memory": value}), "--store-url", url)
        assert refused.returncode == 1 and planned.returncode == 2
        error = json_error(refused)
        [plan_error] = json.loads(planned.stdout)["errors"]
        assert error["field"] == "--resources.memory" and plan_error["path"] == "--request.memory"
        assert error["error"] == plan_error["message"]
        assert error["error"].startswith(f"has an unknown unit {value.lstrip('0123456789')!r} in {value!r}")
    assert contents(url) == before


# -- 2. reserve --node names a node the store does not have -------------------------------------------------------

@pytest.mark.parametrize("check", [False, True])
def test_reserve_on_an_unknown_node_names_it_and_stores_nothing(url, check):
    before = contents(url)
    result = mn("reserve", "--resources", '{"cpu": 1}', "--for", "1h", "--node", "nosuchnode",
                *(["--check"] if check else []), "--store-url", url)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "--node" in result.stderr and "no node 'nosuchnode' in the store" in result.stderr
    assert "constraint" not in result.stderr + result.stdout
    assert contents(url) == before
    assert list_records(open_store(url), ReservationRecord) == []  # not even a refused record
    # A node the store has is still reserved on.
    done = mn("reserve", "--resources", '{"cpu": 1}', "--for", "1h", "--node", "c1", "--json", "--store-url", url)
    assert done.returncode == 0 and json.loads(done.stdout)["reservation"]["nodes"] == ["c1"]


# -- 3. blueprint run of a path that is not there ----------------------------------------------------------------

@pytest.mark.parametrize("command", [["blueprint", "run", "--local"], ["blueprint", "run"],
                                     ["blueprint", "deploy"], ["blueprint", "validate"]])
def test_a_missing_path_is_said_to_be_missing(tmp_path, command):
    missing = tmp_path / "nonexistent"
    result = mn(*command, missing, home=tmp_path)
    assert result.returncode == (1 if command[1] == "validate" else 2), result.stdout + result.stderr
    assert f"{missing}: no such file or folder" in result.stdout + result.stderr
    assert "--local" not in result.stdout + result.stderr and "drop" not in result.stdout + result.stderr
    as_json = mn(*command, missing, "--json", home=tmp_path)
    errors = json.loads(as_json.stdout)["errors"]
    assert errors == [{"path": "PATH", "message": f"{missing}: no such file or folder"}]


# -- 4. simulate --generate with a strategy that does not exist ----------------------------------------------------

@pytest.mark.parametrize("value", ["foo", "binpack,foo", ""])
def test_simulate_generate_refuses_an_unknown_strategy_naming_the_choices(value):
    result = mn("simulate", "--generate", "3", "--strategy", value)
    assert result.returncode == 2 and result.stdout == ""  # no trace written
    text = " ".join(result.stderr.replace("│", " ").split())
    assert "--strategy" in text and "allowed: binpack, spread" in text
    assert mn("simulate", "--generate", "3", "--strategy", "spread").returncode == 0


# -- 5. blueprint validate takes what blueprint run takes ----------------------------------------------------------

@pytest.mark.parametrize("path", sorted(p for p in BUNDLES.iterdir() if p.is_dir()), ids=lambda p: p.name)
def test_validate_accepts_the_bundle_folders_run_accepts(path):
    load_bundle(path)  # what blueprint run loads
    result = mn("blueprint", "validate", path, "--json")
    assert result.returncode == 0 and json.loads(result.stdout) == {"valid": True, "errors": []}, result.stdout
    assert mn("blueprint", "validate", "--folder", path, "--json").returncode == 0
    readable = mn("blueprint", "validate", path)
    assert readable.returncode == 0 and f"valid: {path}" in readable.stdout and "steps" in readable.stdout


def test_validate_takes_manifests_and_flat_blueprints_and_refuses_a_broken_bundle_as_run_does(tmp_path):
    for path in (BUNDLES / "demo_dag_linear" / "manifest.json", BLUEPRINTS / "demo_retry_recovery.manifest.json",
                 ROOT / "flows" / "blueprints" / "hello_batch.json"):
        assert mn("blueprint", "validate", path, "--json").returncode == 0, path
    # A bundle whose payload is missing: run refuses it, and validate with the same issues.
    folder = write_bundle(tmp_path, "broken", [step("a")], [], sink_from="a")
    (folder / "payloads" / "worker" / "worker.py").unlink()
    (folder / "payloads" / "worker").rmdir()
    with pytest.raises(InvalidInput) as refused:
        load_bundle(folder)
    result = mn("blueprint", "validate", folder, "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout)["errors"] == [i.as_dict() for i in refused.value.issues]
    assert "payloads/worker does not exist" in result.stdout
    # A folder that is no bundle is refused by both, naming it.
    empty = tmp_path / "empty"
    empty.mkdir()
    result = mn("blueprint", "validate", empty, "--json")
    assert result.returncode == 1 and "without manifest.json" in json.loads(result.stdout)["errors"][0]["message"]


# -- 6. one rule for environment names, applied by validate and run ------------------------------------------------

BAD_ENV = {"A=B": "x", "": "y"}
BAD_ENV_PATHS = {"agents.nodes[0].config.environment.A=B", "agents.nodes[0].config.environment.",
                 "agents.nodes[0].config.pass_env[0]"}


def _bad_env_bundle(tmp_path: Path) -> Path:
    folder = write_bundle(tmp_path, "badenv", [step("a")], [], sink_from="a")
    doc = json.loads((folder / "manifest.json").read_text())
    doc["agents"]["nodes"][0]["config"]["environment"].update(BAD_ENV)
    doc["agents"]["nodes"][0]["config"]["pass_env"] = ["X=Y", "HOME"]
    (folder / "manifest.json").write_text(json.dumps(doc))
    return folder


def test_validate_and_run_refuse_the_same_environment_names(tmp_path):
    folder = _bad_env_bundle(tmp_path)
    validated = mn("blueprint", "validate", folder, "--json")
    assert validated.returncode == 1
    errors = json.loads(validated.stdout)["errors"]
    assert {e["path"] for e in errors} == BAD_ENV_PATHS
    assert all("is not a valid environment variable name" in e["message"] for e in errors)
    ran = mn("blueprint", "run", folder, "--local", "--json", home=tmp_path)
    assert ran.returncode == 2 and json.loads(ran.stdout) == {"state": "INVALID", "errors": errors}
    # The manifest file alone, and the same names in a flat v1 blueprint (plan and run read it the same way).
    assert json.loads(mn("blueprint", "validate", folder / "manifest.json", "--json").stdout)["errors"] == errors
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"job_name": "j", "nodes": [agent("w", config={
        "command": ["true"], "environment": BAD_ENV, "pass_env": ["X=Y"]})]}))
    flat_errors = json.loads(mn("blueprint", "validate", flat, "--json").stdout)["errors"]
    assert {e["path"] for e in flat_errors} == {p.removeprefix("agents.") for p in BAD_ENV_PATHS}
    planned = mn("plan", flat, "--nodes", ROOT / "deployments" / "mock-nodes.json")
    assert planned.returncode == 2 and json.loads(planned.stdout)["errors"] == flat_errors
    # Good names still pass.
    good = write_bundle(tmp_path, "goodenv", [step("a")], [], sink_from="a")
    assert mn("blueprint", "validate", good, "--json").returncode == 0


# -- 7. retries in place are launches ----------------------------------------------------------------------------

def test_a_step_retried_in_place_counts_each_process_as_a_launch(tmp_path):
    """demo_retry_recovery's step ``run`` fails once with a transient error and is run again in place by the
    executor: one ledger attempt, two processes. Run for real (real processes, a real SQLite store), then read
    through ``job status``, as a table and as JSON."""
    bundle = load_bundle(BUNDLES / "demo_retry_recovery")
    job_id = f"retry-{uuid.uuid4().hex[:8]}"
    digest = hashlib.sha256(f"demo_retry_recovery:run:{job_id}".encode()).hexdigest()[:20]
    marker = Path("/tmp") / f"mn-blueprint-retry-{digest}.marker"
    marker.unlink(missing_ok=True)
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    node_name = store.register_node(this_node(logging.getLogger(__name__))[0]).name
    env = run_environment(bundle, job_id=job_id, run_id="run-1", runs_root=tmp_path / "runs")
    processes: list[int] = []

    def starter(launch, placement, booking):
        result = run_launch(launch, bundle.payloads, job_id=job_id, run_env=env, hints=env_hints(placement),
                            node=placement.node, placement=placement,
                            on_line=lambda stream, text: None)
        processes.append(result.runs)
        return _Done(result)

    outcome = BundleRun(bundle=bundle, store=store, starter=starter, job_id=job_id, run_id="run-1",
                        runs_root=tmp_path / "runs", preferred_node=node_name).run()
    store.close()
    assert outcome.state == "COMPLETED" and not marker.exists()
    assert processes == [2, 1]  # step run: exit 23 then 0 in one launch; publish: once
    assert outcome.steps["run"]["attempts"] == 1 and outcome.steps["run"]["launches"] == 2
    assert outcome.steps["publish"]["attempts"] == 1 and outcome.steps["publish"]["launches"] == 1
    table = " ".join(_rendered(steps_table("t", outcome.steps)).split())
    assert "run │ completed │ 1 │ 2 │" in table and "publish │ completed │ 1 │ 1 │" in table
    status = mn("job", "status", job_id, "--store-url", url, "--json")
    assert status.returncode == 0, status.stderr
    steps = json.loads(status.stdout)["steps"]
    assert (steps["run"]["attempts"], steps["run"]["launches"]) == (1, 2)
    shown = " ".join(mn("job", "status", job_id, "--store-url", url).stdout.split())
    assert "run │ completed │ 1 │ 2 │" in shown


def _rendered(table) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    console.print(table)
    return console.export_text()


# -- 8. reserve --json says what was wrong on stdout --------------------------------------------------------------

@pytest.mark.parametrize("args, field, words, code", [
    (["--resources", '{"cpu": 1', "--for", "1h"], "--resources", "malformed JSON", 1),
    (["--resources", '{"cpu": "lots"}', "--for", "1h"], "--resources.cpu", "must be a number", 1),
    (["--resources", '{"cpu": 1, "gpux": 1}', "--for", "1h"], "--resources.gpux", "unknown key", 1),
    (["--resources", '{"cpu": 1}', "--for", "soon"], "--for", "not a duration", 1),
    (["--resources", '{"cpu": 1}', "--for", "1h", "--group", "nope"], "--group", "no group 'nope'", 1),
    (["--resources", '{"cpu": 1}', "--for", "1h", "--node", "ghost"], "--node", "no node 'ghost'", 1),
    (["--for", "1h"], "--resources", "what to reserve", 2),
    (["--resources", '{"cpu": 1}'], "--for", "how long", 2),
])
def test_reserve_json_errors_are_json_on_stdout(url, args, field, words, code):
    before = contents(url)
    result = mn("reserve", *args, "--json", "--store-url", url)
    assert result.returncode == code, result.stdout + result.stderr
    error = json_error(result)
    assert error["field"] == field and words in error["error"], error
    assert contents(url) == before


def test_reserve_json_with_a_nested_too_deep_request_is_json_too(url):
    result = mn("reserve", "--resources", "[" * 5000 + "]" * 5000, "--for", "1h", "--json", "--store-url", url)
    assert result.returncode == 1 and json_error(result)["field"] == "--resources"


# -- 9. job list: newest first, with the reason for each job's state ---------------------------------------------

def test_job_list_is_newest_first_and_gives_each_jobs_reason(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    now = time.time()
    put_record(store, JobState(job_id="job-old", job_name="train", job_type="batch", status="failed",
                               reason="agent w failed: exit 3, no restarts left", created_at=now - 300))
    put_record(store, WorkflowRecord(
        job_id="wf-mid", job_name="pipeline", run_id="r1", run_dir=str(tmp_path / "runs" / "r1"), bundle="b",
        status="failed", state="FAILED", created_at=now - 200,
        steps={"a": StepSummary(state="failed", attempts=2, launches=2, reason="exit 1")},
        result={"step_id": "a", "error": "exit 1"}))
    put_record(store, WorkflowRecord(
        job_id="wf-new", job_name="pipeline", run_id="r2", run_dir=str(tmp_path / "runs" / "r2"), bundle="b",
        status="running", created_at=now - 100,
        steps={"a": StepSummary(state="completed", attempts=1, launches=1),
               "b": StepSummary(state="running", attempts=1, launches=1)}))
    put_record(store, JobState(job_id="job-newest", job_name="serve", job_type="service", status="running",
                               reason="waiting for capacity: insufficient gpu", created_at=now))
    put_record(store, WorkflowRecord(
        job_id="wf-done", job_name="pipeline", run_id="r3", run_dir=str(tmp_path / "runs" / "r3"), bundle="b",
        status="completed", state="COMPLETED", created_at=now - 50,
        steps={"a": StepSummary(state="completed", attempts=1, launches=1)}))
    store.close()
    result = mn("job", "list", "--store-url", url, "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["job_id"], r["reason"]) for r in rows] == [
        ("job-newest", "waiting for capacity: insufficient gpu"),
        ("wf-done", None),
        ("wf-new", "running: b"),
        ("wf-mid", "step a: exit 1"),
        ("job-old", "agent w failed: exit 3, no restarts left"),
    ]
    assert not any(str(tmp_path) in (r["reason"] or "") for r in rows)
    table = mn("job", "list", "--store-url", url).stdout
    order = [table.index(job) for job in ("job-newest", "wf-done", "wf-new", "wf-mid", "job-old")]
    assert order == sorted(order) and "step a: exit 1" in table and str(tmp_path / "runs") not in table
    running = json.loads(mn("job", "list", "--running-only", "--store-url", url, "--json").stdout)
    assert [r["job_id"] for r in running] == ["job-newest", "wf-new"]


# -- 10. numbers are ASCII digits --------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, path", [({"cpu": "١٢"}, "resources.cpu"), ({"memory_mb": "۵۱۲"}, "resources.memory_mb"),
                                       ({"gpu": "٢"}, "resources.gpu"), ({"cpu": "１２"}, "resources.cpu"),
                                       ({"devices": [{"kind": "gpu", "count": "٢"}]}, "resources.devices[0].count")])
def test_numbers_in_other_scripts_are_refused_naming_the_field(raw, path):
    issues = Issues()
    assert parse_resources(raw, "resources", issues) is None
    [issue] = issues.items
    assert issue.path == path and "ASCII digits" in issue.message


def test_ascii_numeric_strings_still_read_and_the_cli_refuses_the_others(url):
    issues = Issues()
    assert read_number(" 12 ", "cpu", issues) == 12 and read_int("2", "gpu", issues) == 2 and not issues
    assert read_number("١٢", "cpu", issues) is None and read_int("٢", "gpu", issues) is None
    assert [i.path for i in issues.items] == ["cpu", "gpu"]
    before = contents(url)
    reserved = mn("reserve", "--resources", '{"cpu": "١٢"}', "--for", "1h", "--json", "--store-url", url)
    assert reserved.returncode == 1 and json_error(reserved)["field"] == "--resources.cpu"
    assert "ASCII digits" in json_error(reserved)["error"]
    duration = mn("reserve", "--resources", '{"cpu": 1}', "--for", "١h", "--json", "--store-url", url)
    assert duration.returncode == 1 and json_error(duration)["field"] == "--for"
    planned = mn("plan", "--request", '{"cpu": "١٢"}', "--store-url", url)
    assert planned.returncode == 2 and json.loads(planned.stdout)["errors"][0]["path"] == "--request.cpu"
    assert contents(url) == before


# -- 11. resource list: a GPU partly booked is not free ----------------------------------------------------------

def test_resource_list_counts_shared_and_sliced_gpus_as_used_with_free_gpu_memory(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    parent = {**gpu("GPU-m", 0, 81920), "mig_mode": True}
    cut = [{**gpu(f"MIG-m-{n}", 0, 9984), "parent": "GPU-m", "mig_profile": "1g.10gb"} for n in range(3)]
    store = open_store(url)
    store.register_node(node("box", devices=[parent, *cut, gpu("GPU-s", 1, 24576), gpu("GPU-w", 2, 24576),
                                             gpu("GPU-f", 3, 40960)]))
    for job, raw in (("slices", {"devices": [{"kind": "gpu", "mig_profile": "1g.10gb", "count": 2}]}),
                     ("half", {"devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": 10000}]}),
                     ("whole", {"gpu": 1})):
        assert place_and_commit(store, job, [Ask(agent_id="a", request=resource_request(raw))]).placed, job
    store.close()
    result = mn("resource", "list", "--store-url", url, "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    [box] = doc["nodes"]
    # Used: GPU-w whole (1), GPU-s half (0.5), 2 of GPU-m's 1g slices (2/7). Free whole: GPU-f only.
    assert box["used"]["gpu_count"] == pytest.approx(1 + 0.5 + 2 / 7, abs=1e-6)
    assert box["free"]["gpu_count"] == 1 and doc["free"]["gpu_count"] == 1
    assert doc["used"]["gpu_count"] == pytest.approx(box["used"]["gpu_count"])
    # Free GPU memory: GPU-f's, what the half left of GPU-s, GPU-m's slice not booked; none of GPU-w.
    assert box["gpu_memory_free_mb"] == 40960 + (24576 - 10000) + 9984
    assert doc["gpu_memory_free_mb"] == box["gpu_memory_free_mb"]
    lines = mn("resource", "list", "--store-url", url).stdout.splitlines()
    header = [c.strip() for c in next(line for line in lines if "gpus used/sched" in line).split("┃")]
    row = [c.strip() for c in next(line for line in lines if line.replace(" ", "").startswith("│box│")).split("│")]
    shown = dict(zip(header, row, strict=True))
    assert (shown["gpus used/sched"], shown["GPU mem free"]) == ("1.78571/4", "64 GB")  # 65520 MB
