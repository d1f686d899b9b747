"""Reliability on real servers: contention between OS processes, crashes mid-commit, restarts, failover."""

import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import servers
from builders import node
from sqlalchemy import text
from stores import store_url

from mn_prefect.local_lab import descendants
from mn_prefect.model.placement import PlacedResources, Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.placement import reservations
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store
from mn_prefect.store.audit import audit, audit_queues
from mn_prefect.store.records import ReservationRecord, get_record

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "benchmarks" / "store_workload.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import store_workload  # noqa: E402


def spawn_workers(url, count, cycles, seed=0, sharing=False, queues=False):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    mix = (["sharing"] if sharing else []) + (["queues"] if queues else [])
    return [subprocess.Popen([sys.executable, str(WORKLOAD), url, str(i), str(cycles), str(seed * 100 + i), *mix],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(count)]


def _shares_counted(view) -> bool:
    """Whether a node's per-GPU share counters hold something in ``view`` (a fraction is booked)."""
    return any(k.startswith("share:") and v > 0 for n in view["nodes"].values() for k, v in n.items() if k != "record")


def test_contention_between_eight_processes_never_overbooks(backend, request, tmp_path):
    """Whole GPUs by id and by count, MIG slices and GPU fractions, static and dynamic ports: 8 processes x 300
    plan-and-commit cycles, audited while they run and at the end (no overbooked shares or GPU memory, no GPU
    both whole and shared or sliced)."""
    url = store_url(backend, request, tmp_path)
    store_workload.prepare(url, sharing=True)
    store = open_store(url)
    procs = spawn_workers(url, count=8, cycles=300, sharing=True)
    samples, sample_problems, shared_seen = 0, [], False
    while any(p.poll() is None for p in procs):
        view = store.consistent_view()
        sample_problems += audit(view)  # at sampled moments during the run
        shared_seen = shared_seen or _shares_counted(view)
        samples += 1
        time.sleep(0.1)
    results = []
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out))
    assert sample_problems == [] and samples >= 3
    final = store.consistent_view()
    assert audit(final) == []
    assert all(r["cycles"] == 300 for r in results)
    commits = sum(r["commits"] for r in results)
    assert commits > 300, results  # the processes really worked...
    assert sum(r["refused"] for r in results) > 0  # ...against a cluster too small for all of them
    assert sum(r["conflicts"] for r in results) > 0  # ...and really raced each other to commit
    live = {job for r in results for job in r["live_jobs"]}
    assert set(final["bookings"]) == live  # every booking belongs to exactly one live job
    assert sum(r["shared_commits"] for r in results) > 0  # fractions and slices were committed under contention
    assert shared_seen or _shares_counted(final)  # the per-GPU counters the audit compared were there
    for job in live:
        store.release(job)
    assert store.consistent_view()["held"] == [] and audit(store.consistent_view()) == []


def test_eight_processes_over_three_queues_never_pass_a_quota(backend, request, tmp_path):
    """8 processes x 300 plan-and-commit cycles, each job from one of three queues (two lending to each other in
    a cohort) with quotas smaller than the cluster: no queue past its quota and borrowing limit, no cohort past
    its queues' quotas, sampled while they run; at the end every queue's counters equal what its live bookings
    hold, and the nodes are sound."""
    url = store_url(backend, request, tmp_path)
    store_workload.prepare(url, queues=True)
    store = open_store(url)
    procs = spawn_workers(url, count=8, cycles=300, queues=True)
    samples, sample_problems = 0, []
    while any(p.poll() is None for p in procs):
        sample_problems += audit_queues(store.queues())
        samples += 1
        time.sleep(0.05)
    results = []
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out))
    assert sample_problems == [] and samples >= 3
    final = store.consistent_view()
    assert audit(final) == [] and audit_queues(store.queues(), final["bookings"]) == []
    assert sum(r["quota_refused"] for r in results) > 0  # the quotas really held runs back...
    assert sum(r["commits"] for r in results) > 300 and sum(r["conflicts"] for r in results) > 0  # ...under races
    queues = store.queues()
    assert queues.queues["qb"].used.get("gpu", 0) <= 2 and queues.cohorts["x"].used.get("gpu", 0) <= 2
    for job in {job for r in results for job in r["live_jobs"]}:
        store.release(job)
    assert all(not any(q.used.values()) for q in store.queues().queues.values())


