"""The ``mn-reconcile`` flow: sweep missed heartbeats, then reconcile what lost nodes held.

Deployed on an interval (``mn-prefect ops deploy``, or deployments/prefect.yaml) with a concurrency limit of
1; the store lease "mn-reconciler" fences its writes, so even two overlapping runs never both act.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Optional

from prefect import flow, get_run_logger
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelling, Failed, Paused, Scheduled

from mn_prefect.lifecycle.drain import advance_drains
from mn_prefect.lifecycle.leader import Leadership
from mn_prefect.lifecycle.reconcile import ReconcileReport, reconcile
from mn_prefect.lifecycle.states import advance_node_states
from mn_prefect.store import ClusterStore, open_store

RECONCILE_FLOW_NAME = "mn-reconcile"
RECONCILE_ENTRYPOINT = "mn_prefect.ops.flows.reconcile_cluster"
DEFAULT_INTERVAL_S = 15


class PrefectRunEffects:
    """What reconcile does to flow runs, through the Prefect API."""

    def __init__(self, client):
        self.client = client

    def reschedule_run(self, run_id: str, reason: str, delay_s: float) -> None:
        when = datetime.now(timezone.utc) + timedelta(seconds=delay_s)
        self.client.set_flow_run_state(run_id, Scheduled(scheduled_time=when, message=f"mn: {reason}"), force=True)

    def pause_run(self, run_id: str, reason: str) -> None:
        self.client.set_flow_run_state(run_id, Paused(message=f"mn: {reason}"), force=True)

    def fail_run(self, run_id: str, reason: str) -> None:
        self.client.set_flow_run_state(run_id, Failed(message=f"mn: {reason}"), force=True)

    def cancel_run(self, run_id: str, reason: str) -> None:
        self.client.set_flow_run_state(run_id, Cancelling(message=reason), force=True)

    def run_state(self, run_id: str) -> str | None:
        try:
            state = self.client.read_flow_run(run_id).state
        except ObjectNotFound:
            return None
        return state.type.value if state is not None else None


def reconcile_once(store: ClusterStore, client, *, node: str | None = None, dry_run: bool = False,
                   owner: str | None = None) -> dict:
    """One leader-fenced pass: node states (unless dry run), then reconcile. Returns the JSON report; a
    pass that is not the leader acts on nothing and says so."""
    leadership = Leadership(store, owner)
    if leadership.acquire() is None:
        report = ReconcileReport(dry_run=dry_run).as_json()
        return {**report, "leader": False, "transitions": [], "drains": []}
    try:
        effects = PrefectRunEffects(client)
        transitions = [] if dry_run else advance_node_states(store)
        report = reconcile(store, effects, node=node, dry_run=dry_run, lease=leadership.lease)
        drains = [] if dry_run else advance_drains(store, effects, lease=leadership.lease)
        return {**report.as_json(), "leader": True, "transitions": [t.model_dump(mode="json") for t in transitions],
                "drains": [d.as_json() for d in drains]}
    finally:
        leadership.release()


@flow(name=RECONCILE_FLOW_NAME, log_prints=True)
def reconcile_cluster(node: Optional[str] = None, dry_run: bool = False) -> dict:
    """Sweep heartbeats and reconcile after node loss; the counters are the run's result."""
    from prefect.client.orchestration import get_client

    logger = get_run_logger()
    store = open_store()
    try:
        with get_client(sync_client=True) as client:
            result = reconcile_once(store, client, node=node, dry_run=dry_run)
    finally:
        store.close()
    logger.info("reconcile: checked %(checked)d recovered %(recovered)d paused %(paused)d blocked %(blocked)d "
                "skipped %(skipped)d failed %(failed)d (leader: %(leader)s)", result)
    for action in result["actions"]:
        logger.info("%s on %s: %s (%s)", action["job_id"], action["node"], action["action"], action["reason"])
    return result


def deploy_ops(client, pool: str, *, interval_s: int = DEFAULT_INTERVAL_S) -> str:
    """Deploy ``mn-reconcile/<pool>`` on an interval with a concurrency limit of 1 (new runs cancelled while
    one is still going)."""
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.objects import ConcurrencyOptions
    from prefect.client.schemas.schedules import IntervalSchedule
    from prefect.utilities.callables import parameter_schema

    flow_id = client.create_flow_from_name(RECONCILE_FLOW_NAME)
    client.create_deployment(
        flow_id=flow_id, name=pool, entrypoint=RECONCILE_ENTRYPOINT, work_pool_name=pool,
        parameter_openapi_schema=parameter_schema(reconcile_cluster.fn).model_dump_for_openapi(),
        job_variables={"resources": {}},
        schedules=[DeploymentScheduleCreate(schedule=IntervalSchedule(interval=timedelta(seconds=interval_s)))],
        concurrency_limit=1,
        concurrency_options=ConcurrencyOptions(collision_strategy="CANCEL_NEW"),
        description="Sweeps missed heartbeats and reconciles what lost nodes held (leader-fenced).")
    return f"{RECONCILE_FLOW_NAME}/{pool}"
