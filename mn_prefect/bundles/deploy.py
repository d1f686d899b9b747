"""Bundles as Prefect deployments of the ``mn-bundle-run`` flow on an ``mn`` pool.

The deployment names the bundle folder by path (every node reads it from there) and carries the config
overrides; a bundle's ``schedule`` becomes its schedules (mn_prefect.bundles.schedule) and its ``triggers``
automations that run it on events (mn_prefect.bundles.triggers). In prefect.yaml the same
deployment is::

    - name: demo-dag-linear
      entrypoint: mn_prefect.bundles.flows.bundle_run
      work_pool: {name: mn-lab}
      parameters: {bundle_path: /srv/bundles/demo_dag_linear, pool: mn-lab}
"""

from __future__ import annotations

from typing import Any, Literal
from uuid import UUID

from mn_prefect.bundles.bundle import Bundle
from mn_prefect.bundles.flows import BUNDLE_ENTRYPOINT, BUNDLE_FLOW_NAME, bundle_run, ensure_step_deployment
from mn_prefect.bundles.ids import job_id_for
from mn_prefect.bundles.runner import new_ids
from mn_prefect.bundles.schedule import deployment_schedules, parse_schedule
from mn_prefect.bundles.triggers import apply_triggers, parse_triggers, remove_orphaned_automations
from mn_prefect.model.issues import Issues

# What a deploy does with the bundle's ``schedule`` and ``triggers``: "register" them (``blueprint deploy``,
# ``mn schedule create``, ``mn trigger create``), "keep" what the deployment already has (a plain ``blueprint run``
# of a bundle someone deployed keeps its schedules and automations, and registers none of its own), or "none"
# (the MirrorNeuron API's runs: a deployment with no schedule and no automation).
Lifecycle = Literal["register", "keep", "none"]

# The flow run that drives a bundle books almost nothing: its steps are booked one attempt at a time.
DRIVER_RESOURCES = {"cpu_cores": 0.1, "memory_mb": 64}


def deployment_name(bundle: Bundle) -> str:
    return bundle.spec.blueprint_id.replace("_", "-")


def deploy_bundle(client, bundle: Bundle, pool: str, *, name: str | None = None, runs_root: str | None = None,
                  overrides: dict[str, Any] | None = None, version: str | None = None,
                  lifecycle: Lifecycle = "none") -> tuple[UUID, str]:
    """Create or update ``mn-bundle-run/<name>`` on ``pool``: (deployment id, full name). ``version``: the
    deployment's version label in Prefect (a MirrorNeuron deployment's stable version). ``lifecycle``: whether the
    bundle's schedule and triggers are registered (see ``Lifecycle``); a plain run registers neither."""
    from mn_prefect.jobs.deploy import _upsert

    work_pool = client.read_work_pool(pool)
    if work_pool.type != "mn":
        raise ValueError(f"--pool: work pool {pool!r} is of type {work_pool.type!r}; bundles need an mn pool")
    ensure_step_deployment(client, pool)
    name = name or deployment_name(bundle)
    issues = Issues()
    schedule = parse_schedule(bundle.document, issues)
    triggers = parse_triggers(bundle.document, issues)
    issues.raise_if_any()  # (load_bundle refused these already)
    schedules: list[Any] | None = None
    concurrency_limit = None
    if lifecycle == "register":
        schedules = deployment_schedules(schedule) if schedule else None
        concurrency_limit = 1 if schedule and schedule.no_overlap else None
    elif lifecycle == "keep":
        schedules, concurrency_limit = _kept(client, name)
    when = []
    if lifecycle == "register":
        when = [f"runs on {', '.join(schedule.crons)} ({schedule.timezone})"] if schedule else []
        when += [f"runs on each {t.event_type} event" + (f" matching {t.match}" if t.match else "")
                 for t in triggers]
    deployment_id = _upsert(
        client, BUNDLE_FLOW_NAME, bundle_run.fn, name, BUNDLE_ENTRYPOINT, pool,
        parameters={"bundle_path": str(bundle.root), "runs_root": runs_root, "overrides": overrides or None,
                    "pool": pool},
        job_variables={"resources": DRIVER_RESOURCES, "job_type": "batch"},
        description=f"MirrorNeuron bundle {bundle.spec.blueprint_id}: {len(bundle.spec.steps)} step(s), "
                    f"{len(bundle.spec.agents)} agent(s)" + "".join(f"; {w}" for w in when) + ".",
        schedules=schedules, concurrency_limit=concurrency_limit, version=version)
    if lifecycle == "register":
        apply_triggers(client, triggers, deployment_id, f"{BUNDLE_FLOW_NAME}/{name}")
        remove_orphaned_automations(client)  # those of bundle deployments deleted in Prefect since
    elif lifecycle == "none":
        apply_triggers(client, [], deployment_id, f"{BUNDLE_FLOW_NAME}/{name}")
    return deployment_id, f"{BUNDLE_FLOW_NAME}/{name}"


def _kept(client, name: str) -> tuple[list[Any] | None, int | None]:
    """The schedules and concurrency limit ``mn-bundle-run/<name>`` has now (none when it does not exist yet), as
    a new version of it carries them on."""
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.exceptions import ObjectNotFound

    try:
        current = client.read_deployment_by_name(f"{BUNDLE_FLOW_NAME}/{name}")
    except ObjectNotFound:
        return None, None
    schedules = [DeploymentScheduleCreate(schedule=s.schedule, active=s.active) for s in current.schedules or []]
    limit = current.global_concurrency_limit
    return schedules or None, limit.limit if limit is not None else None


def start_bundle(client, bundle: Bundle, deployment_id: UUID, *, run_id: str | None = None):
    """One run of the deployment: (flow run, job id)."""
    run = client.create_flow_run_from_deployment(deployment_id, parameters={"run_id": run_id} if run_id else {})
    _, run_id = new_ids(run_id, str(run.id), bundle.spec.job_name)
    return run, job_id_for(bundle.spec.job_name, run_id)
