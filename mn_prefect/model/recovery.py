"""What happens to work whose node is lost or draining (docs/operating.md): pure rules over job types, recovery
modes and node statuses.

The reconciler and the drains (``mn_prefect.lifecycle``) apply them to plain flow runs; a blueprint job's
machine (``mn_prefect.jobs.machine``) applies them to its own agents.
"""

from __future__ import annotations

from typing import Literal

SYSTEM_TYPES = ("system", "sysbatch")
RecoveryAction = Literal["recovered", "paused", "blocked", "skipped", "failed"]
DrainAction = Literal["migrate", "wait", "pause", "ignore"]


def recovery_rule(recovery_mode: str, job_type: str, node: str, node_status: str) -> tuple[RecoveryAction, str] | None:
    """The first three reconcile rules (docs/operating.md), shared by the reconciler and the blueprint coordinator: what
    to do with work on a lost node, or None when it should be re-placed (within the reschedule policy)."""
    lost = f"node {node} is {node_status}"
    if recovery_mode != "cluster_recover":
        return "paused", f"{lost}; recovery_mode {recovery_mode}: paused for review"
    if node_status == "disconnected":
        return "skipped", f"{lost}: waiting inside the grace window"
    if job_type in SYSTEM_TYPES:
        return "skipped", f"{lost}: {job_type} work waits for its node"
    return None


def drain_action(job_type: str, recovery_mode: str, *, safe_to_retry: bool, deadline_passed: bool) -> tuple[DrainAction, str]:
    """What a drain does with one piece of work on the draining node, and why."""
    if job_type in SYSTEM_TYPES:
        return "ignore", f"{job_type} work stays on its node"
    if job_type == "service":
        if recovery_mode == "cluster_recover":
            return "migrate", "service with cluster_recover migrates"
        return "pause", f"service with recovery_mode {recovery_mode} cannot move: paused for review"
    if not deadline_passed:
        return "wait", "batch work may finish before the deadline"
    if safe_to_retry and recovery_mode == "cluster_recover":
        return "migrate", "deadline passed; safe to retry, migrates"
    return "pause", "deadline passed and not safe to move: paused for review (left running)"
