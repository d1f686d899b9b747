"""Processes for a lab on one machine: a local Prefect server (SQLite) and ``mn`` workers, one per node.

``mn-prefect up`` uses this, and so do the worker tests: the same code starts the same real processes.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from mn_prefect.api_tls import plain_http_env
from mn_prefect.settings import process_alive

BIN = Path(sys.executable).parent


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back for the duration, then delivered again: wrap the start of a process and
    the line that records it, so a stop arriving in between (Popen waits for the child's exec) cannot leave
    a started process that nobody knows of. Only in the main thread, where handlers live."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    before = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
              for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(caught):
            os.kill(os.getpid(), signum)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def _health_client() -> httpx.Client:
    """One client for every health probe: each new one loads a TLS bundle (20 ms), and a starting server is
    probed every 0.3 s. No connection is kept: a server stopped since must not answer through a stale one."""
    return httpx.Client(timeout=2, limits=httpx.Limits(max_keepalive_connections=0))


def healthy(api_url: str) -> bool:
    try:
        return _health_client().get(f"{api_url}/health").status_code == 200
    except httpx.HTTPError:
        return False


class PrefectServer:
    """``prefect server start`` on loopback with its own home and SQLite database (through ``lab_server``: its
    garbage collector off the event loop)."""

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
        self.env.update(plain_http_env(self.api_url, self.env))  # the lab's processes, its runs included
        self.log = open(home / "server.log", "w")
        deadline = time.monotonic() + timeout
        try:
            with interrupts_deferred():  # a stop that lands while it is being started must still find it
                self.proc = subprocess.Popen([sys.executable, "-m", "mn_prefect.lab_server", "server", "start",
                                              "--host", "127.0.0.1", "--port", str(self.port)], env=self.env,
                                             stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
            while not healthy(self.api_url):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the Prefect server did not start; see {home / 'server.log'}")
                time.sleep(0.3)
        except BaseException:  # Ctrl-C or SIGTERM while it starts: nobody else holds this process yet
            if hasattr(self, "proc"):  # (not when Popen itself failed)
                self.stop(3)
            else:
                self.log.close()
            raise

    def stop(self, timeout: float = 15) -> None:
        stop_process(self.proc, timeout)
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
    deadline = time.monotonic() + timeout
    for interrupt in range(2):  # an idle `prefect worker start` ignores the first SIGINT
        for proc in procs:
            try:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        wait_until = min(deadline, time.monotonic() + 1) if interrupt == 0 else deadline
        while any(p.poll() is None for p in procs) and time.monotonic() < wait_until:
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
    """One ``prefect worker start --type mn`` process; ``node`` is its mock inventory (None: this machine). It polls
    every 5 s: a new run wakes it at once (Prefect's event), and so does a store change."""
    workdir.mkdir(parents=True, exist_ok=True)
    worker_env = {**env, "MN_STORE_URL": store_url, "PREFECT_WORKER_QUERY_SECONDS": "5",
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


class LabRunning(RuntimeError):
    """Another ``mn-prefect up`` holds the lab; ``info`` is what its lock file records (pid, URLs)."""

    def __init__(self, lock_path: Path, info: dict[str, Any]):
        self.lock_path, self.info = lock_path, info
        where = info.get("ui_url") or "its server is still starting"
        super().__init__(f"a lab is already running here (pid {info.get('pid', '?')}, {where}; "
                         f"store {info.get('store_url', '?')}); stop it with `mn-prefect down` "
                         f"(lock {lock_path})")


class LabLock:
    """``<lab home>/lab.lock``: an flock held by the one running ``mn-prefect up`` for its whole life (the
    kernel drops it when that process dies, so a stale file is simply taken over), plus JSON saying where
    that lab is: pid, API/UI and store URLs, and the pids of the processes it started."""

    FILE = "lab.lock"

    def __init__(self, lab_home: Path, handle):
        self.path, self._handle, self.info = lab_home / self.FILE, handle, {"pid": os.getpid()}

    @classmethod
    def acquire(cls, lab_home: Path) -> LabLock:
        """Take the lab (LabRunning when a live ``up`` holds it); stops what a dead one left running."""
        lab_home.mkdir(parents=True, exist_ok=True)
        path = lab_home / cls.FILE
        for _ in range(20):  # `mn-prefect down` probes the lock for an instant: try again before refusing
            handle = open(path, "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                info = read_lab_lock(lab_home) or {}
                if process_alive(info.get("pid")):
                    raise LabRunning(path, info) from None
                time.sleep(0.05)
                continue
            handle.seek(0)
            stale = _parse(handle.read())
            lock = cls(lab_home, handle)
            stop_orphans(stale.get("pids") or [], lab_home)
            lock.record()
            return lock
        raise LabRunning(path, read_lab_lock(lab_home) or {})

    def record(self, **info: Any) -> None:
        """Add ``info`` to what the lock file says (written in place: the lock lives on this inode)."""
        self.info.update(info)
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(json.dumps(self.info))
        self._handle.flush()

    def release(self) -> None:
        self._handle.close()


def _parse(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def read_lab_lock(lab_home: Path) -> dict[str, Any] | None:
    """What the lock file says when a live ``up`` holds it; None when no lab is running."""
    path = lab_home / LabLock.FILE
    try:
        handle = open(path)
    except FileNotFoundError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            for _ in range(20):  # the holder rewrites it in place: a read may land between truncate and write
                handle.seek(0)
                info = _parse(handle.read())
                if info:
                    return info
                time.sleep(0.05)
            return {}
        fcntl.flock(handle, fcntl.LOCK_UN)
        return None


def lab_processes(lab_home: Path) -> list[int]:
    """Live processes whose environment names ``lab_home`` (the lab's server, workers and their runs)."""
    marker = str(lab_home).encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes() and int(environ.parent.name) != os.getpid():
                found.append(int(environ.parent.name))
        except (OSError, ValueError):
            continue
    return found


def stop_stray_runs(lab_home: Path, timeout: float = 5) -> list[int]:
    """Stop the flow-run processes of ``lab_home`` that outlived their worker (one killed outright leaves its runs'
    processes behind, no longer its descendants): SIGTERM, then SIGKILL after ``timeout``. Returns their pids."""
    strays = []
    for pid in lab_processes(lab_home):
        try:
            if b"PREFECT__FLOW_RUN_ID=" in Path(f"/proc/{pid}/environ").read_bytes():
                strays.append(pid)
        except OSError:
            continue
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in strays:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(process_alive(p) for p in strays):
            time.sleep(0.1)
    return strays


def stop_orphans(pids: list[int], lab_home: Path) -> None:
    """SIGKILL the process groups a dead ``up`` left behind (only pids that still belong to ``lab_home``)."""
    ours = set(lab_processes(lab_home))
    for pid in pids:
        if pid in ours:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
