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
from typing import Literal

from mn_prefect.model.states import TERMINAL_RUN_STATES
from mn_prefect.placement import bookings
from mn_prefect.placement.job_state import load_job
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import ReservationRecord, WorkflowRecord, get_record

OwnerKind = Literal["reservation", "blueprint_job", "bundle_step", "flow_run", "unknown"]

_LIVE_WORKFLOW = frozenset({"pending", "running"})

# A flow run's state type (``COMPLETED``...), None when no such run exists; raises when it cannot be read now.
RunState = Callable[[str], str | None]


@dataclass(frozen=True)
class Owner:
    booking: str
    kind: OwnerKind
    id: str  # the owner's own id: the reservation, the job, the bundle run's job, the flow run


@dataclass(frozen=True)
class Verdict:
    """``gone``: True when the owner has ended, False while it lives, None when it cannot be told here."""

    owner: Owner
    gone: bool | None
    why: str


def owner_of(store: ClusterStore, booking: str) -> Owner:
    """The owner's kind and id as the audit names them (a system job's copy is its blueprint job's)."""
    owner = bookings.classify(store, booking)
    if isinstance(owner, bookings.Reservation):
        return Owner(booking, "reservation", booking)
    if isinstance(owner, bookings.StepAttempt):
        return Owner(booking, "bundle_step", owner.workflow_job)
    if isinstance(owner, (bookings.JobBooking, bookings.SystemCopy)):
        return Owner(booking, "blueprint_job", owner.job_id)
    if isinstance(owner, bookings.FlowRun):
        return Owner(booking, "flow_run", booking)
    return Owner(booking, "unknown", booking)


def judge(store: ClusterStore, booking: str, *, run_state: RunState | None = None,
          now: float | None = None) -> Verdict:
    """Whether ``booking``'s owner has ended. ``run_state`` reads flow runs (Prefect); without it, a flow
    run's fate cannot be told, and jobs and bundle runs are judged by their records alone."""
    now = time.time() if now is None else now
    owner = owner_of(store, booking)
    if owner.kind == "reservation":
        record = get_record(store, owner.id, ReservationRecord)
        if record is None:
            return Verdict(owner, True, f"reservation {owner.id} has no record")
        if record.status != "active":
            return Verdict(owner, True, f"reservation {owner.id} is {record.status}")
        if record.expires_at <= now:
            return Verdict(owner, True, f"reservation {owner.id} expired at "
                                        f"{utc_text(record.expires_at)}")
        return Verdict(owner, False, f"reservation {owner.id} is active")
    if owner.kind == "blueprint_job":
        job = load_job(store, owner.id)
        if job is None:
            return Verdict(owner, True, f"job {owner.id} has no record")
        if job.finished:
            return Verdict(owner, True, f"job {owner.id} is {job.status}")
        return _by_run(owner, job.flow_run_id, f"job {owner.id}'s coordinator run", run_state)
    if owner.kind == "bundle_step":
        workflow = get_record(store, owner.id, WorkflowRecord)
        if workflow is None:
            return Verdict(owner, True, f"bundle run {owner.id} has no record")
        if workflow.status not in _LIVE_WORKFLOW:
            return Verdict(owner, True, f"bundle run {owner.id} is {workflow.status}")
        return _by_run(owner, workflow.flow_run_id, f"bundle run {owner.id}'s flow run", run_state)
    if owner.kind == "flow_run":
        return _by_run(owner, owner.id, f"flow run {owner.id}", run_state, unknown_without=True)
    return Verdict(owner, None, f"{booking} is no reservation, job, bundle step or flow run")


def _by_run(owner: Owner, run_id: str | None, what: str, run_state: RunState | None, *,
            unknown_without: bool = False) -> Verdict:
    if run_id is None or run_state is None:
        return Verdict(owner, None if unknown_without else False,
                       f"{what} cannot be read here" if unknown_without else f"{owner.kind.replace('_', ' ')} "
                                                                             f"{owner.id} is running")
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
