"""Prometheus metrics (docs/operating.md, "Metrics for Prometheus and Grafana"), without servers: the cluster
collector against a real SQLite store with bookings of every kind of sharing (whole GPUs, fractions, MIG slices)
and owner, read back from the text exposition as Prometheus parses it; the worker's instruments; the commit
conflicts the store reports; `metrics show`, `metrics targets` and `metrics serve`'s refusals.
(tests/test_metrics_lab.py scrapes real workers and `metrics serve` over HTTP while runs are placed.)"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import uuid
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from builders import gpu, node
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mn_prefect.cli import metrics as metrics_cli
from mn_prefect.model.placement import Placement, Plan
from mn_prefect.model.queues import QueueSpec
from mn_prefect.model.resources import resource_request
from mn_prefect.ops import metrics as cluster_metrics
from mn_prefect.placement.placing import Placer, PlaceResult, place_and_commit
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.quotas import RunQueue
from mn_prefect.store import open_store
from mn_prefect.store.admission import CommitRead, commit
from mn_prefect.store.base import CommitResult, Conflict
from mn_prefect.store.booking import NodeState
from mn_prefect.store.dimensions import CLAIM_KINDS
from mn_prefect.store.records import MetricsEndpointRecord, put_record
from mn_prefect.worker import metrics as worker_metrics

MN = str(Path(sys.executable).parent / "mn-prefect")
MB = 1024 * 1024
RUN = "0b5d3c1e-6f7a-4b8c-9d0e-1f2a3b4c5d6e"  # a flow run's booking: its id is a UUID


def mig_gpu(id: str, index: int, slices: int = 7) -> list[dict]:
    parent = {**gpu(id, index, 81920), "mig_mode": True}
    return [parent, *({**gpu(f"MIG-{id}-{n}", index, 9984), "parent": id, "mig_profile": "1g.10gb"}
                      for n in range(slices))]


def _ask(raw: dict) -> list[Ask]:
    return [Ask(agent_id="a", request=resource_request(raw))]


@pytest.fixture
def store(tmp_path):
    """g1: a GPU held whole by a flow run (in queue ``train``), a GPU shared half by a bundle step, a GPU in MIG
    mode with two of its seven slices held by a reservation, and a booking of no known owner; c1 in maintenance."""
    s = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    s.register_node(node("g1", cpu=16, memory=65536, disk=100_000,
                         devices=[gpu("GPU-A", 0, 24576), gpu("GPU-B", 1, 16384), *mig_gpu("GPU-M", 2)]))
    s.register_node(node("c1", cpu=8, memory=16384))
    s.set_node_status("c1", "maintenance")
    s.set_queue(QueueSpec(name="train", quota={"gpu": 4, "cpu": 8}, cohort="research"))
    placed = [
        Placer(s).place(RUN, _ask({"cpu": 2, "memory_mb": 4096, "devices": [{"kind": "gpu", "min_memory_mb": 20000}]}),
                        queue=RunQueue("train")),
        place_and_commit(s, "rsv-0123abcd", _ask({"cpu": 1, "devices": [{"kind": "gpu", "mig_profile": "1g.10gb",
                                                                          "count": 2}]})),
        place_and_commit(s, "wf-1#1", _ask({"cpu": 1, "devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": 4096}]})),
        place_and_commit(s, "mystery", _ask({"cpu": 1, "memory_mb": 1024})),
    ]
    assert all(p.placed and p.commit.placements[0].node == "g1" for p in placed)
    yield s
    s.close()


def scrape(registry) -> dict[str, dict[tuple, float]]:
    """Every sample of the text exposition, as Prometheus parses it: name -> {sorted labels: value}."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(samples, name: str, **labels) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    found = [v for key, v in samples.get(name, {}).items() if set(labels.items()) <= set(key)]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def test_the_cluster_view_reports_capacity_use_and_free_per_node_and_dimension(store):
    samples = scrape(cluster_metrics.cluster_registry(store))
    g1 = {"node": "g1", "group": "default"}
    assert value(samples, "mn_node_capacity", **g1, resource="cpu", unit="cores") == 16
    assert value(samples, "mn_node_allocated", **g1, resource="cpu") == 5  # 2 + 1 + 1 + 1
    assert value(samples, "mn_node_unallocated", **g1, resource="cpu") == 11
    assert value(samples, "mn_node_capacity", **g1, resource="memory", unit="bytes") == 65536 * MB
    assert value(samples, "mn_node_allocated", **g1, resource="memory") == 5120 * MB
    assert value(samples, "mn_node_unallocated", **g1, resource="disk") == 100_000 * MB
    # GPUs: one held whole (1), one half shared (0.5), two 1g slices of seven (2/7); none left untouched.
    assert value(samples, "mn_node_capacity", **g1, resource="gpu", unit="gpus") == 3
    assert value(samples, "mn_node_allocated", **g1, resource="gpu") == pytest.approx(1.5 + 2 / 7, abs=1e-6)
    assert value(samples, "mn_node_unallocated", **g1, resource="gpu") == 0
    assert value(samples, "mn_node_capacity", **g1, resource="gpu_memory") == (24576 + 16384 + 81920) * MB
    assert value(samples, "mn_node_allocated", **g1, resource="gpu_memory") == (24576 + 4096 + 2 * 9984) * MB
    assert value(samples, "mn_node_unallocated", **g1, resource="gpu_memory") == (16384 - 4096 + 5 * 9984) * MB
    assert value(samples, "mn_node_allocated", node="c1", resource="cpu") == 0
    assert value(samples, "mn_node_schedulable", node="c1", resource="cpu") == 8
    assert value(samples, "mn_store_up") == 1


