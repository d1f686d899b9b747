"""The cluster overview (docs/events.md, "The cluster overview"): the reconcile flow keeps the ``mn-cluster`` table
artifact (every node's state and usage) and ``mn-waiting-runs`` (runs no node takes yet, with the reason), each row
linking to what it names in the Prefect UI; a placed run's ``placement`` artifact says where it went and why. A real
Prefect server, a real store file, the real flow run in this process."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import prefect_env
import pytest
from builders import gpu, node
from lab import RetryingClient

from mn_prefect.lifecycle.maintenance import set_maintenance
from mn_prefect.model.placement import Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.ops import overview
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store
from mn_prefect.worker import visibility

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab

POOL = "mn-overview"
WAITING = "mn runnable_later: waiting for capacity (trainer: gpu-a: no free GPU)"


@pytest.fixture(scope="module")
def prefect(tmp_path_factory):
    # A private server, not the test process's shared one: the overview covers every mn pool on its server and
    # every waiting run in them, and these tests compare whole tables.
    server = prefect_env.PrefectServer(tmp_path_factory.mktemp("overview-prefect"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(prefect):
    with RetryingClient(base_url=prefect.api_url, timeout=60) as client:
        yield client


@pytest.fixture
def store(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    monkeypatch.setenv("MN_STORE_URL", url)  # what the flow opens
    s = open_store(url)
    s.register_node(node("gpu-a", devices=[gpu("GPU-a0", 0, 24576), gpu("GPU-a1", 1, 16384)],
                         dynamic_port_range=[21000, 21099]))
    s.register_node(node("cpu-a", cpu=4, memory=8192))
    book(s, "train", {"cpu_cores": 1, "memory_mb": 256, "devices": [{"ids": ["GPU-a0"]}],
                      "ports": [{"label": "api", "port": 8000}]})
    book(s, "infer", {"cpu_cores": 0.5, "memory_mb": 128, "devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": 2048}]})
    set_maintenance(s, "cpu-a", True, "new disks")
    yield s
    s.close()


def book(store, job_id: str, request: dict) -> None:
    assert place_and_commit(store, job_id, [Ask(agent_id=job_id, request=resource_request(request))]).placed


def in_process(prefect):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings({PREFECT_API_URL: prefect.api_url})


def waiting_run(http) -> dict:
    """A run of an ``mn`` pool left Scheduled with the reason the worker's announcer writes (no worker polls it)."""
    from mn_prefect.worker import MNWorker

    if http.get(f"/work_pools/{POOL}").status_code == 404:
        http.post("/work_pools/", json={"name": POOL, "type": "mn",
                                        "base_job_template": MNWorker.get_default_base_job_template()}
                  ).raise_for_status()
    flow_id = http.post("/flows/", json={"name": "trainer"}).json()["id"]
    deployment = http.post("/deployments/", json={"name": f"d-{uuid.uuid4().hex[:6]}", "flow_id": flow_id,
                                                  "work_pool_name": POOL}).json()["id"]
    run = http.post(f"/deployments/{deployment}/create_flow_run", json={"idempotency_key": uuid.uuid4().hex}).json()
    http.post(f"/flow_runs/{run['id']}/set_state",
              json={"state": {"type": "SCHEDULED", "message": WAITING}, "force": True}).raise_for_status()
    return run


def latest(http, key: str) -> dict:
    found = http.post("/artifacts/latest/filter", json={"artifacts": {"key": {"any_": [key]}}}).json()
    assert len(found) == 1, found
    return found[0]


