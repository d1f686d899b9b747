"""``store.repair_derived``: the usage counters and held claims made to agree with the live bookings, on every
backend. Each test books through real commits, corrupts the derived state directly (raw SQL, raw Redis
commands), and checks that the audit reports it, a dry run lists the fix and changes nothing, the repair fixes
it (the audit is then clean) and a second repair finds nothing to do."""

from __future__ import annotations

import json

import pytest
from builders import gpu, node
from sqlalchemy import text

from mn_prefect.model.placement import Allocation, PlacedResources, Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.placement import reservations as rsv
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store.audit import audit
from mn_prefect.store.base import CAPACITY

GPUS = {"g0", "g1", "g2"}


def ask(**resources) -> Ask:
    return Ask(agent_id="a", request=resource_request(resources))


@pytest.fixture
def booked(store):
    """Three GPUs on g, one held whole with a port (job-1), one shared (job-2), one free; a job on c (job-3)."""
    store.register_node(node("g", cpu=8, memory=16384, devices=[gpu(g, i) for i, g in enumerate(sorted(GPUS))]))
    store.register_node(node("c", cpu=4, memory=8192))
    assert place_and_commit(store, "job-1", [ask(cpu_cores=2, gpu=1, ports=[{"label": "api", "port": 8080}])]).placed
    fraction = {"devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": 4000}], "cpu_cores": 1}
    assert place_and_commit(store, "job-2", [Ask(agent_id="f", request=resource_request(fraction))]).placed
    assert place_and_commit(store, "job-3", [ask(cpu_cores=3, memory_mb=1000)]).placed
    assert {p.job_id: p.node for p in store.active_placements()} == {"job-1": "g", "job-2": "g", "job-3": "c"}
    assert audit(store.consistent_view()) == [] and store.repair_derived() == []
    return store


def whole(store, job="job-1") -> str:
    return store.active_placements(job_id=job)[0].device_ids[0]


def shared(store) -> str:
    return store.active_placements(job_id="job-2")[0].allocation.shares[0].id


def free(store) -> str:
    (gpu_id,) = GPUS - {whole(store), shared(store)}
    return gpu_id


# -- raw corruption, per backend ----------------------------------------------------------------------------

def _sql(store, statement: str, **params) -> None:
    with store.tx() as conn:
        conn.execute(text(statement), params)


def set_counter(store, name: str, dim: str, value: float) -> None:
    if store.backend == "redis":
        store.client.hset(f"{store.prefix}usage:{name}", dim, repr(float(value)))
        return
    with store.tx() as conn:
        used = json.loads(conn.execute(text("SELECT used FROM mn_nodes WHERE name = :n"), {"n": name}).scalar())
        conn.execute(text("UPDATE mn_nodes SET used = :u WHERE name = :n"),
                     {"u": json.dumps({**used, dim: value}), "n": name})


def hold(store, kind: str, name: str, key: str, job: str) -> None:
    """Make ``job`` the holder of the key (a new claim, or another holder for one that is held)."""
    if store.backend == "redis":
        store.client.hset(f"{store.prefix}held_{kind}s:{name}", key, job)
        return
    _sql(store, "DELETE FROM mn_held WHERE node = :n AND kind = :k AND key = :key", n=name, k=kind, key=key)
    _sql(store, "INSERT INTO mn_held (node, kind, key, job_id) VALUES (:n, :k, :key, :j)", n=name, k=kind, key=key,
         j=job)


def unhold(store, kind: str, name: str, key: str) -> None:
    if store.backend == "redis":
        store.client.hdel(f"{store.prefix}held_{kind}s:{name}", key)
    else:
        _sql(store, "DELETE FROM mn_held WHERE node = :n AND kind = :k AND key = :key", n=name, k=kind, key=key)


def lose_booking(store, job: str) -> None:
    """The booking alone gone, as from a release that died after dropping it: its claims and counters stay."""
    if store.backend == "redis":
        store.client.delete(f"{store.prefix}booking:{job}")
        store.client.srem(f"{store.prefix}active", job)
    else:
        _sql(store, "DELETE FROM mn_bookings WHERE job_id = :j", j=job)


# -- checks -------------------------------------------------------------------------------------------------

def state(store) -> dict:
    view = store.consistent_view()
    return {**view, "held": sorted(view["held"])}


def counter(store, name: str, dim: str) -> float:
    return store.consistent_view()["nodes"][name].get(dim, 0.0)


