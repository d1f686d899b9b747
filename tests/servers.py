"""Real servers for the tests: redis-server (standalone, replica, sentinel) and PostgreSQL, on loopback.

Nothing here is a substitute: these start the Debian binaries (`.ci/run` installs them) on free ports.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

FAST_TIER_VAR = "MN_TEST_FAST_TIER"


def lab_only(what: str) -> None:
    """Called by everything that starts a server (Redis, PostgreSQL, Prefect, dockerd, a whole lab): in the fast
    tier (``pytest -m "not lab"``) that is a test missing its ``lab`` mark, and it fails saying so."""
    if os.environ.get(FAST_TIER_VAR) == "1":
        import pytest

        pytest.fail(f"this test starts {what}: mark it @pytest.mark.lab (the fast tier starts no server)",
                    pytrace=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception:
            pass
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


def redis_binary() -> str:
    path = shutil.which("redis-server") or "/usr/bin/redis-server"
    assert os.path.exists(path), "redis-server is required (.ci/run installs Debian's redis-server)"
    return path


class RedisServer:
    """One redis-server process (master, replica or sentinel)."""

    def __init__(self, workdir: Path, *, password: str | None = None, appendonly: bool = False,
                 replica_of: int | None = None, sentinel_of: tuple[int, str] | None = None, port: int | None = None):
        lab_only("redis-server")
        self.port = port or free_port()
        self.workdir = workdir
        self.password = password
        workdir.mkdir(parents=True, exist_ok=True)
        lines = [f"port {self.port}", "bind 127.0.0.1", f"dir {workdir}", "save ''", "protected-mode no",
                 f"logfile {workdir / 'redis.log'}"]
        if sentinel_of is None:
            lines.append(f"appendonly {'yes' if appendonly else 'no'}")
            if appendonly:
                lines.append("appendfsync always")
            if password:
                lines += [f"requirepass {password}", f"masterauth {password}"]
            if replica_of:
                lines.append(f"replicaof 127.0.0.1 {replica_of}")
        else:
            master_port, name = sentinel_of
            lines += [f"sentinel monitor {name} 127.0.0.1 {master_port} 2",
                      f"sentinel down-after-milliseconds {name} 1000",
                      f"sentinel failover-timeout {name} 3000", f"sentinel parallel-syncs {name} 1"]
            if password:
                lines.append(f"sentinel auth-pass {name} {password}")
        self.config = workdir / ("sentinel.conf" if sentinel_of else "redis.conf")
        self.config.write_text("\n".join(lines) + "\n")
        self.sentinel = sentinel_of is not None
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        args = [redis_binary(), str(self.config)] + (["--sentinel"] if self.sentinel else [])
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self.ping, what=f"redis on {self.port}")

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=None if self.sentinel else self.password,
                           socket_timeout=1)

    def ping(self) -> bool:
        return self.client().ping()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


def pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    path = found[-1] if found else shutil.which(name)
    assert path, f"PostgreSQL's {name} is required (.ci/run installs Debian's postgresql)"
    return path


class PostgresServer:
    """A throwaway PostgreSQL cluster on a free loopback port, run as a non-root user (initdb refuses root)."""

    def __init__(self, password: str = "mn-test-secret", user: str = "mn", settings: dict[str, str] | None = None):
        lab_only("PostgreSQL")
        self.settings = dict(settings or {})  # server settings beyond the defaults below (-c name=value)
        self.port = free_port()
        self.password = password
        self.user = user
        self.base = Path(tempfile.mkdtemp(prefix="mn-pg-"))
        self.data = self.base / "data"
        os.chmod(self.base, 0o755)
        self.run_as = None
        if os.geteuid() == 0:
            self.run_as = "nobody"
            uid = pwd.getpwnam("nobody").pw_uid
            os.chown(self.base, uid, -1)
        pwfile = self.base / "pw"
        pwfile.write_text(password + "\n")
        os.chmod(pwfile, 0o644)
        self._run([pg_bin("initdb"), "-D", str(self.data), "-U", user, f"--pwfile={pwfile}", "--auth-local=trust",
                   "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync"])
        self.start()

    def _run(self, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
        if self.run_as:
            args = ["runuser", "-u", self.run_as, "--", *args]
        return subprocess.run(args, check=check, capture_output=True, text=True, cwd=str(self.base))

    def start(self) -> None:
        opts = (f"-c listen_addresses=127.0.0.1 -c port={self.port} -k {self.base} -c fsync=on "
                "-c max_connections=200 -c shared_buffers=64MB")
        opts += "".join(f" -c {name}={value}" for name, value in self.settings.items())
        self._run([pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.base / "log"), "-o", opts, "-w", "-t", "600", "start"])

    def stop(self, mode: str = "fast") -> None:
        self._run([pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "600", "stop"], check=False)

    def kill(self) -> None:
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not _alive(pid), what="postgres to die")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str, template: str | None = None) -> str:
        """A new database, a copy of ``template`` when given (nobody may be connected to it)."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
        return self.url(name)

    def cleanup(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def prometheus_binary(name: str = "prometheus") -> str:
    path = shutil.which(name) or f"/usr/bin/{name}"
    assert os.path.exists(path), f"{name} is required (.ci/run installs Debian's prometheus, which has promtool)"
    return path


class PrometheusServer:
    """Debian's ``prometheus`` on a free loopback port with its own data folder under ``workdir``, scraping
    ``targets`` (host:port, path /metrics) every ``interval`` and evaluating ``rule_files`` as often."""

    def __init__(self, workdir: Path, targets: list[str], *, interval: str = "1s",
                 rule_files: list[Path] | None = None):
        lab_only("Prometheus")
        import json

        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        config = {"global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
                  "rule_files": [str(p) for p in rule_files or []],
                  "scrape_configs": [{"job_name": "mn", "static_configs": [{"targets": targets}]}]}
        self.config = workdir / "prometheus.yml"
        self.config.write_text(json.dumps(config))  # YAML reads JSON
        self.log = workdir / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [prometheus_binary(), f"--config.file={self.config}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
                stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_for(self.ready, timeout=60, interval=0.2, what=f"prometheus on {self.port}")

    def ready(self) -> bool:
        import httpx

        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
        return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200

    def api(self, path: str, **params) -> dict:
        """``/api/v1/<path>``'s data (an error answer raises AssertionError with it)."""
        import httpx

        answer = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10).json()
        assert answer.get("status") == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's result now (a vector's samples; a scalar as one sample)."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.workdir / "data", ignore_errors=True)
