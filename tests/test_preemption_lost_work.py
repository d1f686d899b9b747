"""Victims by least lost work (scheduler/preemption.py): an eviction loses the work since the victim's last
checkpoint (or its start), in GPU-seconds then CPU-seconds; ties, and a call without ``now``, keep the old order
(lowest priority, most recently started, booking). Fast: a view of one node, no servers."""

from __future__ import annotations

import math

import pytest

from mn_prefect.model.issues import Issues
from mn_prefect.model.placement import Allocation, DeviceShare, PlacedResources, Placement
from mn_prefect.model.resources import parse_resources
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.scheduler.preemption import Evictable, choose, lost_seconds, lost_work, victim_order
from mn_prefect.scheduler.view import ClusterView
from tests.builders import gpu, node

NOW = 100_000.0
MINUTE = 60.0


def ask(name: str, **resources: float) -> Ask:
    issues = Issues()
    request = parse_resources(dict(resources), "resources", issues)
    assert request is not None and not issues
    return Ask(agent_id=name, source_agent_id=name, request=request)


def booked(view: ClusterView, name: str, *, started: float, checkpointed: float = -math.inf, priority: int = 0,
           **resources: float) -> Evictable:
    """A run of ``resources`` placed (and left booked) on ``view``, as a candidate victim."""
    plan = plan_asks([ask(name, **resources)], [], explain=False, view=view)
    assert plan.status == "runnable_now", plan.reason
    placements = tuple(p.model_copy(update={"job_id": name, "priority": priority, "preemptible": True})
                       for p in plan.placements)
    return Evictable(booking=name, placements=placements, started=started, checkpointed=checkpointed)


def fleet(gpus: int = 2, cpu: float = 16) -> ClusterView:
    return ClusterView([node("n", cpu=cpu, memory=65536, devices=[gpu(f"g{k}", k) for k in range(gpus)])])


def evict_for(view: ClusterView, candidates: list[Evictable], *, now: float | None, **resources: float) -> list[str]:
    victims, plan = choose(view, lambda: plan_asks([ask("waiting", **resources)], [], explain=False, view=view),
                           candidates, now=now)
    assert plan.status == "runnable_now"
    return [v.booking for v in victims]


def placement(gpus: int = 0, cpu: float = 0.0, shares: tuple[float, ...] = ()) -> Placement:
    return Placement(agent_id="a", node="n", resources=PlacedResources(cpu_cores=cpu, gpu_count=gpus),
                     allocation=Allocation(shares=tuple(DeviceShare(id=f"g{k}", shares=s, memory_mb=0)
                                                        for k, s in enumerate(shares))))


@pytest.mark.parametrize(("started", "checkpointed", "now", "seconds"), [
    (NOW - 3600, -math.inf, NOW, 3600.0),  # never checkpointed: everything since it started
    (NOW - 3600, NOW - MINUTE, NOW, MINUTE),  # since its last checkpoint
    (NOW - 3600, NOW - 7200, NOW, 3600.0),  # a checkpoint from before this start (an earlier attempt) is no help
    (NOW, -math.inf, NOW - 5, 0.0),  # never below 0
    (-math.inf, -math.inf, NOW, math.inf),  # start unknown
])
def test_the_seconds_an_eviction_loses(started, checkpointed, now, seconds):
    assert lost_seconds(started, checkpointed, now) == seconds
    assert Evictable("r", (placement(gpus=1),), started, checkpointed).lost_seconds(now) == seconds


@pytest.mark.parametrize(("held", "lost"), [
    (placement(gpus=2, cpu=8), (7200.0, 28800.0)),  # 2 GPUs and 8 cores for an hour
    (placement(cpu=4), (0.0, 14400.0)),  # no GPU: none lost
    (placement(gpus=1, cpu=1, shares=(0.25,)), (3600.0, 3600.0)),  # a GPU counted by its device or its count
])
def test_lost_work_is_what_it_books_times_the_seconds(held, lost):
    assert Evictable("r", (held,), started=NOW - 3600).lost(NOW) == lost


def test_a_fraction_of_a_gpu_loses_its_share():
    shared = Placement(agent_id="a", node="n", resources=PlacedResources(cpu_cores=1),
                       allocation=Allocation(devices=(gpu("g0", 0),), shares=(DeviceShare(id="g0", shares=0.25,
                                                                                          memory_mb=1024),)))
    assert Evictable("r", (shared,), started=NOW - 3600).lost(NOW) == (900.0, 3600.0)


