"""Who owns a booking, and whether that owner is gone: what every releaser asks before it releases.

A booking's id says what kind of thing holds it; the store's records say whether that thing still lives:

- a reservation (``rsv-<hex>``): live while its record is active and its time is not up;
- a blueprint job (its job record, also ``<job>@<node>`` for a system job's copy): live until the job finishes,
  or, when flow runs can be read, until its coordinator run is over;
- a bundle step attempt (``<workflow job>#<launch>``): live while its workflow record is running, or, when flow
  runs can be read, until the bundle's flow run is over;
- a flow run (a UUID, a system run's parts included): live until the run ends; only Prefect can say.

Anything else has an unknown owner, and nothing releases it automatically.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from mn_prefect.model.bookings import Owner
from mn_prefect.model.states import TERMINAL_RUN_STATES
from mn_prefect.placement import bookings
from mn_prefect.placement.job_state import load_job
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import ReservationRecord, WorkflowRecord, get_record

_LIVE_WORKFLOW = frozenset({"pending", "running"})

# A flow run's state type (``COMPLETED``...), None when no such run exists; raises when it cannot be read now.
RunState = Callable[[str], str | None]


@dataclass(frozen=True)
class Verdict:
    """``gone``: True when the owner has ended, False while it lives, None when it cannot be told here."""

    owner: Owner
    gone: bool | None
    why: str


def owner_of(store: ClusterStore, booking: str) -> Owner:
    """``booking``'s owner as the store tells it (``placement.bookings.classify``)."""
    return bookings.classify(store, booking)


def judge(store: ClusterStore, booking: str, *, run_state: RunState | None = None,
          now: float | None = None) -> Verdict:
    """Whether ``booking``'s owner has ended. ``run_state`` reads flow runs (Prefect); without it, a flow
    run's fate cannot be told, and jobs and bundle runs are judged by their records alone."""
    now = time.time() if now is None else now
    owner = owner_of(store, booking)
    if isinstance(owner, bookings.Reservation):
        record = get_record(store, owner.owner_id, ReservationRecord)
        if record is None:
            return Verdict(owner, True, f"reservation {owner.owner_id} has no record")
        if record.status != "active":
            return Verdict(owner, True, f"reservation {owner.owner_id} is {record.status}")
        if record.expires_at <= now:
            return Verdict(owner, True, f"reservation {owner.owner_id} expired at "
                                        f"{utc_text(record.expires_at)}")
        return Verdict(owner, False, f"reservation {owner.owner_id} is active")
    if isinstance(owner, (bookings.JobBooking, bookings.SystemCopy)):
        job = load_job(store, owner.owner_id)
        if job is None:
            return Verdict(owner, True, f"job {owner.owner_id} has no record")
        if job.finished:
            return Verdict(owner, True, f"job {owner.owner_id} is {job.status}")
        return _by_run(owner, job.flow_run_id, f"job {owner.owner_id}'s coordinator run", run_state)
    if isinstance(owner, bookings.StepAttempt):
        workflow = get_record(store, owner.owner_id, WorkflowRecord)
        if workflow is None:
            return Verdict(owner, True, f"bundle run {owner.owner_id} has no record")
        if workflow.status not in _LIVE_WORKFLOW:
            return Verdict(owner, True, f"bundle run {owner.owner_id} is {workflow.status}")
        return _by_run(owner, workflow.flow_run_id, f"bundle run {owner.owner_id}'s flow run", run_state)
    if isinstance(owner, bookings.FlowRun):
        return _by_run(owner, owner.owner_id, f"flow run {owner.owner_id}", run_state, unknown_without=True)
    return Verdict(owner, None, f"{booking} is no reservation, job, bundle step or flow run")


def _by_run(owner: Owner, run_id: str | None, what: str, run_state: RunState | None, *,
            unknown_without: bool = False) -> Verdict:
    if run_id is None or run_state is None:
        return Verdict(owner, None if unknown_without else False,
                       f"{what} cannot be read here" if unknown_without else f"{owner.words} {owner.owner_id} "
                                                                             "is running")
    try:
        state = run_state(run_id)
    except Exception as error:  # the API is away: say so rather than guess
        return Verdict(owner, None, f"{what} cannot be read now ({error})")
    if state is None:
        return Verdict(owner, True, f"{what} no longer exists")
    if state in TERMINAL_RUN_STATES:
        return Verdict(owner, True, f"{what} is {state.lower()}")
    return Verdict(owner, False, f"{what} is {state.lower()}")


def utc_text(at: float) -> str:
    """A time for people: ``2026-12-03 07:12:00 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