def repairs(store, problems: list[str], lines: list[str]) -> None:
    """The audit finds ``problems`` (among others); a dry run lists ``lines`` and writes nothing; the repair makes
    exactly those fixes, never touches a booking, and leaves a sound store that needs no second repair."""
    before = state(store)
    found = audit(store.consistent_view())
    for problem in problems:
        assert problem in found, found
    assert sorted(store.repair_derived(dry_run=True)) == sorted(lines)
    assert state(store) == before and audit(store.consistent_view()) == found
    assert sorted(store.repair_derived()) == sorted(lines)
    assert audit(store.consistent_view()) == []
    assert store.repair_derived() == [] and store.repair_derived(dry_run=True) == []
    assert state(store)["bookings"] == before["bookings"]


# -- tests --------------------------------------------------------------------------------------------------

def test_a_clean_store_needs_no_repair_and_writes_nothing(booked):
    before = state(booked)
    watcher = booked.changes()
    try:
        watcher.wait(0.3)  # whatever the watcher reports on connecting
        assert booked.repair_derived(dry_run=True) == [] and booked.repair_derived() == []
        assert CAPACITY not in watcher.wait(0.6)  # nothing written, so nothing announced
    finally:
        watcher.close()
    assert state(booked) == before


def test_an_empty_store_and_one_after_partial_and_full_releases_need_no_repair(store):
    assert store.repair_derived() == []
    store.register_node(node("a", cpu=4))
    store.register_node(node("b", cpu=4))
    spread = [Placement(agent_id=f"x{n}", node=n, resources=PlacedResources(cpu_cores=1.25)) for n in "ab"]
    assert store.commit_plan("spread", spread).ok
    assert store.release("spread", node="a") == 1
    assert store.repair_derived() == [] and audit(store.consistent_view()) == []
    assert store.release("spread") == 1
    assert store.repair_derived() == [] and audit(store.consistent_view()) == []


def test_claims_whose_holder_has_no_live_booking_are_removed(booked):
    spare = free(booked)
    hold(booked, "device", "g", spare, "run-x")
    hold(booked, "port", "c", "tcp:9000", "run-y")
    repairs(booked, [f"device g/{spare} held by run-x, which has no live booking",
                     "port c/tcp:9000 held by run-y, which has no live booking"],
            [f"removed the claim on device g/{spare} held by run-x, which has no live booking",
             "removed the claim on port c/tcp:9000 held by run-y, which has no live booking"])
    assert {(b.node, b.key) for b in booked.bookings()} == {("g", whole(booked)), ("g", "tcp:8080")}


def test_drifted_usage_counters_are_set_to_what_the_bookings_hold(booked):
    clean = booked.consistent_view()["nodes"]
    gpu_id = shared(booked)
    cpu, mem = clean["g"]["cpu"], clean["c"]["mem"]
    set_counter(booked, "g", "cpu", 99)
    set_counter(booked, "c", "mem", 0)
    set_counter(booked, "g", f"share:{gpu_id}", 0)
    set_counter(booked, "g", f"gmem:{gpu_id}", 123)
    set_counter(booked, "c", "gpu", 2)
    repairs(booked, [f"node g usage counter cpu=99 but bookings sum to {cpu:g}",
                     f"node c usage counter mem=0 but bookings sum to {mem:g}",
                     f"node g counter share:{gpu_id}=0 but bookings sum to 0.5",
                     f"node g counter gmem:{gpu_id}=123 but bookings sum to 4000",
                     "node c usage counter gpu=2 but bookings sum to 0"],
            [f"set node g's cpu usage from 99 to {cpu:g} (what its bookings hold)",
             f"set node c's mem usage from 0 to {mem:g} (what its bookings hold)",
             f"set node g's share:{gpu_id} usage from 0 to 0.5 (what its bookings hold)",
             f"set node g's gmem:{gpu_id} usage from 123 to 4000 (what its bookings hold)",
             "set node c's gpu usage from 2 to 0 (what its bookings hold)"])
    assert booked.consistent_view()["nodes"] == clean


def test_a_claim_a_live_booking_lost_is_restored(booked):
    unhold(booked, "port", "g", "tcp:8080")
    repairs(booked, ["port g/tcp:8080 booked by job-1 but held by None"],
            ["restored the claim on port g/tcp:8080 for job-1, whose booking claims it"])
    assert ("g", "port", "tcp:8080", "job-1") in {(b.node, b.kind, b.key, b.job_id) for b in booked.bookings()}


