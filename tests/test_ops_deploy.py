"""`mn-prefect ops deploy --pool P` gives a pool one reconcile schedule however often it runs: beside the lab's
`mn-reconcile/reconcile` (deployments/prefect.yaml) it adds none and says which one is kept; run again it replaces
its own. Fast: Prefect's client replaced by a table of deployments."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

from mn_prefect.ops.flows import deploy_ops, reconcile_schedules


class Client:
    """What deploy_ops asks of Prefect's client, over a list of deployments (the server upserts by flow and name)."""

    def __init__(self, deployments=()):
        self.deployments = {(d.flow, d.name): d for d in deployments}

    def read_deployments(self, *, flow_filter, work_pool_filter):
        flows, pools = set(flow_filter.name.any_), set(work_pool_filter.name.any_)
        return [d for d in self.deployments.values() if d.flow in flows and d.work_pool_name in pools]

    def create_flow_from_name(self, name):
        return name

    def create_deployment(self, *, flow_id, name, work_pool_name, schedules=(), **_):
        self.deployments[(flow_id, name)] = deployment(flow_id, name, work_pool_name,
                                                       [s.schedule.interval.total_seconds() for s in schedules])


def deployment(flow, name, pool, intervals=(), paused=False):
    schedules = [SimpleNamespace(active=True, schedule=SimpleNamespace(interval=timedelta(seconds=s))) for s in intervals]
    return SimpleNamespace(flow=flow, name=name, work_pool_name=pool, schedules=schedules, paused=paused)


def scheduled(client):
    return sorted(f"{d.flow}/{d.name}" for d in client.deployments.values() if d.flow == "mn-reconcile" and d.schedules)


def test_beside_the_labs_reconcile_schedule_no_second_one_is_added():
    client = Client([deployment("mn-reconcile", "reconcile", "mn-lab", [60])])

    done = deploy_ops(client, "mn-lab", interval_s=60)

    assert done == {"deployments": ["mn-drain/mn-lab"],
                    "kept": [{"deployment": "mn-reconcile/reconcile", "interval_s": 60.0}]}
    assert scheduled(client) == ["mn-reconcile/reconcile"]


def test_on_a_pool_without_one_it_deploys_its_own_and_again_replaces_it():
    client = Client([deployment("mn-reconcile", "reconcile", "other-pool", [60])])  # another pool's: no matter

    first = deploy_ops(client, "mine", interval_s=60)
    again = deploy_ops(client, "mine", interval_s=20)

    assert first == again == {"deployments": ["mn-reconcile/mine", "mn-drain/mine"], "kept": []}
    assert scheduled(client) == ["mn-reconcile/mine", "mn-reconcile/reconcile"]
    assert [s.schedule.interval for s in client.deployments[("mn-reconcile", "mine")].schedules] == [timedelta(seconds=20)]


def test_a_paused_or_unscheduled_reconcile_deployment_does_not_count():
    found = reconcile_schedules([deployment("mn-reconcile", "a", "p", [60], paused=True),
                                 deployment("mn-reconcile", "b", "p", []),
                                 deployment("mn-reconcile", "c", "p", [600])], "p")
    assert found == [{"deployment": "mn-reconcile/c", "interval_s": 600.0}]


def test_the_lab_s_reconcile_runs_on_the_events_that_call_for_it_and_a_slow_safety_schedule():
    """An idle lab's runs list is about the user's work: mn-reconcile/reconcile runs every 10 minutes (about 7
    scheduled runs ahead, as Prefect schedules at least an hour ahead; every 60 s made 60), and at once on the
    events that call for it: a node lost (each LOST status's event) or a drain started."""
    from pathlib import Path

    import yaml
    from prefect.cli.deploy._triggers import _initialize_deployment_triggers

    from mn_prefect import events
    from mn_prefect.model.node_status import LOST
    from mn_prefect.model.run_tags import OPS_TAG

    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "deployments" / "prefect.yaml").read_text())
    [reconcile] = [d for d in spec["deployments"] if d["name"] == "reconcile"]
    assert [s["interval"] for s in reconcile["schedules"]] == [600] and OPS_TAG in reconcile["tags"]
    [trigger] = _initialize_deployment_triggers("mn-reconcile/reconcile", reconcile["triggers"])
    assert trigger.enabled and trigger.match.root == {"prefect.resource.id": f"{events.NODE}*"}
    assert trigger.expect == {f"{events.NODE}{status}" for status in (*LOST, "draining")}
    assert reconcile["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
