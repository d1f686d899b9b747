"""One contract, three backends: every test here runs on SQLite, Redis and PostgreSQL (real servers)."""

import hashlib
import json
import time

import numpy as np
import pytest
from builders import agent, blueprint, gpu, node
from sqlalchemy import text

from mn_prefect.model.placement import Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.placing import place_and_commit, place_blueprint
from mn_prefect.scheduler import Ask, Limits, plan_asks
from mn_prefect.store import Event, JobRecord, StaleLease
from mn_prefect.store.admission import Ticket
from mn_prefect.store.base import NodeNotRegistered
from mn_prefect.store.booking import NodeDemand, demand_by_node, fingerprint


def ask(name="w", **resources):
    return Ask(agent_id=name, request=resource_request(resources))


def plan_for(store, *asks, job_type="batch"):
    snap = store.snapshot()
    plan = plan_asks(list(asks), snap.nodes, snap.holds, job_type=job_type, limits=snap.limits)
    assert plan.status == "runnable_now", plan.reason
    return list(plan.placements)


@pytest.fixture
def gpu_store(store):
    store.register_node(node("g", cpu=8, memory=16384, devices=[gpu("g0", 0), gpu("g1", 1)]))
    store.register_node(node("c", cpu=4, memory=8192))
    return store


# -- nodes ------------------------------------------------------------------------------------------------

def test_registered_nodes_are_listed(gpu_store):
    names = [n.record.name for n in gpu_store.list_nodes()]
    assert names == ["c", "g"]
    g = gpu_store.get_node("g")
    assert [d.id for d in g.record.devices] == ["g0", "g1"] and g.last_heartbeat is not None
    assert gpu_store.get_node("missing") is None


@pytest.mark.parametrize("status", ["maintenance", "draining"])
def test_heartbeat_never_leaves_maintenance_or_draining(gpu_store, status):
    gpu_store.set_node_status("g", status, eligible=False)
    record = gpu_store.heartbeat("g")
    assert (record.status, record.scheduling_eligible) == (status, False)
    assert gpu_store.get_node("g").record.status == status


def test_heartbeat_never_makes_an_ineligible_node_eligible(gpu_store):
    gpu_store.set_node_status("g", "healthy", eligible=False)
    assert gpu_store.heartbeat("g").scheduling_eligible is False


def test_heartbeat_reconnects_a_disconnected_node_and_records_the_time(gpu_store):
    gpu_store.set_node_status("c", "disconnected")
    record = gpu_store.heartbeat("c", now=1234.5)
    assert record.status == "healthy" and gpu_store.get_node("c").last_heartbeat == 1234.5


def test_re_registering_keeps_an_operators_maintenance(gpu_store):
    gpu_store.set_node_status("g", "maintenance", eligible=False)
    again = gpu_store.register_node(node("g", cpu=16, devices=[gpu("g0", 0)]))
    assert (again.status, again.scheduling_eligible, again.cpu_cores) == ("maintenance", False, 16)


def test_heartbeat_of_an_unknown_node_is_an_error(store):
    with pytest.raises(NodeNotRegistered):
        store.heartbeat("ghost")


# -- commits ----------------------------------------------------------------------------------------------

def test_commit_books_devices_ports_and_capacity(gpu_store):
    placements = plan_for(gpu_store, ask(cpu_cores=2, gpu=1, ports=[{"label": "api", "port": 8080}]))
    result = gpu_store.commit_plan("job-1", placements)
    assert result.ok and not result.already_committed
    keys = {(b.node, b.kind, b.key, b.job_id) for b in gpu_store.bookings()}
    assert keys == {("g", "device", "g0", "job-1"), ("g", "port", "tcp:8080", "job-1")}
    active = gpu_store.active_placements()
    assert [(p.job_id, p.node, p.device_ids) for p in active] == [("job-1", "g", ["g0"])]
    assert gpu_store.active_jobs() == ["job-1"]
    hold = next(h for h in gpu_store.snapshot().holds if h.node == "g")
    assert hold.resources.cpu_cores == 2 and hold.resources.gpu_count == 1


