"""Maintenance and undrain (docs/operating.md): operator state changes, each recorded with its reason.

Maintenance stops new placements and moves nothing: what runs on the node keeps running. A heartbeat never
takes a node out of maintenance (the store's heartbeat keeps it), so only these functions do. A node in
maintenance is not scheduling-eligible either; leaving it restores the eligibility it had before (eligibility.py).
"""

from __future__ import annotations

from mn_prefect.lifecycle.drain import close_drain
from mn_prefect.lifecycle.eligibility import eligibility_before, keep_eligibility
from mn_prefect.lifecycle.states import Transition, apply_transition
from mn_prefect.model.issues import InvalidInput, Issue
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.node_status import OUT_OF_SERVICE
from mn_prefect.store.base import ClusterStore, NodeNotRegistered

# A read-then-change can lose to a concurrent change (a heartbeat reconnecting the node): read again, a few times.
_ATTEMPTS = 3


class NodeStateRefused(RuntimeError):
    """The change does not fit the node's current state; the message names the node and what to do instead."""


def set_maintenance(store: ClusterStore, node: str, enable: bool, reason: str, *,
                    now: float | None = None) -> Transition | None:
    """``enable``: the node goes to ``maintenance``, not scheduling-eligible (no new placements; nothing moves).
    Disable: a node in maintenance goes back to ``healthy`` with the eligibility it had before maintenance (kept
    as it is when the store's events no longer say). None when there is nothing to change (already in
    maintenance / not in it). Refuses a draining node: ``undrain`` cancels a drain."""
    reason = _required(reason)
    for _ in range(_ATTEMPTS):
        record = _record(store, node)
        status = record.status
        if status == "draining":
            raise NodeStateRefused(f"node {node!r} is draining: use undrain to cancel the drain "
                                   "(the node then stays in maintenance)")
        if (status == "maintenance") == enable:
            return None  # already in maintenance, or not in it to end
        if enable:
            change = apply_transition(store, node, status, "maintenance", reason=reason, now=now, eligible=False)
            if change is not None:
                keep_eligibility(store, node, record.scheduling_eligible, status, now=change.at)
        else:
            change = apply_transition(store, node, status, "healthy", reason=reason, now=now,
                                      eligible=eligibility_before(store, node))
        if change is not None:
            return change
    raise NodeStateRefused(f"node {node!r} kept changing state while setting maintenance; try again")


def undrain(store: ClusterStore, node: str, reason: str, mark_eligible: bool = False, *,
            now: float | None = None) -> Transition | None:
    """Cancel a drain: a ``draining`` node goes to ``maintenance`` (still not eligible: leaving maintenance
    restores its eligibility from before the drain); with ``mark_eligible`` it (or a node left in maintenance by
    a finished drain) becomes ``healthy`` and scheduling-eligible, as the operator says. None when there is
    nothing to change (in maintenance, without ``mark_eligible``). Refuses a node in any other state."""
    reason = _required(reason)
    for _ in range(_ATTEMPTS):
        status = _record(store, node).status
        if status not in OUT_OF_SERVICE:
            raise NodeStateRefused(f"node {node!r} is {status}, not draining: nothing to undrain")
        if status == "maintenance" and not mark_eligible:
            return None
        change = apply_transition(store, node, status, "healthy" if mark_eligible else "maintenance", reason=reason,
                                  now=now, eligible=True if mark_eligible else None)
        if change is not None:
            close_drain(store, node, "cancelled")
            return change
    raise NodeStateRefused(f"node {node!r} kept changing state while undraining; try again")


def _record(store: ClusterStore, node: str) -> NodeRecord:
    stored = store.get_node(node)
    if stored is None:
        raise NodeNotRegistered(f"node {node!r} is not registered")
    return stored.record


def _required(reason: str) -> str:
    if not reason or not reason.strip():
        raise InvalidInput([Issue("reason", "a reason is required: it is recorded with the state change")])
    return reason.strip()
