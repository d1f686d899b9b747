"""A node's status and the rules over it (docs/nodes.md, docs/operating.md), defined once here: which statuses
take runs, which count as lost, what a heartbeat does to each status, what a re-registration keeps, and when a
conditional transition applies.

Pure and free of any store: the admission rule (scheduler/admission.py), the scheduler's static checks, every
store backend (store/sql.py; the Redis scripts in store/redis_scripts.py have their status lists generated from
these constants) and the lifecycle rules (mn_prefect/lifecycle) all decide with it.
"""

from __future__ import annotations

from typing import Literal, Protocol, get_args


class Registering(Protocol):
    """What re-registering reads of the node record a worker reports (``node.NodeRecord``)."""

    @property
    def status(self) -> str: ...

    @property
    def scheduling_eligible(self) -> bool: ...


NodeStatus = Literal["healthy", "joining", "maintenance", "draining", "disconnected", "offline", "quarantined"]
NODE_STATES: tuple[str, ...] = get_args(NodeStatus)

SCHEDULABLE_STATES: frozenset[str] = frozenset(("healthy", "joining"))
"""A node in one of these takes runs (if also eligible); the admission rule refuses any other."""

LOST: tuple[str, ...] = ("disconnected", "offline")
"""Silent past the heartbeat timeout: what ran there is recovered elsewhere (model/recovery.py)."""

RECONNECTED = "healthy"
"""What a heartbeat makes of a ``LOST`` node; any other status a heartbeat leaves as it is."""

OUT_OF_SERVICE: tuple[str, ...] = ("maintenance", "draining")
"""Taken out of service by an operator (maintenance, drain); eligibility is theirs while there."""

KEPT_ON_REGISTER: tuple[str, ...] = ("maintenance", "draining", "quarantined")
"""An operator's decision: a worker's restart (re-registering the node) keeps it, and a heartbeat never leaves it."""


def heartbeat_status(current: str) -> str:
    """A heartbeat reconnects a disconnected/offline node; it never leaves maintenance, draining or quarantine."""
    if current in LOST:
        return RECONNECTED
    return current


def registered_status(new: Registering, stored_status: str | None, stored_eligible: bool | None) -> tuple[str, bool]:
    """Re-registering (a worker restart) keeps an operator's maintenance/draining/quarantine and ineligibility."""
    if stored_status is None:
        return new.status, new.scheduling_eligible
    status = stored_status if stored_status in KEPT_ON_REGISTER else new.status
    return status, new.scheduling_eligible and stored_eligible is not False


def check_transition(to_status: str, from_statuses: tuple[str, ...]) -> None:
    """ValueError naming any state that is not a node state (before anything is written)."""
    unknown = [s for s in (to_status, *from_statuses) if s not in NODE_STATES]
    if unknown:
        raise ValueError(f"unknown node status {unknown[0]!r} (allowed: {', '.join(NODE_STATES)})")
    if not from_statuses:
        raise ValueError("from_statuses is empty: the transition could never apply")


def transition_applies(status: str, last_heartbeat: float | None, from_statuses: tuple[str, ...],
                       heartbeat_before: float | None) -> bool:
    """A conditional transition applies when the node is in one of ``from_statuses`` and, with
    ``heartbeat_before`` (seconds since the epoch), its last heartbeat is older than that (the Redis script
    TRANSITION_NODE applies the same rule)."""
    if status not in from_statuses:
        return False
    return heartbeat_before is None or last_heartbeat is None or last_heartbeat < heartbeat_before