def test_committing_the_same_plan_twice_is_a_no_op(gpu_store):
    placements = plan_for(gpu_store, ask(gpu=1))
    assert gpu_store.commit_plan("job-1", placements).ok
    again = gpu_store.commit_plan("job-1", placements)
    assert again.ok and again.already_committed
    assert len(gpu_store.bookings()) == 1 and len(gpu_store.history("job-1")) == 1


def _store_fingerprint(store, job_id: str, value: str) -> None:
    """Overwrite the fingerprint a backend keeps with a booking (as an earlier version would have written it)."""
    if hasattr(store, "client"):  # Redis
        store.client.hset(f"{store.prefix}booking:{job_id}", "fingerprint", value)
    else:
        with store.engine.begin() as conn:
            conn.execute(text("UPDATE mn_bookings SET fingerprint = :f WHERE job_id = :j"), {"f": value, "j": job_id})


def test_a_booking_fingerprinted_by_an_earlier_version_is_still_the_same_plan(gpu_store):
    """The first fingerprints hashed json.dumps's spaced text of the demands; a commit retried across an upgrade
    is still recognised as the plan already booked, and a different plan still conflicts."""
    placements = plan_for(gpu_store, ask(cpu_cores=2, gpu=1, ports=[{"label": "api", "port": 8080}]))
    assert gpu_store.commit_plan("job-1", placements).ok
    body = json.dumps({n: d.as_json() for n, d in demand_by_node(placements).items()}, sort_keys=True)
    legacy = hashlib.sha256(body.encode()).hexdigest()[:32]
    assert legacy != fingerprint(placements)  # the two texts differ: the test reads the old one back
    _store_fingerprint(gpu_store, "job-1", legacy)
    again = gpu_store.commit_plan("job-1", placements)
    assert again.ok and again.already_committed
    assert len(gpu_store.bookings()) == 2 and len(gpu_store.history("job-1")) == 1
    other = gpu_store.commit_plan("job-1", plan_for(gpu_store, ask(cpu_cores=1)))
    assert not other.ok and "already holds" in other.conflict.reason


def test_numpy_numbers_in_a_plan_are_written_as_the_numbers_they_are():
    """Amounts, ceilings or versions that arrive as numpy scalars give the fingerprint and the plan text the same
    Python numbers give (json.dumps wrote numpy's float64 as a float; the commit path must not refuse them)."""
    claim = {"device": ["g0"], "port": ["tcp:8080"], "reservation": []}
    plain = {"g": NodeDemand(add={"cpu": 0.5, "mem": 512.0, "disk": 0.0, "gpu": 1.0}, claim=claim)}
    numbers = {"g": NodeDemand(add={k: np.float64(v) for k, v in plain["g"].add.items()}, claim=claim)}
    assert fingerprint([], numbers) == fingerprint([], plain)
    ticket = Ticket(job_id="j", fingerprint="f", placements="[]", demands=numbers, versions={"g": np.int64(3)},
                    ceilings={"g": {"cpu": np.float64(8.0), "mem": np.float32(16384.0)}}, now=0.0, count=1)
    assert json.loads(ticket.plan_json()) == {"g": {"version": 3, "ceiling": {"cpu": 8.0, "mem": 16384.0},
                                                    "add": plain["g"].add, "claim": claim}}


def test_the_same_job_with_a_different_plan_conflicts(gpu_store):
    assert gpu_store.commit_plan("job-1", plan_for(gpu_store, ask(gpu=1))).ok
    other = plan_for(gpu_store, ask(gpu=1))
    result = gpu_store.commit_plan("job-1", other)
    assert not result.ok and "already holds" in result.conflict.reason


