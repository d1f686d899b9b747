"""Reservations with expiry (docs/operating.md) through the ``reserve`` command and the store, on every backend:
what a reservation holds, runs placed inside it, expiry that never blocks a commit, bad input, and refusals
(racing ones too) and errors that leave nothing in the store."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cli_runner
import pytest
from builders import gpu, node
from stores import store_url

from mn_prefect.model.placement import Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.placement import reservations as rsv
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.store import open_store
from mn_prefect.store.audit import audit
from mn_prefect.store.records import ReservationRecord, get_record

MN = str(Path(sys.executable).parent / "mn-prefect")


def mn(url: str, *args: str) -> subprocess.CompletedProcess:
    return cli_runner.run(["reserve", *args, "--store-url", url], env={"PREFECT_API_URL": ""})


def reserve_json(url: str, *args: str) -> tuple[int, dict]:
    result = mn(url, *args, "--json")
    return result.returncode, json.loads(result.stdout)


def ask(raw: dict) -> Ask:
    return Ask(agent_id="a", request=resource_request(raw))


@pytest.fixture
def url(backend, request, tmp_path) -> str:
    url = store_url(backend, request, tmp_path)
    store = open_store(url)
    store.register_node(node("g1", cpu=8, memory=16384, devices=[gpu("GPU-0", 0), gpu("GPU-1", 1)]))
    store.register_node(node("c1", cpu=4, memory=8192))
    return url


def test_a_reservation_holds_its_capacity_against_other_runs_until_released(url):
    code, out = reserve_json(url, "--resources", '{"cpu": 6, "gpu": 2}', "--for", "2h", "--name", "train")
    assert code == 0 and out["booked"] and out["reservation"]["nodes"] == ["g1"]
    rid = out["reservation"]["id"]
    assert 7100 < out["reservation"]["seconds_left"] <= 7200
    store = open_store(url)
    # Another run cannot take what it holds: two GPUs, six of g1's eight cores.
    assert not place_and_commit(store, "other", [ask({"gpu": 1})]).placed
    elsewhere = place_and_commit(store, "big", [ask({"cpu": 3})])
    assert elsewhere.placed and elsewhere.plan.placements[0].node == "c1"  # g1 has two cores left, c1 four
    # --check says where it would go and books nothing; exit 2 runnable later, 3 never.
    code, check = reserve_json(url, "--resources", '{"gpu": 1}', "--for", "1h", "--check")
    assert code == 2 and not check["booked"] and check["status"] == "runnable_later"
    code, check = reserve_json(url, "--resources", '{"gpu": 3}', "--for", "1h", "--check")
    assert code == 3 and check["status"] == "not_runnable"
    code, check = reserve_json(url, "--resources", '{"cpu": 1}', "--for", "1h", "--check")
    assert code == 0 and check["status"] == "runnable_now" and check["placements"][0]["node"] in ("g1", "c1")
    code, listed = reserve_json(url, "--list")
    assert code == 0 and [r["id"] for r in listed] == [rid]
    assert mn(url, "--release", rid).returncode == 0
    assert place_and_commit(store, "after", [ask({"gpu": 2})]).placed
    code, listed = reserve_json(url, "--list", "--all")
    assert [(r["id"], r["status"]) for r in listed] == [(rid, "released")]
    assert audit(store.consistent_view()) == []


def test_runs_inside_share_the_reservation_and_never_spill_onto_the_node(url):
    store = open_store(url)
    out = rsv.reserve(store, resource_request({"cpu": 4, "memory_mb": 4096, "gpu": 1}), {"cpu": 4}, 3600, key="k")
    rid = out.record.job_id
    half = ask({"cpu": 1, "devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": 8000}]})
    first = rsv.place_inside(store, "in-1", [half], rid, "k")
    second = rsv.place_inside(store, "in-2", [half], rid, "k")
    third = rsv.place_inside(store, "in-3", [half], rid, "k")
    assert first.placed and second.placed and not third.placed  # the one reserved GPU holds two halves
    assert third.plan.status == "runnable_later" and "0 of 4 free" not in third.plan.reason  # waits for a half
    held = out.plan.placements[0].device_ids
    for result in (first, second):
        placement = result.commit.placements[0]
        assert placement.reservation == rid and placement.device_ids == held
    # Beyond what the reservation holds: refused for good, with the reservation's reason.
    too_big = rsv.place_inside(store, "in-big", [ask({"cpu": 5})], rid, "k")
    assert too_big.plan.status == "not_runnable" and "insufficient cpu" in too_big.plan.reason
    # Outside runs still see only what the reservation left: g1's other GPU and four cores.
    assert place_and_commit(store, "outside", [ask({"cpu": 4, "gpu": 1})]).placed
    assert not place_and_commit(store, "outside-2", [ask({"cpu": 1, "gpu": 1})]).placed
    assert audit(store.consistent_view()) == []


def test_a_run_never_lands_in_a_reservation_that_has_ended(url):
    """A plan made while the reservation lived is refused at commit once it was released: the commit needs
    the reservation's claim on the node, checked where the commit is applied."""
    store = open_store(url)
    rid = rsv.reserve(store, resource_request({"cpu": 2}), {"cpu": 2}, 3600).record.job_id
    plan = plan_asks([ask({"cpu": 1})], [], view=rsv.inside_view(store, rid))  # what a run would commit
    assert plan.status == "runnable_now"
    placements = [p.model_copy(update={"reservation": rid}) for p in plan.placements]
    rsv.release(store, rid, None)
    result = store.commit_plan("late", placements)
    assert not result.ok and "reservation ended" in result.conflict.reason
    assert store.active_placements(job_id="late") == []


