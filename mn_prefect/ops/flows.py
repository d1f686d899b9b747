"""The ``mn-reconcile`` flow: sweep missed heartbeats, then reconcile what lost nodes held, and keep the
cluster overview (the ``mn-cluster`` and ``mn-waiting-runs`` artifacts, mn_prefect.ops.overview) current.

Deployed on an interval (``mn-prefect ops deploy``, or deployments/prefect.yaml) with a concurrency limit of
1; the store lease "mn-reconciler" fences its writes, so even two overlapping runs never both act.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from prefect import flow, get_run_logger
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Cancelling, Failed, Paused, Scheduled

from mn_prefect.lifecycle.drain import active_drain, advance_drain, advance_drains, start_drain
from mn_prefect.lifecycle.leader import Leadership
from mn_prefect.lifecycle.reconcile import ReconcileReport, reconcile
from mn_prefect.lifecycle.states import advance_node_states
from mn_prefect.model.run_tags import OPS_TAG
from mn_prefect.ops import accounting, overview
from mn_prefect.placement import reservations
from mn_prefect.store import ClusterStore, open_store

RECONCILE_FLOW_NAME = "mn-reconcile"
RECONCILE_ENTRYPOINT = "mn_prefect.ops.flows.reconcile_cluster"
DRAIN_FLOW_NAME = "mn-drain"
DRAIN_ENTRYPOINT = "mn_prefect.ops.flows.drain_node"
DEFAULT_INTERVAL_S = 60  # the pool's announcer sweeps node states every 10 s; this catches up the rest


class PrefectRunEffects:
    """What reconcile does to flow runs, through the Prefect API."""

    def __init__(self, client):
        self.client = client

    def reschedule_run(self, run_id: str, reason: str, delay_s: float) -> None:
        when = datetime.now(UTC) + timedelta(seconds=delay_s)
        self.client.set_flow_run_state(run_id, Scheduled(scheduled_time=when, message=f"mn: {reason}"), force=True)

    def pause_run(self, run_id: str, reason: str) -> None:
        self.client.set_flow_run_state(run_id, Paused(message=f"mn: {reason}"), force=True)

    def fail_run(self, run_id: str, reason: str) -> None:
        self.client.set_flow_run_state(run_id, Failed(message=f"mn: {reason}"), force=True)

    def cancel_run(self, run_id: str, reason: str) -> None:
        self.client.set_flow_run_state(run_id, Cancelling(message=reason), force=True)

    def cancel_waiting_run(self, run_id: str, reason: str) -> None:
        """A run that has not started: Cancelled at once (a process of it that starts now finds it so and exits)."""
        self.client.set_flow_run_state(run_id, Cancelled(message=reason), force=True)

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
        idle = ReconcileReport(dry_run=dry_run).as_json()
        return {**idle, "leader": False, "transitions": [], "drains": []}
    try:
        effects = PrefectRunEffects(client)
        transitions = [] if dry_run else advance_node_states(store)
        report = reconcile(store, effects, node=node, dry_run=dry_run, lease=leadership.lease)
        drains = [] if dry_run else advance_drains(store, effects, lease=leadership.lease)
        reserved = {} if dry_run else reservations.reconcile(store, effects)
        return {**report.as_json(), "leader": True, "transitions": [t.model_dump(mode="json") for t in transitions],
                "drains": [d.as_json() for d in drains], "reservations": reserved}
    finally:
        leadership.release()


@flow(name=RECONCILE_FLOW_NAME, log_prints=True)
def reconcile_cluster(node: str | None = None, dry_run: bool = False) -> dict:
    """Sweep heartbeats and reconcile after node loss, then publish the cluster overview; the counters are the
    run's result."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_UI_URL

    logger = get_run_logger()
    store = open_store()
    try:
        with get_client(sync_client=True) as client:
            result = reconcile_once(store, client, node=node, dry_run=dry_run)
            try:
                result["overview"] = overview.publish(store, client, flow_run_id=flow_run.get_id(),
                                                      ui_url=PREFECT_UI_URL.value())
            except Exception as error:  # the overview is for people: it never fails the reconcile
                logger.warning("could not publish the cluster overview: %s: %s", type(error).__name__, error)
            try:
                result["usage_artifact"] = publish_usage_day(store, client, flow_run_id=flow_run.get_id())
            except Exception as error:  # accounting's artifact is for people too; `usage` reads the same
                logger.warning("could not publish the daily usage: %s: %s", type(error).__name__, error)
    finally:
        store.close()
    logger.info("reconcile: checked %(checked)d recovered %(recovered)d paused %(paused)d blocked %(blocked)d "
                "skipped %(skipped)d failed %(failed)d (leader: %(leader)s)", result)
    for action in result["actions"]:
        logger.info("%s on %s: %s (%s)", action["job_id"], action["node"], action["action"], action["reason"])
    return result


def publish_usage_day(store: ClusterStore, client, *, flow_run_id, day: date | None = None) -> str | None:
    """The usage of ``day`` (default: yesterday, UTC) by queue, pool and deployment as the table artifact
    ``mn-usage-<day>`` (ops/accounting.py): written when the day has none yet or its rows changed (a release
    made late), so each pass reads one artifact and a day gets one version. The key when written, else None."""
    day = day or (datetime.now(UTC) - timedelta(days=1)).date()
    rows = accounting.day_rows(store, day)
    key = accounting.DAY_KEY.format(day=day.isoformat())
    written = overview._write_if_changed(client, key, rows, f"mn-prefect usage of {day.isoformat()} (UTC): "
                                                           "GPU-, GPU-memory-, CPU- and memory-hours by queue, pool "
                                                           "and deployment", flow_run_id)
    return key if written else None


