"""``mn-prefect queue`` and ``plan --queues``: the console script's entry point (tests/cli_runner.py), on a real SQLite store."""

import json
import time

import pytest
from builders import gpu, node
from test_cli import run, write

from mn_prefect.model.placement import Placement
from mn_prefect.store import open_store

NODES = [{"name": "g", "cpu_cores": 16, "memory_mb": 65536, "disk_mb": 100000,
          "devices": [gpu(f"G{i}", i, 40960) for i in range(4)]}]
QUEUES = {"train": {"quota": {"gpu": 2}, "priority": 5, "cohort": "lab"},
          "serve": {"quota": {"gpu": 1}, "borrow": {"gpu": 0}, "cohort": "lab"}}


@pytest.fixture
def files(tmp_path):
    return write(tmp_path, "nodes.json", NODES), write(tmp_path, "queues.json", QUEUES)


def plan(*args):
    result = run("plan", "--request", '{"gpu": 1}', *args)
    return result.returncode, json.loads(result.stdout)


def test_a_dry_run_places_within_the_queue_and_says_so(tmp_path, files):
    nodes, queues = files
    code, first = plan("--nodes", nodes, "--queues", queues, "--queue", "train", "--preemptible")
    assert code == 0
    [placement] = first["placements"]
    assert (placement["queue"], placement["priority"], placement["preemptible"]) == ("train", 5, True)
    allocation = json.loads(placement["env"]["MN_ALLOCATION_JSON"])
    assert allocation["queue"] == "train" and allocation["priority"] == 5  # the run sees it too
    # --active carries the queue back in: two GPUs of train's quota, then what serve does not use (it lends)
    held = [Placement.model_validate(placement)]
    for expected_code in (0, 0):
        code, doc = plan("--nodes", nodes, "--queues", queues, "--queue", "train", "--priority", "9",
                         "--active", write(tmp_path, "active.json", [p.model_dump(mode="json") for p in held]))
        assert code == expected_code, doc["reason"]
        held += [Placement.model_validate(p) for p in doc["placements"]]
    assert [p.priority for p in held] == [5, 9, 9]
    code, doc = plan("--nodes", nodes, "--queues", queues, "--queue", "train",
                     "--active", write(tmp_path, "active.json", [p.model_dump(mode="json") for p in held]))
    assert (code, doc["status"]) == (1, "runnable_later")
    assert doc["reason"] == "quota: queue train is at its quota of 2 GPUs and cohort lab has none to lend"
    code, doc = run_never(nodes, queues)
    assert (code, doc["status"]) == (1, "not_runnable") and "serve asks 2 GPUs, more than it may ever hold" in doc["reason"]


def run_never(nodes, queues):
    result = run("plan", "--request", '{"gpu": 2}', "--nodes", nodes, "--queues", queues, "--queue", "serve")
    return result.returncode, json.loads(result.stdout)


def test_a_plan_without_a_queue_has_no_queue_fields(files):
    nodes, queues = files
    code, doc = plan("--nodes", nodes, "--queues", queues)
    assert code == 0 and "queue" not in doc["placements"][0]
    assert "queue" not in json.loads(doc["placements"][0]["env"]["MN_ALLOCATION_JSON"])


@pytest.mark.parametrize("args, path, words", [
    (["--queue", "nope"], "--queue", "not one of the queues"),
    (["--priority", "3"], "--priority", "needs --queue"),
])
def test_bad_queue_options_name_the_option(files, args, path, words):
    nodes, queues = files
    code, doc = plan("--nodes", nodes, "--queues", queues, *args)
    assert code == 2 and any(e["path"] == path and words in e["message"] for e in doc["errors"]), doc


def test_a_bad_queues_file_names_the_field(tmp_path, files):
    nodes, _ = files
    bad = write(tmp_path, "bad.json", {"train": {"quota": {"gpus": "many"}, "cohort": "a/b"}})
    code, doc = plan("--nodes", nodes, "--queues", bad, "--queue", "train")
    assert code == 2
    assert {e["path"] for e in doc["errors"]} == {"bad.json.train.quota.gpus", "bad.json.train.cohort"}


