"""Bad input on the command line: each gets a clear error naming the field or argument, exits non-zero and
leaves the store as it was. Through the installed ``mn-prefect`` script in real subprocesses, against a real
SQLite store file; and the counts and listings those commands show, checked against what really ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders import gpu, node

from mn_prefect.model.issues import Issues
from mn_prefect.model.resources import parse_resources
from mn_prefect.model.scalars import read_int, read_number
from mn_prefect.store import open_store
from mn_prefect.store.records import ReservationRecord, list_records

ROOT = Path(__file__).resolve().parents[1]
MN = str(Path(sys.executable).parent / "mn-prefect")
BUNDLES = ROOT / "examples" / "bundles"
BLUEPRINTS = ROOT / "examples" / "blueprints"


def mn(*args, home: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MN_"))}
    env.update(COLUMNS="250", PREFECT_API_URL="")
    if home is not None:
        env.update(HOME=str(home), MN_PREFECT_HOME=str(home / ".mn-prefect"), PREFECT_HOME=str(home / ".prefect"))
    return subprocess.run([MN, *map(str, args)], capture_output=True, text=True, timeout=120, env=env)


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
    # What no resource request accepts, a reservation refuses the same way: a size with a unit suffix is not a
    # number in this grammar (memory is MB, memory_gb GB), named at the field, exit 1, nothing written.
    before = contents(url)
    for value in ("32G", "512Mi"):
        refused = mn("reserve", "--resources", json.dumps({"memory": value}), "--for", "2h", "--json",
                     "--store-url", url)
        planned = mn("plan", "--request", json.dumps({"memory": value}), "--store-url", url)
        assert refused.returncode == 1 and planned.returncode == 2
        error = json_error(refused)
        [plan_error] = json.loads(planned.stdout)["errors"]
        assert error["field"] == "--resources.memory" and plan_error["path"] == "--request.memory"
        assert error["error"] == plan_error["message"] == f"must be a number, got the string {value!r}"
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
