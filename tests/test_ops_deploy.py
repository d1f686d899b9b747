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