def _pg_sleepers(url):
    import psycopg

    with psycopg.connect(url.split("?")[0], autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep'").fetchone()[0]


def _crash_in_commit(url, failpoint, tmp_path):
    marker = tmp_path / f"marker-{failpoint}"
    code = (
        "import sys; from mn_prefect.store import open_store; from mn_prefect.placement.placing import place_and_commit;"
        "from mn_prefect.scheduler import Ask; from mn_prefect.model.resources import resource_request as r;"
        "s = open_store(sys.argv[1]);"
        "place_and_commit(s, 'crashing', [Ask(agent_id='a', request=r({'gpu': 1, 'cpu_cores': 1, 'ports': [{'label': 'p', 'port': 7000}]}))])"
    )
    env = {**os.environ, "MN_FAILPOINTS": failpoint, "MN_FAILPOINT_MARKER": str(marker)}
    proc = subprocess.Popen([sys.executable, "-c", code, url], env=env, stderr=subprocess.PIPE, text=True)
    servers.wait_for(lambda: marker.exists() or proc.poll() is not None, timeout=60, what="the failpoint")
    assert proc.poll() is None, proc.stderr.read()
    if url.startswith("postgresql"):
        # Kill only once the server is inside the commit function with every row written, not yet committed.
        servers.wait_for(lambda: _pg_sleepers(url) >= 1, timeout=30, what="the commit function to reach its failpoint")
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    if url.startswith("postgresql"):
        servers.wait_for(lambda: _pg_sleepers(url) == 0, timeout=30, what="the server to abort the dead client's commit")


@pytest.mark.parametrize("failpoint", ["commit.after_reads", "commit.half_written"])
def test_a_crash_in_the_middle_of_a_commit_leaves_no_half_booking(backend, request, tmp_path, failpoint):
    if backend == "redis":
        failpoint = "commit.after_reads"  # the Redis commit is one server-side script: the client dies before it
    if backend == "postgresql":
        failpoint = "commit.half_written"  # one function call reads and writes; the client dies before COMMIT
    url = store_url(backend, request, tmp_path)
    store_workload.prepare(url)
    _crash_in_commit(url, failpoint, tmp_path)
    store = open_store(url)
    view = store.consistent_view()
    assert view["bookings"] == {} and view["held"] == [] and audit(view) == []
    assert all(n["cpu"] == 0 and n["gpu"] == 0 for n in view["nodes"].values())
    # The store is not left locked: the same booking now succeeds at once.
    result = place_and_commit(store, "after", [Ask(agent_id="a", request=resource_request({"gpu": 1, "ports": [{"label": "p", "port": 7000}]}))])
    assert result.placed


def _book_some(store, count=5):
    jobs = {}
    for i in range(count):
        result = place_and_commit(store, f"job{i}", [Ask(agent_id="a", request=resource_request({"cpu_cores": 0.5, "gpu": 1 if i < 3 else 0, "ports": [{"label": "p"}]}))])
        assert result.placed
        jobs[f"job{i}"] = result.commit.placements
    return jobs


def _same_bookings(store, jobs):
    view = store.consistent_view()
    assert set(view["bookings"]) == set(jobs) and audit(view) == []
    for job, placements in jobs.items():
        assert [p.device_ids for p in view["bookings"][job]] == [p.device_ids for p in placements]


@pytest.mark.lab
def test_redis_restart_with_aof_loses_nothing_committed(tmp_path):
    server = servers.RedisServer(tmp_path / "aof", password="aof-secret", appendonly=True)
    url = f"redis://:aof-secret@127.0.0.1:{server.port}/0"
    try:
        store_workload.prepare(url)
        store = open_store(url)
        jobs = _book_some(store)
        store.release("job4")
        del jobs["job4"]
        server.kill(signal.SIGKILL)  # no shutdown save: only the append-only file remains
        server.start()
        _same_bookings(open_store(url), jobs)
    finally:
        server.stop()


@pytest.mark.lab
def test_a_redis_store_commits_on_after_its_server_restarts_and_forgets_the_scripts(tmp_path):
    """The commit path's one connection (store/redis_line.py) reconnects after a restart, and a server that
    lost the scripts (restart, SCRIPT FLUSH) is sent them again."""
    server = servers.RedisServer(tmp_path / "line", password="line-secret", appendonly=True)
    url = f"redis://:line-secret@127.0.0.1:{server.port}/0"
    try:
        store = open_store(url)
        store.register_node(node("a", cpu=8, mem=8192))

        def commit(job: str) -> bool:
            return store.commit_plan(job, [Placement(agent_id=job, node="a", resources=PlacedResources(cpu_cores=1))]).ok

        assert commit("before") and store.release("before") == 1
        server.kill(signal.SIGKILL)
        server.start()
        assert commit("after-restart")
        store.client.script_flush()
        assert commit("after-flush")
        assert store.release("after-restart") == 1
        assert sorted(store.consistent_view()["bookings"]) == ["after-flush"]
        assert audit(store.consistent_view()) == []
        store.close()
    finally:
        server.stop()


@pytest.mark.lab
def test_a_postgresql_store_commits_on_after_its_commit_connection_is_cut(request, tmp_path):
    """The commit path's connection (store/pg_line.py, prepared statements) is replaced and prepared again."""
    store = open_store(store_url("postgresql", request, tmp_path))
    store.register_node(node("a", cpu=8, mem=8192))

    def commit(job: str) -> bool:
        return store.commit_plan(job, [Placement(agent_id=job, node="a", resources=PlacedResources(cpu_cores=1))]).ok

    assert commit("one")
    pid = store.dialect._hot.info.backend_pid
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
    servers.wait_for(lambda: not _running(pid), timeout=10, what="the cut backend to exit")
    assert commit("two")
    assert store.dialect._hot.info.backend_pid != pid
    assert store.release("one") == 1
    assert sorted(store.consistent_view()["bookings"]) == ["two"]
    assert audit(store.consistent_view()) == []
    store.close()


def test_postgresql_restart_loses_nothing_committed(postgres_server):
    url = postgres_server.create_database("restart_test")
    store_workload.prepare(url)
    store = open_store(url)
    jobs = _book_some(store)
    store.close()
    postmaster = int((postgres_server.data / "postmaster.pid").read_text().split()[0])
    children = descendants(postmaster)
    postgres_server.kill()  # SIGKILL of the postmaster: recovery from the WAL on start
    servers.wait_for(lambda: _postgres_down(postgres_server, children), timeout=30,
                     what="the killed server to be down: pg_ctl finds no server, its port refuses, its backends gone")
    (postgres_server.data / "postmaster.pid").unlink(missing_ok=True)
    postgres_server.start()
    _same_bookings(open_store(url), jobs)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _postgres_down(server, children: list[int]) -> bool:
    """No server runs on the data directory (pg_ctl status exits 3), nothing answers on its port, and none of
    the killed postmaster's processes is left (a backend still attached to its shared memory would make the
    next start refuse)."""
    status = server._run([servers.pg_bin("pg_ctl"), "-D", str(server.data), "status"], check=False)
    with socket.socket() as probe:
        refused = probe.connect_ex(("127.0.0.1", server.port)) != 0
    return status.returncode == 3 and refused and not [pid for pid in children if _running(pid)]


def test_sqlite_survives_a_killed_writer_and_reopens(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store_workload.prepare(url)
    jobs = _book_some(open_store(url))
    _crash_in_commit(url, "commit.half_written", tmp_path)
    _same_bookings(open_store(url), jobs)


@contextlib.contextmanager
def sentinel_cluster(tmp_path):
    """A master, its replica and three Sentinels watching it (``mnmaster``), with the store URL through them."""
    password = "sentinel-secret"
    master = servers.RedisServer(tmp_path / "m", password=password)
    replica = servers.RedisServer(tmp_path / "r", password=password, replica_of=master.port)
    sentinels = [servers.RedisServer(tmp_path / f"s{i}", password=password, sentinel_of=(master.port, "mnmaster"))
                 for i in range(3)]
    try:
        servers.wait_for(lambda: replica.client().info("replication")["master_link_status"] == "up", what="replication")
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in sentinels)
        url = f"redis+sentinel://:{password}@{hosts}/mnmaster/0?retry_seconds=20&socket_timeout=0.5"
        servers.wait_for(lambda: all(s.client().execute_command("SENTINEL", "get-master-addr-by-name", "mnmaster")
                                     for s in sentinels), what="sentinels")
        yield master, replica, url
    finally:
        for server in [*sentinels, replica, master]:
            server.kill()


@pytest.mark.lab
def test_redis_sentinel_failover_resumes_commits_on_the_promoted_replica(tmp_path):
    with sentinel_cluster(tmp_path) as (master, replica, url):
        store_workload.prepare(url)
        store = open_store(url)
        committed: dict[str, list] = {}
        ask = Ask(agent_id="a", request=resource_request({"cpu_cores": 0.01, "ports": [{"label": "p"}]}))
        for i in range(20):
            result = place_and_commit(store, f"before{i}", [ask])
            assert result.placed
            committed[f"before{i}"] = result.commit.placements
        for i in range(20):  # keep the set of live jobs bounded
            store.release(f"before{i}")
            committed.pop(f"before{i}")
        servers.wait_for(lambda: replica.client().info("replication")["master_repl_offset"]
                         >= master.client().info("replication")["master_repl_offset"], what="replica catch-up")
        master.kill(signal.SIGKILL)
        # Blocks through the failover (the URL's retry_seconds bounds it); how long it takes is measured by
        # `python benchmarks/recovery.py --failover`, not asserted here.
        result = place_and_commit(store, "after-failover", [ask])
        assert result.placed and not result.commit.already_committed
        assert store.client.connection_pool.get_master_address()[1] == replica.port
        promoted = replica.client().info("replication")
        assert promoted["role"] == "master"  # the commit after the kill went to the replica sentinel promoted
        assert master.proc.poll() is not None
        committed["after-failover"] = result.commit.placements
        # Heal: every placement this placer believes it holds is re-asserted (a no-op when it survived).
        for job, placements in committed.items():
            assert store.resync(job, placements).ok
        assert audit(store.consistent_view()) == []
        assert set(store.consistent_view()["bookings"]) == set(committed)


@pytest.mark.lab
def test_a_reservation_reported_made_survives_a_failover_right_after(tmp_path):
    """Its record, booking and claim reached the replica before ``reserve`` returned (store.replicate): the
    master killed at once loses none of it. Without a replica there is nothing to wait for."""
    with sentinel_cluster(tmp_path) as (master, replica, url):
        store = open_store(url)
        store.register_node(node("n1", cpu=8))
        # One replica acknowledges (WAIT gives it 0.4 s here: on a loaded machine a first WAIT can time out).
        servers.wait_for(lambda: store.replicate() == 1, timeout=20, what="the replica to acknowledge a write")
        made = reservations.reserve(store, resource_request({"cpu": 4}), {"cpu": 4}, 3600)
        assert made.record is not None
        master.kill(signal.SIGKILL)
        rid = made.record.job_id
        kept = get_record(store, rid, ReservationRecord)  # blocks through the failover
        assert store.client.connection_pool.get_master_address()[1] == replica.port
        assert kept is not None and kept.status == "active"
        assert sum(p.resources.cpu_cores for p in store.active_placements(job_id=rid)) == 4
        assert audit(store.consistent_view()) == []


@pytest.mark.lab
def test_a_reservation_waits_for_its_replica_and_says_when_none_acknowledged(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(reservations, "DURABLE_SECONDS", 2.0)  # how long it asks again (30 s in a fleet)
    master = servers.RedisServer(tmp_path / "m")
    replica = servers.RedisServer(tmp_path / "r", replica_of=master.port)
    try:
        servers.wait_for(lambda: replica.client().info("replication")["master_link_status"] == "up", what="replication")
        store = open_store(f"redis://127.0.0.1:{master.port}/0")
        store.register_node(node("n1", cpu=8))
        os.kill(replica.proc.pid, signal.SIGSTOP)  # it acknowledges nothing while stopped
        try:
            started = time.monotonic()
            made = reservations.reserve(store, resource_request({"cpu": 4}), {"cpu": 4}, 3600)
            waited = time.monotonic() - started
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        assert made.record is not None and waited >= 2.0  # asked again, WAIT's timeout each time, until the deadline
        assert f"reservation {made.record.job_id}: no replica acknowledged it; a failover now could lose it" in caplog.text
    finally:
        for server in [replica, master]:
            server.kill()


def test_a_store_without_replicas_has_nothing_to_wait_for(redis_server, tmp_path):
    url = f"redis://:{redis_server.password}@127.0.0.1:{redis_server.port}/0?prefix=norepl{os.getpid()}:"
    assert open_store(url).replicate() is None
    assert open_store(f"sqlite:///{tmp_path / 'state.db'}").replicate() is None


def test_resync_restores_a_booking_a_failover_lost(redis_server):
    url = f"redis://:{redis_server.password}@127.0.0.1:{redis_server.port}/0?prefix=resync{os.getpid()}:"
    store_workload.prepare(url)
    store = open_store(url)
    result = place_and_commit(store, "running", [Ask(agent_id="a", request=resource_request({"gpu": 1}))])
    placements = result.commit.placements
    # Simulate the lost write: the new master never saw this commit.
    store.release("running")
    assert store.consistent_view()["bookings"] == {}
    healed = store.resync("running", placements)
    assert healed.ok and not healed.already_committed
    assert store.resync("running", placements).already_committed
    assert [p.device_ids for p in store.active_placements(job_id="running")] == [placements[0].device_ids]


# -- partial release racing a full release (node row locks, then the booking row) ---------------------------

def _race_store(backend, request, tmp_path):
    store = open_store(store_url(backend, request, tmp_path))
    for name in ("c", "g"):
        store.register_node(node(name, cpu=4, memory=8192))
    for job, cpu in (("spread", 2), ("other", 1)):  # "other" keeps the counters above zero: no clamp hides a slip
        assert store.commit_plan(job, [Placement(agent_id=f"{job}-{n}", node=n, resources=PlacedResources(cpu_cores=cpu))
                                       for n in ("c", "g")]).ok
    return store


def _blocked_on_a_lock(store, query_like: str) -> None:
    def blocked():
        with store.engine.connect() as conn:  # a fresh transaction each time: pg_stat_activity is cached in one
            return conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                     "AND query LIKE :q"), {"q": query_like}).scalar()
    servers.wait_for(blocked, timeout=10, what=f"a statement like {query_like!r} waiting on a lock")