def test_an_expired_reservation_never_blocks_a_commit(url):
    store = open_store(url)
    now = time.time()
    rid = rsv.reserve(store, resource_request({"gpu": 2}), {"gpu": 2}, 1.0, now=now).record.job_id
    # Planned against g1 before the reservation existed, committed after it expired: no one ended it yet,
    # the commit ends it and lands.
    plan = [Placement(agent_id="a", node="g1", job_id="late",
                      allocation={"devices": [gpu("GPU-0", 0), gpu("GPU-1", 1)]}, resources={"gpu_count": 2})]
    assert not store.commit_plan("early", plan).ok  # while it lasts, its GPUs are held
    time.sleep(max(0.0, now + 1.05 - time.time()))
    assert store.commit_plan("late", plan).ok
    record = get_record(store, rid, ReservationRecord)
    assert record.status == "expired" and record.ended_at is not None
    assert [e.kind for e in store.events(job_id=rid)][-1] == "reservation.expired"
    assert audit(store.consistent_view()) == []


def test_extend_moves_the_expiry_and_for_zero_ends_it(url):
    store = open_store(url)
    code, out = reserve_json(url, "--resources", '{"cpu": 1}', "--for", "1m", "--key", "s3cret")
    rid = out["reservation"]["id"]
    code, moved = reserve_json(url, "--extend", rid, "--for", "3h", "--key", "s3cret")
    assert code == 0 and 3 * 3600 - 60 < moved["seconds_left"] <= 3 * 3600
    assert get_record(store, rid, ReservationRecord).expires_at > time.time() + 3 * 3600 - 60
    code, ended = reserve_json(url, "--extend", rid, "--for", "0", "--key", "s3cret")
    assert code == 0 and ended["status"] == "released" and store.active_placements(job_id=rid) == []


