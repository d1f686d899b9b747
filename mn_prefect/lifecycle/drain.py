"""Drain (docs/operating.md): maintenance plus movement, with a deadline.

A drain is a record in the store (``drain:<node>``) next to the node's ``draining`` status. Each pass
(``advance_drains``, from the scheduled reconcile flow or ``node drain --wait``) decides per booking on the
node with ``drain_action``: service work with ``cluster_recover`` migrates at once (not counted as a
reschedule); batch work may finish until the deadline, then migrates only if safe to retry; system and
sysbatch work is left alone; unsafe leftovers pause for review and are never killed. A placement that
cannot be made keeps the node draining and is retried. When nothing movable is left, the node goes to
``maintenance`` and the drain is complete. Blueprint jobs move their own agents (their coordinator reads
the same decision); this module moves plain flow runs. Each step is recorded in the store's event log and
emitted as ``mn.job.<paused|migrating|migrated>`` (mn_prefect.events).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from mn_prefect import events
from mn_prefect.lifecycle.eligibility import keep_eligibility
from mn_prefect.lifecycle.reconcile import RunEffects, run_record
from mn_prefect.lifecycle.states import apply_transition
from mn_prefect.model.recovery import drain_action
from mn_prefect.placement import bookings
from mn_prefect.placement.job_state import load_job, owning_job
from mn_prefect.placement.reservations import is_reservation
from mn_prefect.store.base import ClusterStore, Event, Lease
from mn_prefect.store.records import (
    DrainRecord,
    FlowRunRecord,
    JobState,
    ReservationRecord,
    drain_record_id,
    get_record,
    list_records,
    put_record,
)

DEFAULT_DEADLINE_S = 30 * 60


Drain = DrainRecord  # the store's drain record (``drain:<node>``): node, reason, deadline, started_at, status


def active_drain(store: ClusterStore, node: str) -> Drain | None:
    drain = get_record(store, drain_record_id(node), DrainRecord)
    return drain if drain is not None and drain.status == "active" else None


class DrainRefused(RuntimeError):
    pass


def start_drain(store: ClusterStore, node: str, reason: str, *, deadline_s: float = DEFAULT_DEADLINE_S,
                now: float | None = None, dry_run: bool = False) -> Drain:
    """Put ``node`` in ``draining`` (no new placements) with a deadline; nothing moves until the next pass."""
    now = time.time() if now is None else now
    stored = store.get_node(node)
    if stored is None:
        raise DrainRefused(f"no node named {node!r} is registered")
    drain = Drain(job_id=drain_record_id(node), node=node, reason=reason, deadline=now + deadline_s, started_at=now)
    if dry_run:
        return drain
    current = stored.record.status
    if current != "draining":
        # Out of service like maintenance, which the drain ends in: not eligible until it leaves maintenance.
        if apply_transition(store, node, current, "draining", reason=f"drain: {reason}", now=now,
                            eligible=False) is None:
            raise DrainRefused(f"node {node} changed state while the drain started; try again")
        keep_eligibility(store, node, stored.record.scheduling_eligible, current, now=now)
    put_record(store, drain)
    return drain


def close_drain(store: ClusterStore, node: str, status: Literal["complete", "cancelled"]) -> None:
    drain = active_drain(store, node)
    if drain is not None:
        drain.status = status
        put_record(store, drain)


@dataclass
class DrainPass:
    node: str
    status: str  # draining | complete | cancelled
    deadline: float
    actions: list[dict] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"node": self.node, "status": self.status, "deadline": self.deadline, "actions": self.actions,
                "remaining": sum(1 for a in self.actions if a["action"] not in ("ignore", "migrated"))}


def advance_drain(store: ClusterStore, effects: RunEffects, node: str, *, now: float | None = None,
                  lease: Lease | None = None, dry_run: bool = False) -> DrainPass | None:
    """One pass over a draining node; None when the node has no active drain."""
    now = time.time() if now is None else now
    drain = active_drain(store, node)
    if drain is None:
        return None
    result = DrainPass(node=node, status="draining", deadline=drain.deadline)
    passed = now >= drain.deadline
    if not dry_run:
        result.actions.extend(_finish_migrations(store, effects, node, lease))
    for booking in sorted({p.job_id for p in store.active_placements(node=node) if p.job_id}):
        result.actions.append(_drain_one(store, effects, booking, node, passed, lease, dry_run))
    if any(a["action"] == "wait" for a in result.actions) or any(
            r.node == node for r in list_records(store, FlowRunRecord, status="migrating")):
        return result
    if all(a["action"] in ("ignore", "migrated") for a in result.actions):
        if not dry_run:  # only ignored work (or nothing) is left
            apply_transition(store, node, "draining", "maintenance", reason=f"drain complete: {drain.reason}", now=now)
            close_drain(store, node, "complete")
        result.status = "complete"
    return result


def _drain_one(store: ClusterStore, effects: RunEffects | None, booking: str, node: str, passed: bool,
               lease: Lease | None, dry_run: bool) -> dict:
    """What to do with one booking on a draining node; ``effects`` may be None only for a dry run."""
    if is_reservation(booking):
        # Not the drain's to end: the capacity is a team's until the reservation expires or is released.
        reservation = get_record(store, booking, ReservationRecord)
        until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(reservation.expires_at)) if reservation \
            else "it ends"
        return {"job_id": booking, "action": "wait",
                "reason": f"reservation {booking} holds capacity here until {until}; release it to finish sooner"}
    job = load_job(store, owning_job(booking))
    if job is not None:
        # The coordinator moves its own agents; the drain only waits for their bookings to leave.
        if job.job_type in ("system", "sysbatch"):
            return {"job_id": booking, "action": "ignore", "reason": f"{job.job_type} work stays on its node"}
        return {"job_id": booking, "action": "wait", "reason": "blueprint job: its coordinator moves its agents"}
    record = run_record(store, booking)
    if record is None:
        return {"job_id": booking, "action": "pause", "reason": "unknown booking: left for review"}
    if any(j.flow_run_id == booking for j in list_records(store, JobState)):
        # A blueprint job's coordinator books nothing and only talks to the API: moving it would stop its job.
        return {"job_id": booking, "action": "ignore", "reason": "a blueprint job's coordinator (books nothing)"}
    mode = record.recovery_mode
    action, why = drain_action(record.job_type, mode, safe_to_retry=mode == "cluster_recover",
                               deadline_passed=passed)
    if dry_run or action in ("wait", "ignore"):
        return {"job_id": booking, "action": action, "reason": why}
    if action == "pause":
        if record.status != "paused":
            record.status = "paused"
            put_record(store, record)
            store.record_event(Event(kind="job.paused", node=node, job_id=booking, reason=f"drain: {why}"))
            events.job_status("paused", booking, reason=f"drain: {why}", node_name=node)
        return {"job_id": booking, "action": "pause", "reason": why}
    # Migrate in two steps: stop the run here (its worker releases the booking when the process ends), then,
    # once it is over, schedule it again for the placers (a drain move is not a reschedule attempt).
    if effects is None:
        raise ValueError("a drain that changes runs needs their effects (None only with dry_run)")
    if record.status != "migrating":
        record.status = "migrating"
        put_record(store, record)
        effects.cancel_run(booking, f"mn: drain of {node}: {why}")
        store.record_event(Event(kind="job.migrating", node=node, job_id=booking, reason=why))
        events.job_status("migrating", booking, reason=why, node_name=node)
    return {"job_id": booking, "action": "wait", "reason": f"{why}: stopping it here first"}


def _finish_migrations(store: ClusterStore, effects: RunEffects, node: str, lease: Lease | None) -> list[dict]:
    """Runs this drain stopped: once over, they are scheduled again (and their booking is surely gone)."""
    done = []
    for record in list_records(store, FlowRunRecord, status="migrating"):
        if record.node != node:
            continue
        state = effects.run_state(record.job_id)
        if state in ("RUNNING", "PENDING", "CANCELLING"):
            continue
        reason = f"drain of {node}: migrated"
        if bookings.release(store, bookings.FlowRun(record.job_id), "drain", lease=lease):
            events.placement("released", node, record.job_id, reason=reason)
        if state == "CANCELLED":
            effects.reschedule_run(record.job_id, reason, 0)
        record.status = "migrated"
        put_record(store, record)
        store.record_event(Event(kind="job.migrated", node=node, job_id=record.job_id, reason=reason))
        events.job_status("migrated", record.job_id, reason=reason, node_name=node)
        done.append({"job_id": record.job_id, "action": "migrated", "reason": reason})
    return done


def advance_drains(store: ClusterStore, effects: RunEffects, *, now: float | None = None,
                   lease: Lease | None = None) -> list[DrainPass]:
    """A pass over every node with an active drain (the scheduled flow calls this)."""
    passes = []
    for stored in store.list_nodes():
        if stored.record.status == "draining":
            result = advance_drain(store, effects, stored.record.name, now=now, lease=lease)
            if result is not None:
                passes.append(result)
    return passes


def preview_drain(store: ClusterStore, node: str, *, deadline_passed: bool = False) -> list[dict]:
    """What a drain pass would do on ``node`` now (``--dry-run``): nothing is changed."""
    return [_drain_one(store, None, booking, node, deadline_passed, None, True)
            for booking in sorted({p.job_id for p in store.active_placements(node=node) if p.job_id})]


def parse_duration(text: str) -> float | None:
    """``30m``, ``90s``, ``1h``, ``1h30m`` or plain seconds -> seconds; None when it is not a duration."""
    import re

    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
