"""Processes for a lab on one machine: a local Prefect server (SQLite) and ``mn`` workers, one per node.

``mn-prefect up`` uses this, and so do the worker tests: the same code starts the same real processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(api_url: str) -> bool:
    try:
        return httpx.get(f"{api_url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class PrefectServer:
    """``prefect server start`` on loopback with its own home and SQLite database."""

    def __init__(self, home: Path, port: int | None = None, *, ui: bool = False, timeout: float = 120,
                 extra_env: dict[str, str] | None = None):
        home.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.home = home
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.ui_url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "true" if ui else "false",
            "PREFECT_SERVER_UI_API_URL": self.api_url,
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
            **(extra_env or {}),
        }
        self.log = open(home / "server.log", "w")
        self.proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                      str(self.port)], env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while not healthy(self.api_url):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the Prefect server did not start; see {home / 'server.log'}")
                time.sleep(0.3)
        except BaseException:  # Ctrl-C or SIGTERM while it starts: nobody else holds this process yet
            self.stop()
            raise

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


def stop_processes(procs: list[subprocess.Popen], timeout: float = 7) -> None:
    """Stop several process groups at once: SIGINT to all, one shared wait of ``timeout`` seconds, then
    SIGKILL to what is left, including anything they started that left their process group."""
    procs = [p for p in procs if p.poll() is None]
    started = [pid for p in procs for pid in descendants(p.pid)]
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait(5)


def start_worker(env: dict[str, str], pool: str, node: dict[str, Any] | None, store_url: str, workdir: Path,
                 *, name: str | None = None, extra_env: dict[str, str] | None = None,
                 limit: int | None = None) -> subprocess.Popen:
    """One ``prefect worker start --type mn`` process; ``node`` is its mock inventory (None: this machine)."""
    workdir.mkdir(parents=True, exist_ok=True)
    worker_env = {**env, "MN_STORE_URL": store_url, "PREFECT_WORKER_QUERY_SECONDS": "1",
                  "PREFECT_WORKER_PREFETCH_SECONDS": "0", "MN_HEARTBEAT_SECONDS": "2", **(extra_env or {})}
    label = name or (node["name"] if node else "local")
    if node is not None:
        inventory = workdir / f"{node['name']}.json"
        inventory.write_text(json.dumps(node))
        worker_env["MN_INVENTORY_FILE"] = str(inventory)
    else:
        worker_env.pop("MN_INVENTORY_FILE", None)
    log = open(workdir / f"worker-{label}.log", "w")
    command = [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "mn", "--name", f"mn-{label}"]
    if limit is not None:
        command += ["--limit", str(limit)]
    return subprocess.Popen(command, env=worker_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every process started (directly or not) by ``pid``, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen, *extra: int) -> None:
    """SIGKILL a process, everything it started and ``extra`` pids: a machine that is simply gone."""
    for pid in [proc.pid, *descendants(proc.pid), *extra]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)