def test_bad_input_names_the_field_and_books_nothing(url):
    store = open_store(url)
    rid = rsv.reserve(store, resource_request({"cpu": 1}), {"cpu": 1}, 3600, key="right").record.job_id
    before = store.active_jobs()
    cases = [
        (["--resources", '{"cpu": 1}', "--for", "soon"], "--for", "not a duration"),
        (["--resources", '{"cpu": -1}', "--for", "1h"], "--resources", ""),
        (["--resources", '{"devices": [{"kind": "gpu", "shares": 0.5}]}', "--for", "1h"], "shares", "whole GPUs"),
        (["--resources", '{"cpu": 1}', "--for", "1h", "--group", "nope"], "--group", ""),
        (["--release", "rsv-0000000000"], "--release", "no reservation"),
        (["--release", "bogus"], "--release", "not a reservation id"),
        (["--release", rid, "--key", "wrong"], "--key", "does not match"),
        (["--extend", rid, "--for", "1h"], "--key", "has a key"),
    ]
    for args, field, words in cases:
        result = mn(url, *args)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert field in result.stderr and words in result.stderr, (args, result.stderr)
    assert store.active_jobs() == before
    # Usage errors exit 2 like every command's.
    assert mn(url, "--for", "1h").returncode == 2
    assert mn(url, "--list", "--release", rid).returncode == 2
    with pytest.raises(rsv.ReservationError) as error:
        rsv.place_inside(store, "x", [ask({"cpu": 1})], rid, "wrong")
    assert error.value.field == "job_variables.reservation_key"
    assert store.active_placements(job_id="x") == []


def test_a_refused_reserve_keeps_nothing_and_exits_with_its_reason(url):
    store = open_store(url)
    rid = rsv.reserve(store, resource_request({"cpu": 6}), {"cpu": 6}, 3600).record.job_id
    before = [j.job_id for j in store.list_jobs()]
    code, out = reserve_json(url, "--resources", '{"cpu": 6}', "--for", "1h")
    assert code == 2 and not out["booked"] and out["status"] == "runnable_later" and out["reason"]
    code, out = reserve_json(url, "--resources", '{"cpu": 64}', "--for", "1h")
    assert code == 3 and not out["booked"] and out["reason"]
    assert [j.job_id for j in store.list_jobs()] == before == [rid] and store.active_jobs() == [rid]


RACERS = 8


def test_of_reserves_racing_for_capacity_only_one_can_get_one_stands_and_the_losers_leave_nothing(url):
    """Each racer has its own store and a view read before any commit, so the losers plan on it, write their
    record and lose at the commit: each takes its record back."""
    stores = [open_store(url) for _ in range(RACERS)]
    for store in stores:
        rsv._placer(store, None)[0].refresh()
    start = threading.Barrier(RACERS)

    def race(store) -> rsv.Reserved:
        start.wait(60)
        return rsv.reserve(store, resource_request({"cpu": 6}), {"cpu": 6}, 3600)  # only g1, once

    with ThreadPoolExecutor(RACERS) as pool:
        results = list(pool.map(race, stores))
    won = [r.record.job_id for r in results if r.record is not None]
    assert len(won) == 1
    assert all(r.plan.status == "runnable_later" and r.plan.reason for r in results if r.record is None)
    store = stores[0]
    assert [(j.job_id, j.status) for j in store.list_jobs()] == [(won[0], "active")]  # no other record of any kind
    assert store.active_jobs() == won and [r.job_id for r in rsv.listing(store, every=True)] == won
    assert audit(store.consistent_view()) == []
    for racer in stores:
        racer.close()


def test_an_error_after_the_booking_takes_back_the_booking_and_the_record(url, monkeypatch):
    from mn_prefect.cli.reserve import reserve as reserve_command

    store = open_store(url)

    def lost(*_args, **_kwargs):
        raise rsv.ReservationError("--resources", "lost in a store failover and taken meanwhile: nothing is reserved")

    with monkeypatch.context() as patch:  # the replica check fails after the commit
        patch.setattr(rsv, "_durable", lost)
        with pytest.raises(rsv.ReservationError):
            rsv.reserve(store, resource_request({"cpu": 6}), {"cpu": 6}, 3600)
    assert store.active_jobs() == [] and store.list_jobs() == []

    def broken_pipe(*_args, **_kwargs):
        raise BrokenPipeError("stdout closed")

    monkeypatch.setattr("mn_prefect.cli.reserve._show_plan", broken_pipe)  # the output cannot be given
    with pytest.raises(BrokenPipeError):
        reserve_command(resources='{"cpu": 6}', duration="1h", store_url=url, as_json=True)
    assert store.active_jobs() == [] and store.list_jobs() == []
    assert place_and_commit(store, "after", [ask({"cpu": 8})]).placed  # all of g1 is free again
