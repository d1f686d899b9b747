"""Who goes next: priority, fair share with decaying use, and the queue-aware simulator's three policies."""

import json
import math

import pytest

from mn_prefect.model.node import NodeRecord
from mn_prefect.model.queues import QueueSpec
from mn_prefect.scheduler.fairshare import Usage, dominant_share, precedence, share
from mn_prefect.scheduler.quotas import Queues
from mn_prefect.simulate.fair import entitlement, replay_queues
from mn_prefect.simulate.trace import read_trace


def test_max_min_entitlement_gives_what_one_does_not_need_to_the_others_by_weight():
    assert entitlement({"a": 10, "b": 10}, {"a": 1, "b": 1}, 8) == {"a": 4, "b": 4}
    assert entitlement({"a": 1, "b": 10, "c": 10}, {"a": 1, "b": 1, "c": 2}, 10) == pytest.approx(
        {"a": 1, "b": 3, "c": 6})
    assert entitlement({"a": 2, "b": 3}, {"a": 1, "b": 1}, 10) == {"a": 2, "b": 3}


def test_past_use_decays_by_half_each_half_life():
    usage = Usage(half_life_s=100)
    usage.advance(1000, {"a": {"gpu": 4}})  # held 4 GPUs for many half-lives: about 4 GPUs' worth now
    assert usage.equivalent("a")["gpu"] == pytest.approx(4 / math.log(2), rel=1e-3)
    before = usage.equivalent("a")["gpu"]
    usage.advance(1100, {})
    assert usage.equivalent("a")["gpu"] == pytest.approx(before / 2)
    assert Usage(half_life_s=0).equivalent("a") == {}


def test_share_is_the_dominant_share_over_the_weight():
    capacity = {"cpu": 100, "memory": 1000, "gpu": 10}
    assert dominant_share({"cpu": 10, "memory": 500, "gpu": 1}, capacity) == 0.5
    queues = Queues.build([QueueSpec(name="a", weight=2)])
    assert share("a", {"gpu": 4}, capacity, queues) == pytest.approx(0.2)
    assert share("b", {"gpu": 4}, capacity, queues) == pytest.approx(0.4)  # no settings: weight 1


def test_the_order_is_priority_then_share_then_age():
    runs = [("r1", "a", 0, 1.0), ("r2", "b", 0, 5.0), ("r3", "a", 5, 9.0), ("r4", "b", None, 2.0)]
    queues = Queues.build([QueueSpec(name="a"), QueueSpec(name="b")])
    ordered = sorted(runs, key=lambda r: precedence(*r, queues, {"a": 0.7, "b": 0.1}))
    assert [r[0] for r in ordered] == ["r3", "r4", "r2", "r1"]


def node(gpus=2):
    return [NodeRecord(name="n", cpu_cores=64, memory_mb=65536,
                       devices=[{"id": f"g{i}", "index": i, "kind": "gpu", "memory_total_mb": 16384}
                                for i in range(gpus)])]


def trace(*jobs):
    return read_trace(json.dumps({"t": t, "job": j, "duration": d, "resources": {"gpu": 1}, "queue": q, **extra})
                      for j, t, d, q, extra in jobs)


FLOOD = [(f"a{i}", 0, 100, "a", {"preemptible": True}) for i in range(6)] + [("b0", 1, 10, "b", {})]
# a and b may each hold one GPU and borrow the other's: b reclaims what a borrowed
COHORT = [QueueSpec(name="a", quota={"gpu": 1}, cohort="c"), QueueSpec(name="b", quota={"gpu": 1}, cohort="c")]


@pytest.mark.parametrize("policy, b_wait", [("fifo", 299), ("fair", 99), ("preempt", 0)])
def test_a_small_queue_waits_behind_a_flood_only_under_fifo(policy, b_wait):
    result = replay_queues(node(), trace(*FLOOD), COHORT, policy)
    assert result.completed == 7 and result.queues["b"].wait_p95 == pytest.approx(b_wait)
    assert result.preemptions == (1 if policy == "preempt" else 0)
    assert result.queues["a"].preempted == result.preemptions


def test_preemption_spares_what_is_not_preemptible_or_too_young():
    stiff = [(f"a{i}", 0, 100, "a", {}) for i in range(2)] + [("b0", 1, 10, "b", {})]
    assert replay_queues(node(), trace(*stiff), COHORT, "preempt").preemptions == 0
    assert replay_queues(node(), trace(*FLOOD), [], "preempt").preemptions == 0  # no priority, nothing lent
    young = replay_queues(node(), trace(*FLOOD), COHORT, "preempt", min_runtime_s=50)
    assert young.preemptions == 1 and young.queues["b"].wait_p95 == pytest.approx(49)


def test_a_quota_holds_in_the_replay_and_a_job_past_it_forever_is_refused():
    jobs = [(f"a{i}", 0, 100, "a", {}) for i in range(4)]
    specs = [QueueSpec(name="a", quota={"gpu": 1})]
    result = replay_queues(node(gpus=4), trace(*jobs), specs, "fair")
    assert result.makespan == pytest.approx(400)  # one at a time, though four GPUs were free
    two = read_trace([json.dumps({"t": 0, "job": "x", "duration": 1, "resources": {"gpu": 2}, "queue": "a"})])
    assert replay_queues(node(gpus=4), two, specs, "fifo").queues["a"].refused == 1


def test_fairness_is_measured_against_entitlement():
    fifo = replay_queues(node(), trace(*FLOOD), COHORT, "fifo")
    fair = replay_queues(node(), trace(*FLOOD), COHORT, "preempt")
    assert fair.jain > fifo.jain


def test_the_command_compares_the_policies_per_queue_with_a_plot(tmp_path):
    from test_cli import run

    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps([n.model_dump(mode="json") for n in node()]))
    lines = tmp_path / "trace.jsonl"
    lines.write_text("\n".join(json.dumps({"t": t, "job": j, "duration": d, "resources": {"gpu": 1}, "queue": q, **e})
                               for j, t, d, q, e in FLOOD))
    queues = tmp_path / "q.json"
    queues.write_text(json.dumps({"a": {"quota": {"gpu": 2}, "cohort": "c"}, "b": {"quota": {"gpu": 1},
                                                                                   "cohort": "c"}}))
    plot = tmp_path / "waits.html"
    result = run("simulate", "--nodes", nodes, "--trace", lines, "--queues", queues, "--json", "--plot", plot)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert list(doc["policies"]) == ["fifo", "fair", "preempt"]
    assert doc["policies"]["fifo"]["queues"]["b"]["wait_s"]["p95"] > doc["policies"]["preempt"]["queues"]["b"][
        "wait_s"]["p95"]
    assert "<svg" in plot.read_text() and "preempt" in plot.read_text()
    bad = run("simulate", "--nodes", nodes, "--trace", lines, "--queues", queues, "--policies", "fifo,lottery")
    assert bad.returncode == 2 and "lottery" in bad.stderr


def test_the_fleet_capacity_reads_any_iterable_of_nodes():
    from mn_prefect.scheduler.fairshare import capacity_of

    nodes = node(gpus=3)
    assert capacity_of(n for n in nodes) == capacity_of(nodes) == {"cpu": 64, "memory": 65536, "gpu": 3}
