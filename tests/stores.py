"""A fresh store of each backend for one test, importable by name from any test module (a conftest is not: another
test directory's conftest may hold that name in the process)."""

import itertools
import os
import uuid

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
