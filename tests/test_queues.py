"""Queues with quotas: the rule (pure), its words, and the store's accounts on SQLite, Redis and PostgreSQL."""

import json

import pytest
from builders import gpu, node

from mn_prefect.model.issues import InvalidInput, Issues
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Allocation, PlacedResources, Placement
from mn_prefect.model.queues import QueueRecord, QueueSpec, parse_amounts, parse_queues
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.placing import Placer
from mn_prefect.scheduler import Ask
from mn_prefect.scheduler.quotas import Queues, RunQueue, charge
from mn_prefect.store.accounts import QueueInUse
from mn_prefect.store.base import StoreError


def gpus(n, **extra):
    return [Ask(agent_id="w", request=resource_request(gpu=n, **extra))]


def spec(name, cohort=None, **quota):
    return QueueSpec(name=name, quota={k: float(v) for k, v in quota.items()}, cohort=cohort)


# -- the rule, pure ------------------------------------------------------------------------------------------------

def test_a_charge_counts_whole_gpus_fractions_memory_and_models():
    a100 = {"id": "g0", "index": 0, "kind": "gpu", "model": "NVIDIA A100-SXM4-80GB", "memory_total_mb": 81920}
    l4 = {"id": "g1", "index": 1, "kind": "gpu", "model": "NVIDIA L4", "memory_total_mb": 23034}
    whole = Placement(agent_id="a", node="n", resources=PlacedResources(cpu_cores=4, memory_mb=1024, gpu_count=1),
                      allocation=Allocation(devices=(a100,)))
    half = Placement(agent_id="b", node="n", allocation=Allocation(devices=(l4,), shares=(
        {"id": "g1", "shares": 0.5, "memory_mb": 8000},)))
    got = charge([whole, half], ["a100", "l4"])
    assert got == {"cpu": 4, "memory": 1024, "disk": 0, "gpu": 1.5, "gpu_memory": 81920 + 8000, "gpu:a100": 1,
                   "gpu:l4": 0.5}


def test_outside_a_cohort_a_queue_stops_at_its_quota_and_says_so():
    queues = Queues.build([spec("a", gpu=4)])
    queues.add("a", {"gpu": 3})
    assert queues.reason("a", {"gpu": 1}) is None
    assert queues.reason("a", {"gpu": 2}) == "quota: queue a asks 2 GPUs with 3 of its quota of 4 in use"
    assert queues.never("a", {"gpu": 5}) == "quota: queue a asks 5 GPUs, more than it may ever hold: its quota of 4"
    assert queues.never("a", {"gpu": 4}) is None


def test_in_a_cohort_a_queue_borrows_what_the_others_leave_unused():
    queues = Queues.build([spec("a", cohort="c", gpu=4), spec("b", cohort="c", gpu=4)])
    queues.add("a", {"gpu": 4})
    assert queues.reason("a", {"gpu": 3}) is None  # b uses nothing: a may borrow its 4
    queues.add("b", {"gpu": 2})
    assert queues.reason("a", {"gpu": 3}) == ("quota: queue a is at its quota of 4 GPUs and cohort c has only 2 to "
                                              "lend")
    queues.add("a", {"gpu": 2})
    assert queues.reason("a", {"gpu": 1}) == "quota: queue a is at its quota of 4 GPUs and cohort c has none to lend"
    # b is still entitled to its own quota, but a holds the rest of it: b waits for a to give it back
    assert queues.reason("b", {"gpu": 1}).startswith("quota: queue b asks 1 GPU with 2 of its quota of 4 in use")
    assert queues.lent("b") == {"gpu": 2}


def test_a_borrowing_limit_caps_what_a_queue_may_take_past_its_quota():
    queues = Queues.build([QueueSpec(name="a", quota={"gpu": 2}, borrow={"gpu": 1}, cohort="c"), spec("b", "c", gpu=8)])
    queues.add("a", {"gpu": 3})
    assert queues.reason("a", {"gpu": 1}) == ("quota: queue a asks 1 GPU with 3 in use: its quota of 2 plus at most 1 "
                                              "borrowed")


def test_a_queue_without_settings_or_a_dimension_without_quota_is_not_limited():
    queues = Queues.build([spec("a", gpu=1)])
    assert queues.reason("other", {"gpu": 99}) is None
    assert queues.reason("a", {"cpu": 1000, "gpu": 1}) is None


def test_the_dry_run_counts_active_placements_of_each_queue():
    used = Placement(agent_id="x", node="n", queue="a", resources=PlacedResources(cpu_cores=6))
    other = Placement(agent_id="y", node="n", queue="b", resources=PlacedResources(cpu_cores=6))
    queues = Queues.build([spec("a", cpu=8)], [used, other])
    assert queues.queues["a"].used["cpu"] == 6
    assert queues.reason("a", {"cpu": 3}).startswith("quota: queue a asks 3 cores with 6 of its quota of 8")


