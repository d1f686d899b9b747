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

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from mn_prefect import events
from mn_prefect.model.states import TERMINAL_RUN_STATES
from mn_prefect.placement import bookings
from mn_prefect.placement.job_state import load_job
from mn_prefect.placement.reservations import is_reservation
from mn_prefect.store.base import ClusterStore, Event
from mn_prefect.store.records import ReservationRecord, WorkflowRecord, get_record, list_records

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
                                        f"{_utc(record.expires_at)}")
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


# -- the audit of owners -----------------------------------------------------------------------------------------

FindingKind = Literal["owner_ended", "reservation_not_held", "derived_state"]


@dataclass
class Finding:
    """One thing ``store audit`` found about owners, and what ``--repair`` does (or did) about it."""

    kind: FindingKind
    subject: str  # the booking, the reservation, or the node whose derived state is off
    text: str
    repair: str
    repaired: bool = False
    outcome: str | None = None

    def as_json(self) -> dict:
        return {"kind": self.kind, "subject": self.subject, "finding": self.text, "repair": self.repair,
                "repaired": self.repaired, "outcome": self.outcome}


def owner_findings(store: ClusterStore, *, run_state: RunState | None = None,
                   now: float | None = None) -> list[Finding]:
    """Bookings that outlived their owner, live reservations that hold no capacity, and held capacity (device and
    port claims, usage counters) that no live booking accounts for."""
    now = time.time() if now is None else now
    found: list[Finding] = []
    for booking in sorted(store.active_jobs()):
        verdict = judge(store, booking, run_state=run_state, now=now)
        if verdict.gone:
            found.append(Finding("owner_ended", booking, f"booking {booking} ({verdict.owner.kind.replace('_', ' ')})"
                                                         f" outlived its owner: {verdict.why}", "release it"))
    for record in list_records(store, ReservationRecord, status="active"):
        if record.expires_at <= now:
            continue  # its time is up: ending it is expiry's work (and its booking, if any, is found above)
        held = [p for p in store.active_placements(job_id=record.job_id) if p.reserves == record.job_id]
        if not held:
            found.append(Finding("reservation_not_held", record.job_id,
                                 f"reservation {record.job_id} is active until {_utc(record.expires_at)} but holds no "
                                 "capacity", f"hold {_describe(record.resources)} again on "
                                             f"{', '.join(record.nodes) or record.node or 'a node of its group'}"))
    for line in store.repair_derived(dry_run=True):
        found.append(Finding("derived_state", "", line, "make it agree with the live bookings"))
    return found


def repair(store: ClusterStore, findings: list[Finding], *, now: float | None = None) -> list[Finding]:
    """Fix each finding (the derived state last, once the bookings are right), recording an ``audit.repaired``
    event for each fix; the findings, marked repaired or not with what happened."""
    now = time.time() if now is None else now
    for finding in findings:
        if finding.kind == "owner_ended":
            _release_ended(store, finding, now)
        elif finding.kind == "reservation_not_held":
            _hold_again(store, finding, now)
    if any(f.kind == "derived_state" for f in findings):
        done = store.repair_derived()
        for finding in findings:
            if finding.kind == "derived_state":
                finding.repaired, finding.outcome = True, "fixed" if done else "already agreed"
        for line in done:
            store.record_event(Event(kind="audit.repaired", at=now, reason=line))
            events.audit_repaired("derived_state", None, line)
    return findings


def _release_ended(store: ClusterStore, finding: Finding, now: float) -> None:
    from mn_prefect.placement import reservations

    booking = finding.subject
    placements = store.active_placements(job_id=booking)
    record = get_record(store, booking, ReservationRecord) if is_reservation(booking) else None
    if record is not None and record.status == "active":
        reservations.end(store, record, "expired", f"expired at {_utc(record.expires_at)} (found by the audit)",
                         now=now)
        released = bool(placements)
    else:
        released = bookings.release(store, bookings.classify(store, booking), "audit_owner_ended") > 0
    finding.repaired = True
    finding.outcome = "released" if released else "already released"
    reason = f"audit repair: {finding.text}"
    store.record_event(Event(kind="audit.repaired", at=now, job_id=booking, reason=reason,
                             data={"nodes": sorted({p.node for p in placements})}))
    for node in sorted({p.node for p in placements}):
        events.placement("released", node, booking, reason=reason)
    events.audit_repaired(finding.kind, booking, f"{finding.text}: {finding.outcome}",
                          nodes=sorted({p.node for p in placements}))


def _hold_again(store: ClusterStore, finding: Finding, now: float) -> None:
    from mn_prefect.model.resources import resource_request
    from mn_prefect.placement import reservations
    from mn_prefect.placement.placing import Placer

    rid = finding.subject
    record = get_record(store, rid, ReservationRecord)
    if record is None or record.status != "active":
        finding.outcome = "the reservation has ended since"
        return
    # First what it held before (the same node, devices and amounts: what every process knows it by), else the
    # same request on the same node.
    history = store.history(rid)
    previous = history[-1].placements if history else []
    commit = store.commit_plan(rid, previous) if previous else None
    if commit is not None:
        reservations.announce_ended(store, commit.ended)
    if commit is None or not commit.ok:
        node = record.nodes[0] if record.nodes else record.node
        ask = reservations.reservation_ask(resource_request(record.resources), node)
        result = Placer(store, group=record.group).place(rid, [ask], update={"reserves": rid})
        if not result.placed:
            why = result.plan.reason if result.commit is None or result.commit.conflict is None else \
                result.commit.conflict.reason
            finding.outcome = f"cannot hold it again now: {why}"
            return
        commit = result.commit
    assert commit is not None
    finding.repaired, finding.outcome = True, f"held again on {', '.join(p.node for p in commit.placements)}"
    store.record_event(Event(kind="audit.repaired", at=now, job_id=rid, reason=f"audit repair: {finding.text}; "
                                                                                  f"{finding.outcome}"))
    reservations.emit("held", record, f"held again by the audit: {finding.outcome}")
    events.audit_repaired(finding.kind, rid, f"{finding.text}: {finding.outcome}",
                          nodes=[p.node for p in commit.placements])


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def _describe(resources: object) -> str:
    return json.dumps(resources, sort_keys=True)
