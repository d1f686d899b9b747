"""What ``store audit`` finds about owners (bookings that outlived their owner, reservations that hold nothing, held
capacity no live booking accounts for), and what ``--repair`` does about each; who owns a booking and whether that
owner is gone is ``lifecycle.owners``."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Literal

from mn_prefect import events
from mn_prefect.lifecycle.owners import RunState, judge, utc_text
from mn_prefect.placement import bookings
from mn_prefect.placement.reservations import is_reservation
from mn_prefect.store.base import ClusterStore, Event
from mn_prefect.store.records import ReservationRecord, get_record, list_records

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
            found.append(Finding("owner_ended", booking, f"booking {booking} ({verdict.owner.words})"
                                                         f" outlived its owner: {verdict.why}", "release it"))
    for record in list_records(store, ReservationRecord, status="active"):
        if record.expires_at <= now:
            continue  # its time is up: ending it is expiry's work (and its booking, if any, is found above)
        held = [p for p in store.active_placements(job_id=record.job_id) if p.reserves == record.job_id]
        if not held:
            found.append(Finding("reservation_not_held", record.job_id,
                                 f"reservation {record.job_id} is active until {utc_text(record.expires_at)} but holds no "
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
        reservations.end(store, record, "expired", f"expired at {utc_text(record.expires_at)} (found by the audit)",
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


def _describe(resources: object) -> str:
    return json.dumps(resources, sort_keys=True)