@pytest.mark.parametrize("raw, path, words", [
    ({"a": {"quota": {"gpus": -1}}}, "queues.a.quota.gpus", "negative"),
    ({"a": {"quota": {"vram": 1}}}, "queues.a.quota.vram", "unknown dimension"),
    ({"a": {"quota": {}, "weight": 0}}, "queues.a.weight", "greater than 0"),
    ({"a": {"quota": {}, "priority": 1.5}}, "queues.a.priority", "integer"),
    ({"a": {"quota": {}, "colour": "red"}}, "queues.a.colour", "unknown key"),
    ({"a/b": {"quota": {}}}, "queues.a/b", "not a valid queue name"),
    ({"a": "gpu=4"}, "queues.a", "must be an object"),
])
def test_a_bad_queues_file_names_the_field(raw, path, words):
    with pytest.raises(InvalidInput) as error:
        parse_queues(raw)
    assert any(i.path == path and words in i.message for i in error.value.issues), error.value.issues


def test_amounts_read_the_command_line_form_with_units():
    issues = Issues()
    assert parse_amounts("gpu=4, memory_gb=2,gpu:A100=2", "quota", issues) == {"gpu": 4, "memory": 2048,
                                                                              "gpu:a100": 2}
    assert not issues
    parse_amounts("gpu4", "quota", issues)
    assert "not DIMENSION=AMOUNT" in str(issues.items[0])


def test_node_names_never_look_like_accounts():
    with pytest.raises(ValueError, match="may not start with @"):
        NodeRecord(name="@queue:a")


# -- the store's accounts, on every backend ---------------------------------------------------------------------------

@pytest.fixture
def fleet(store):
    for name in ("n0", "n1"):
        store.register_node(node(name, cpu=16, memory=65536, devices=[gpu(f"{name}g{i}", i) for i in range(4)]))
    return store


def used(store, name):
    return {d: v for d, v in store.queues().queues[name].used.items() if v}


def test_settings_are_kept_listed_and_kept_out_of_the_nodes(fleet):
    fleet.set_queue(spec("a", cohort="c", gpu=2))
    record = fleet.set_queue(spec("b", cohort="c", gpu=3, cpu=8))
    assert isinstance(record, QueueRecord) and record.spec.quota == {"gpu": 3, "cpu": 8}
    queues = fleet.queues()
    assert sorted(queues.queues) == ["a", "b"] and queues.cohorts["c"].nominal == {"gpu": 5, "cpu": 8}
    assert [n.record.name for n in fleet.list_nodes()] == ["n0", "n1"]
    snap = fleet.snapshot()
    assert [n.name for n in snap.nodes] == ["n0", "n1"] and {q.spec.name for q in snap.queues} == {"a", "b"}
    assert fleet.check().counts["nodes"] == 2
    assert fleet.repair_derived() == []  # the accounts are not nodes: nothing to repair there


def test_a_commit_is_charged_to_its_queue_and_refused_past_quota_writing_nothing(fleet):
    fleet.set_queue(spec("a", gpu=2))
    placer = Placer(fleet)
    assert placer.place("j1", gpus(2), queue=RunQueue("a", priority=5)).placed
    assert used(fleet, "a")["gpu"] == 2
    [placement] = fleet.active_placements(job_id="j1")
    assert (placement.queue, placement.priority, placement.preemptible) == ("a", 5, False)
    before = (fleet.bookings(), fleet.snapshot().holds)
    result = placer.place("j2", gpus(1), queue=RunQueue("a"))
    assert not result.placed and result.plan.status == "runnable_later"
    assert result.plan.reason == "quota: queue a asks 1 GPU with 2 of its quota of 2 in use"
    # the commit itself refuses too, whatever the planner thought: a stale plan cannot pass the quota
    stale = [p.model_copy(update={"agent_id": "w2", "allocation": Allocation(devices=(
        fleet.get_node("n1").record.devices[0],)), "node": "n1"}) for p in fleet.active_placements(job_id="j1")]
    commit = fleet.commit_plan("j3", stale)
    assert not commit.ok and commit.conflict.reason.startswith("quota: queue a")
    assert (fleet.bookings(), fleet.snapshot().holds) == before and fleet.active_jobs() == ["j1"]
    assert fleet.release("j1") == 1 and used(fleet, "a") == {}
    assert placer.place("j2", gpus(1), queue=RunQueue("a")).placed


def test_a_cohort_lends_unused_quota_and_takes_it_back_as_runs_end(fleet):
    fleet.set_queue(spec("a", cohort="c", gpu=2))
    fleet.set_queue(spec("b", cohort="c", gpu=2))
    placer = Placer(fleet)
    for j in range(4):
        assert placer.place(f"a{j}", gpus(1), queue=RunQueue("a")).placed  # 2 of its own, 2 borrowed from b
    refused = placer.place("b0", gpus(1), queue=RunQueue("b"))
    assert refused.plan.reason.startswith("quota: queue b asks 1 GPU with 0 of its quota of 2 in use")
    assert fleet.queues().lent("b") == {"gpu": 2}
    fleet.release("a3")
    assert placer.place("b0", gpus(1), queue=RunQueue("b")).placed
    queues = fleet.queues()
    assert queues.cohorts["c"].used["gpu"] == 4 and queues.queues["a"].used["gpu"] == 3


