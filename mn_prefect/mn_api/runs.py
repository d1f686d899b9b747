"""A MirrorNeuron job (v1) or run (v2) as mn-prefect holds it: one Prefect flow run, and the store's record of
what it runs (a bundle's workflow record, or a blueprint job's state).

Ids map one to one: MirrorNeuron's run id (which the ``mn`` command chooses, and which is also its v1 job id) is
the bundle run's ``run_id`` and the flow run's tag ``mn-run:<run id>``; mn-prefect's job id and the Prefect
flow-run id find the same run. Statuses are MirrorNeuron's (pending, scheduled, running, paused, cancelling,
completed, failed, cancelled); events are derived from what changed between two looks (``changes``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from mn_prefect.mn_api.cluster import iso
from mn_prefect.mn_api.errors import not_found
from mn_prefect.model.scalars import is_uuid
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import (
    JobState,
    RunControlRecord,
    WorkflowRecord,
    get_record,
    list_records,
    run_control_id,
)

RUN_TAG = "mn-run:"
JOB_TAG = "mn-job:"
FINAL = ("completed", "failed", "cancelled")
# Prefect's state type -> MirrorNeuron's job status.
STATUS_OF_STATE = {"SCHEDULED": "pending", "PENDING": "scheduled", "RUNNING": "running", "PAUSED": "paused",
                   "CANCELLING": "cancelling", "COMPLETED": "completed", "FAILED": "failed", "CRASHED": "failed",
                   "CANCELLED": "cancelled"}
# A bundle step's state -> the MirrorNeuron event that announces it.
STEP_EVENT = {"running": "workflow_step_started", "queued": "workflow_step_ready", "completed": "workflow_step_completed",
              "failed": "workflow_step_failed", "skipped": "workflow_step_skipped", "partial": "workflow_step_partial",
              "blocked": "workflow_step_blocked", "retry_wait": "workflow_step_attempt_retry_scheduled",
              "cancelled": "workflow_step_failed"}


def taken_by_worker(state_type: str | None, start_time: Any) -> bool:
    """Whether a worker has a run in ``state_type``, so that cancelling it means Cancelling (its worker stops the
    process and releases its bookings) rather than Cancelled: Pending (its process may still go Running after a
    forced Cancelled, which Prefect accepts), Running or Paused after it started, or Cancelling already."""
    return state_type in ("PENDING", "CANCELLING") or (state_type in ("RUNNING", "PAUSED") and start_time is not None)


def cancel_flow_run(client, flow_run: Any, reason: str, *, before_start: str | None = None) -> bool:
    """Cancel ``flow_run`` (a Prefect FlowRun) as MirrorNeuron's cancel means it: Cancelling when a worker has it
    (``taken_by_worker``), else Cancelled at once (``before_start`` is then the message). Whether it was made
    Cancelling."""
    from prefect.states import Cancelled, Cancelling

    taken = taken_by_worker(flow_run.state_type.value if flow_run.state_type is not None else None,
                            flow_run.start_time)
    client.set_flow_run_state(flow_run.id, Cancelling(message=reason) if taken else
                              Cancelled(message=before_start or reason), force=True)
    return taken


@dataclass
class Run:
    """What one look at a run found."""

    run_id: str
    flow_run: Any = None  # prefect FlowRun, when there is one
    workflow: WorkflowRecord | None = None
    blueprint_job: JobState | None = None
    job_id: str | None = None  # MirrorNeuron v2 job (the deployment's job), from the flow run's tags
    ui_url: str | None = None
    paused: bool = False  # a running bundle run an operator paused (RunControlRecord)
    # A run the API holds until its job's deployment is ready (no flow run yet): failed or cancelled when it
    # never became one, and why; when it was asked for.
    outcome: str | None = None
    failure: str | None = None
    created: float | None = None

    @property
    def flow_run_id(self) -> str | None:
        if self.flow_run is not None:
            return str(self.flow_run.id)
        record = self.workflow or self.blueprint_job
        return record.flow_run_id if record is not None else None

    @property
    def state_type(self) -> str | None:
        state = getattr(self.flow_run, "state", None)
        return state.type.value if state is not None else None

    @property
    def status(self) -> str:
        if self.outcome is not None:
            return self.outcome
        state = self.state_type
        if state is not None and STATUS_OF_STATE.get(state) in FINAL + ("pending", "scheduled", "paused"):
            return STATUS_OF_STATE[state]
        record = self.workflow or self.blueprint_job
        if record is not None and record.status in FINAL:
            return record.status
        if record is not None and record.status == "crashed":
            return "failed"
        if self.paused and state in ("RUNNING", None):
            return "paused"
        return STATUS_OF_STATE.get(state or "", "running" if record is not None else "pending")

    @property
    def reason(self) -> str | None:
        if self.status in ("failed", "cancelled"):
            if self.failure:
                return self.failure
            state = getattr(self.flow_run, "state", None)
            if state is not None and state.message:
                return state.message
            record = self.blueprint_job
            return getattr(record, "reason", None)
        return None

    @property
    def url(self) -> str | None:
        flow_run_id = self.flow_run_id
        return f"{self.ui_url}/runs/flow-run/{flow_run_id}" if self.ui_url and flow_run_id else None

    def steps(self) -> dict[str, dict[str, Any]]:
        if self.workflow is not None:
            return {k: s.model_dump(mode="json") for k, s in self.workflow.steps.items()}
        if self.blueprint_job is not None:
            return {name: {"state": a.status, "node": a.node} for name, a in self.blueprint_job.agents.items()}
        return {}

    def snapshot(self) -> Snapshot:
        steps = {k: s.get("state") or "pending" for k, s in self.steps().items()}
        result = self.workflow.result if self.workflow is not None else None
        node = self.workflow.host if self.workflow is not None else None
        return Snapshot(status=self.status, steps=steps, result=result, reason=self.reason, node=node)

    def view(self) -> dict[str, Any]:
        """The run as ``mn job status`` / ``mn run status`` print it (and as ``mn blueprint run`` polls it)."""
        record = self.workflow or self.blueprint_job
        flow_run = self.flow_run
        submitted = iso(flow_run.created.timestamp()) if flow_run is not None and flow_run.created else (
            iso(record.created_at) if record is not None else iso(self.created) if self.created else None)
        updated = iso(record.updated_at) if record is not None else submitted
        return {"job_id": self.run_id, "run_id": self.run_id, "stable_job_id": self.job_id,
                "mn_prefect_job_id": record.job_id if record is not None else None,
                "job_name": getattr(record, "job_name", None) or (flow_run.name if flow_run is not None else None),
                "status": self.status, "submitted_at": submitted, "updated_at": updated,
                "result": shown_result(self.workflow.result, self.workflow.job_id) if self.workflow is not None
                else None,
                "failure": self.reason, "steps": self.steps(),
                "run_dir": self.workflow.run_dir if self.workflow is not None else None,
                "flow_run_id": self.flow_run_id, "flow_run_name": getattr(flow_run, "name", None),
                "flow_run_url": self.url, "prefect_state": self.state_type}


@dataclass(frozen=True)
class Snapshot:
    status: str = "none"
    steps: dict[str, str] = field(default_factory=dict)
    result: Any = None
    reason: str | None = None
    node: str | None = None


RESULT_SHOWN_BYTES = 2048  # a run's result up to this size is shown whole; a larger one as a summary


def shown_result(result: Any, job_id: str) -> Any:
    """The result as ``mn job status`` shows it: whole up to ``RESULT_SHOWN_BYTES`` of JSON, else a summary (its
    size, its top-level keys) saying how to read it whole (``mn-prefect job status <job id> --json``)."""
    if result is None:
        return None
    text = json.dumps(result, default=str, separators=(",", ":"))
    if len(text) <= RESULT_SHOWN_BYTES:
        return result
    keys = sorted(str(k) for k in result)[:20] if isinstance(result, dict) else None
    return {"truncated": True, "size_bytes": len(text.encode()), "keys": keys,
            "details": f"mn-prefect job status {job_id} --json"}


JOB_EVENTS = {"pending": "job_pending", "scheduled": "job_scheduled", "running": "job_running",
              "paused": "job_paused", "cancelling": "job_cancelling", "completed": "job_completed",
              "failed": "job_failed", "cancelled": "job_cancelled"}


def changes(before: Snapshot, after: Snapshot, run_id: str, now: float | None = None) -> list[dict[str, Any]]:
    """The MirrorNeuron events between two looks at a run: each step whose state changed, then the job's own
    status (the terminal one last, with the result or the reason). From ``Snapshot()``, a replay up to now."""
    stamp = iso(time.time() if now is None else now)
    out: list[dict[str, Any]] = []

    def event(kind: str, **fields: Any) -> None:
        out.append({"type": kind, "job_id": run_id, "timestamp": stamp, **fields, "version": 1})

    moved = after.status != before.status and after.status in JOB_EVENTS
    if moved:
        if before.status == "none" and after.status != "pending":
            event("job_pending")  # a replay starts where every run starts
        if after.status == "running" and before.status in ("none", "pending"):
            event("job_scheduled", node=after.node)
        if before.status == "paused" and after.status not in FINAL:
            event("job_resumed")
        if after.status not in FINAL:
            event(JOB_EVENTS[after.status], node=after.node)
    for step, state in after.steps.items():
        if before.steps.get(step) != state and state in STEP_EVENT:
            event(STEP_EVENT[state], step=step, step_id=step, agent_id=step, status=state)
    if moved and after.status == "completed":
        event("job_completed", result=after.result)
    elif moved and after.status in FINAL:
        event(JOB_EVENTS[after.status], reason=after.reason, error=after.reason)
    return out


def find(store: ClusterStore, client, given: str, *, ui_url: str | None = None, field: str = "job_id") -> Run:
    """The run ``given`` names (a MirrorNeuron run id, an mn-prefect job id, a Prefect flow-run id); NOT_FOUND."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.exceptions import ObjectNotFound

    given = given.strip()
    if not given:
        raise not_found(f"{field}: a job or run id is required")
    workflow = next((r for r in list_records(store, WorkflowRecord)
                     if given in (r.run_id, r.job_id, r.flow_run_id)), None)
    blueprint = None if workflow is not None else next(
        (j for j in list_records(store, JobState) if given in (j.job_id, j.flow_run_id)), None)
    record = workflow or blueprint
    flow_run_id = record.flow_run_id if record is not None else None
    flow_run = None
    if flow_run_id or is_uuid(given):
        try:
            flow_run = client.read_flow_run(flow_run_id or given)
        except ObjectNotFound:
            flow_run = None
    if flow_run is None:
        tagged = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[RUN_TAG + given])),
                                       limit=1)
        flow_run = tagged[0] if tagged else None
        if flow_run is not None and workflow is None and blueprint is None:
            workflow = next((r for r in list_records(store, WorkflowRecord) if r.flow_run_id == str(flow_run.id)),
                            None)
    if flow_run is None and workflow is None and blueprint is None:
        raise not_found(f"unknown job {given!r}: no run, mn-prefect job or Prefect flow run has that id")
    tags = list(getattr(flow_run, "tags", None) or [])
    run_id = next((t[len(RUN_TAG):] for t in tags if t.startswith(RUN_TAG)), None) or (
        workflow.run_id if workflow is not None else given)
    job_id = next((t[len(JOB_TAG):] for t in tags if t.startswith(JOB_TAG)), None)
    control = get_record(store, run_control_id(workflow.run_id), RunControlRecord) if workflow is not None else None
    return Run(run_id=run_id, flow_run=flow_run, workflow=workflow, blueprint_job=blueprint, job_id=job_id,
               ui_url=ui_url, paused=control is not None and control.status == "paused")


