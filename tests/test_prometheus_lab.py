"""The Grafana dashboard and the alert rules, proven against a real Prometheus (Debian's ``prometheus``, loopback, its
own data folder, a 1 s scrape): a lab with runs, a waiting run and its hold, a reservation, two queues of a cohort
(one borrowing, one lending) a MIG node and gpu-1's GPUs sampled through the fake NVML, scraped at the one URL ``mn-prefect up`` prints (``metrics serve``);
every query of deployments/grafana/mn-prefect-dashboard.json returns data through Prometheus' HTTP API, and the
node-lost rule of deployments/prometheus/ fires once a worker stops."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import prefect_env
import pytest
import servers
from builders import gpu
from lab import ROOT, Lab

from mn_prefect.ops.metrics import endpoints

pytestmark = pytest.mark.lab  # a Prefect server, workers, a metrics server and Prometheus

MN = str(Path(sys.executable).parent / "mn-prefect")
DASHBOARD = ROOT / "deployments" / "grafana" / "mn-prefect-dashboard.json"
RULES = ROOT / "deployments" / "prometheus" / "mn-prefect-rules.yml"
MIG_NODE = {**json.loads((ROOT / "deployments" / "mock-nodes-mig.json").read_text())[0], "host_paths": []}
FLEET = [
    {"name": "gpu-1", "cpu_cores": 8, "memory_mb": 16384, "dynamic_port_range": [26000, 26999],
     "devices": [gpu("GPU-p0", 0, 24576), gpu("GPU-p1", 1, 24576)]},
    MIG_NODE,  # gpu-mig-1: an A100 in MIG mode (7 slices of 1g.10gb) and a whole one
]
SLICE = json.dumps({"devices": [{"kind": "gpu", "mig_profile": "1g.10gb", "count": 1}]})


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, rows' panels included."""
    def panels(node):
        for panel in node.get("panels", []):
            yield panel
            yield from panels(panel)

    return [(panel.get("title", ""), target["expr"]) for panel in panels(json.loads(DASHBOARD.read_text()))
            for target in panel.get("targets", []) if target.get("expr")]