@pytest.mark.parametrize("second, fragment", [
    ({"devices": [{"ids": ["g0"]}]}, "device g0"),
    ({"devices": [{"ids": ["g1"]}], "ports": [{"label": "x", "port": 8080, "protocol": "grpc"}]}, "tcp:8080"),
    ({"cpu_cores": 7}, "insufficient cpu"),
])
def test_a_stale_plan_conflicts_and_books_nothing(gpu_store, second, fragment):
    stale = plan_for(gpu_store, ask(**{**second}))  # planned before the first commit
    first = plan_for(gpu_store, ask(cpu_cores=2, devices=[{"ids": ["g0"]}], ports=[{"label": "api", "port": 8080}]))
    assert gpu_store.commit_plan("first", first).ok
    before = sorted((b.kind, b.key) for b in gpu_store.bookings())
    result = gpu_store.commit_plan("second", stale)
    assert not result.ok and fragment in result.conflict.reason and result.conflict.node == "g"
    assert sorted((b.kind, b.key) for b in gpu_store.bookings()) == before
    assert gpu_store.active_jobs() == ["first"]


def test_a_rejected_gang_leaves_no_half_booking(gpu_store):
    # The plan's first placement fits; its second needs a device that is already held.
    assert gpu_store.commit_plan("holder", plan_for(gpu_store, ask(devices=[{"ids": ["g1"]}]))).ok
    gang = [Placement(agent_id="a", node="c", resources={"cpu_cores": 1}, allocation={"ports": [{"label": "p", "port": 9000}]}),
            Placement(agent_id="b", node="g", resources={"gpu_count": 1},
                      allocation={"devices": [gpu_store.get_node("g").record.devices[1]]})]
    result = gpu_store.commit_plan("gang", gang)
    assert not result.ok
    assert {b.job_id for b in gpu_store.bookings()} == {"holder"}
    assert not any(h.node == "c" for h in gpu_store.snapshot().holds)


def test_commits_to_unschedulable_or_unknown_nodes_conflict(gpu_store):
    placements = plan_for(gpu_store, ask(cpu_cores=1))
    gpu_store.set_node_status(placements[0].node, "maintenance", eligible=False)
    assert "not ready" in gpu_store.commit_plan("j", placements).conflict.reason
    ghost = [Placement(agent_id="a", node="ghost")]
    assert "unknown node" in gpu_store.commit_plan("k", ghost).conflict.reason


def test_devices_must_belong_to_the_node(gpu_store):
    fake = [Placement(agent_id="a", node="c", resources={"gpu_count": 0}, allocation={"devices": [{"id": "g0"}]})]
    assert "not on c" in gpu_store.commit_plan("j", fake).conflict.reason


def test_limits_are_enforced_at_commit(gpu_store):
    placements = plan_for(gpu_store, ask(cpu_cores=6))
    gpu_store.set_limits(Limits(cpu=50))
    assert gpu_store.get_limits().cpu == 50
    result = gpu_store.commit_plan("j", placements)
    assert not result.ok and "insufficient cpu" in result.conflict.reason


def test_per_node_limits_round_trip(store):
    limits = Limits(gpu=50, per_node={"g": {"cpu": 25}})
    store.set_limits(limits)
    assert store.get_limits() == limits


def test_release_frees_everything_and_is_idempotent(gpu_store):
    placements = plan_for(gpu_store, ask(cpu_cores=2.1, memory_mb=100.7, gpu=2, ports=[{"label": "a"}]))
    assert gpu_store.commit_plan("j", placements).ok
    assert gpu_store.release("j") == 1
    assert gpu_store.release("j") == 0
    assert gpu_store.bookings() == [] and gpu_store.active_jobs() == [] and gpu_store.snapshot().holds == []
    history = gpu_store.history("j")
    assert len(history) == 1 and history[0].released_at is not None and history[0].placements[0].node == "g"


def test_many_commits_and_releases_leave_no_residue(gpu_store):
    for i in range(30):
        placements = plan_for(gpu_store, ask(cpu_cores=0.1, memory_mb=33.3, disk_mb=0.7))
        assert gpu_store.commit_plan(f"j{i}", placements).ok
    for i in range(30):
        gpu_store.release(f"j{i}")
    assert gpu_store.snapshot().holds == []


