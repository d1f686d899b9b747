"""Reconcile after node loss (docs/operating.md): per affected job, the first rule that matches decides.

1. not ``cluster_recover``            -> paused for review (the run is paused with the reason)
2. node still ``disconnected`` (grace) -> skipped: wait
3. ``system`` / ``sysbatch``          -> skipped: wait for the node
4. otherwise, within the reschedule policy, release the lost booking (fenced by the reconciler's lease)
   and hand the run back to the placers, which never choose an offline node -> recovered;
   policy exhausted -> failed.

The first three rules are ``mn_prefect.model.recovery.recovery_rule``, shared with blueprint jobs' machines.
Decisions here; effects on Prefect runs go through ``RunEffects`` (the ops flow implements it with the
Prefect client), so this module stays free of Prefect. ``dry_run`` decides and reports, changing nothing. Each
action taken is emitted as ``mn.job.<action>`` (and a released booking as ``mn.placement.released``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from mn_prefect import events
from mn_prefect.model.node_status import LOST
from mn_prefect.model.policies import default_reschedule
from mn_prefect.model.recovery import SYSTEM_TYPES, RecoveryAction, recovery_rule
from mn_prefect.placement import bookings
from mn_prefect.placement.job_state import load_job, owning_job
from mn_prefect.store.base import ClusterStore, Event, Lease, StaleLease
from mn_prefect.store.records import FlowRunRecord, get_record, put_record


class RunEffects(Protocol):
    def reschedule_run(self, run_id: str, reason: str, delay_s: float) -> None: ...
    def pause_run(self, run_id: str, reason: str) -> None: ...
    def fail_run(self, run_id: str, reason: str) -> None: ...
    def cancel_run(self, run_id: str, reason: str) -> None: ...
    def run_state(self, run_id: str) -> str | None: ...


@dataclass(frozen=True)
class JobAction:
    job_id: str
    node: str
    action: RecoveryAction
    reason: str


@dataclass
class ReconcileReport:
    checked: int = 0
    recovered: int = 0
    paused: int = 0
    blocked: int = 0
    skipped: int = 0
    failed: int = 0
    dry_run: bool = False
    actions: list[JobAction] = field(default_factory=list)

    def add(self, action: JobAction) -> None:
        self.actions.append(action)
        setattr(self, action.action, getattr(self, action.action) + 1)

    def as_json(self) -> dict:
        return {"checked": self.checked, "recovered": self.recovered, "paused": self.paused,
                "blocked": self.blocked, "skipped": self.skipped, "failed": self.failed, "dry_run": self.dry_run,
                "actions": [a.__dict__ for a in self.actions]}


def run_record(store: ClusterStore, run_id: str) -> FlowRunRecord | None:
    """The record the worker keeps for a placed flow run (recovery mode, job type, reschedules)."""
    return get_record(store, run_id, FlowRunRecord)


def reconcile(store: ClusterStore, effects: RunEffects, *, node: str | None = None, dry_run: bool = False,
              lease: Lease | None = None, now: float | None = None) -> ReconcileReport:
    """Act on every booking held on a disconnected or offline node (only ``node``'s when given)."""
    now = time.time() if now is None else now
    report = ReconcileReport(dry_run=dry_run)
    status = {n.record.name: n.record.status for n in store.list_nodes()}
    lost = {name for name, s in status.items() if s in LOST and (node is None or name == node)}
    by_booking: dict[str, str] = {}
    for placement in store.active_placements():
        if placement.reserves:
            continue  # a reservation holds its node's capacity until it ends, lost node or not
        if placement.node in lost and placement.job_id:
            by_booking.setdefault(placement.job_id, placement.node)
    for booking, where in sorted(by_booking.items()):
        report.checked += 1
        action = _decide(store, booking, where, status, now)
        if action.action == "recovered" and not dry_run and load_job(store, owning_job(booking)) is None:
            action = _recover(store, effects, booking, action, lease, now)
        elif not dry_run:
            _apply(store, effects, booking, action, lease, status[where] == "offline")
        report.add(action)
    return report


def _decide(store: ClusterStore, booking: str, node: str, status: Mapping[str, str], now: float) -> JobAction:
    node_status = status[node]
    job = load_job(store, owning_job(booking))
    record = None if job is not None else run_record(store, booking)
    mode = job.recovery_mode if job else record.recovery_mode if record else "local_restart"
    job_type = job.job_type if job else record.job_type if record else "batch"
    lost = f"node {node} is {node_status}"
    rule = recovery_rule(mode, job_type, node, node_status)
    if rule is not None:
        return JobAction(booking, node, *rule)
    if job is not None:
        # The job's coordinator moves its own agents (it owns their runs and bookings); when the coordinator
        # itself was on a lost node, its run is re-placed like any run and re-places the whole job.
        held = store.active_placements(job_id=job.flow_run_id) if job.flow_run_id else []
        if any(status.get(p.node) in LOST for p in held):
            return JobAction(booking, node, "skipped", f"{lost}: the job's coordinator was lost too; the whole job is "
                                                       "re-placed with it")
        return JobAction(booking, node, "recovered", f"{lost}: handed to the job's coordinator, which re-places "
                                                     "the agents within their reschedule policy")
    if record is None:
        return JobAction(booking, node, "paused", f"{lost}: no record of how to recover this booking; paused for review")
    policy = default_reschedule(job_type, mode)
    history = list(record.reschedules_ms)
    now_ms = int(now * 1000)
    if not policy.allows(history, now_ms):
        return JobAction(booking, node, "failed", f"{lost}: reschedule attempts exhausted")
    delay = policy.delay_for(len(history) + 1) / 1000
    return JobAction(booking, node, "recovered", f"{lost}: re-placing elsewhere in {delay:g} s "
                                                  f"(reschedule {len(history) + 1})")


def _recover(store: ClusterStore, effects: RunEffects, booking: str, action: JobAction, lease: Lease | None,
             now: float) -> JobAction:
    record = run_record(store, booking)
    if record is None:  # gone since the decision: nothing of ours to re-place
        return JobAction(booking, action.node, "skipped", f"{action.reason}; the run's record is gone")
    history = list(record.reschedules_ms)
    policy = default_reschedule(record.job_type, "cluster_recover")
    try:
        released = bookings.release(store, bookings.FlowRun(booking), "node_lost", lease=lease)
    except StaleLease as stale:
        return JobAction(booking, action.node, "failed", f"not the reconciler any more: {stale}")
    if released:
        events.placement("released", action.node, booking, reason=action.reason)
    record.reschedules_ms = [*history, int(now * 1000)]
    record.status = "rescheduled"
    put_record(store, record)
    effects.reschedule_run(booking, action.reason, policy.delay_for(len(history) + 1) / 1000)
    store.record_event(Event(kind="job.rescheduled", node=action.node, job_id=booking, reason=action.reason))
    events.job_status("rescheduled", booking, reason=action.reason, node_name=action.node)
    return action


def _apply(store: ClusterStore, effects: RunEffects, booking: str, action: JobAction, lease: Lease | None,
           offline: bool) -> None:
    if action.action == "skipped":
        return
    record = run_record(store, booking)
    if record is None:
        return  # a blueprint job's coordinator applies the rules to its own agents and records them
    if record.job_type in SYSTEM_TYPES:
        # One copy per node (a system/sysbatch deployment): only the lost node's copy is gone; the others run on.
        if offline and bookings.release(store, bookings.FlowRun(booking), "node_lost", lease=lease, node=action.node):
            events.placement("released", action.node, booking, reason=action.reason)
        return
    if offline and bookings.release(store, bookings.FlowRun(booking), "node_lost", lease=lease):  # gone with its node
        events.placement("released", action.node, booking, reason=action.reason)
    if record.status == action.action:
        return  # already paused (or failed): once is enough
    if action.action != "paused" and action.action != "failed":
        return  # the only other outcomes here (recovered, blocked) are not a flow run's record status
    record.status = action.action
    put_record(store, record)
    (effects.pause_run if action.action == "paused" else effects.fail_run)(booking, action.reason)
    store.record_event(Event(kind=f"job.{action.action}", node=action.node, job_id=owning_job(booking),
                             reason=action.reason))
    events.job_status(action.action, owning_job(booking), reason=action.reason, node_name=action.node,
                      run_id=events.run_of(booking))