def test_the_reconcile_flow_publishes_each_nodes_usage_and_the_waiting_runs_with_links(prefect, http, store):
    from prefect.logging.handlers import APILogWorker

    from mn_prefect.ops.flows import reconcile_cluster

    run = waiting_run(http)
    with in_process(prefect):
        result = reconcile_cluster()
        APILogWorker.drain_all(timeout=10)  # the run's logs, while the server is there to take them
    assert result["overview"] == {"nodes": 2, "waiting": 1, "queues": 0, "written": ["mn-cluster", "mn-waiting-runs"]}
    yesterday = (datetime.now(UTC) - timedelta(days=1)).date().isoformat()  # the day's usage (ops/accounting.py)
    assert result["usage_artifact"] == f"mn-usage-{yesterday}"
    day = latest(http, f"mn-usage-{yesterday}")
    assert day["type"] == "table" and day["data"][-1]["queue"] == "total"
    ui = prefect.ui_url
    cluster = latest(http, "mn-cluster")
    reconcile_run = http.get(f"/flow_runs/{cluster['flow_run_id']}").json()
    assert http.get(f"/flows/{reconcile_run['flow_id']}").json()["name"] == "mn-reconcile"
    assert cluster["type"] == "table"
    assert cluster["data"] == [
        {"node": f"[cpu-a]({ui}/events?resource=mn.node.cpu-a)", "group": "default",
         "state": "maintenance (not eligible)", "cpu used / free": "0 / 4", "memory MB used / free": "0 / 8192",
         "gpus used / free": "0 / 0", "held": "-", "gpu devices": "-", "ports in use": "-"},
        {"node": f"[gpu-a]({ui}/events?resource=mn.node.gpu-a)", "group": "default", "state": "healthy",
         "cpu used / free": "1.5 / 6.5", "memory MB used / free": "384 / 16000", "gpus used / free": "1.5 / 0",
         "held": "-", "gpu devices": "GPU-a0: held whole; GPU-a1: 0.5 shares and 2048 MB booked", "ports in use": "tcp:8000"},
    ]
    waiting = latest(http, "mn-waiting-runs")
    assert waiting["flow_run_id"] == cluster["flow_run_id"]
    assert [(r["run"], r["pool"], r["status"], r["reason"]) for r in waiting["data"]] == [
        (f"[{run['name']}]({ui}/runs/flow-run/{run['id']})", POOL, "runnable_later",
         "waiting for capacity (trainer: gpu-a: no free GPU)")]


def test_a_new_version_is_written_only_for_the_artifact_whose_rows_changed(prefect, http, store):
    from prefect.client.orchestration import get_client

    with in_process(prefect), get_client(sync_client=True) as client:
        overview.publish(store, client, flow_run_id=None, ui_url=prefect.ui_url)
        again = overview.publish(store, client, flow_run_id=None, ui_url=prefect.ui_url)
        store.release("infer")
        released = overview.publish(store, client, flow_run_id=None, ui_url=prefect.ui_url)
    assert again["written"] == []
    assert released["written"] == ["mn-cluster"]
    assert "GPU-a1: free" in latest(http, "mn-cluster")["data"][1]["gpu devices"]


def test_queues_with_settings_get_their_own_artifact(prefect, http, store):
    from prefect.client.orchestration import get_client

    from mn_prefect.model.queues import QueueSpec

    store.set_queue(QueueSpec(name="train", quota={"gpu": 1}, cohort="lab", priority=5))
    with in_process(prefect), get_client(sync_client=True) as client:
        result = overview.publish(store, client, flow_run_id=None, ui_url=prefect.ui_url)
    assert "mn-queues" in result["written"] and result["queues"] == 1
    assert latest(http, "mn-queues")["data"] == [
        {"queue": "train", "cohort": "lab", "quota": "gpu=1", "used": "-", "borrowed": "-", "lent": "-",
         "weight": "1", "priority": "5", "waiting runs": "0"}]


def test_a_placement_artifact_says_node_devices_shares_ports_volumes_score_and_reason():
    placement = Placement.model_validate({
        "agent_id": "trainer", "node": "gpu-a", "score": 0.75, "locality": "job_colocated",
        "resources": {"cpu_cores": 2, "memory_mb": 1024, "gpu_count": 1},
        "allocation": {"devices": [gpu("GPU-a0", 0, 24576)], "shares": [{"id": "GPU-a1", "shares": 0.5,
                                                                         "memory_mb": 2048}],
                       "ports": [{"label": "api", "port": 21007, "dynamic": True}],
                       "volumes": [{"name": "data", "source": "/srv/data", "target": "/data"}]}})
    rows = {r["what"]: r["value"] for r in visibility.artifact(placement, uuid.uuid4()).data}
    assert rows["node"] == "gpu-a"
    assert rows["device 0"] == "GPU-a0 (nvidia/cuda, nvidia-24576, 24576 MB)"
    assert rows["gpu share GPU-a1"] == "0.5 of the GPU, 2048 MB"
    assert rows["port api"] == "tcp:21007"
    assert rows["volume data"] == "/srv/data -> /data (ro)"
    assert rows["score"] == "0.75"
    assert rows["reason"] == "the best-scored node that fits (job_colocated)"
