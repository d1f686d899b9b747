"""Node states driven by time (SPEC section 7): missed heartbeats make a node ``disconnected``, then ``offline``.

Every change goes through the store's conditional ``transition_node``: it applies only if the node is still in
the state (and as silent as) this sweep saw, so a heartbeat or an operator that gets there first always wins.
"""

from __future__ import annotations

import math
import time

from pydantic import BaseModel, ConfigDict

from mn_prefect import notify
from mn_prefect.lifecycle import settings
from mn_prefect.model.node import SCHEDULABLE_STATES
from mn_prefect.store.base import ClusterStore

# The node states that signed notifications report (SPEC section 11).
_NOTIFIED: dict[str, notify.Kind] = {"healthy": "ONLINE", "offline": "OFFLINE"}


class Transition(BaseModel):
    """One applied change of a node's status (also recorded in the store as the event ``node.<to_status>``)."""

    model_config = ConfigDict(frozen=True)

    node: str
    from_status: str
    to_status: str
    reason: str | None = None
    at: float


def apply_transition(store: ClusterStore, node: str, from_status: str, to_status: str, *, reason: str,
                     now: float | None = None, eligible: bool | None = None,
                     heartbeat_before: float | None = None) -> Transition | None:
    """Move ``node`` from exactly ``from_status`` to ``to_status`` (and record the event); None when the node
    was no longer in ``from_status`` or had heartbeated since ``heartbeat_before`` (seconds since the epoch).
    A node that becomes ``healthy`` or ``offline`` is reported to the notification webhooks (ONLINE, OFFLINE)."""
    now = time.time() if now is None else now
    record = store.transition_node(node, to_status, from_statuses=(from_status,), now=now, reason=reason,
                                   eligible=eligible, heartbeat_before=heartbeat_before)
    if record is None:
        return None
    if to_status in _NOTIFIED:  # queued for the webhooks, if any are configured: never waits on them
        notify.publish(_NOTIFIED[to_status], f"mn.node.{to_status}", node=node, reason=reason)
    return Transition(node=node, from_status=from_status, to_status=to_status, reason=reason, at=now)


def advance_node_states(store: ClusterStore, *, now: float | None = None, heartbeat_timeout_s: float | None = None,
                        grace_s: float | None = None) -> list[Transition]:
    """One sweep over every node: ``healthy``/``joining`` nodes silent for more than ``heartbeat_timeout_s``
    become ``disconnected`` (their capacity is no longer offered); ``disconnected`` nodes silent for more than
    ``heartbeat_timeout_s + grace_s`` become ``offline``. A node silent past both goes through both in one
    sweep. Times in seconds; the defaults come from ``settings``. Returns the transitions applied."""
    now = time.time() if now is None else now
    timeout = settings.heartbeat_timeout_s() if heartbeat_timeout_s is None else heartbeat_timeout_s
    grace = settings.disconnect_grace_s() if grace_s is None else grace_s
    steps = ((SCHEDULABLE_STATES, "disconnected", timeout, f"timeout {timeout:g} s"),
             (("disconnected",), "offline", timeout + grace, f"timeout {timeout:g} s + grace {grace:g} s"))
    applied: list[Transition] = []
    for stored in store.list_nodes():
        status: str = stored.record.status
        silence = math.inf if stored.last_heartbeat is None else now - stored.last_heartbeat
        for sources, target, limit, limit_text in steps:
            if status not in sources or silence <= limit:
                continue
            heard = "no heartbeat recorded" if math.isinf(silence) else f"no heartbeat for {silence:.0f} s"
            change = apply_transition(store, stored.record.name, status, target, reason=f"{heard} ({limit_text})",
                                      now=now, heartbeat_before=now - limit)
            if change is None:
                break  # a heartbeat or an operator changed the node since we read it: theirs stands
            applied.append(change)
            status = target
    return applied
