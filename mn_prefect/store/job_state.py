"""A blueprint job's durable record in the store: its agents, their runs, restarts and bookings.

The coordinator flow writes it on every change; ``job status``, the worker's sweep and the lifecycle flows
read it. It lives in ``JobRecord.spec`` so every store backend keeps it without a schema of its own.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field

from mn_prefect.model.policies import RetryPolicy
from mn_prefect.store.base import ClusterStore, Event, JobRecord

JOB_STATUSES = ("pending", "waiting", "running", "completed", "failed", "cancelled")
FINISHED = ("completed", "failed", "cancelled")
AGENT_FINISHED = ("completed", "failed", "stopped")


class AgentRun(BaseModel):
    """One attempt of an agent: a child flow run of the job's coordinator."""

    run_id: str
    attempt: int
    state: str = "SCHEDULED"
    started_at: float = Field(default_factory=time.time)
    ended_at: float | None = None
    message: str | None = None


class AgentTrack(BaseModel):
    """An agent (or one ``agent@node`` copy of a system job) through the life of its job."""

    agent_id: str
    source_agent_id: str
    node: str | None = None
    booking: str | None = Field(None, description="The store job id its placement is booked under.")
    status: str = "pending"  # pending | running | restarting | completed | failed | stopped
    runs: list[AgentRun] = Field(default_factory=list)
    restarts_ms: list[int] = Field(default_factory=list)
    reschedules_ms: list[int] = Field(default_factory=list)
    restart: RetryPolicy
    reschedule: RetryPolicy
    next_start_at: float | None = None
    reason: str | None = None
    blocked_backoff_s: float = 0.0

    @property
    def current(self) -> AgentRun | None:
        return self.runs[-1] if self.runs else None

    def remaining(self, now_ms: int | None = None) -> dict[str, int | None]:
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        return {"restarts": self.restart.remaining(self.restarts_ms, now_ms),
                "reschedules": self.reschedule.remaining(self.reschedules_ms, now_ms)}


class JobState(BaseModel):
    """What ``JobRecord.spec`` holds for a blueprint job."""

    job_id: str
    job_name: str
    job_type: str
    status: str = "pending"
    reason: str | None = None
    flow_run_id: str | None = None
    pool: str | None = None
    strategy: str = "binpack"
    recovery_mode: str = "local_restart"
    plan: dict[str, Any] | None = None
    bookings: list[str] = Field(default_factory=list)
    agents: dict[str, AgentTrack] = Field(default_factory=dict)
    generation: int = Field(1, description="Grows each time the coordinator is re-placed after losing its node.")

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def record(self) -> JobRecord:
        return JobRecord(job_id=self.job_id, name=self.job_name, job_type=self.job_type, status=self.status,
                         spec=self.model_dump(mode="json"), updated_at=time.time())

    def save(self, store: ClusterStore) -> None:
        existing = store.get_job(self.job_id)
        record = self.record()
        if existing is not None:
            record.created_at = existing.created_at
        store.put_job(record)


def load_job(store: ClusterStore, job_id: str) -> JobState | None:
    """The job's state, or None when ``job_id`` is not a blueprint job."""
    record = store.get_job(job_id)
    if record is None or "agents" not in record.spec:
        return None
    return JobState.model_validate(record.spec)


def owning_job(booking_id: str) -> str:
    """The job a booking id belongs to: ``J`` for gang bookings, ``J@node`` for a system copy."""
    return booking_id.rsplit("@", 1)[0] if "@" in booking_id else booking_id


def release_job(store: ClusterStore, job: JobState, status: str, reason: str) -> int:
    """Release every booking of ``job``, mark it finished with ``reason`` and record the event."""
    released = sum(store.release(b) for b in dict.fromkeys([*job.bookings, job.job_id]))
    job.status, job.reason = status, reason
    for track in job.agents.values():
        if track.status not in AGENT_FINISHED:
            track.status = "stopped"
    job.save(store)
    store.record_event(Event(kind=f"job.{status}", job_id=job.job_id, reason=reason, data={"released": released}))
    return released
