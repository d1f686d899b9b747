"""Holds in the store's one commit rule, on SQLite, Redis and PostgreSQL (real servers): a hold books capacity past
what is free, every other commit sees it booked, and only a placement over the hold (the held run, a backfill) may
take it, and only while the hold stands."""

import pytest
from builders import gpu, node

from mn_prefect.model.placement import PlacedResources, Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.holding import holds_of, place_over, read_holds
from mn_prefect.placement.placing import Placer
from mn_prefect.scheduler import Ask
from mn_prefect.store.audit import audit


def ask(name="w", **resources):
    return Ask(agent_id=name, request=resource_request(resources))


@pytest.fixture
def busy(store):
    """Node g: 2 GPUs, 8 cores, each GPU taken by a 1-GPU run; node c: CPUs only."""
    store.register_node(node("g", cpu=8, memory=16384, devices=[gpu("g0", 0), gpu("g1", 1)]))
    store.register_node(node("c", cpu=4, memory=8192))
    placer = Placer(store)
    for run in ("r0", "r1"):
        assert placer.place(run, [ask(run, gpu=1, cpu=1)]).placed
    return store


def hold(hold_id="hold-0000000a", gpus=2, cpu=2.0, on="g", run="wide", start=1000.0):
    return Placement(agent_id="hold:wide", node=on, job_id=hold_id, hold=hold_id, hold_for=run, hold_start=start,
                     resources=PlacedResources(cpu_cores=cpu, gpu_count=gpus))


def test_a_hold_books_past_what_is_free_and_keeps_freed_gpus_off_other_commits(busy):
    assert busy.commit_plan("hold-0000000a", [hold()]).ok
    busy.release("r0")
    refused = Placer(busy).place("narrow", [ask("narrow", gpu=1, cpu=1)])
    assert not refused.placed and refused.plan.status == "runnable_later"
    assert {p.job_id for p in busy.active_placements(node="g")} == {"hold-0000000a", "r1"}
    assert audit(busy.consistent_view()) == []


def test_cpu_beyond_what_the_hold_books_stays_usable(busy):
    assert busy.commit_plan("hold-0000000a", [hold(cpu=2.0)]).ok
    # 8 cores: 2 runs take 1 each, the hold 2: 4 are free for work that asks no GPU
    assert Placer(busy).place("cpu-job", [ask("cpu-job", cpu=4)]).placed


def test_a_backfill_over_the_hold_takes_its_capacity_and_the_held_run_lands_once_covered(busy):
    assert busy.commit_plan("hold-0000000a", [hold()]).ok
    busy.release("r0")
    standing = read_holds(busy)["wide"]
    placer = Placer(busy)
    backfill = place_over(placer, "short", [ask("short", gpu=1, cpu=1)], standing, ends_by=900.0)
    assert backfill.placed and backfill.commit.placements[0].over_hold == "hold-0000000a"
    assert not place_over(placer, "wide", [ask("wide", gpu=2, cpu=2)], standing).placed  # r1 and short still run
    busy.release("short")
    busy.release("r1")
    landed = place_over(placer, "wide", [ask("wide", gpu=2, cpu=2)], standing)
    assert landed.placed and sorted(landed.commit.placements[0].device_ids) == ["g0", "g1"]
    assert audit(busy.consistent_view()) == []


def test_nothing_lands_over_a_hold_that_has_ended(busy):
    assert busy.commit_plan("hold-0000000a", [hold()]).ok
    standing = read_holds(busy)["wide"]
    busy.release("r0")
    busy.release("hold-0000000a")
    over = Placement(agent_id="late", node="g", job_id="late", over_hold="hold-0000000a",
                     resources=PlacedResources(cpu_cores=1, gpu_count=0))
    result = busy.commit_plan("late", [over])
    assert not result.ok and "hold ended" in result.conflict.reason
    assert read_holds(busy) == {} and standing.hold_id == "hold-0000000a"


def test_two_holds_never_stack_on_one_node(busy):
    assert busy.commit_plan("hold-0000000a", [hold()]).ok
    second = busy.commit_plan("hold-0000000b", [hold("hold-0000000b", run="other")])
    assert not second.ok and "insufficient gpu" in second.conflict.reason
    assert list(holds_of(busy.active_placements())) == ["wide"]


def test_a_hold_on_an_unschedulable_node_is_refused(busy):
    busy.set_node_status("g", "maintenance", eligible=False)
    refused = busy.commit_plan("hold-0000000a", [hold()])
    assert not refused.ok and "node not ready" in refused.conflict.reason
