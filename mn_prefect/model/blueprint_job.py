"""A blueprint job as it runs: its agents, their runs, restarts, reschedules and bookings.

Plain data: the job's machine (``mn_prefect.jobs.machine``) updates it, the store keeps it as the
``blueprint_job`` record (``mn_prefect.store.records.JobState``), ``job status`` shows it.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field

from mn_prefect.model.policies import JobType, RecoveryMode, RetryPolicy, Strategy
from mn_prefect.model.states import FINISHED_JOB_STATUSES, AgentStatus, JobStatus, RunState


class AgentRun(BaseModel):
    """One attempt of an agent: a child flow run of the job's coordinator."""

    run_id: str
    attempt: int
    state: RunState = "SCHEDULED"
    started_at: float = Field(default_factory=time.time)
    ended_at: float | None = None
    message: str | None = None


class AgentTrack(BaseModel):
    """An agent (or one ``agent@node`` copy of a system job) through the life of its job."""

    agent_id: str
    source_agent_id: str
    node: str | None = None
    booking: str | None = Field(None, description="The store job id its placement is booked under.")
    status: AgentStatus = "pending"
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

    @property
    def next_attempt(self) -> int:
        """The number of the agent's next run (1 for its first)."""
        return len(self.runs) + 1

    def remaining(self, now_ms: int | None = None) -> dict[str, int | None]:
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        return {"restarts": self.restart.remaining(self.restarts_ms, now_ms),
                "reschedules": self.reschedule.remaining(self.reschedules_ms, now_ms)}


class BlueprintJob(BaseModel):
    """A blueprint job: its agents, their runs, restarts and bookings."""

    job_id: str = Field(min_length=1)
    job_name: str
    job_type: JobType
    status: JobStatus = "pending"
    reason: str | None = None
    flow_run_id: str | None = None
    pool: str | None = None
    strategy: Strategy = "binpack"
    recovery_mode: RecoveryMode = "local_restart"
    plan: dict[str, Any] | None = Field(None, description="The scheduler's plan as JSON (shown as it is).")
    bookings: list[str] = Field(default_factory=list)
    agents: dict[str, AgentTrack] = Field(default_factory=dict)
    generation: int = Field(1, description="Grows each time the coordinator is re-placed after losing its node.")

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_JOB_STATUSES

    def summary(self) -> dict[str, Any]:
        """The job's status and, per agent, its node, status and number of runs (what the coordinator returns)."""
        return {"job_id": self.job_id, "status": self.status, "reason": self.reason,
                "agents": {a: {"node": t.node, "status": t.status, "attempts": len(t.runs)}
                           for a, t in self.agents.items()}}