def test_each_device_reports_what_is_booked_of_it_whole_in_shares_and_in_slices(store):
    samples = scrape(cluster_metrics.cluster_registry(store))
    assert value(samples, "mn_device_used", node="g1", UUID="GPU-A", parent="") == 1
    assert value(samples, "mn_device_memory_used_bytes", UUID="GPU-A") == 24576 * MB
    assert value(samples, "mn_device_used", UUID="GPU-B") == 0.5
    assert value(samples, "mn_device_free", UUID="GPU-B") == 0.5
    assert value(samples, "mn_device_memory_used_bytes", UUID="GPU-B") == 4096 * MB
    assert value(samples, "mn_device_memory_bytes", UUID="GPU-B") == 16384 * MB
    assert value(samples, "mn_device_used", UUID="GPU-M") == pytest.approx(2 / 7, abs=1e-6)
    slices = {dict(key)["UUID"]: v for key, v in samples["mn_device_used"].items() if dict(key)["parent"] == "GPU-M"}
    assert len(slices) == 7 and sorted(slices.values()) == [0] * 5 + [1] * 2
    assert all(dict(key)["GPU_I_PROFILE"] == "1g.10gb" for key in samples["mn_device_used"] if dict(key)["parent"])
    assert value(samples, "mn_device_slices", UUID="GPU-M", state="booked") == 2
    assert value(samples, "mn_device_slices", UUID="GPU-M", state="free") == 5
    assert value(samples, "mn_device_info", UUID="GPU-A", model="nvidia-24576") == 1


def test_bookings_are_counted_by_owner_kind_and_node_states_are_labelled(store):
    samples = scrape(cluster_metrics.cluster_registry(store))
    kinds = {dict(key)["kind"]: v for key, v in samples["mn_bookings"].items() if dict(key)["node"] == "g1"}
    assert kinds == {"flow_run": 1, "reservation": 1, "step_attempt": 1, "unknown": 1, "blueprint_job": 0,
                     "system_copy": 0, "hold": 0}
    assert sum(v for key, v in samples["mn_bookings"].items() if dict(key)["node"] == "c1") == 0
    states = {(dict(key)["node"], dict(key)["state"]): v for key, v in samples["mn_node_state"].items()}
    assert states[("c1", "maintenance")] == 1 and states[("c1", "healthy")] == 0 and states[("g1", "healthy")] == 1
    assert sum(v for (n, _), v in states.items() if n == "c1") == 1  # one state per node
    assert value(samples, "mn_node_heartbeat_age_seconds", node="g1") >= 0
    # the queue's quota and what its run holds
    assert value(samples, "mn_queue_nominal_quota", queue="train", cohort="research", resource="gpu") == 4
    assert value(samples, "mn_queue_resource_usage", queue="train", resource="gpu") == 1
    assert value(samples, "mn_queue_resource_usage", queue="train", resource="cpu") == 2


def test_a_workers_view_has_its_own_node_only_and_a_store_away_says_so(store, tmp_path):
    samples = scrape(cluster_metrics.cluster_registry(store, node="c1", group="default", queues=False))
    assert {dict(key)["node"] for key in samples["mn_node_capacity"]} == {"c1"}
    assert "mn_queue_nominal_quota" not in samples and "mn_device_used" not in samples
    assert value(samples, "mn_node_state", state="maintenance") == 1

    def unreachable():
        raise OSError("store away")

    samples = scrape(cluster_metrics.cluster_registry(unreachable))
    assert value(samples, "mn_store_up") == 0 and "mn_node_capacity" not in samples