@pytest.mark.lab
def test_postgresql_full_release_waiting_on_a_node_frees_only_what_a_partial_release_left(request, tmp_path):
    store = _race_store("postgresql", request, tmp_path)
    with store.engine.connect() as holder, ThreadPoolExecutor(1) as pool:
        holder.execute(text("SELECT name FROM mn_nodes WHERE name = 'c' FOR UPDATE"))
        full = pool.submit(store.release, "spread")  # reads the booking (c and g), then waits for c
        _blocked_on_a_lock(store, "SELECT mn_release%")
        assert store.release("spread", node="g") == 1  # g is free: this goes first
        holder.rollback()
        assert full.result(timeout=10) == 1
    assert store.active_jobs() == ["other"] and audit(store.consistent_view()) == []
    store.close()


@pytest.mark.lab
def test_postgresql_partial_release_waiting_on_a_node_sees_a_full_release_made_meanwhile(request, tmp_path):
    store = _race_store("postgresql", request, tmp_path)
    with store.engine.connect() as holder, ThreadPoolExecutor(1) as pool:
        holder.execute(text("SELECT name FROM mn_nodes WHERE name = 'c' FOR UPDATE"))
        partial = pool.submit(store.release, "spread", node="c")
        _blocked_on_a_lock(store, "%FOR UPDATE%")
        assert holder.execute(text("SELECT mn_release('spread', 0, '', '', 0)")).scalar() == 2
        holder.commit()
        assert partial.result(timeout=10) == 0  # the booking it waited for is gone: nothing left to free
    assert store.active_jobs() == ["other"] and audit(store.consistent_view()) == []
    store.close()