def list_runs(store: ClusterStore) -> list[dict[str, Any]]:
    """Every bundle run and blueprint job in the store, newest first, as ``mn job list`` reads them."""
    rows: list[tuple[float, dict[str, Any]]] = []
    for record in list_records(store, WorkflowRecord):
        status = {"crashed": "failed"}.get(record.status, record.status)
        rows.append((record.created_at, {"job_id": record.run_id, "graph_id": record.job_name,
                                         "job_name": record.job_name, "status": status,
                                         "mn_prefect_job_id": record.job_id, "flow_run_id": record.flow_run_id,
                                         "submitted_at": iso(record.created_at), "updated_at": iso(record.updated_at),
                                         "recovery_status": None, "recovery_requires_review": False}))
    for job in list_records(store, JobState):
        status = job.status if job.status in FINAL + ("pending", "running") else "running"
        rows.append((job.created_at, {"job_id": job.job_id, "graph_id": job.job_name, "job_name": job.job_name,
                                      "status": status, "mn_prefect_job_id": job.job_id,
                                      "flow_run_id": job.flow_run_id, "submitted_at": iso(job.created_at),
                                      "updated_at": iso(job.updated_at), "recovery_status": None,
                                      "recovery_requires_review": False}))
    rows.sort(key=lambda pair: pair[0], reverse=True)
    return [row for _, row in rows]
