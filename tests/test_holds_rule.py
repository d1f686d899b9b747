"""The head-of-line hold rule (scheduler/holds.py): where a held job starts, when, and who may backfill."""

from __future__ import annotations

import pytest

from mn_prefect.model.issues import Issues
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Allocation, PlacedResources, Placement
from mn_prefect.model.resources import parse_resources
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.holds import (
    HISTORY,
    HoldChoice,
    Running,
    choose_hold,
    learned_estimate,
    may_backfill,
    worth_holding,
)
from mn_prefect.scheduler.view import ClusterView
from tests.builders import gpu, node


def gpu_node(name: str, gpus: int = 4, cpu: float = 32) -> NodeRecord:
    return node(name, cpu=cpu, memory=131072, devices=[gpu(f"{name}-g{k}", k) for k in range(gpus)])


def ask(**resources: float) -> Ask:
    issues = Issues()
    request = parse_resources(dict(resources), "resources", issues)
    assert request is not None and not issues
    return Ask(agent_id="job", request=request)


def booking(view: ClusterView, job_id: str, node_name: str, ends_at: float | None, *, gpus: int = 1,
            cpu: float = 1.0, memory: float = 1024.0) -> Running:
    """Book ``gpus`` GPUs (scalars only) on a node of ``view`` and return it as a running job."""
    view.hold(Placement.model_construct(
        agent_id="job", source_agent_id="job", node=node_name, job_id=job_id, env={}, score=None, preferred=None,
        group=None, locality="job_colocated", allocation=Allocation(),
        resources=PlacedResources.model_construct(cpu_cores=cpu, memory_mb=memory, disk_mb=0.0, gpu_count=gpus)))
    return Running(job_id=job_id, node=node_name, ends_at=ends_at, cpu_cores=cpu, memory_mb=memory, disk_mb=0.0,
                   gpu_count=gpus)


def test_hold_goes_where_the_needed_releases_end_first() -> None:
    view = ClusterView([gpu_node("a"), gpu_node("b")])
    running = [booking(view, "a1", "a", 500), booking(view, "a2", "a", 900), booking(view, "a3", "a", 100),
               booking(view, "b1", "b", 300), booking(view, "b2", "b", 400)]
    # a needs 3 releases (1 GPU free): a3 (100), a1 (500), a2 (900) -> 900; b needs b1, b2 -> 400.
    assert choose_hold(view, [ask(cpu=4, memory=4096, gpu=4)], running, now=0.0) == HoldChoice(
        nodes=("b",), expected_start=400.0, waits_on=("b1", "b2"))


def test_only_as_many_releases_as_the_request_needs() -> None:
    view = ClusterView([gpu_node("a")])
    running = [booking(view, "late", "a", 800), booking(view, "early", "a", 200), booking(view, "mid", "a", 500)]
    choice = choose_hold(view, [ask(cpu=1, memory=1024, gpu=2)], running, now=0.0)
    assert choice == HoldChoice(nodes=("a",), expected_start=200.0, waits_on=("early",))


def test_an_estimated_end_already_past_means_now() -> None:
    view = ClusterView([gpu_node("a", gpus=1)])
    running = [booking(view, "overran", "a", 50)]
    choice = choose_hold(view, [ask(cpu=1, memory=1024, gpu=1)], running, now=120.0)
    assert choice is not None and choice.expected_start == 120.0


def test_unknown_end_loses_to_any_known_one() -> None:
    view = ClusterView([gpu_node("a", gpus=1), gpu_node("b", gpus=1)])
    running = [booking(view, "a1", "a", None), booking(view, "b1", "b", 10_000)]
    choice = choose_hold(view, [ask(cpu=1, memory=1024, gpu=1)], running, now=0.0)
    assert choice == HoldChoice(nodes=("b",), expected_start=10_000.0, waits_on=("b1",))


def test_no_known_start_picks_fewest_releases_with_start_unknown() -> None:
    view = ClusterView([gpu_node("a", gpus=2), gpu_node("b", gpus=2)])
    running = [booking(view, "a1", "a", None), booking(view, "a2", "a", None), booking(view, "b1", "b", None, gpus=2)]
    choice = choose_hold(view, [ask(cpu=1, memory=1024, gpu=2)], running, now=0.0)
    assert choice == HoldChoice(nodes=("b",), expected_start=None, waits_on=("b1",))


def test_ties_go_to_node_order() -> None:
    view = ClusterView([gpu_node("a", gpus=1), gpu_node("b", gpus=1)])
    running = [booking(view, "b1", "b", 100), booking(view, "a1", "a", 100)]
    choice = choose_hold(view, [ask(cpu=1, memory=1024, gpu=1)], running, now=0.0)
    assert choice is not None and choice.nodes == ("a",)


def test_a_job_no_node_could_ever_take_gets_no_hold() -> None:
    view = ClusterView([gpu_node("a"), gpu_node("b")])
    running = [booking(view, "a1", "a", 100)]
    assert choose_hold(view, [ask(cpu=1, memory=1024, gpu=8)], running, now=0.0) is None