def test_the_worker_records_placement_latency_conflicts_retries_and_waiting_runs():
    pool = f"p-{uuid.uuid4().hex[:6]}"
    registry = worker_metrics.REGISTRY
    run = SimpleNamespace(id=uuid.uuid4(), work_queue_name="train",
                          expected_start_time=datetime.now(UTC) - timedelta(seconds=3))
    waiting = Plan(status="runnable_later", reason="waiting for capacity (a: ...)",
                   agents={"a": {"n1": "insufficient gpu: asks 2, 1 of 2 free", "n2": "insufficient gpu: asks 2",
                                 "n3": "node not ready: status offline"}})
    worker_metrics.poll_began(pool, [run])
    worker_metrics.placing(pool, run, PlaceResult(plan=waiting, commit=None, attempts=2, rereads=0))
    assert scrape(registry)["mn_queue_pending_runs"][(("pool", pool), ("queue", "train"), ("reason", "insufficient gpu"),
                                                ("status", "runnable_later"))] == 1
    placed = Plan(status="runnable_now")
    booked = Placement(agent_id="a", node="n2")
    worker_metrics.placing(pool, run, PlaceResult(plan=placed, attempts=3, conflicts=2, rereads=1,
                                                  commit=CommitResult(ok=True, job_id=str(run.id),
                                                                      placements=[booked])))
    samples = scrape(registry)
    assert not [k for k in samples.get("mn_queue_pending_runs", {}) if ("pool", pool) in k]  # placed: waits no more
    assert value(samples, "mn_admission_wait_time_seconds_count", pool=pool, node="n2") == 1
    assert 2.5 < value(samples, "mn_admission_wait_time_seconds_sum", pool=pool) < 60
    assert value(samples, "mn_commit_conflicts_total", pool=pool, kind="taken") == 2
    assert value(samples, "mn_commit_conflicts_total", pool=pool, kind="changed") == 1
    assert value(samples, "mn_commit_retries_total", pool=pool, stage="placer") == 1 + 2
    assert value(samples, "mn_commit_retries_total", pool=pool, stage="store") == 1
    other = SimpleNamespace(id=uuid.uuid4(), work_queue_name=None, expected_start_time=None, created=None)
    worker_metrics.placing(pool, other, PlaceResult(plan=waiting, attempts=1, commit=CommitResult(
        ok=False, job_id=str(other.id), conflict=Conflict(reason="booked", job_booked=True))))
    worker_metrics.woke(pool, "placed", 0.2)
    samples = scrape(registry)
    assert value(samples, "mn_commit_conflicts_total", pool=pool, kind="same_run") == 1
    assert value(samples, "mn_wakeup_latency_seconds_count", pool=pool, change="placed") == 1
    assert value(samples, "mn_wakeup_latency_seconds_bucket", pool=pool, change="placed", le="0.25") == 1


def test_waiting_reasons_are_a_bounded_set():
    def category(reason, **agents):
        return worker_metrics.reason_category(Plan(status="runnable_later", reason=reason, agents=agents))

    assert category("quota: queue train is at its quota of 4 GPUs") == "quota"
    assert category("waiting for capacity: no nodes") == "no nodes"
    assert category("x", a={"n1": "port in use: tcp:8080", "n2": "node not ready: offline"}) == "node not ready"
    assert category("x", a={"n1": "something new: words", "n2": "it changed"}) == "other"


def test_a_commit_whose_apply_found_the_nodes_changed_says_how_often():
    """The store's optimistic apply (Redis, PostgreSQL): a ticket applied on a changed node is decided again."""

    class Changing:
        applies = 0

        @contextmanager
        def commit_session(self):
            yield self

        def read(self, job_id, nodes, lease):
            return CommitRead(states=[NodeState(record=node("n", cpu=4), used={}, held={k: set() for k in CLAIM_KINDS})],
                              limits=Limits())

        def apply(self, ticket, lease):
            self.applies += 1
            return ("changed", None) if self.applies <= 2 else ("ok", None)

    result = commit(Changing(), "j", [Placement(agent_id="a", node="n")], None, 0.0)
    assert result.ok and result.rereads == 2


