"""A flow-run process whose worker was killed outright is no descendant of any worker: the lab's stop finds it by
its environment (mn_prefect/local_lab.py, ``stop_stray_runs``) and stops it, and leaves alone what is not the lab's
or not a run."""

from __future__ import annotations

import os
import subprocess
import sys

from mn_prefect.local_lab import stop_stray_runs

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


def start(env: dict) -> subprocess.Popen:
    return subprocess.Popen(SLEEP, env={**os.environ, **env}, start_new_session=True)


def test_a_runs_process_left_by_a_killed_worker_is_stopped_and_others_are_not(tmp_path):
    lab_home = tmp_path / "lab"
    stray = start({"PREFECT_HOME": str(lab_home / "prefect"), "PREFECT__FLOW_RUN_ID": "0b0e"})
    not_a_run = start({"PREFECT_HOME": str(lab_home / "prefect")})  # the lab's, but no run (a server, a worker)
    other_lab = start({"PREFECT_HOME": str(tmp_path / "elsewhere"), "PREFECT__FLOW_RUN_ID": "0b0f"})
    try:
        assert stop_stray_runs(lab_home, timeout=10) == [stray.pid]
        assert stray.wait(10) == -15  # SIGTERM was enough
        assert not_a_run.poll() is None and other_lab.poll() is None
    finally:
        for proc in (stray, not_a_run, other_lab):
            proc.kill()
            proc.wait()
