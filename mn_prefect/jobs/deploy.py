"""Blueprints as Prefect deployments: compile, deploy on an ``mn`` pool, start a run.

Both flows are deployed by module path (``mn_prefect.jobs...``), so any machine with mn-prefect installed
runs them without pulling code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from prefect.client.schemas.objects import FlowRun
from prefect.utilities.callables import parameter_schema

from mn_prefect.jobs.agent import AGENT_FLOW_NAME, mn_agent
from mn_prefect.jobs.coordinator import JOB_FLOW_NAME, agent_deployment_name, blueprint_job, new_job_id
from mn_prefect.jobs.preflight import load, runnable
from mn_prefect.model.blueprint import Blueprint

AGENT_ENTRYPOINT = "mn_prefect.jobs.agent.mn_agent"
JOB_ENTRYPOINT = "mn_prefect.jobs.coordinator.blueprint_job"
# The coordinator books nothing worth counting: it waits on its agents.
COORDINATOR_RESOURCES = {"cpu_cores": 0, "memory_mb": 0}


@dataclass(frozen=True)
class CompiledJob:
    """A validated, pre-checked blueprint and the flow that runs it."""

    blueprint: Blueprint
    raw: dict[str, Any]

    @property
    def flow(self):
        return blueprint_job

    def parameters(self, job_id: str | None = None, pool: str | None = None) -> dict[str, Any]:
        return {"blueprint": self.raw, "job_id": job_id, "pool": pool}

    def __call__(self, *, pool: str, job_id: str | None = None) -> dict:
        """Run the job in this process (its agents still run on the pool's workers)."""
        return blueprint_job(**self.parameters(job_id, pool))


def compile_blueprint(raw: dict[str, Any], *, local_checks: bool = True) -> CompiledJob:
    """Validate ``raw`` (BlueprintInvalid with every issue) and refuse what mn-prefect cannot run
    (JobRefused naming each agent and why), before anything is deployed or booked."""
    return CompiledJob(blueprint=runnable(load(raw), local=local_checks), raw=raw)


def _upsert(client, flow_name: str, fn, name: str, entrypoint: str, pool: str, *, parameters: dict | None = None,
            job_variables: dict | None = None, description: str | None = None, schedules: list | None = None,
            concurrency_limit: int | None = None, version: str | None = None) -> UUID:
    flow_id = client.create_flow_from_name(flow_name)
    return client.create_deployment(
        flow_id=flow_id, name=name, entrypoint=entrypoint, work_pool_name=pool, parameters=parameters or {},
        parameter_openapi_schema=parameter_schema(fn).model_dump_for_openapi(), job_variables=job_variables or {},
        description=description, enforce_parameter_schema=False, schedules=schedules,
        concurrency_limit=concurrency_limit, version=version)


def ensure_agent_deployment(client, pool: str) -> UUID:
    """The ``mn-agent/agents-<pool>`` deployment that agent runs are created from (created or updated)."""
    work_pool = client.read_work_pool(pool)
    if work_pool.type != "mn":
        raise ValueError(f"--pool: work pool {pool!r} is of type {work_pool.type!r}; blueprint jobs need an mn pool")
    name = agent_deployment_name(pool).split("/", 1)[1]  # the coordinator starts agents by this name
    return _upsert(client, AGENT_FLOW_NAME, mn_agent.fn, name, AGENT_ENTRYPOINT, pool,
                   job_variables={"resources": {}},
                   description="One attempt of one blueprint agent, pinned by its job's booking.")


def deploy_blueprint(client, job: CompiledJob, pool: str, name: str | None = None) -> tuple[UUID, str]:
    """Deploy the compiled job on ``pool``: (deployment id, "mn-blueprint-job/<name>")."""
    ensure_agent_deployment(client, pool)
    name = name or job.blueprint.job_name
    deployment_id = _upsert(
        client, JOB_FLOW_NAME, blueprint_job.fn, name, JOB_ENTRYPOINT, pool,
        parameters=job.parameters(pool=pool),
        # The coordinator lives as long as its job; typed batch or service so that, when its node is lost,
        # the reconciler re-places it like any run (system coordinators must not wait for their node).
        job_variables={"resources": COORDINATOR_RESOURCES,
                       "job_type": "batch" if job.blueprint.job_type in ("batch", "sysbatch") else "service",
                       "recovery_mode": job.blueprint.recovery_mode},
        description=f"Blueprint job {job.blueprint.job_name}: {len(job.blueprint.agents)} agent(s), "
                    f"{job.blueprint.job_type}.")
    return deployment_id, f"{JOB_FLOW_NAME}/{name}"


def start_job(client, job: CompiledJob, pool: str, name: str | None = None,
              job_variables: dict[str, Any] | None = None) -> tuple[str, FlowRun]:
    """Deploy and create one run: (job id, the coordinator's flow run). ``job_variables`` apply to the
    coordinator's run only (e.g. ``preferred_node``)."""
    deployment_id, _ = deploy_blueprint(client, job, pool, name)
    job_id = new_job_id(job.blueprint)
    run = client.create_flow_run_from_deployment(deployment_id, parameters=job.parameters(job_id, pool),
                                                 name=job_id, job_variables=job_variables)
    return job_id, run