def test_a_placer_whose_commit_was_taken_counts_the_conflict_and_plans_again(tmp_path):
    url = f"sqlite:///{tmp_path / 'two.db'}"
    first, second = open_store(url), open_store(url)
    for name in ("n1", "n2"):
        first.register_node(node(name, cpu=4, devices=[gpu(f"{name}-gpu", 0)]))
    stale = Placer(first, reread="on_invalidate")
    stale.refresh()  # both GPUs free, as this placer last read
    assert place_and_commit(second, "other", _ask({"gpu": 1, "cpu": 4}), strategy="binpack").placed
    result = stale.place("mine", _ask({"gpu": 1, "cpu": 4}))
    taken = first.active_placements(job_id="other")[0].node
    if result.attempts == 1:  # the stale view happened to pick the other node first: nothing to count
        assert result.conflicts == 0 and result.commit.placements[0].node != taken
    else:
        assert result.placed and result.conflicts == 1 and result.attempts == 2
        assert result.commit.placements[0].node != taken
    first.close()
    second.close()


def test_metrics_targets_and_show_print_the_endpoints_and_the_numbers(store, capsys):
    put_record(store, MetricsEndpointRecord(job_id="metrics:g1", node="g1", pool="gpu", pid=7,
                                            url="http://10.0.0.5:9465/metrics"))
    url = str(store.url.raw)
    metrics_cli.metrics_targets(store_url=url, as_json=True, file_sd=False)
    assert [(r["node"], r["url"], r["node_status"]) for r in json.loads(capsys.readouterr().out)] == [
        ("g1", "http://10.0.0.5:9465/metrics", "healthy")]
    metrics_cli.metrics_targets(store_url=url, as_json=False, file_sd=True)
    assert json.loads(capsys.readouterr().out) == [{"targets": ["10.0.0.5:9465"],
                                                    "labels": {"mn_node": "g1", "mn_pool": "gpu"}}]
    metrics_cli.metrics_show(store_url=url, as_json=True)
    assert {"name": "mn_node_allocated", "value": 5.0, "labels": {"node": "g1", "group": "default", "resource": "cpu",
                                                             "unit": "cores"}} in json.loads(capsys.readouterr().out)


def test_metrics_serve_refuses_a_taken_port_naming_it(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([MN, "metrics", "serve", "--port", str(port), "--store-url",
                              f"sqlite:///{tmp_path / 'state.db'}"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "--port" in out.stderr and str(port) in out.stderr and "in use" in out.stderr
    assert out.stdout == ""  # no URL: nothing listens


def test_the_worker_port_setting_is_checked():
    assert worker_metrics.metrics_port({}) is None and worker_metrics.metrics_port({"MN_METRICS_PORT": "off"}) is None
    assert worker_metrics.metrics_port({"MN_METRICS_PORT": "0"}) == 0
    assert worker_metrics.metrics_port({"MN_METRICS_PORT": " 9465 "}) == 9465
    for bad in ("http", "-1", "65536"):
        with pytest.raises(ValueError, match="MN_METRICS_PORT"):
            worker_metrics.metrics_port({"MN_METRICS_PORT": bad})
    assert cluster_metrics.url_for("127.0.0.1", 9465) == "http://127.0.0.1:9465/metrics"
    assert cluster_metrics.url_for("::1", 9465) == "http://[::1]:9465/metrics"


DASHBOARD = Path(__file__).resolve().parents[1] / "deployments" / "grafana" / "mn-prefect-dashboard.json"


def test_the_grafana_dashboard_asks_only_for_metrics_that_are_exported(store):
    """Every ``mn_`` name a panel's query uses is one the collectors or the worker's instruments export (a renamed
    metric would leave a panel empty), and every panel reads the dashboard's Prometheus data source variable."""
    dashboard = json.loads(DASHBOARD.read_text())
    suffixes = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",)}
    exported = {family.name + suffix for registry in (cluster_metrics.cluster_registry(store), worker_metrics.REGISTRY)
                for family in registry.collect() for suffix in suffixes.get(family.type, ("",))}
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for query in queries for name in re.findall(r"\bmn_[a-z_]+", query)}
    assert used and not used - exported, sorted(used - exported)
    assert {"mn_admission_wait_time_seconds_bucket", "mn_wakeup_latency_seconds_bucket", "mn_commit_conflicts_total",
            "mn_commit_retries_total", "mn_bookings", "mn_device_used", "mn_node_state", "mn_node_unallocated"} <= used
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource", "pool", "node"}
    assert all(p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for p in dashboard["panels"]
               if p["type"] != "row")