def test_place_and_commit_replans_after_a_conflict(gpu_store):
    # A competitor takes g0 between our snapshot and our commit: the helper re-plans onto g1.
    stale = plan_for(gpu_store, ask(gpu=1))
    assert gpu_store.commit_plan("competitor", stale).ok
    result = place_and_commit(gpu_store, "mine", [ask(gpu=1)])
    assert result.placed and result.commit.placements[0].device_ids == ["g1"]
    result = place_and_commit(gpu_store, "third", [ask(gpu=1)])
    assert not result.placed and result.plan.status == "runnable_later"


def test_place_blueprint_books_a_whole_gang(gpu_store):
    bp = blueprint(agent("a", {"gpu": 1}), agent("b", {"cpu_cores": 3}))
    result = place_blueprint(gpu_store, "job", bp)
    assert result.placed and {p.agent_id for p in gpu_store.active_placements(job_id="job")} == {"a", "b"}


# -- leases -----------------------------------------------------------------------------------------------

def test_lease_has_one_owner_and_a_growing_epoch(store):
    first = store.acquire_lease("placer", "w1", ttl_s=30, now=100)
    assert first.epoch == 1
    assert store.acquire_lease("placer", "w2", ttl_s=30, now=110) is None
    assert store.acquire_lease("placer", "w1", ttl_s=30, now=110).epoch == 1  # re-acquire by the owner
    taken = store.acquire_lease("placer", "w2", ttl_s=30, now=200)  # expired: another owner, next epoch
    assert taken.owner == "w2" and taken.epoch == 2
    assert store.renew_lease(first, 30, now=201) is None
    assert store.renew_lease(taken, 30, now=201).expires_at == 231
    assert store.release_lease(first) is False and store.release_lease(taken) is True
    assert store.acquire_lease("placer", "w3", ttl_s=30).epoch == 3


def test_a_stale_lease_cannot_write(gpu_store):
    old = gpu_store.acquire_lease("placer", "w1", ttl_s=0.2)
    placements = plan_for(gpu_store, ask(gpu=1))
    assert gpu_store.commit_plan("j1", placements, lease=old).ok
    time.sleep(0.3)
    new = gpu_store.acquire_lease("placer", "w2", ttl_s=30)
    assert new.epoch == old.epoch + 1
    with pytest.raises(StaleLease):
        gpu_store.commit_plan("j2", plan_for(gpu_store, ask(gpu=1)), lease=old)
    with pytest.raises(StaleLease):
        gpu_store.release("j1", lease=old)
    assert gpu_store.release("j1", lease=new) == 1


# -- jobs, events, info -----------------------------------------------------------------------------------

def test_jobs_round_trip(store):
    store.put_job(JobRecord(job_id="j1", name="train", job_type="batch", spec={"a": [1, 2]}))
    store.put_job(JobRecord(job_id="j2", status="running"))
    store.put_job(JobRecord(job_id="j1", name="train", job_type="batch", status="running", spec={"a": [1, 2]}))
    assert store.get_job("j1").spec == {"a": [1, 2]} and store.get_job("j1").status == "running"
    assert [j.job_id for j in store.list_jobs(status="running")] == ["j1", "j2"]
    assert store.get_job("nope") is None


def _reservation(job_id, expires_at, status="active"):
    return JobRecord(job_id=job_id, job_type="reservation", status=status, spec={"expires_at": expires_at})


def test_reservations_due_reads_the_active_reservations_whose_time_is_up(store):
    store.put_job(_reservation("r-due", 100.0))
    store.put_job(_reservation("r-at", 150.0))  # exactly now: due
    store.put_job(_reservation("r-later", 400.5))
    store.put_job(_reservation("r-soon", 200.25))
    store.put_job(_reservation("r-ended", 50.0, status="released"))
    store.put_job(JobRecord(job_id="j-batch", job_type="batch", status="active", spec={"expires_at": 10.0}))
    due, earliest = store.reservations_due(150.0)
    assert sorted(r.job_id for r in due) == ["r-at", "r-due"] and earliest == 200.25
    assert due[0].spec["expires_at"] == 100.0
    store.put_job(_reservation("r-due", 100.0, status="expired"))  # ended: out of the index
    store.put_job(_reservation("r-soon", 900.0))  # extended: its new expiry counts
    due, earliest = store.reservations_due(150.0)
    assert [r.job_id for r in due] == ["r-at"] and earliest == 400.5
    assert store.reservations_due(1000.0)[1] == float("inf")


