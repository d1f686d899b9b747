"""Prefect's own scheduler feeds an ``mn`` pool: an interval-scheduled deployment gets runs from the server's
scheduler service, and an ``mn`` worker places and completes them. (SQLAlchemy 2.1 broke exactly this on
prefect 3.8.8 while every test that creates runs by hand kept passing.)"""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta

import pytest
import servers
from builders import gpu
from lab import FLOWS, RetryingClient
from prefect_env import PrefectServer

from mn_prefect.local_lab import BIN, start_worker, stop_processes
from mn_prefect.store import open_store

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab

POOL = "mn-scheduled"


@pytest.fixture
def scheduled_lab(tmp_path):
    # The scheduler service visits deployments every 60 s by default: make its loop short so runs come soon. A
    # private server, not the test process's shared one: that setting is the server's own.
    server = PrefectServer(tmp_path / "prefect", extra_env={"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2"})
    worker = None
    try:
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", POOL, "--type", "mn"], env=server.env,
                       check=True, capture_output=True)
        store_url = f"sqlite:///{tmp_path / 'state.db'}"
        node = {"name": "gpu-1", "cpu_cores": 4, "memory_mb": 8192, "devices": [gpu("GPU-1a", 0)]}
        worker = start_worker(server.env, POOL, node, store_url, tmp_path / "worker")
        store = open_store(store_url)
        servers.wait_for(lambda: len(store.list_nodes()) == 1, timeout=90, what="the mn worker to register gpu-1")
        yield server, tmp_path
    finally:
        if worker is not None:
            stop_processes([worker])  # an idle worker may ignore the first SIGINT: a second follows
        server.stop()


def test_interval_schedule_runs_complete_on_an_mn_worker(scheduled_lab):
    from prefect.flows import Flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    server, home = scheduled_lab
    out = home / "out"
    out.mkdir()
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        flow = Flow.from_source(source=str(FLOWS), entrypoint="probe.py:probe")
        deployment_id = str(flow.deploy(name="every-5s", work_pool_name=POOL, interval=timedelta(seconds=5),
                                        parameters={"out_dir": str(out)}, job_variables={"resources": {"cpu": 1}},
                                        print_next_steps=False))
    http = RetryingClient(base_url=server.api_url, timeout=30)

    def runs() -> list[dict]:
        return http.post("/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [deployment_id]}}}).json()

    # Nobody creates runs by hand here: every run comes from the server's scheduler service.
    scheduled = servers.wait_for(runs, timeout=120, interval=1,
                                 what="Prefect's scheduler service to create runs of an interval deployment "
                                      f"(see {server.home / 'server.log'})")
    assert all(r["auto_scheduled"] for r in scheduled)

    def completed() -> list[dict]:
        return [r for r in runs() if r["state"]["type"] == "COMPLETED"]

    done = servers.wait_for(completed, timeout=180, interval=1,
                            what=f"the mn worker to complete a scheduled run (see {home / 'worker'})")
    record = json.loads((out / f"{done[0]['id']}.json").read_text())
    assert record["env"]["MN_NODE"] == "gpu-1"  # the flow itself ran, with the placement the worker made