def test_nothing_booked_loses_nothing_even_since_an_unknown_start():
    assert lost_work(0.0, 0.0, math.inf) == (0.0, 0.0)
    assert Evictable("r", (placement(cpu=2),), started=-math.inf).lost(NOW) == (0.0, math.inf)


def test_the_run_that_checkpointed_a_minute_ago_goes_before_the_one_that_never_did():
    view = fleet(gpus=2)
    never = booked(view, "never", started=NOW - 1800, gpu=1, cpu=2)  # started later, but lost 30 min
    saved = booked(view, "saved", started=NOW - 3600, checkpointed=NOW - MINUTE, gpu=1, cpu=2)
    assert evict_for(view, [never, saved], now=NOW, gpu=1) == ["saved"]
    assert evict_for(view, [never, saved], now=None, gpu=1) == ["never"]  # today's order: most recently started


def test_gpu_seconds_come_before_cpu_seconds():
    view = fleet(gpus=2, cpu=16)
    wide_cpu = booked(view, "wide-cpu", started=NOW - 600, gpu=1, cpu=12)  # 600 GPU-s, 7,200 CPU-s
    long_gpu = booked(view, "long-gpu", started=NOW - 900, gpu=1, cpu=1)  # 900 GPU-s, 900 CPU-s
    assert victim_order([long_gpu, wide_cpu], NOW) == [wide_cpu, long_gpu]
    assert evict_for(view, [long_gpu, wide_cpu], now=NOW, gpu=1, cpu=1) == ["wide-cpu"]


def test_cpu_seconds_decide_between_equal_gpu_seconds():
    view = fleet(gpus=2, cpu=16)
    heavy = booked(view, "heavy", started=NOW - 600, gpu=1, cpu=8)
    light = booked(view, "light", started=NOW - 600, gpu=1, cpu=2)
    assert [v.booking for v in victim_order([heavy, light], NOW)] == ["light", "heavy"]


@pytest.mark.parametrize("now", [NOW, None])
def test_equal_lost_work_falls_back_to_priority_recency_and_booking(now):
    view = fleet(gpus=4)
    same = {"started": NOW - 1200, "gpu": 1, "cpu": 1}
    high = booked(view, "high", priority=5, **same)
    low_b = booked(view, "low-b", **same)
    low_a = booked(view, "low-a", **same)
    later = booked(view, "later", started=NOW - 600, checkpointed=NOW + 1, gpu=1, cpu=1)  # lost 0 at NOW
    order = [v.booking for v in victim_order([high, low_b, low_a], now)]
    assert order == ["low-a", "low-b", "high"]
    # lost 0 at NOW, and the most recently started: first either way
    assert [v.booking for v in victim_order([high, low_b, later, low_a], now)] == ["later", "low-a", "low-b", "high"]


def test_without_now_the_order_is_exactly_todays():
    view = fleet(gpus=4)
    runs = [booked(view, "p0-old", started=NOW - 3000, gpu=1, cpu=1),
            booked(view, "p0-new", started=NOW - 10, checkpointed=NOW - 5, gpu=1, cpu=1),
            booked(view, "p5-new", started=NOW - 1, priority=5, gpu=1, cpu=1),
            booked(view, "p0-unknown", started=-math.inf, gpu=1, cpu=1)]
    today = sorted(runs, key=lambda r: (r.priority, -r.started, r.booking))
    assert victim_order(runs) == today
    assert [v.booking for v in victim_order(runs, NOW)] == ["p5-new", "p0-new", "p0-old", "p0-unknown"]


def test_the_fewest_are_still_evicted_and_the_view_is_left_as_found():
    view = fleet(gpus=2)
    a = booked(view, "a", started=NOW - 100, gpu=1, cpu=1)
    b = booked(view, "b", started=NOW - 200, gpu=1, cpu=1)
    assert evict_for(view, [a, b], now=NOW, gpu=2) == ["a", "b"]
    assert evict_for(view, [a, b], now=NOW, gpu=1) == ["a"]
    refused = plan_asks([ask("waiting", gpu=1)], [], explain=False, view=view)
    assert refused.status != "runnable_now"  # both still held