def test_a_deleted_record_is_gone_and_out_of_the_expiry_index(store):
    store.put_job(_reservation("r-gone", 100.0))
    store.put_job(_reservation("r-kept", 120.0))
    assert store.delete_job("r-gone") and not store.delete_job("r-gone") and not store.delete_job("nope")
    assert store.get_job("r-gone") is None and [j.job_id for j in store.list_jobs()] == ["r-kept"]
    assert [r.job_id for r in store.reservations_due(150.0)[0]] == ["r-kept"]


def test_reservations_due_returns_a_bounded_batch_and_says_more_may_be_due(store, monkeypatch):
    import mn_prefect.store.redis_store as redis_store
    import mn_prefect.store.sql as sql

    for module in (redis_store, sql):
        monkeypatch.setattr(module, "DUE_AT_ONCE", 2)
    for i in range(3):
        store.put_job(_reservation(f"r{i}", 10.0 + i))
    due, earliest = store.reservations_due(50.0)
    assert [r.job_id for r in due] == ["r0", "r1"] and earliest == 50.0  # ask again: one more is due
    store.put_job(_reservation("r0", 10.0, status="expired"))
    store.put_job(_reservation("r1", 11.0, status="expired"))
    due, earliest = store.reservations_due(50.0)
    assert [r.job_id for r in due] == ["r2"] and earliest == float("inf")


def test_events_are_recorded_in_order_and_filterable(store):
    for i in range(5):
        store.record_event(Event(kind="mn.node.state", node=f"n{i % 2}", job_id="j", reason=f"r{i}", data={"i": i}))
    assert [e.reason for e in store.events(node="n0")] == ["r0", "r2", "r4"]
    assert [e.data["i"] for e in store.events(limit=2)] == [3, 4]


def test_check_reports_backend_version_and_counts(gpu_store, backend):
    info = gpu_store.check()
    assert info.reachable and info.version and info.counts["nodes"] == 2
    assert info.backend.startswith(backend if backend != "postgresql" else "postgresql")


# -- partial release (one node's share of a booking) ---------------------------------------------------------

def _two_node_booking(store, job_id="spread"):
    from mn_prefect.model.placement import Allocation, PlacedResources, PortAllocation

    g0 = store.get_node("g").record.devices[0]
    on_g = Placement(agent_id="a", node="g", job_id=job_id, resources=PlacedResources(cpu_cores=2, memory_mb=1024, gpu_count=1),
                     allocation=Allocation(devices=(g0,), ports=(PortAllocation(label="api", port=8080),)))
    on_c = Placement(agent_id="b", node="c", job_id=job_id, resources=PlacedResources(cpu_cores=1, memory_mb=512),
                     allocation=Allocation(ports=(PortAllocation(label="api", port=8080),)))
    assert store.commit_plan(job_id, [on_g, on_c]).ok
    return on_g, on_c


def _used(store, name):
    return {p.node: p for p in store.snapshot().holds}.get(name)


def test_releasing_one_node_frees_exactly_that_nodes_share(gpu_store):
    on_g, on_c = _two_node_booking(gpu_store)
    assert gpu_store.release("spread", node="c") == 1
    assert [p.agent_id for p in gpu_store.active_placements(job_id="spread")] == ["a"]
    assert "spread" in gpu_store.active_jobs()
    held = {(b.node, b.kind, b.key) for b in gpu_store.bookings()}
    assert ("g", "device", "g0") in held and not any(node == "c" for node, _, _ in held)
    assert _used(gpu_store, "c") is None or _used(gpu_store, "c").resources.cpu_cores == 0
    assert _used(gpu_store, "g").resources.cpu_cores == 2
    # The freed port on c can be booked by another job; g's device and port are still held.
    again = on_c.model_copy(update={"job_id": "other"})
    assert gpu_store.commit_plan("other", [again]).ok
    assert not gpu_store.commit_plan("thief", [on_g.model_copy(update={"job_id": "thief"})]).ok


