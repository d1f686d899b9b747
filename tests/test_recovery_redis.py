"""A Redis store SIGKILLed and restarted (from its append-only file) while two reconcilers move a lost node's run:
nothing is lost, the survivor keeps its booking and the run moves exactly once. Apart from tests/test_recovery.py,
whose lab runs on SQLite, so that the two run side by side."""

from __future__ import annotations

import threading
import time

import pytest
import servers
from lab import Lab
from test_recovery import LOST_NODE, kill_node, reconcile_until, started

from mn_prefect.store.records import FlowRunRecord, get_record

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab


def test_a_redis_restart_while_reconciling_loses_nothing(tmp_path):
    redis = servers.RedisServer(tmp_path / "redis", password="recovery-secret", appendonly=True)
    lab = Lab(tmp_path / "lab", store_url=f"redis://:recovery-secret@127.0.0.1:{redis.port}/0")
    try:
        small = {"resources": {"cpu_cores": 1, "memory_mb": 64}}
        stay_run = lab.run(lab.deploy({**small, "preferred_node": "gpu-1"}), seconds=60)
        move_run = lab.run(lab.deploy({**small, "preferred_node": LOST_NODE, "recovery_mode": "cluster_recover"}),
                           seconds=6)
        servers.wait_for(lambda: started(lab, stay_run), timeout=120, what="the surviving run to start")
        moving = servers.wait_for(lambda: started(lab, move_run), timeout=120, what="the run on the lost node to start")
        kept = lab.booked(stay_run)
        assert [p.node for p in kept] == ["gpu-1"]
        kill_node(lab, LOST_NODE, [moving["pid"]])
        (lab.out / f"{move_run}.started").unlink()

        def bounce():  # SIGKILL redis mid-way through the reconcile passes; it comes back from its AOF
            time.sleep(4)
            redis.kill()
            time.sleep(0.5)
            redis.start()

        restart = threading.Thread(target=bounce)
        restart.start()
        totals = reconcile_until(lab, lambda t: t["recovered"] >= 1 and not restart.is_alive(), "recover the run",
                                 parallel=2, tolerate_failures=True)
        restart.join()
        print(f"reconcile passes: {totals['passes']}, failed while redis was down: {totals.get('failed_passes', 0)}")
        assert totals["recovered"] == 1
        assert lab.booked(stay_run) == kept  # the survivor's booking outlived the restart
        assert lab.wait(move_run, timeout=150)["state"]["type"] == "COMPLETED"
        assert lab.record(move_run)["env"]["MN_NODE"] != LOST_NODE
        assert len(get_record(lab.store, move_run, FlowRunRecord).reschedules_ms) == 1
        assert lab.store.active_placements(node=LOST_NODE) == []
    finally:
        lab.stop()
        redis.stop()
