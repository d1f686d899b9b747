"""The worker tests' lab: the same processes ``mn-prefect up`` starts (mn_prefect.local_lab), and the Prefect server
the lab tests of one test process share (``shared_server``)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import servers

from mn_prefect.local_lab import (
    BIN,
    PrefectServer as _PrefectServer,
    start_worker as _start_worker,
    stop_process,
    stop_processes,
)

__all__ = ["BIN", "PrefectServer", "shared_server", "stop_process", "stop_processes", "stop_shared_server",
           "start_worker"]


class PrefectServer(_PrefectServer):
    """A Prefect server for the tests, with its state in a PostgreSQL database of its own (unless ``extra_env``
    names another), as a fleet's Prefect server keeps it. On SQLite, Prefect's background work and a burst of API
    calls can wait on one another's write lock for up to a minute ("database is locked", retried six times ten
    seconds): a stall no test is about. ``mn-prefect up`` and the tests of it keep SQLite, the lab's default."""

    def __init__(self, home, *args, extra_env: dict[str, str] | None = None, **kwargs):
        servers.lab_only("a Prefect server")
        extra_env = dict(extra_env or {})
        extra_env.setdefault("PREFECT_API_DATABASE_CONNECTION_URL", _new_database())
        super().__init__(home, *args, extra_env=extra_env, **kwargs)


_postgres: servers.PostgresServer | None = None
_template: str | None = None

# The cluster holds only the test servers' Prefect databases, thrown away with it: nothing there needs to survive
# a machine's crash, so no server of it waits for the disk (a process killed still loses nothing written).
_THROWAWAY = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


def _asyncpg(url: str) -> str:
    return url.replace("postgresql://", "postgresql+asyncpg://", 1)


def _new_database() -> str:
    """A fresh database on this test process's PostgreSQL cluster (started on first use), a copy of a database
    Prefect's migrations already ran on: a server started on it finds its schema current and migrates nothing
    (a server's start went from 7.3 s to 6.0 s)."""
    global _postgres, _template
    if _postgres is None:
        _postgres = servers.PostgresServer(settings=_THROWAWAY)
    if _template is None:
        _template = _migrated(_postgres)
    return _asyncpg(_postgres.create_database(f"prefect_{uuid.uuid4().hex[:12]}", template=_template))


def _migrated(cluster: servers.PostgresServer) -> str:
    """A database with Prefect's schema, made by ``prefect server database upgrade`` (which then disconnects)."""
    name = "prefect_template"
    url = _asyncpg(cluster.create_database(name))
    with tempfile.TemporaryDirectory(prefix="mn-prefect-template-") as home:
        env = {**os.environ, "PREFECT_HOME": home, "PREFECT_API_DATABASE_CONNECTION_URL": url}
        done = subprocess.run([str(BIN / "prefect"), "server", "database", "upgrade", "-y"], env=env,
                              capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"Prefect's migrations failed on the template database:\n{done.stdout}\n{done.stderr}")
    return name


# One Prefect server per test process (per xdist worker), started on first use and stopped at the session's end
# (tests/conftest.py sets ``shared_home`` and stops it). The modules that use it run one after another in this
# process, each with its own work pools (lab.Lab), so none sees another's pools, workers or runs.
shared_home: Callable[[], Path] | None = None
_shared: PrefectServer | None = None


def shared_server() -> PrefectServer:
    """This test process's shared Prefect server, started now if it is not running. Never stop it in a test: a
    test that stops, kills, restarts or proxies its server starts a private one (``PrefectServer``)."""
    global _shared
    if _shared is not None and _shared.proc.poll() is not None:  # it died (see its server.log): start another
        _shared.stop()
        _shared = None
    if _shared is None:
        home = shared_home() if shared_home is not None else Path(tempfile.mkdtemp(prefix="mn-prefect-shared-"))
        _shared = PrefectServer(home)
    return _shared


def stop_shared_server() -> None:
    global _shared, _postgres, _template
    if _shared is not None:
        _shared.stop()
        _shared = None
    if _postgres is not None:  # the cluster of every test server of this process
        _postgres.cleanup()
        _postgres = _template = None


def start_worker(server: PrefectServer, pool: str, node: dict, store_url: str, workdir: Path,
                 extra_env: dict | None = None, api_url: str | None = None):
    """``api_url``: where the worker sends its Prefect API calls (a proxy in front of ``server``)."""
    env = {**server.env, "PREFECT_API_URL": api_url} if api_url else server.env
    return _start_worker(env, pool, node, store_url, workdir, extra_env=extra_env)
