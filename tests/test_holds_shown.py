"""Head-of-line holds where people and dashboards look (docs/scheduling.md, "Holds and backfill"): `plan` against
the store says where a waiting run's hold stands or would go and when it is expected to start, `resource list
--store` what holds book per node, `queue status` each of the queue's holds, and the metrics what holds book, how
many stand and how old the oldest is, with free capacity never below 0. A real SQLite store, no servers."""

from __future__ import annotations

import json
import time

import pytest
from builders import gpu, node
from cli_runner import run
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mn_prefect.model.placement import PlacedResources, Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.ops import metrics as cluster_metrics
from mn_prefect.placement.placing import Placer
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store

HOLD = "hold-0000000a"
WIDE = "7d0c9a4e-2b1f-4e3a-8c5d-6f7a8b9c0d1e"  # the held flow run
STARTS_IN = 1200.0  # seconds until the held run is expected to start: when r1, the later of the two, ends


def ask(name: str, **resources) -> list[Ask]:
    return [Ask(agent_id=name, request=resource_request(resources))]


@pytest.fixture
def url(tmp_path):
    """Node g: 2 GPUs, 8 cores, each GPU taken by a 1-GPU run (r0 ends in 10 min, r1 in 20); node c: CPUs only."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    store.register_node(node("g", cpu=8, memory=16384, devices=[gpu("g0", 0), gpu("g1", 1)]))
    store.register_node(node("c", cpu=4, memory=8192))
    placer = Placer(store)
    for run_id, ends_in in (("r0", 600.0), ("r1", STARTS_IN)):
        placed = placer.place(run_id, ask(run_id, gpu=1, cpu=1), update={"ends_by": time.time() + ends_in})
        assert placed.placed and placed.commit.placements[0].node == "g"
    store.close()
    return url


def book_hold(url: str, *, queue: str | None = "train", start: float | None = None) -> None:
    """The hold a worker books for run WIDE (2 GPUs, 2 cores) on g: past what is free there."""
    store = open_store(url)
    start = time.time() + STARTS_IN if start is None else start
    placement = Placement(agent_id="hold:wide", node="g", job_id=HOLD, hold=HOLD, hold_for=WIDE, hold_queue=queue,
                          hold_start=start, group="default", resources=PlacedResources(cpu_cores=2, gpu_count=2))
    assert store.commit_plan(HOLD, [placement]).ok
    store.close()


# -- metrics ---------------------------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    store = open_store(url)
    try:
        text = generate_latest(cluster_metrics.cluster_registry(store)).decode()
    finally:
        store.close()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(samples, name: str, **labels) -> float:
    found = [v for key, v in samples.get(name, {}).items() if set(labels.items()) <= set(key)]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def test_metrics_count_what_a_hold_books_apart_from_use_and_free_never_goes_below_zero(url):
    book_hold(url)
    samples = scrape(url)
    g = {"node": "g", "group": "default"}
    assert value(samples, "mn_node_held", **g, resource="gpu", unit="gpus") == 2
    assert value(samples, "mn_node_held", **g, resource="cpu", unit="cores") == 2
    assert value(samples, "mn_node_held", **g, resource="memory") == 0
    assert value(samples, "mn_node_held", node="c", resource="gpu") == 0
    assert value(samples, "mn_node_allocated", **g, resource="cpu") == 2  # the runs' cores; the hold's are held
    assert value(samples, "mn_node_unallocated", **g, resource="cpu") == 4  # 8 - 2 used - 2 held
    assert value(samples, "mn_node_allocated", **g, resource="gpu") == 2
    assert value(samples, "mn_node_unallocated", **g, resource="gpu") == 0  # booked 2 past what was free: not -2


def test_a_gpu_freed_under_a_hold_is_held_not_free(url):
    book_hold(url)
    store = open_store(url)
    store.release("r0")
    store.close()
    samples = scrape(url)
    assert value(samples, "mn_node_allocated", node="g", resource="gpu") == 1
    assert value(samples, "mn_node_held", node="g", resource="gpu") == 2
    assert value(samples, "mn_node_unallocated", node="g", resource="gpu") == 0


def test_metrics_count_standing_holds_per_group_and_queue_with_the_oldest_ones_age(url):
    assert "mn_holds" not in scrape(url)  # no hold, no series
    book_hold(url)
    samples = scrape(url)
    assert value(samples, "mn_holds", group="default", queue="train") == 1
    assert 0 <= value(samples, "mn_hold_oldest_age_seconds", group="default", queue="train") < 60


def test_a_workers_own_view_shows_its_nodes_held_capacity_but_not_the_pools_holds(url):
    book_hold(url)
    store = open_store(url)
    try:
        text = generate_latest(cluster_metrics.cluster_registry(store, node="g", queues=False)).decode()
    finally:
        store.close()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "mn_node_held" in names and "mn_holds" not in names


# -- resource list --------------------------------------------------------------------------------------------


def test_resource_list_says_what_each_hold_books_and_for_which_run(url):
    book_hold(url)
    doc = json.loads(run(["resource", "list", "--store", "--store-url", url, "--json"]).stdout)
    g = next(n for n in doc["nodes"] if n["name"] == "g")
    assert g["held"] == {"cpu_cores": 2.0, "memory_mb": 0.0, "disk_mb": 0.0, "gpu_count": 2.0}
    [hold] = g["holds"]
    assert (hold["hold"], hold["run"], hold["queue"], hold["resources"]["gpu_count"]) == (HOLD, WIDE, "train", 2)
    assert hold["expected_start"] == pytest.approx(time.time() + STARTS_IN, abs=60)
    assert g["used"]["cpu_cores"] == 2 and g["free"]["cpu_cores"] == 4 and g["free"]["gpu_count"] == 0
    assert next(n for n in doc["nodes"] if n["name"] == "c")["holds"] == []
    assert doc["held"]["gpu_count"] == 2
    table = run(["resource", "list", "--store", "--store-url", url])
    assert table.returncode == 0 and "2 GPUs, 2 cores" in table.stdout and WIDE[:8] in table.stdout  # held column


def test_the_cluster_overview_artifact_says_what_each_hold_books_and_for_which_run(url):
    from mn_prefect.ops.overview import cluster_rows

    book_hold(url)
    store = open_store(url)
    try:
        rows = {r["node"]: r for r in cluster_rows(store, None)}
    finally:
        store.close()
    assert rows["g"]["held"] == f"2 GPUs, 2 cores for run {WIDE[:8]}" and rows["c"]["held"] == "-"
    assert rows["g"]["gpus used / free"] == "2 / 0"  # the runs' GPUs; the hold's are held, not used


def test_resource_list_without_holds_shows_none_held(url):
    doc = json.loads(run(["resource", "list", "--store", "--store-url", url, "--json"]).stdout)
    assert all(n["holds"] == [] and n["held"]["gpu_count"] == 0 for n in doc["nodes"])
    assert doc["nodes"][0]["free"]["gpu_count"] >= 0


# -- plan -----------------------------------------------------------------------------------------------------


def plan(*args: str) -> tuple[int, dict]:
    result = run(["plan", *args])
    return result.returncode, json.loads(result.stdout)


def test_a_store_plan_that_fits_later_says_where_its_hold_would_go_and_when_it_would_start(url):
    code, doc = plan("--request", '{"gpu": 2}', "--store-url", url)
    assert code == 1 and doc["status"] == "runnable_later" and doc["placements"] == []
    assert doc["hold"]["nodes"] == ["g"] and doc["hold"]["standing"] is False
    assert doc["hold"]["expected_start_s"] == pytest.approx(STARTS_IN, abs=60)  # when r1, the later one, ends


def test_the_plan_table_says_the_hold_in_words(url):
    result = run(["plan", "--request", '{"gpu": 2}', "--store-url", url, "--table"])
    text = " ".join(result.stdout.split())
    assert result.returncode == 1 and "hold: a hold for this run would go on g" in text
    assert "expected start in about 20 min" in text


def test_a_hold_standing_for_the_run_is_its_own_and_its_expected_start_is_the_holds(url):
    book_hold(url, start=time.time() + 900)
    code, doc = plan("--request", '{"gpu": 2, "cpu": 2}', "--store-url", url, "--flow-run", WIDE)
    assert code == 1 and doc["status"] == "runnable_later"
    assert doc["hold"] == {"nodes": ["g"], "expected_start_s": pytest.approx(900, abs=60), "standing": True}
    table = " ".join(run(["plan", "--request", '{"gpu": 2, "cpu": 2}', "--store-url", url, "--flow-run", WIDE,
                          "--table"]).stdout.split())
    assert "hold: a hold stands for this run on g; expected start in about 15 min" in table


def test_once_the_runs_end_the_held_run_fits_over_its_own_hold_and_no_other_run_does(url):
    book_hold(url)
    store = open_store(url)
    store.release("r0")
    store.release("r1")
    store.close()
    code, doc = plan("--request", '{"gpu": 2, "cpu": 2}', "--store-url", url, "--flow-run", WIDE)
    assert code == 0 and doc["status"] == "runnable_now" and doc["placements"][0]["node"] == "g"
    assert "hold" not in doc
    code, doc = plan("--request", '{"gpu": 2, "cpu": 2}', "--store-url", url)  # another run: g is held
    assert code == 1 and doc["status"] == "runnable_later" and "hold" not in doc  # no node frees for it


def test_a_hold_waiting_on_a_run_without_an_estimate_has_no_expected_start(url):
    store = open_store(url)
    store.release("r1")
    assert Placer(store).place("r2", ask("r2", gpu=1, cpu=1)).placed  # no ends_by: its end is unknown
    store.close()
    code, doc = plan("--request", '{"gpu": 2}', "--store-url", url)
    assert code == 1 and doc["hold"] == {"nodes": ["g"], "expected_start_s": None, "standing": False}
    table = " ".join(run(["plan", "--request", '{"gpu": 2}', "--store-url", url, "--table"]).stdout.split())
    assert "expected start unknown" in table


def test_a_plan_that_never_fits_or_against_a_nodes_file_has_no_hold(url, tmp_path):
    code, doc = plan("--request", '{"gpu": 3}', "--store-url", url)
    assert code == 1 and doc["status"] == "not_runnable" and "hold" not in doc
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps([node("g", devices=[gpu("g0", 0)]).model_dump(mode="json")]))
    active = tmp_path / "active.json"
    active.write_text(json.dumps([Placement(agent_id="x", node="g", job_id="x",
                                            resources=PlacedResources(gpu_count=1)).model_dump(mode="json")]))
    code, doc = plan("--request", '{"gpu": 1}', "--nodes", str(nodes), "--active", str(active))
    assert code == 1 and doc["status"] == "runnable_later" and "hold" not in doc


def test_flow_run_is_for_a_store_plan_of_one_run(url, tmp_path):
    bp = tmp_path / "b.json"
    bp.write_text(json.dumps({"manifest_version": "1.0", "graph_id": "b", "job_name": "b", "edges": [],
                              "policies": {}, "nodes": [{"node_id": "w", "agent_type": "executor",
                                                         "config": {"command": ["true"]}, "resources": {}}]}))
    code, doc = plan(str(bp), "--store-url", url, "--flow-run", WIDE)
    assert code == 2 and [e["path"] for e in doc["errors"]] == ["--flow-run"]


# -- queue status ---------------------------------------------------------------------------------------------

NO_PREFECT = {"PREFECT_API_URL": ""}  # the queue's accounts only: no server to read waiting runs from


def test_queue_status_shows_each_hold_of_the_queue_with_what_it_holds_of_what_its_run_needs(url):
    book_hold(url)
    store = open_store(url)
    store.release("r0")  # one of the two GPUs the run needs is free, and held for it
    store.close()
    status = json.loads(run(["queue", "status", "train", "--store-url", url, "--json"], env=NO_PREFECT).stdout)
    [hold] = status["holds"]
    assert (hold["hold"], hold["run"], hold["nodes"]) == (HOLD, WIDE, ["g"])
    assert hold["held"] == [{"node": "g", "gpus_free": 1, "gpus": 2}]
    assert hold["expected_start_s"] == pytest.approx(STARTS_IN, abs=60)
    assert hold["message"].startswith("holding 1 of 2 GPUs on g for this run; expected start in about 20 min")
    assert hold["message"].endswith("when run r1 ends")
    table = " ".join(run(["queue", "status", "train", "--store-url", url], env=NO_PREFECT).stdout.split())
    assert "holds (1)" in table and "1 of 2 GPUs on g" in table and "in about 20 min" in table


def test_queue_status_shows_only_the_holds_of_its_own_queue(url):
    book_hold(url, queue="other")
    status = json.loads(run(["queue", "status", "train", "--store-url", url, "--json"], env=NO_PREFECT).stdout)
    assert status["holds"] == []
    assert "holds (" not in run(["queue", "status", "train", "--store-url", url], env=NO_PREFECT).stdout
    other = json.loads(run(["queue", "status", "other", "--store-url", url, "--json"], env=NO_PREFECT).stdout)
    assert [h["run"] for h in other["holds"]] == [WIDE]


def test_the_mirror_neuron_apis_resource_view_counts_holds_apart_and_free_never_below_zero(url):
    """``GetResource`` (``mn resource list``): the hold's two GPUs and two cores on g are held, not used, and what
    g has free stops at 0 (its GPUs are both booked to runs, the hold books past them)."""
    from mn_prefect.mn_api.cluster import resources

    before = resources(open_store(url))
    book_hold(url)
    store = open_store(url)
    view = resources(store)
    store.close()
    g = next(n for n in view["nodes"] if n["name"] == "g")
    assert (g["held"]["gpu_count"], g["held"]["cpu_cores"]) == (2, 2.0)
    assert g["used"]["gpu_count"] == 2 and g["used"]["cpu_cores"] == 2.0  # the two runs' bookings only
    assert all(g["free"][k] >= 0 for k in ("cpu_cores", "memory_mb", "disk_mb", "gpu_count")), g["free"]
    assert g["free"]["gpu_count"] == 0 and g["free"]["cpu_cores"] == 4.0  # 8 cores, 2 used, 2 held
    assert view["held"]["gpu_count"] == 2 and before["held"]["gpu_count"] == 0
    assert view["free"]["gpu_count"] == 0 and view["used"] == before["used"]
