"""The Redis store's own paths, on a real redis-server. Writes sent ahead on its script line (``store.pipelined()``,
store/redis_line.py): a record goes with the commit after it, in order and in one exchange; what a block queued is
sent by its end, even when it fails; a lost connection sends it again; one thread's writes never ride on another's.
The expiry index (``reservations_due``): a store written before it existed builds it on first use."""

import os
import threading

import pytest
from builders import node

from mn_prefect.model.placement import PlacedResources, Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.placement import reservations
from mn_prefect.store import open_store
from mn_prefect.store.base import JobRecord
from mn_prefect.store.records import ReservationRecord, get_record
from mn_prefect.store.redis_line import ScriptLine


@pytest.fixture
def store(redis_server, request):
    url = (f"redis://:{redis_server.password}@127.0.0.1:{redis_server.port}/0"
           f"?prefix=ahead{os.getpid()}{abs(hash(request.node.name)) % 10**8}:")
    store = open_store(url)
    store.register_node(node("a", cpu=8, mem=8192))
    yield store
    store.close()


@pytest.fixture
def exchanges(monkeypatch):
    """How many exchanges (one send, the answers read) each thread made on a script line."""
    counts: dict[int, int] = {}
    real = ScriptLine._exchange

    def counted(self, call):
        me = threading.get_ident()
        counts[me] = counts.get(me, 0) + 1
        return real(self, call)

    monkeypatch.setattr(ScriptLine, "_exchange", counted)
    return counts


def _job(job_id: str) -> JobRecord:
    return JobRecord(job_id=job_id, name="ahead", status="running")


def _placement(job: str) -> list[Placement]:
    return [Placement(agent_id=job, node="a", resources=PlacedResources(cpu_cores=1))]


def test_a_record_written_ahead_goes_with_the_commit_after_it_in_order_in_one_exchange(store, redis_server,
                                                                                      exchanges):
    assert store.commit_plan("warm", _placement("warm")).ok  # the process has read node a: the next commit decides
    exchanges.clear()                                          # on what it read, and sends only its apply
    with store.client.monitor() as watcher:  # every command the server runs, in the order it runs them
        with store.pipelined():
            store.put_job(_job("job-1"))
            assert store.get_job("job-1") is None  # queued, not sent yet (the read went over another connection)
            assert store.commit_plan("job-1", _placement("job-1")).ok
        seen: list[str] = []
        while not seen or not seen[-1].startswith("EVALSHA "):  # up to the commit
            command = watcher.next_command()
            if command["client_type"] != "lua":  # not one a script ran
                seen.append(command["command"])
    assert exchanges[threading.get_ident()] == 1  # the record and the commit: one exchange
    record = [i for i, command in enumerate(seen) if command.startswith("EVAL ") and "job-1" in command]
    assert record == [len(seen) - 2], seen  # the record's script, sent whole, ran just before the commit
    assert store.get_job("job-1") is not None and store.active_placements(job_id="job-1")


def test_what_a_block_queued_is_sent_at_its_end_even_when_it_fails(store):
    with store.pipelined():
        store.put_job(_job("quiet"))
    assert store.get_job("quiet") is not None  # no call followed: sent at the block's end

    with pytest.raises(RuntimeError, match="the block failed"), store.pipelined():
        store.put_job(_job("refused"))
        raise RuntimeError("the block failed")
    assert store.get_job("refused") is not None


def test_writes_queued_before_a_lost_connection_go_again_with_the_retry(store):
    assert store.commit_plan("warm", _placement("warm")).ok  # the line is connected
    with store.pipelined():
        store.put_job(_job("after-cut"))
        killed = store.client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        assert killed >= 1
        assert store.commit_plan("after-cut", _placement("after-cut")).ok
    assert store.get_job("after-cut") is not None
    assert [p.job_id for p in store.active_placements(job_id="after-cut")] == ["after-cut"]


def test_one_threads_queued_writes_never_ride_on_anothers_call(store):
    queued, other_done = threading.Event(), threading.Event()

    def writer() -> None:
        with store.pipelined():
            store.put_job(_job("mine"))
            queued.set()
            other_done.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    assert queued.wait(10)
    assert store.commit_plan("theirs", _placement("theirs")).ok  # this thread's call on the same line
    assert store.get_job("mine") is None  # still queued with its own thread
    other_done.set()
    thread.join(10)
    assert store.get_job("mine") is not None


def test_a_reservation_on_redis_is_one_exchange_and_its_record_names_its_booking(store, exchanges):
    request = resource_request({"cpu": 1})
    first = reservations.reserve(store, request, {"cpu": 1}, 60)  # reads the view, as every process's first does
    assert first.record is not None
    exchanges.clear()
    made = [reservations.reserve(store, request, {"cpu": 1}, 60).record for _ in range(5)]
    # The record ahead of its commit, whose script records the event and says the master has no replica (a
    # standalone server): one exchange each, no replica check after it.
    assert sum(exchanges.values()) == 5
    for record in made:
        assert record is not None
        stored = get_record(store, record.job_id, ReservationRecord)
        assert stored is not None and stored.nodes == ["a"] and stored.status == "active"
        assert [p.reserves for p in store.active_placements(job_id=record.job_id)] == [record.job_id]
        assert any(e.kind == "reservation.created" for e in store.events(job_id=record.job_id))


def test_a_store_written_before_the_expiry_index_builds_it_on_first_use(store):
    past = JobRecord(job_id="rsv-old", job_type="reservation", status="active", spec={"expires_at": 5.0})
    store.put_job(past)
    store.put_job(JobRecord(job_id="rsv-next", job_type="reservation", status="active", spec={"expires_at": 90.0}))
    store.client.delete(store.prefix + "expiries", store.prefix + "expiries_built")  # as an older version left it
    due, earliest = store.reservations_due(10.0)
    assert [r.job_id for r in due] == ["rsv-old"] and earliest == 90.0
    assert store.client.zcard(store.prefix + "expiries") == 2


@pytest.mark.lab  # starts its own redis-server and a replica
def test_a_reservation_on_a_master_with_a_replica_waits_for_it(tmp_path):
    from servers import RedisServer, wait_for

    redis_server = RedisServer(tmp_path / "master", password="rep-secret")  # its own: the shared one has no replica
    replica = RedisServer(tmp_path / "replica", password=redis_server.password, replica_of=redis_server.port)
    try:
        wait_for(lambda: replica.client().info("replication").get("master_link_status") == "up", timeout=20,
                 what="the replica in sync")
        store = open_store(f"redis://:{redis_server.password}@127.0.0.1:{redis_server.port}/0?prefix=rep{os.getpid()}:")
        store.register_node(node("a", cpu=8, mem=8192))
        waited = []
        real = store.replicate
        store.replicate = lambda *a, **k: waited.append(real(*a, **k)) or waited[-1]
        made = reservations.reserve(store, resource_request({"cpu": 1}), {"cpu": 1}, 60).record
        assert made is not None and waited == [1]  # the commit's script saw the replica: WAIT for it
        wait_for(lambda: replica.client().hget(f"rep{os.getpid()}:jobs", made.job_id) is not None, timeout=10,
                 what="the record on the replica")
        assert any(e.kind == "reservation.created" for e in store.events(job_id=made.job_id))
        store.close()
    finally:
        replica.stop()
        redis_server.stop()
