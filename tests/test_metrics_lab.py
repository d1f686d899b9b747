"""Prometheus metrics while runs are placed (docs/operating.md, "Metrics for Prometheus and Grafana"): a real Prefect
server, two real ``mn`` workers started with ``MN_METRICS_PORT=0`` (each picks a free port and records it in the
store) and ``mn-prefect metrics serve`` as a real process, all scraped over loopback as Prometheus would."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import servers
from builders import gpu
from lab import Lab
from prometheus_client.parser import text_string_to_metric_families

from mn_prefect.ops.metrics import endpoints

pytestmark = pytest.mark.lab  # a Prefect server, workers and a metrics server

MN = str(Path(sys.executable).parent / "mn-prefect")
FLEET = [
    {"name": "gpu-1", "cpu_cores": 8, "memory_mb": 16384, "dynamic_port_range": [24000, 24999],
     "devices": [gpu("GPU-m0", 0, 24576), gpu("GPU-m1", 1, 24576)]},
    {"name": "cpu-1", "cpu_cores": 4, "memory_mb": 8192, "dynamic_port_range": [25000, 25999]},
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("metrics"), fleet=FLEET, worker_env={"MN_METRICS_PORT": "0"})
    yield lab
    lab.stop()


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample /metrics answers, parsed as Prometheus parses it."""
    response = httpx.get(url, timeout=20)
    response.raise_for_status()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(response.text)
            for s in family.samples]


def total(samples, name: str, **labels) -> float:
    return sum(v for n, have, v in samples if n == name and labels.items() <= have.items())


def test_workers_and_metrics_serve_expose_the_cluster_while_runs_are_placed(lab):
    rows = servers.wait_for(lambda: (found := endpoints(lab.store)) and len(found) == 2 and found, timeout=60,
                            interval=0.5, what="both workers' metrics endpoints in the store")
    workers = {row["node"]: row["url"] for row in rows}
    assert all(url.startswith("http://127.0.0.1:") and url.endswith("/metrics") for url in workers.values())
    assert {row["pool"] for row in rows} == {lab.pool}
    serve = subprocess.Popen([MN, "metrics", "serve", "--port", "0", "--store-url", lab.store_url],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cluster = serve.stdout.readline().strip()
        assert cluster.startswith("http://127.0.0.1:"), (cluster, serve.poll())

        barrier = lab.out / "metrics.barrier"
        held = lab.run(lab.deploy({"resources": {"gpu": 1, "cpu": 1, "memory_mb": 256}}), hold_until=str(barrier))
        quick = [lab.run(lab.deploy({"resources": {"cpu": 1, "memory_mb": 256}})) for _ in range(2)]
        servers.wait_for(lambda: lab.started([held]), timeout=90, interval=0.5, what="the GPU run holding its GPU")
        both = lab.run(lab.deploy({"resources": {"gpu": 2, "cpu": 1, "memory_mb": 256}}))  # waits for the other
        lab.told_to_wait([both])  # and holds the GPU left free on gpu-1 (holds are on by default)

        # The GPU node's worker: its own node only, one GPU of two booked by a flow run, the other held.
        own = scrape(workers["gpu-1"])
        assert {labels["node"] for name, labels, _ in own if name == "mn_node_capacity"} == {"gpu-1"}
        assert total(own, "mn_node_allocated", node="gpu-1", resource="gpu") == 1
        assert total(own, "mn_node_held", node="gpu-1", resource="gpu") == 2  # the hold books the run's 2
        assert total(own, "mn_node_unallocated", node="gpu-1", resource="gpu") == 0
        assert total(own, "mn_device_used", node="gpu-1") == 1  # one of GPU-m0, GPU-m1 held whole
        assert total(own, "mn_bookings", node="gpu-1", kind="flow_run") == 1
        assert total(own, "mn_node_state", node="gpu-1", state="healthy") == 1
        assert total(own, "mn_worker_info", pool=lab.pool, node="gpu-1") == 1

        # The cluster view: both nodes, the same numbers.
        view = scrape(cluster)
        assert total(view, "mn_node_allocated", node="gpu-1", resource="gpu") == 1
        assert total(view, "mn_node_capacity", resource="gpu") == 2
        assert total(view, "mn_node_state", state="healthy") == 2 and total(view, "mn_store_up") == 1

        # The run that needs both GPUs waits, and the workers say why.
        def waiting():
            samples = [s for url in workers.values() for s in scrape(url)]
            return [labels for name, labels, value in samples if name == "mn_queue_pending_runs" and value >= 1
                    and labels["pool"] == lab.pool]
        reported = servers.wait_for(waiting, timeout=60, interval=0.5, what="the waiting run in mn_queue_pending_runs")
        assert {(r["status"], r["reason"], r["queue"]) for r in reported} == {
            ("runnable_later", "insufficient gpu", "default")}, reported

        barrier.write_text("go")
        for run_id in (held, both, *quick):
            assert lab.wait(run_id, timeout=120)["state"]["type"] == "COMPLETED"
        placed = [s for url in workers.values() for s in scrape(url)]
        assert total(placed, "mn_admission_wait_time_seconds_count", pool=lab.pool) >= 4  # each run, once
        assert total(placed, "mn_admission_wait_time_seconds_sum", pool=lab.pool) > 0
        assert total(placed, "mn_wakeup_latency_seconds_count", pool=lab.pool) >= 1
        assert not [labels for name, labels, value in placed if name == "mn_queue_pending_runs" and value]
        servers.wait_for(lambda: total(scrape(cluster), "mn_node_allocated", resource="gpu") == 0, timeout=60,
                         interval=0.5, what="the GPUs released in the cluster view")
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            code = serve.wait(timeout=15)
        except subprocess.TimeoutExpired:
            serve.kill()
            raise
    assert code == 0, serve.stderr.read()