def drain_until_done(store: ClusterStore, client, node: str, *, timeout_s: float, on_pass=None) -> dict:
    """Advance ``node``'s drain (each pass under the reconciler lease; when another holder leads, it advances
    the drain instead) until it completes, is undrained, or ``timeout_s`` passes."""
    import time

    deadline = time.monotonic() + timeout_s
    data: dict = {"node": node, "status": "draining", "actions": []}
    while time.monotonic() < deadline:
        leadership = Leadership(store)
        if leadership.acquire() is not None:
            try:
                result = advance_drain(store, PrefectRunEffects(client), node, lease=leadership.lease)
            finally:
                leadership.release()
            if result is not None:
                data = result.as_json()
        if active_drain(store, node) is None:
            stored = store.get_node(node)
            assert stored is not None  # a node that was draining is registered
            status = stored.record.status
            data["status"] = "complete" if status == "maintenance" else f"ended ({status})"
            return data
        if on_pass is not None:
            on_pass(data)
        time.sleep(1)
    data["status"] = "timed out"
    return data


@flow(name=DRAIN_FLOW_NAME, log_prints=True)
def drain_node(node: str, reason: str, deadline_minutes: float = 30.0, timeout_minutes: float = 240.0) -> dict:
    """Drain ``node`` (no new placements; services with cluster_recover migrate, batch finishes until the
    deadline, system work stays) and follow it until it completes; the node is then in maintenance."""
    from prefect.client.orchestration import get_client

    logger = get_run_logger()
    store = open_store()
    try:
        start_drain(store, node, reason, deadline_s=deadline_minutes * 60)
        logger.info("draining %s (%s), deadline in %g min", node, reason, deadline_minutes)
        with get_client(sync_client=True) as client:
            result = drain_until_done(store, client, node, timeout_s=timeout_minutes * 60,
                                      on_pass=lambda d: logger.info("drain %s: %s", node, d["actions"]))
    finally:
        store.close()
    logger.info("drain of %s: %s", node, result["status"])
    if result["status"] != "complete":
        raise RuntimeError(f"drain of {node} did not complete: {result['status']}")
    return result


def reconcile_schedules(deployments, pool: str) -> list[dict]:
    """Of ``deployments`` (Prefect's deployment objects), the reconcile flow's on ``pool`` that run on a schedule
    (not paused, an active schedule): each as {"deployment": "mn-reconcile/NAME", "interval_s": seconds or None}."""
    found = []
    for deployment in deployments:
        if deployment.work_pool_name != pool or getattr(deployment, "paused", False):
            continue
        active = [s for s in (deployment.schedules or []) if getattr(s, "active", True)]
        if active:
            interval = getattr(active[0].schedule, "interval", None)
            found.append({"deployment": f"{RECONCILE_FLOW_NAME}/{deployment.name}",
                          "interval_s": interval.total_seconds() if interval is not None else None})
    return found


def deploy_ops(client, pool: str, *, interval_s: int = DEFAULT_INTERVAL_S) -> dict:
    """Deploy ``mn-reconcile/<pool>`` on an interval with a concurrency limit of 1 (new runs cancelled while
    one is still going), and ``mn-drain/<pool>`` to start from the UI or the API. A pool gets one reconcile
    schedule however often this runs: when another reconcile deployment already runs on the pool on a schedule
    (the lab's ``mn-reconcile/reconcile`` from deployments/prefect.yaml), it is kept and no second one is added.
    Returns {"deployments": what was deployed, "kept": the reconcile schedules kept (reconcile_schedules)}."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, WorkPoolFilter, WorkPoolFilterName

    existing = client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=[RECONCILE_FLOW_NAME])),
                                       work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))
    ours = f"{RECONCILE_FLOW_NAME}/{pool}"
    kept = [s for s in reconcile_schedules(existing, pool) if s["deployment"] != ours]
    deployed = _deploy_ops(client, pool, interval_s=interval_s, reconcile=not kept)
    return {"deployments": deployed, "kept": kept}


def _deploy_ops(client, pool: str, *, interval_s: int, reconcile: bool) -> list[str]:
    from prefect.utilities.callables import parameter_schema

    deployed = []
    if reconcile:
        _deploy_reconcile(client, pool, interval_s)
        deployed.append(f"{RECONCILE_FLOW_NAME}/{pool}")
    client.create_deployment(
        flow_id=client.create_flow_from_name(DRAIN_FLOW_NAME), name=pool, entrypoint=DRAIN_ENTRYPOINT,
        work_pool_name=pool, parameter_openapi_schema=parameter_schema(drain_node.fn).model_dump_for_openapi(),
        job_variables={"resources": {}}, tags=[OPS_TAG], description="Drains one node with a deadline and follows it to the end.")
    return [*deployed, f"{DRAIN_FLOW_NAME}/{pool}"]


def _deploy_reconcile(client, pool: str, interval_s: int) -> None:
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy, ConcurrencyOptions
    from prefect.client.schemas.schedules import IntervalSchedule
    from prefect.utilities.callables import parameter_schema

    flow_id = client.create_flow_from_name(RECONCILE_FLOW_NAME)
    client.create_deployment(
        flow_id=flow_id, name=pool, entrypoint=RECONCILE_ENTRYPOINT, work_pool_name=pool,
        parameter_openapi_schema=parameter_schema(reconcile_cluster.fn).model_dump_for_openapi(),
        job_variables={"resources": {}}, tags=[OPS_TAG],
        schedules=[DeploymentScheduleCreate(schedule=IntervalSchedule(interval=timedelta(seconds=interval_s)))],
        concurrency_limit=1,
        concurrency_options=ConcurrencyOptions(collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW),
        description="Sweeps missed heartbeats, reconciles what lost nodes held, advances due drains (leader-fenced).")