def test_a_node_without_the_right_devices_is_not_chosen() -> None:
    plain = node("cpu-only", cpu=64, memory=262144)
    view = ClusterView([plain, gpu_node("g", gpus=1)])
    running = [booking(view, "g1", "g", 700)]
    choice = choose_hold(view, [ask(cpu=1, memory=1024, gpu=1)], running, now=0.0)
    assert choice == HoldChoice(nodes=("g",), expected_start=700.0, waits_on=("g1",))


def test_running_jobs_on_nodes_outside_the_view_are_ignored() -> None:
    view = ClusterView([gpu_node("a", gpus=1)])
    running = [booking(view, "a1", "a", 300), Running("ghost", "elsewhere", 5.0, 1.0, 1024.0, 0.0, 1)]
    choice = choose_hold(view, [ask(cpu=1, memory=1024, gpu=1)], running, now=0.0)
    assert choice == HoldChoice(nodes=("a",), expected_start=300.0, waits_on=("a1",))


def test_a_gang_takes_distinct_nodes_and_starts_when_the_last_is_ready() -> None:
    view = ClusterView([gpu_node("a", gpus=2), gpu_node("b", gpus=2), gpu_node("c", gpus=2)])
    running = [booking(view, "a1", "a", 100, gpus=2), booking(view, "b1", "b", 300, gpus=2),
               booking(view, "c1", "c", 200, gpus=2)]
    wide = ask(cpu=1, memory=1024, gpu=2)
    choice = choose_hold(view, [wide, wide], running, now=0.0)
    assert choice == HoldChoice(nodes=("a", "c"), expected_start=200.0, waits_on=("a1", "c1"))


def test_a_gang_larger_than_the_fleet_gets_no_hold() -> None:
    view = ClusterView([gpu_node("a", gpus=2)])
    wide = ask(cpu=1, memory=1024, gpu=2)
    assert choose_hold(view, [wide, wide], [], now=0.0) is None


def test_the_view_is_left_as_it_was() -> None:
    view = ClusterView([gpu_node("a")])
    running = [booking(view, "a1", "a", 100, gpus=4)]
    before = (view.free_cpu.copy(), view.free_gpu.copy())
    choose_hold(view, [ask(cpu=1, memory=1024, gpu=4)], running, now=0.0)
    assert (view.free_cpu == before[0]).all() and (view.free_gpu == before[1]).all()


@pytest.mark.parametrize(("estimate", "now", "expected_start", "allowed"), [
    (100.0, 0.0, 100.0, True),  # ends exactly when the hold starts
    (100.0, 0.0, 99.0, False),
    (None, 0.0, 1e9, False),  # unknown runtime never backfills
    (1.0, 0.0, None, False),  # unknown hold start: nothing backfills
    (50.0, 200.0, 300.0, True),
    (150.0, 200.0, 300.0, False),
])
def test_backfill_only_when_known_to_end_before_the_hold(estimate: float | None, now: float,
                                                         expected_start: float | None, allowed: bool) -> None:
    assert may_backfill(estimate, now, expected_start) is allowed


@pytest.mark.parametrize(("durations", "estimate"), [
    ([], None),
    ([42.0], 42.0),
    ([10.0, 20.0], 20.0),  # ceil(0.9 * 2) = 2nd
    ([float(k) for k in range(1, 11)], 9.0),  # ceil(0.9 * 10) = 9th
    ([float(k) for k in range(1, 21)], 18.0),
    ([1000.0] * 5 + [float(k) for k in range(1, 21)], 18.0),  # only the last HISTORY count
])
def test_learned_estimate_is_the_p90_of_the_recent_history(durations: list[float], estimate: float | None) -> None:
    assert learned_estimate(durations) == estimate


def test_history_is_twenty() -> None:
    assert HISTORY == 20


@pytest.mark.parametrize(("gpus_free", "asks", "releases", "worth"), [
    (0, 1, 1, False),  # what one 1-GPU booking frees lets it start: first in line, it takes that anyway
    (1, 2, 1, True),  # one booking's GPU and the GPU free now: others would take the free one meanwhile
    (0, 2, 2, True),  # two bookings must end
    (0, 2, 1, False),  # one 2-GPU booking frees all it needs
])
def test_a_hold_is_worth_making_only_where_one_booking_freeing_would_not_do(gpus_free, asks, releases, worth) -> None:
    view = ClusterView([gpu_node("a", gpus=2)])
    if asks == 2 and releases == 1 and gpus_free == 0:
        running = [booking(view, "pair", "a", 300, gpus=2, cpu=2)]
    else:
        running = [booking(view, f"r{k}", "a", 100 * (k + 1)) for k in range(2 - gpus_free)]
    choice = choose_hold(view, [ask(cpu=1, memory=1024, gpu=asks)], running, now=0.0)
    assert choice is not None and len(choice.waits_on) == releases
    assert worth_holding(choice) is worth
