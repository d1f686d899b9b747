"""Runtime estimates over the store: the durations of completed runs, kept per key, and a run's estimate from them
(the rule is ``mn_prefect.model.estimates``).

Keys name what runs again and again: a deployment (``deployment:<deployment id>``), a bundle step
(``step:<bundle id>/<step>``), a blueprint agent (``agent:<blueprint name>/<agent id>``). Each key's durations are
one small record (``RuntimeHistoryRecord``, job id ``runtime:<key>``) in the jobs table that every backend keeps.

A duration is how long the run held its booking: from the booking's commit to its release (for a blueprint agent,
whose booking is its job's, from the agent's run being started to its end as the coordinator saw it). That is the
time the capacity was unavailable to others, which is what holds and backfill must predict; Prefect's own
start -> end leaves out the launch (pull steps, a container's start) during which the booking is already held.

Only a completed run is a sample: a failed or cancelled run says nothing about how long the work takes. Two
processes recording under one key at the same instant may keep only one of the two durations (the record is read,
extended and written back): an estimate can afford to miss a sample, and a lock per release could not be afforded.
"""

from __future__ import annotations

import time
from typing import Any

from mn_prefect.model.blueprint import Agent
from mn_prefect.model.estimates import UNKNOWN, Estimate, estimate_of, is_sample, kept_history
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import JobState, RuntimeHistoryRecord, get_record, put_record, runtime_history_id


def deployment_key(deployment_id: Any) -> str:
    """The key of a deployment's flow runs."""
    return f"deployment:{deployment_id}"


def step_key(bundle_id: str, step: str) -> str:
    """The key of a bundle's step (its step id, or its agent's id where the bundle has no steps)."""
    return f"step:{bundle_id}/{step}"


def agent_key(blueprint: str, agent: str) -> str:
    """The key of a blueprint's agent (its id; a system job's ``agent@node`` copies share their agent's key)."""
    return f"agent:{blueprint}/{agent}"


def run_key(flow_run: Any) -> str | None:
    """The key of a flow run: its deployment's; None for a run of no deployment (nothing to learn from)."""
    deployment_id = getattr(flow_run, "deployment_id", None)
    return None if deployment_id is None else deployment_key(deployment_id)


def history(store: ClusterStore, key: str) -> list[float]:
    """The durations in seconds of the last completed runs under ``key``, oldest first (empty when none)."""
    record = get_record(store, runtime_history_id(key), RuntimeHistoryRecord)
    return [] if record is None else list(record.durations_s)


def record_duration(store: ClusterStore, key: str, seconds: float) -> bool:
    """Add a completed run's ``seconds`` to ``key``'s history (only the last ones are kept); False, and nothing
    written, when the duration is no sample (negative or not finite)."""
    if not is_sample(seconds):
        return False
    job_id = runtime_history_id(key)
    record = get_record(store, job_id, RuntimeHistoryRecord)
    if record is None:
        record = RuntimeHistoryRecord(job_id=job_id, key=key)
    put_record(store, record.model_copy(update={"durations_s": kept_history(record.durations_s, seconds),
                                                "count": record.count + 1}))
    return True


def estimate_for(store: ClusterStore, key: str | None, *, declared: float | None = None,
                 timeout: float | None = None, is_limit: bool = False) -> Estimate:
    """The estimate of a run under ``key``: ``declared`` seconds (``is_limit``: marked a limit), else ``timeout``
    seconds, else learned from the key's history; the store is read only when neither is given."""
    if declared is not None or timeout is not None:
        return estimate_of(declared, timeout, (), is_limit=is_limit)
    if key is None:
        return UNKNOWN
    return estimate_of(None, None, history(store, key))


def held_seconds(store: ClusterStore, booking: str, *, now: float | None = None) -> float | None:
    """How long ``booking`` was held, in seconds: from its latest commit to its release (``now``, default the
    clock, when it is still held in part: a system run's part released while its other parts stand); None when
    the store has no history of it."""
    entries = store.history(booking)
    if not entries:
        return None
    latest = max(entries, key=lambda entry: entry.committed_at)
    ended = latest.released_at if latest.released_at is not None else (time.time() if now is None else now)
    return ended - latest.committed_at


def record_held(store: ClusterStore, key: str, booking: str) -> float | None:
    """Record under ``key`` how long ``booking`` (a completed run's, just released) was held: the seconds recorded,
    or None when nothing was (no history, or no sample)."""
    seconds = held_seconds(store, booking)
    if seconds is None or not record_duration(store, key, seconds):
        return None
    return seconds


def agent_estimate(store: ClusterStore, blueprint: str, agent: Agent) -> Estimate:
    """A blueprint agent's estimate: its ``config.timeout_seconds`` when it has one, else learned from its past
    completed runs."""
    return estimate_for(store, agent_key(blueprint, agent.agent_id), timeout=agent.config.timeout_seconds)


def record_agent_run(store: ClusterStore, job: JobState, agent_id: str) -> float | None:
    """Agent ``agent_id`` of ``job`` was seen to end: when its current run completed, how long it ran (from its
    start by the coordinator to its end as the coordinator saw it; the booking is the job's and outlives it) is
    recorded under its agent's key (a system job's copies under the agent they copy). The seconds recorded, or
    None."""
    track = job.agents.get(agent_id)
    run = None if track is None else track.current
    if track is None or run is None or run.state != "COMPLETED" or run.ended_at is None:
        return None
    seconds = run.ended_at - run.started_at
    return seconds if record_duration(store, agent_key(job.job_name, track.source_agent_id), seconds) else None