def test_a_claim_held_by_a_live_job_that_does_not_book_it_goes_to_the_job_that_does(booked):
    hold(booked, "port", "g", "tcp:8080", "job-3")
    repairs(booked, ["port g/tcp:8080 booked by job-1 but held by ['job-3']"],
            ["removed the claim on port g/tcp:8080 held by job-3, whose booking does not claim it",
             "restored the claim on port g/tcp:8080 for job-1, whose booking claims it"])


def test_what_a_booking_lost_mid_release_left_behind_is_freed(booked):
    gpu_id = whole(booked)  # job-1: 2 cores and a whole GPU on g (job-2 keeps 1 core and half of another)
    assert (counter(booked, "g", "cpu"), counter(booked, "g", "gpu")) == (3, 1)
    lose_booking(booked, "job-1")
    repairs(booked, [f"device g/{gpu_id} held by job-1, which has no live booking",
                     "port g/tcp:8080 held by job-1, which has no live booking",
                     "node g usage counter cpu=3 but bookings sum to 1",
                     "node g usage counter gpu=1 but bookings sum to 0",
                     f"node g counter share:{gpu_id}=1 but bookings sum to 0"],
            [f"removed the claim on device g/{gpu_id} held by job-1, which has no live booking",
             "removed the claim on port g/tcp:8080 held by job-1, which has no live booking",
             "set node g's cpu usage from 3 to 1 (what its bookings hold)",
             "set node g's gpu usage from 1 to 0 (what its bookings hold)",
             f"set node g's share:{gpu_id} usage from 1 to 0 (what its bookings hold)"])
    # The GPU, the port and the cores are free again: the same run can be placed and committed anew.
    again = place_and_commit(booked, "job-1b", [ask(cpu_cores=2, gpu=1, ports=[{"label": "api", "port": 8080}])])
    assert again.placed and again.plan.placements[0].device_ids == [gpu_id]
    assert audit(booked.consistent_view()) == []


def test_a_double_booking_is_left_for_an_operator(booked):
    gpu_id = whole(booked)
    device = next(d for d in booked.get_node("g").record.devices if d.id == gpu_id)
    # The claim and the GPU's share counter lost: a commit of the same GPU for another job goes through.
    unhold(booked, "device", "g", gpu_id)
    set_counter(booked, "g", f"share:{gpu_id}", 0)
    thief = Placement(agent_id="t", node="g", resources=PlacedResources(gpu_count=1), allocation=Allocation(devices=(device,)))
    assert booked.commit_plan("job-x", [thief]).ok
    problems = audit(booked.consistent_view())
    assert f"device g/{gpu_id} held by 2 placements: ['job-1', 'job-x']" in problems
    bookings, held = state(booked)["bookings"], state(booked)["held"]
    operator = (f"device g/{gpu_id} is claimed by 2 live bookings (job-1, job-x) and held by job-x: a double booking, "
                f"left for an operator (no automatic fix)")
    dry = booked.repair_derived(dry_run=True)
    assert operator in dry
    assert booked.repair_derived() == dry
    assert booked.repair_derived() == [operator]  # never fixed silently: it is reported every time
    after = state(booked)
    assert after["bookings"] == bookings and after["held"] == held
    assert f"device g/{gpu_id} held by 2 placements: ['job-1', 'job-x']" in audit(booked.consistent_view())


def test_counters_and_claims_inside_a_reservation_are_repaired(booked):
    out = rsv.reserve(booked, resource_request({"cpu": 2, "memory_mb": 2048}), {"cpu": 2}, 3600)
    rid = out.record.job_id
    where = out.record.nodes[0]
    assert rsv.place_inside(booked, "inside", [ask(cpu_cores=1, memory_mb=512)], rid, None).placed
    assert audit(booked.consistent_view()) == [] and booked.repair_derived() == []
    set_counter(booked, where, f"rsv:{rid}:cpu", 2)
    unhold(booked, "reservation", where, rid)
    hold(booked, "reservation", where, "rsv-gone", "rsv-gone")
    repairs(booked, [f"node {where} counter rsv:{rid}:cpu=2 but bookings sum to 1",
                     f"reservation {where}/rsv-gone held by rsv-gone, which has no live booking"],
            [f"set node {where}'s rsv:{rid}:cpu usage from 2 to 1 (what its bookings hold)",
             f"restored the claim on reservation {where}/{rid} for {rid}, whose booking claims it",
             f"removed the claim on reservation {where}/rsv-gone held by rsv-gone, which has no live booking"])
    # The repaired reservation still takes runs, counted in its own space.
    assert rsv.place_inside(booked, "inside-2", [ask(cpu_cores=1)], rid, None).placed
    assert counter(booked, where, f"rsv:{rid}:cpu") == 2 and audit(booked.consistent_view()) == []


