"""A real Prefect server and real ``mn`` worker processes on loopback, for the worker tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

import servers

BIN = Path(sys.executable).parent


class PrefectServer:
    def __init__(self, home: Path):
        self.port = servers.free_port()
        self.home = home
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
            "PREFECT_LOGGING_LEVEL": "INFO",
        }
        self.log = open(home / "server.log", "w")
        self.proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                      str(self.port)], env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        servers.wait_for(lambda: httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200, timeout=120,
                         what="the Prefect server")

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGINT, wait, then SIGKILL (a `prefect worker start` ignores the first SIGINT while idle)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def start_worker(server: PrefectServer, pool: str, node: dict, store_url: str, workdir: Path,
                 extra_env: dict | None = None) -> subprocess.Popen:
    inventory = workdir / f"{node['name']}.json"
    inventory.write_text(json.dumps(node))
    env = {**server.env, "MN_STORE_URL": store_url, "MN_INVENTORY_FILE": str(inventory),
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "0",
           "MN_HEARTBEAT_SECONDS": "2", **(extra_env or {})}
    log = open(workdir / f"worker-{node['name']}.log", "w")
    return subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "mn",
                             "--name", f"mn-{node['name']}"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
