"""Node loss with real parts: a real Prefect server, three real ``mn`` workers, a real SQLite store. A node's
worker and its runs are SIGKILLed; the reconciler (the real CLI) moves or pauses what the node held."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

import prefect_env
import servers
from lab import Lab

LOST_NODE = "cpu-1"
FAST = {"MN_HEARTBEAT_TIMEOUT_SECONDS": "3", "MN_DISCONNECT_GRACE_SECONDS": "2"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("recoverylab"))
    yield lab
    lab.stop()


def mn_prefect(lab: Lab, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(prefect_env.BIN / "mn-prefect"), *args, "--store-url", lab.store_url],
                          env={**lab.server.env, **(env or {})}, capture_output=True, text=True, timeout=120)


def started(lab: Lab, run_id: str) -> dict | None:
    path = lab.out / f"{run_id}.started"
    return json.loads(path.read_text()) if path.exists() else None


def kill_node(lab: Lab, name: str, pids: list[int]) -> None:
    worker = lab.workers[[n["name"] for n in lab.nodes].index(name)]
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(10)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_lost_nodes_cluster_recover_run_moves_and_completes_while_local_restart_pauses(lab):
    placed_on_lost = {"preferred_node": LOST_NODE, "resources": {"cpu_cores": 1, "memory_mb": 64}}
    recover = lab.deploy({**placed_on_lost, "recovery_mode": "cluster_recover"})
    local = lab.deploy({**placed_on_lost, "recovery_mode": "local_restart"})
    recover_run = lab.run(recover, seconds=12)
    local_run = lab.run(local, seconds=12)
    first = servers.wait_for(lambda: started(lab, recover_run), timeout=120, what="the recoverable run to start")
    servers.wait_for(lambda: started(lab, local_run), timeout=120, what="the local_restart run to start")
    assert {p.node for p in lab.booked(recover_run) + lab.booked(local_run)} == {LOST_NODE}

    killed_at = time.time()
    kill_node(lab, LOST_NODE, [first["pid"], started(lab, local_run)["pid"]])
    (lab.out / f"{recover_run}.started").unlink()
    totals = {"recovered": 0, "paused": 0}
    deadline = time.monotonic() + 120
    while totals["recovered"] < 1 or totals["paused"] < 1:
        assert time.monotonic() < deadline, f"reconcile never acted: {totals}"
        result = mn_prefect(lab, "node", "reconcile", "--json", env=FAST)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        for key in totals:
            totals[key] += report[key]
        time.sleep(1)
    assert lab.store.get_node(LOST_NODE).record.status == "offline"

    again = servers.wait_for(lambda: started(lab, recover_run), timeout=120, what="the run to start elsewhere")
    moved_in = again["start"] - killed_at
    print(f"kill to re-placed and running: {moved_in:.1f} s (heartbeat timeout 3 s + grace 2 s)")
    done = lab.wait(recover_run, timeout=120)
    assert done["state"]["type"] == "COMPLETED"
    assert lab.record(recover_run)["env"]["MN_NODE"] != LOST_NODE
    assert lab.store.active_placements(node=LOST_NODE) == []  # the lost node's bookings are released
    paused = lab.flow_run(local_run)
    assert paused["state"]["type"] == "PAUSED" and "paused for review" in paused["state"]["message"]
    events = [e.kind for e in lab.store.events(job_id=recover_run)]
    assert "job.rescheduled" in events
