import sys
from pathlib import Path

# Test helpers (builders.py) import as a plain module.
sys.path.insert(0, str(Path(__file__).parent))

import itertools
import os
import uuid

import pytest
import servers

from mn_prefect.store import open_store


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = servers.RedisServer(tmp_path_factory.mktemp("redis"), password="redis-test-secret")
    yield server
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def _shared_prefect_server(tmp_path_factory):
    """The lifetime of this test process's shared Prefect server (prefect_env.shared_server): nothing starts it
    here; the first lab that needs it does, and it stops when the session ends."""
    import prefect_env

    prefect_env.shared_home = lambda: tmp_path_factory.mktemp("prefect-shared")
    yield
    prefect_env.stop_shared_server()


@pytest.fixture(scope="session")
def prefect_server():
    """This test process's shared Prefect server (one per xdist worker): never stop it; use work pools of your own."""
    import prefect_env

    return prefect_env.shared_server()


@pytest.fixture(scope="session")
def postgres_server():
    server = servers.PostgresServer()
    yield server
    server.cleanup()


def pytest_configure(config):
    config.addinivalue_line("markers", "lab: starts a server (Prefect, Redis, PostgreSQL, dockerd) or a whole lab; "
                                       "the fast tier is pytest -m 'not lab'")
    if "not lab" in (config.option.markexpr or ""):
        os.environ[servers.FAST_TIER_VAR] = "1"  # anything that starts a server then fails: it lacks the mark


def pytest_collection_modifyitems(config, items):
    """A test on a Redis or PostgreSQL store (a parameter naming one, or the servers' fixtures) is a lab test."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if {"redis", "postgresql"} & {v for v in params.values() if isinstance(v, str)} or {
                "redis_server", "postgres_server"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.lab)


_db_counter = itertools.count()


def store_url(backend: str, request, tmp_path) -> str:
    """A fresh, empty store of the given backend for one test."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    if backend == "redis":
        server = request.getfixturevalue("redis_server")
        return f"redis://:{server.password}@127.0.0.1:{server.port}/0?prefix=t{uuid.uuid4().hex[:12]}:"
    server = request.getfixturevalue("postgres_server")
    return server.create_database(f"t{os.getpid()}_{next(_db_counter)}")


@pytest.fixture(params=["sqlite", "redis", "postgresql"])
def backend(request):
    return request.param


@pytest.fixture
def store(backend, request, tmp_path):
    s = open_store(store_url(backend, request, tmp_path))
    yield s
    s.close()
