import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Hermetic: each test process gets a HOME of its own (so ~/.prefect and ~/.mn-prefect are its own, empty), and
# nothing of the user's Prefect or mn-prefect settings (an active profile, PREFECT_API_URL, MN_STORE_URL) reaches a
# test or the processes it starts. Set before anything imports Prefect, which reads its settings at import.
for _name in [n for n in os.environ if n.startswith(("PREFECT_", "MN_"))]:
    del os.environ[_name]
_HOME = tempfile.mkdtemp(prefix="mn-prefect-test-home-")
os.environ["HOME"] = _HOME
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)

# Test helpers (builders.py) import as a plain module.
sys.path.insert(0, str(Path(__file__).parent))

import pytest
import servers
from stores import store_url

from mn_prefect.api_tls import plain_http_env
from mn_prefect.store import open_store

# Every Prefect API the tests reach is plain http on loopback: the tests' own clients (and the processes they start)
# load the one-certificate bundle, as the lab's processes do (mn_prefect/api_tls.py), not certifi's every time.
os.environ.update(plain_http_env("http://127.0.0.1", os.environ))


@pytest.fixture(autouse=True)
def _prefect_environment_kept(request):
    """A test that leaves a PREFECT_ or MN_ variable changed in this process's environment would point every later
    test of the process at its server (tests/cli_runner.py runs a call naming a server as a subprocess): put them
    back and say which test it was."""
    def ours():
        return {k: v for k, v in os.environ.items() if k.startswith(("PREFECT_", "MN_"))}

    before = ours()
    yield
    after = ours()
    if after != before:
        changed = sorted(set(before.items()) ^ set(after.items()))
        for name in {name for name, _ in changed}:
            if name in before:
                os.environ[name] = before[name]
            else:
                os.environ.pop(name, None)
        import warnings

        warnings.warn(f"{request.node.nodeid} left the environment changed: {sorted({n for n, _ in changed})}",
                      stacklevel=1)


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


@pytest.fixture(scope="session")
def fake_gpu_libs(tmp_path_factory) -> Path:
    """A folder holding the fake ``libnvidia-ml.so.1`` and ``libcuda.so.1`` (tests/fake_nvml), compiled once per
    session: put it on LD_LIBRARY_PATH and describe the machine in FAKE_NVML_DEVICES."""
    import shutil
    import subprocess

    gcc = shutil.which("gcc") or shutil.which("cc")
    assert gcc is not None, "a C compiler is needed to build the fake GPU libraries (.ci/run installs gcc)"
    out = tmp_path_factory.mktemp("fake_gpu_libs")
    sources = Path(__file__).parent / "fake_nvml"
    for library, source in (("libnvidia-ml.so.1", "fake_nvml.c"), ("libcuda.so.1", "fake_cuda.c")):
        subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-o", str(out / library), str(sources / source)],
                       check=True, capture_output=True, text=True)
    return out


def pytest_configure(config):
    config.addinivalue_line("markers", "lab: starts a server (Prefect, Redis, PostgreSQL, dockerd) or a whole lab; "
                                       "the fast tier is pytest -m 'not lab'")
    if "not lab" in (config.option.markexpr or ""):
        os.environ[servers.FAST_TIER_VAR] = "1"  # anything that starts a server then fails: it lacks the mark
    _compile_sources()


def _compile_sources() -> None:
    """Byte-compile the package and the flows the labs run, once. With PYTHONDONTWRITEBYTECODE set (as on CI's
    machines) Python never caches what it compiles, and every worker, flow run and command the tests start
    compiled mn-prefect's modules again: 0.4 CPU-s for each process that loads the worker. Python still reads a
    cache that exists; compileall writes it whatever that variable says, and skips what is up to date."""
    import compileall

    root = Path(__file__).resolve().parents[1]
    for folder in (root / "mn_prefect", root / "tests" / "flows"):
        compileall.compile_dir(folder, quiet=1)


# The modules that take longest (seconds in the whole suite, from --durations), slowest first. The README's test
# command runs modules whole on each xdist process (--dist loadscope) in collection order (--no-loadscope-reorder),
# so the long ones start first and the short ones fill in at the end, instead of a long one starting last and
# running alone. Order only: no test depends on it; a module not named here keeps its place after these.
SLOWEST_FIRST = ("test_recovery", "test_job_runs", "test_worker", "test_offline_e2e", "test_up", "test_multihost",
                 "test_mn_clients", "test_worker_queues",
                 "test_wakeups", "test_faults_redis", "test_bundle_runs", "test_store_reliability", "test_reservations",
                 "test_worker_system", "test_faults", "test_gpu_check", "test_worker_sharing", "test_groups",
                 "test_worker_visibility",
                 "test_events", "test_worker_retries", "test_bad_inputs", "test_maintenance_eligibility",
                 "test_docker_driver", "test_ui", "test_cli", "test_store_cli", "test_worker_reservations",
                 "test_recovery_redis", "test_scheduled")


def pytest_collection_modifyitems(config, items):
    """The slowest modules first (SLOWEST_FIRST). A test on a Redis or PostgreSQL store (a parameter naming one, or
    the servers' fixtures) is a lab test."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's own order is kept
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if {"redis", "postgresql"} & {v for v in params.values() if isinstance(v, str)} or {
                "redis_server", "postgres_server"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.lab)


@pytest.fixture(params=["sqlite", "redis", "postgresql"])
def backend(request):
    return request.param


@pytest.fixture
def store(backend, request, tmp_path):
    s = open_store(store_url(backend, request, tmp_path))
    yield s
    s.close()