def test_a_partial_release_refunds_the_queue_exactly(fleet):
    fleet.set_queue(spec("a", cpu=100, gpu=8))
    system = Placer(fleet).place("s", gpus(1), job_type="system", queue=RunQueue("a"))
    assert system.placed and len(system.commit.placements) == 2
    assert used(fleet, "a") == {"gpu": 2, "gpu_memory": 2 * 16384}
    assert fleet.release("s", node="n0") == 1
    assert used(fleet, "a")["gpu"] == 1
    assert fleet.release("s", node="n1") == 1 and used(fleet, "a") == {}


def test_changing_settings_keeps_use_and_makes_stale_decisions_read_again(fleet):
    fleet.set_queue(spec("a", gpu=4))
    placer = Placer(fleet)
    assert placer.place("j1", gpus(2), queue=RunQueue("a")).placed
    before = fleet.queues().queues["a"].version
    fleet.set_queue(spec("a", gpu=2))
    after = fleet.queues().queues["a"]
    assert after.version > before and after.used["gpu"] == 2
    # the placer's view still has the old quota: its commit meets the new one
    result = placer.place("j2", gpus(1), queue=RunQueue("a"))
    assert not result.placed and "quota of 2" in result.plan.reason


def test_a_queue_moved_to_another_cohort_is_charged_there(fleet):
    fleet.set_queue(spec("a", cohort="c1", gpu=1))
    fleet.set_queue(spec("b", cohort="c2", gpu=3))
    assert Placer(fleet).place("j1", gpus(1), queue=RunQueue("a")).placed
    fleet.set_queue(spec("a", cohort="c2", gpu=1))
    assert Placer(fleet).place("j2", gpus(2), queue=RunQueue("a")).placed  # borrows from b in c2
    queues = fleet.queues()
    assert queues.cohorts["c2"].used["gpu"] == 2 and queues.cohorts["c1"].used["gpu"] == 1
    fleet.release("j1")  # refunded where it was charged
    assert "c1" not in fleet.queues().cohorts or not fleet.queues().cohorts["c1"].used.get("gpu")


def test_settings_of_a_queue_in_use_are_not_deleted(fleet):
    fleet.set_queue(spec("a", gpu=4))
    assert Placer(fleet).place("j1", gpus(1), queue=RunQueue("a")).placed
    with pytest.raises(QueueInUse, match="still holds"):
        fleet.delete_queue("a")
    fleet.release("j1")
    fleet.delete_queue("a")
    assert fleet.queues().queues == {}
    with pytest.raises(StoreError, match="no settings"):
        fleet.delete_queue("a")


def test_runs_without_a_queue_are_not_charged(fleet):
    fleet.set_queue(spec("a", gpu=1))
    assert Placer(fleet).place("j1", gpus(4)).placed
    assert used(fleet, "a") == {}
    assert json.loads(fleet.active_placements(job_id="j1")[0].model_dump_json())["queue"] is None


# -- a pool's deny-list and priorities by tag ---------------------------------------------------------------------

def test_the_deny_list_names_the_rule_and_what_matched():
    from mn_prefect.model.pool_policy import PoolPolicy, parse_deny

    issues = Issues()
    rules = tuple(parse_deny(t, "--deny", issues) for t in ("tag:Exp*=no experiments", "deployment:legacy/*=retired",
                                                            "flow:scratch?=not here"))
    policy = PoolPolicy(deny=rules, tag_priorities={"urgent": 50, "low": -5})
    assert not issues
    assert policy.refusal(deployment="train/nightly", flow="train", tags=["prod", "EXPERIMENT-7"]) == (
        "refused by the pool's deny-list: no experiments (tag 'EXPERIMENT-7' matches tag:Exp*)")
    assert "retired" in policy.refusal(deployment="legacy/old", flow="x", tags=[])
    assert "not here" in policy.refusal(deployment=None, flow="scratch1", tags=[])
    assert policy.refusal(deployment="train/nightly", flow="train", tags=["prod"]) is None
    assert policy.priority_for(["Urgent", "low"]) == 50 and policy.priority_for(["other"]) is None
    parse_deny("colour:red=x", "--deny", issues)
    assert "SUBJECT:PATTERN=REASON" in str(issues.items[0])


def test_a_queue_given_settings_after_a_process_read_it_unset_is_charged_all_the_same(fleet):
    """A process remembers a queue it read without settings (one round trip per commit); settings made later
    (as by another process) raise every node's version, so its next ticket decided on that memory is read again
    and charged."""
    placer = Placer(fleet)
    assert placer.place("j0", gpus(1), queue=RunQueue("late")).placed  # no settings yet: not counted
    fleet.set_queue(spec("late", gpu=1))
    assert placer.place("j1", gpus(1), queue=RunQueue("late")).placed
    assert used(fleet, "late")["gpu"] == 1
    refused = placer.place("j2", gpus(1), queue=RunQueue("late"))
    assert not refused.placed and refused.plan.reason.startswith("quota: queue late")
    assert sorted(fleet.active_jobs()) == ["j0", "j1"]