def mn(lab: Lab, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([MN, *args, "--store-url", lab.store_url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done


# gpu-1's two GPUs as the fake NVML reports them, sampled every second by each worker's device watch (0% busy: the
# run holding them is quiet, so the "Booked GPUs idle" panel has data).
FAKE_NVML = "GPU-p0,NVIDIA L4,24576,24000,8,9;GPU-p1,NVIDIA L4,24576,24000,8,9"


@pytest.fixture(scope="module")
def lab(tmp_path_factory, fake_gpu_libs):
    lab = Lab(tmp_path_factory.mktemp("prometheus"), fleet=FLEET,
              worker_env={"MN_METRICS_PORT": "0", "LD_LIBRARY_PATH": str(fake_gpu_libs), "FAKE_NVML_DEVICES": FAKE_NVML,
                          "MN_DEVICE_SAMPLE_SECONDS": "1"})
    yield lab
    lab.stop()


def test_every_dashboard_query_returns_data_from_the_one_url_and_a_lost_node_fires_its_alert(lab, tmp_path):
    rows = servers.wait_for(lambda: (found := endpoints(lab.store)) and len(found) == 2 and found, timeout=60,
                            interval=0.5, what="both workers' metrics endpoints in the store")
    assert {row["node"] for row in rows} == {"gpu-1", "gpu-mig-1"}
    # Two queues of one cohort, a GPU each: train borrows eval's unused GPU, eval lends it.
    for queue in ("train", "eval"):
        created = lab.http.post(f"/work_pools/{lab.pool}/queues", json={"name": queue})
        assert created.status_code in (200, 201), created.text
        mn(lab, "queue", "set", queue, "--quota", "gpu=1", "--cohort", "research")
    serve = subprocess.Popen([MN, "metrics", "serve", "--port", "0", "--store-url", lab.store_url],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prometheus = None
    barrier = lab.out / "prometheus.barrier"
    try:
        cluster = serve.stdout.readline().strip()
        assert cluster.startswith("http://127.0.0.1:"), (cluster, serve.poll())
        # The rules as shipped, each `for:` made 0s: the test waits for a condition, not for a minute.
        rules = tmp_path / "rules.yml"
        rules.write_text(re.sub(r"(?m)^(\s*)for: .*$", r"\1for: 0s", RULES.read_text()))
        prometheus = servers.PrometheusServer(tmp_path / "prometheus", [cluster.split("//")[1].split("/")[0]],
                                              rule_files=[rules])

        held = lab.run(lab.deploy({"resources": {"gpu": 2, "cpu": 1, "memory_mb": 256}}, work_queue="train"),
                       hold_until=str(barrier))
        quick = lab.run(lab.deploy({"resources": {"cpu": 1, "memory_mb": 256}}))
        mn(lab, "reserve", "--resources", SLICE, "--for", "10m", "--node", "gpu-mig-1", "--name", "notebook")
        servers.wait_for(lambda: lab.started([held]), timeout=90, interval=0.5, what="train's run holding 2 GPUs")
        # It waits, and holds: it needs more CPU than the 2-GPU booking frees (a run that one booking's end alone
        # lets start makes no hold), so part of its request is capacity free now.
        waiting = lab.run(lab.deploy({"resources": {"gpu": 2, "cpu": 2, "memory_mb": 256}}))
        lab.told_to_wait([waiting])
        assert lab.wait(quick, timeout=120)["state"]["type"] == "COMPLETED"

        # The dashboard's variables: pool from the nodes' group (the pool's name), node from the pool's nodes.
        groups = prometheus.api("label/group/values", **{"match[]": "mn_node_capacity"})
        assert lab.pool in groups, groups
        pool, node = lab.pool, "gpu-1|gpu-mig-1"  # as Grafana puts them: a name, several joined by |
        queries = [(title, expr.replace("$pool", pool).replace("$node", node).replace("$__rate_interval", "1m"))
                   for title, expr in dashboard_queries()]
        assert len(queries) >= 44

        for _title, expr in queries:  # each is valid PromQL (an error answer raises with Prometheus' reason)
            prometheus.query(expr)
        empty: list[tuple[str, str]] = []

        def all_answer() -> bool:
            empty[:] = [(title, expr) for title, expr in queries if not prometheus.query(expr)]
            return not empty

        try:
            servers.wait_for(all_answer, timeout=60, interval=1, what="every dashboard query to return data")
        except TimeoutError:
            raise AssertionError(f"{len(empty)} of {len(queries)} queries return nothing: {empty}") from None

        # The "Waiting runs" stat counts the waiting run (not a 0 standing in for no data).
        [stat] = [expr for title, expr in queries if title.startswith("Waiting runs /") and "mn_queue_pending_runs" in expr]
        assert float(prometheus.query(stat)[0]["value"][1]) >= 1
        assert prometheus.query('max(mn_queue_pending_oldest_age_seconds{queue="default"})')
        slices = prometheus.query('sum(mn_device_slices{node="gpu-mig-1", state="booked"})')
        assert float(slices[0]["value"][1]) == 1  # the reservation's slice
        assert float(prometheus.query('sum(mn_queue_borrowed{queue="train", resource="gpu"})')[0]["value"][1]) == 1
        assert prometheus.query('mn_bookings{kind="reservation", node="gpu-mig-1"} == 1')
        quiet = prometheus.query('max by (UUID) (mn_device_booked_idle_seconds{node="gpu-1"})')
        assert {q["metric"]["UUID"] for q in quiet} == {"GPU-p0", "GPU-p1"}  # train's run holds both, at 0%
        assert not [a for a in prometheus.api("alerts")["alerts"] if a["labels"]["alertname"] == "MNNodeLost"]

        # A node lost: its worker stops (the node is disconnected at once) and the rule fires.
        prefect_env.stop_processes([lab.worker_of("gpu-mig-1")], timeout=15)

        def firing() -> set[tuple[str, str]]:
            return {(a["labels"]["alertname"], a["labels"].get("node", "")) for a in prometheus.api("alerts")["alerts"]
                    if a["state"] == "firing"}

        fired = servers.wait_for(lambda: {("MNNodeLost", "gpu-mig-1"), ("MNWorkerDown", "gpu-mig-1")} <= firing()
                                 and firing(), timeout=60, interval=1, what="MNNodeLost and MNWorkerDown firing")
        assert ("MNNodeLost", "gpu-1") not in fired, fired
    finally:
        barrier.write_text("go")
        if prometheus is not None:
            prometheus.stop()
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout=15)
        except subprocess.TimeoutExpired:
            serve.kill()