@pytest.mark.lab
def test_redis_partial_release_rereads_a_booking_rebooked_after_its_read(request, tmp_path):
    store = _race_store("redis", request, tmp_path)
    spread = store.active_placements(job_id="spread")
    assert store.release("spread", node="g") == 1  # "spread" now holds c only
    read = store.client.hmget  # the partial release reads the booking's placements and demands in one call

    def read_then_rebook(*args):
        value = read(*args)
        store.client.hmget = read  # once
        store.release("spread")
        assert store.commit_plan("spread", spread).ok  # c and g again
        return value  # what the release read: c only, stale now

    store.client.hmget = read_then_rebook
    assert store.release("spread", node="c") == 1
    assert [p.node for p in store.active_placements(job_id="spread")] == ["g"]
    assert audit(store.consistent_view()) == []
    store.close()


@pytest.mark.lab
def test_postgresql_transactions_never_get_the_autocommit_connection_of_commits(request, tmp_path):
    store = open_store(store_url("postgresql", request, tmp_path))
    store.release("nothing")  # opens the connection commits and releases use (autocommit)
    gc.collect()
    for _ in range(3):  # more than the pool holds idle
        with store.engine.connect() as conn:
            assert not conn.connection.driver_connection.autocommit
    store.close()


def _apply_function_row(store) -> str:
    with store.engine.connect() as conn:
        return conn.execute(text("SELECT xmin::text FROM pg_proc WHERE proname = 'mn_apply'")).scalar_one()


@pytest.mark.lab
def test_opening_a_current_postgresql_store_leaves_its_functions_alone_and_an_older_one_gets_them(request, tmp_path):
    url = store_url("postgresql", request, tmp_path)
    first = open_store(url)
    first.register_node(node("a", cpu=4, mem=4096))
    created = _apply_function_row(first)
    # Replacing mn_apply under running commits makes every session compile it again: a current store keeps it.
    second = open_store(url)
    assert _apply_function_row(second) == created
    second.close()
    # A store whose functions are another version's (tag differs) gets this version's when opened.
    with first.engine.begin() as conn:
        conn.execute(text("UPDATE mn_meta SET value = 'older' WHERE key = 'functions'"))
        conn.execute(text("DROP FUNCTION mn_apply(text, text, jsonb, text, float8, text, text, bigint)"))
    third = open_store(url)
    assert third.commit_plan("j1", [Placement(agent_id="x", node="a", resources=PlacedResources(cpu_cores=1))]).ok
    with third.engine.connect() as conn:
        assert conn.execute(text("SELECT value FROM mn_meta WHERE key = 'functions'")).scalar_one() != "older"
    assert audit(third.consistent_view()) == []
    for store in (first, third):
        store.close()