def test_queue_settings_round_trip_and_the_store_plans_with_them(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    store.register_node(node("g", cpu=16, devices=[gpu("G0", 0), gpu("G1", 1)]))
    set_ = run("queue", "set", "train", "--quota", "gpu=1,memory_gb=8", "--cohort", "lab", "--weight", "2",
               "--priority", "4", "--store-url", url, "--json")
    assert set_.returncode == 0, set_.stderr
    assert json.loads(set_.stdout)["spec"] == {"name": "train", "quota": {"gpu": 1, "memory": 8192}, "borrow": None,
                                               "weight": 2, "priority": 4, "cohort": "lab"}
    listed = json.loads(run("queue", "list", "--store-url", url, "--json").stdout)
    assert [(q["queue"], q["quota"], q["used"], q["cohort"]) for q in listed] == [
        ("train", {"gpu": 1, "memory": 8192}, {}, "lab")]
    table = run("queue", "list", "--store-url", url).stdout
    assert "train" in table and "8192 MB of memory" in table
    # the store's queues are what a plan against the store is charged to
    code, doc = plan("--store-url", url, "--queue", "train")
    assert code == 0 and doc["placements"][0]["priority"] == 4
    assert store.commit_plan("r1", [Placement.model_validate(doc["placements"][0])]).ok
    status = json.loads(run("queue", "status", "train", "--store-url", url, "--json",
                            env={"PREFECT_API_URL": ""}).stdout)
    assert status["used"]["gpu"] == 1 and status["waiting"] == [] and "no Prefect server" in status["waiting_from"]
    code, doc = plan("--store-url", url, "--queue", "train")
    assert code == 1 and doc["reason"].startswith("quota: queue train is at its quota of 1 GPU")
    refused = run("queue", "delete", "train", "--store-url", url)
    assert refused.returncode == 1 and "still holds" in refused.stderr
    bad = run("queue", "set", "x", "--quota", "gpu=-1", "--weight", "0", "--store-url", url)
    assert bad.returncode == 2 and "--quota.gpu" in bad.stdout + bad.stderr and "--weight" in bad.stdout + bad.stderr


def test_a_dry_run_names_the_runs_placing_it_would_preempt(tmp_path, files):
    nodes, _ = files
    queues = write(tmp_path, "q.json", {"batch": {"quota": {"gpu": 2}, "cohort": "c"},
                                        "urgent": {"quota": {"gpu": 2}, "cohort": "c", "priority": 10}})
    held = []
    for n, preemptible in enumerate([True, True, True, False]):  # batch fills the 4 GPUs, borrowing urgent's 2
        args = ["--queue", "batch"] + (["--preemptible"] if preemptible else [])
        code, doc = plan("--nodes", nodes, "--queues", queues, *args,
                         "--active", write(tmp_path, "a.json", [p.model_dump(mode="json") for p in held]))
        assert code == 0, doc
        held.append(Placement.model_validate({**doc["placements"][0], "job_id": f"run-{n}"}))
    active = write(tmp_path, "a.json", [p.model_dump(mode="json") for p in held])
    code, doc = plan("--nodes", nodes, "--queues", queues, "--queue", "urgent", "--active", active)
    assert code == 0 and doc["status"] == "runnable_now"
    assert doc["placements"][0]["preempts"] == ["run-0"] and "after preempting 1 run(s): run-0" in doc["reason"]
    # the same priority takes back only what was lent: batch is not preempted for batch
    code, doc = plan("--nodes", nodes, "--queues", queues, "--queue", "batch", "--active", active)
    assert code == 1 and doc["placements"] == []


def test_a_waiting_run_s_estimate_is_its_declared_runtime_else_its_flow_s_timeout_else_learned(tmp_path):
    from types import SimpleNamespace

    from mn_prefect.cli.queues import _run_estimate
    from mn_prefect.placement import estimates
    from mn_prefect.store import open_store

    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    run = SimpleNamespace(deployment_id="d-1")
    estimates.record_duration(store, estimates.run_key(run), 700.0)
    declared = _run_estimate(store, run, {"max_runtime_seconds": 7200, "max_runtime_is_limit": True})
    assert (declared.source, declared.is_limit) == ("declared", True)
    assert _run_estimate(store, run, {"flow_timeout_seconds": 60}).describe() == "at most 60 s (its timeout)"
    assert _run_estimate(store, run, {}).describe() == "about 12 min, learned from 1 run (p90)"
    assert _run_estimate(store, run, {"max_runtime_seconds": "soon"}).source == "learned"  # the worker fails it
    assert _run_estimate(store, SimpleNamespace(deployment_id=None), {}).describe() == "unknown"
    store.close()


def test_queue_set_announces_the_settings_and_fair_share_keeps_its_half_life_and_standings(tmp_path, monkeypatch):
    """``queue set`` says what changed as the event ``mn.queue.updated`` about the queue (the events Automations
    hear); ``queue fair-share --half-life`` keeps how fast past use is forgotten, and ``queue fair-share`` shows each
    queue's past use once the announcer has moved it on."""
    from mn_prefect import events
    from mn_prefect.placement.fair_share import advance

    said: list[tuple[str, str, dict]] = []
    monkeypatch.setattr(events, "emit", lambda event, resource, related=(), payload=None: said.append(
        (event, resource["prefect.resource.id"], payload or {})) or True)
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    store.register_node(node("g", cpu=16, devices=[gpu("G0", 0), gpu("G1", 1)]))
    assert run("queue", "set", "train", "--quota", "gpu=1", "--store-url", url).returncode == 0
    [(event, resource, payload)] = said
    assert (event, resource, payload["queue"], payload["spec"]["quota"]) == (
        "mn.queue.updated", "mn.queue.train", "train", {"gpu": 1.0})
    half = run("queue", "fair-share", "--half-life", "600", "--store-url", url, "--json")
    assert half.returncode == 0 and json.loads(half.stdout)["half_life_s"] == 600
    assert store.commit_plan("r1", [Placement(agent_id="r1", node="g", job_id="r1", queue="train",
                                              resources={"gpu_count": 1})]).ok
    now = time.time()
    advance(store, now)
    advance(store, now + 60)  # the announcer's passes, a minute apart
    standings = json.loads(run("queue", "fair-share", "--store-url", url, "--json").stdout)["queues"]
    past = {q["queue"]: q["past"] for q in standings}
    assert past["train"] > 0