def test_a_commit_after_a_repair_is_booked_and_counted_right(booked):
    spare = free(booked)
    cpu = counter(booked, "g", "cpu")
    hold(booked, "device", "g", spare, "run-x")
    set_counter(booked, "g", "cpu", 8)
    assert not place_and_commit(booked, "job-4", [ask(cpu_cores=1, gpu=1)], retries=1).placed  # the corruption blocks it
    assert len(booked.repair_derived()) == 2
    result = place_and_commit(booked, "job-4", [ask(cpu_cores=1, gpu=1)])
    assert result.placed and result.plan.placements[0].device_ids == [spare]
    assert counter(booked, "g", "cpu") == cpu + 1 and counter(booked, "g", "gpu") == 2
    assert audit(booked.consistent_view()) == [] and booked.repair_derived() == []
    assert booked.release("job-4") == 1
    assert counter(booked, "g", "cpu") == cpu and audit(booked.consistent_view()) == []


def test_a_repair_beside_running_commits_and_releases_sees_one_moment_and_finds_nothing(store):
    import threading

    from mn_prefect.model.placement import PortAllocation
    from mn_prefect.store import open_store

    for name in ("a", "b"):
        store.register_node(node(name, cpu=64, memory=65536))
    other = open_store(store.url.raw)
    stop, errors = threading.Event(), []

    def churn() -> None:
        try:
            i = 0
            while not stop.is_set():
                plan = [Placement(agent_id=f"x{n}", node=n, resources=PlacedResources(cpu_cores=0.25, memory_mb=10),
                                  allocation=Allocation(ports=(PortAllocation(label="p", port=9000 + i % 20),)))
                        for n in ("a", "b")]
                assert other.commit_plan(f"j{i}", plan).ok
                if i >= 5:
                    other.release(f"j{i - 5}", node="a" if i % 2 else None)
                    if i % 2:
                        other.release(f"j{i - 5}")
                i += 1
        except Exception as error:  # reported by the main thread
            errors.append(error)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(25):
            assert store.repair_derived() == []
            assert store.repair_derived(dry_run=True) == []
    finally:
        stop.set()
        worker.join()
        other.close()
    assert not errors and audit(store.consistent_view()) == []


def test_a_commit_racing_a_repair_is_never_lost_or_miscounted(booked, monkeypatch):
    """A commit made while the repair has read and not yet written: the SQL backends hold it off (SQLite's
    write transaction, PostgreSQL's node row locks) until the repair is done; Redis lets it in and the repair,
    finding the state changed, writes nothing and reads again. Either way both land, counted right."""
    import threading

    import mn_prefect.store.redis_store as redis_store
    import mn_prefect.store.sql as sql
    from mn_prefect.store import open_store
    from mn_prefect.store.repair import plan_repair

    other = open_store(booked.url.raw)
    spare, cpu = free(booked), counter(booked, "g", "cpu")
    hold(booked, "device", "g", spare, "run-x")
    set_counter(booked, "g", "cpu", 7)
    plans, results = [], []

    def racing(used, bookings, held):
        plans.append(sorted(bookings))
        if len(plans) == 1:  # after the first read: a commit of the spare GPU's neighbour resources
            place = Placement(agent_id="r", node="g", resources=PlacedResources(cpu_cores=1))
            racer = threading.Thread(target=lambda: results.append(other.commit_plan("racer", [place])))
            racer.start()
            racer.join(0.5 if booked.backend != "redis" else 10)
            assert racer.is_alive() == (booked.backend != "redis")  # SQL: held off by the repair's transaction
            plans.append(racer)
        return plan_repair(used, bookings, held)

    monkeypatch.setattr(sql, "plan_repair", racing)
    monkeypatch.setattr(redis_store, "plan_repair", racing)
    try:
        lines = booked.repair_derived()
        plans[1].join(30)
    finally:
        other.close()
    assert results and results[0].ok
    assert f"removed the claim on device g/{spare} held by run-x, which has no live booking" in lines
    if booked.backend == "redis":  # read again after the racer: the repair counted it
        assert plans[2] == ["job-1", "job-2", "job-3", "racer"]
        assert f"set node g's cpu usage from 8 to {cpu + 1:g} (what its bookings hold)" in lines
    else:  # the racer committed after the repair, on the repaired counters
        assert f"set node g's cpu usage from 7 to {cpu:g} (what its bookings hold)" in lines
    assert counter(booked, "g", "cpu") == cpu + 1
    assert audit(booked.consistent_view()) == [] and booked.repair_derived() == []
