"""A blueprint job's durable record in the store: its agents, their runs, restarts and bookings.

The coordinator flow writes it on every change; ``job status``, the worker's sweep and the lifecycle flows
read it. It is the ``blueprint_job`` kind of the store's typed records (``mn_prefect.store.records``), so every
store backend keeps it without a schema of its own.
"""

from __future__ import annotations

from mn_prefect.model.blueprint_job import AgentRun, AgentTrack
from mn_prefect.model.bookings import job_booking, owning_job
from mn_prefect.model.recovery import SYSTEM_TYPES
from mn_prefect.model.states import FINISHED_AGENT_STATUSES, FINISHED_JOB_STATUSES, JOB_STATUSES
from mn_prefect.store.base import ClusterStore, Event
from mn_prefect.store.records import JobState, get_record
from mn_prefect.store.releasing import release

FINISHED = FINISHED_JOB_STATUSES
AGENT_FINISHED = FINISHED_AGENT_STATUSES

__all__ = ["AGENT_FINISHED", "FINISHED", "JOB_STATUSES", "AgentRun", "AgentTrack", "JobState", "load_job",
           "owning_job", "release_job"]


def load_job(store: ClusterStore, job_id: str) -> JobState | None:
    """The job's state, or None when ``job_id`` is not a blueprint job."""
    return get_record(store, job_id, JobState)


def release_job(store: ClusterStore, job: JobState, status: str, reason: str) -> int:
    """Release every booking of ``job``, mark it finished with ``reason`` and record the event."""
    if status not in FINISHED_JOB_STATUSES:
        raise ValueError(f"a job is released as one of {sorted(FINISHED_JOB_STATUSES)}, not {status!r}")
    system = job.job_type in SYSTEM_TYPES
    released = sum(release(store, job_booking(job.job_id, b, system=system), "job_finished")
                   for b in dict.fromkeys([*job.bookings, job.job_id]))
    job.status, job.reason = status, reason  # type: ignore[assignment]  # checked above
    for track in job.agents.values():
        if track.status not in AGENT_FINISHED:
            track.status = "stopped"
    job.save(store)
    store.record_event(Event(kind=f"job.{status}", job_id=job.job_id, reason=reason, data={"released": released}))
    return released