def test_releasing_the_last_node_removes_the_booking_entirely(gpu_store):
    _two_node_booking(gpu_store)
    assert gpu_store.release("spread", node="c") == 1
    assert gpu_store.release("spread", node="g") == 1
    assert "spread" not in gpu_store.active_jobs() and gpu_store.active_placements(job_id="spread") == []
    assert gpu_store.bookings() == []
    assert gpu_store.history("spread")[-1].released_at is not None


def test_releasing_a_node_the_job_does_not_use_changes_nothing(gpu_store):
    _two_node_booking(gpu_store)
    before = (gpu_store.active_placements(job_id="spread"), sorted(b.key for b in gpu_store.bookings()))
    assert gpu_store.release("spread", node="elsewhere") == 0
    assert gpu_store.release("no-such-job", node="g") == 0
    assert (gpu_store.active_placements(job_id="spread"), sorted(b.key for b in gpu_store.bookings())) == before


def test_a_partial_release_with_a_stale_lease_is_refused_and_changes_nothing(gpu_store):
    _two_node_booking(gpu_store)
    old = gpu_store.acquire_lease("mn-reconciler", "a", 0.2)
    time.sleep(0.3)
    assert gpu_store.acquire_lease("mn-reconciler", "b", 30) is not None
    before = (gpu_store.active_placements(job_id="spread"), gpu_store.bookings(), gpu_store.snapshot().holds)
    with pytest.raises(StaleLease):
        gpu_store.release("spread", node="c", lease=old)
    assert (gpu_store.active_placements(job_id="spread"), gpu_store.bookings(), gpu_store.snapshot().holds) == before


def test_a_stale_lease_is_refused_even_where_the_job_holds_nothing(gpu_store):
    _two_node_booking(gpu_store)
    old = gpu_store.acquire_lease("mn-reconciler", "a", 0.2)
    time.sleep(0.3)
    assert gpu_store.acquire_lease("mn-reconciler", "b", 30) is not None
    with pytest.raises(StaleLease):  # as a full release of a job that holds nothing
        gpu_store.release("spread", node="elsewhere", lease=old)


def test_the_audit_finds_the_store_sound_after_partial_releases(gpu_store):
    from mn_prefect.store.audit import audit

    _two_node_booking(gpu_store)
    gpu_store.release("spread", node="g")
    assert audit(gpu_store.consistent_view()) == []
    gpu_store.release("spread", node="c")
    assert audit(gpu_store.consistent_view()) == []


def test_random_partial_and_full_releases_match_a_model_and_keep_the_store_sound(gpu_store):
    import random

    from mn_prefect.model.placement import Allocation, PlacedResources, PortAllocation
    from mn_prefect.store.audit import audit

    gpu_store.register_node(node("d", cpu=4, memory=8192))
    rng = random.Random(20261122)
    booked: dict[str, set[str]] = {}
    for i in range(6):
        nodes = rng.sample(["c", "d", "g"], rng.randint(1, 3))
        plan = [Placement(agent_id=f"a{k}", node=n, resources=PlacedResources(cpu_cores=0.25 * (i + 1), memory_mb=100 + i),
                          allocation=Allocation(ports=(PortAllocation(label="p", port=9000 + i),)))
                for k, n in enumerate(nodes)]
        assert gpu_store.commit_plan(f"j{i}", plan).ok
        booked[f"j{i}"] = set(nodes)
    while booked:
        job, where = rng.choice(sorted(booked)), rng.choice(["c", "d", "g", None])
        expected = len(booked[job]) if where is None else int(where in booked[job])
        assert gpu_store.release(job, node=where) == expected, (job, where)
        booked[job] -= set(booked[job]) if where is None else {where}
        if not booked[job]:
            del booked[job]
            assert gpu_store.history(job)[-1].released_at is not None
        assert sorted(gpu_store.active_jobs()) == sorted(booked)
        assert {j: {p.node for p in gpu_store.active_placements(job_id=j)} for j in booked} == booked
        assert audit(gpu_store.consistent_view()) == []
    assert gpu_store.snapshot().holds == [] and gpu_store.bookings() == []
