"""Node states driven by time (docs/operating.md): missed heartbeats make a node ``disconnected``, then ``offline``.

Every change goes through the store's conditional ``transition_node``: it applies only if the node is still in
the state (and as silent as) this sweep saw, so a heartbeat or an operator that gets there first always wins.
Every applied change, and a heartbeat that brings a node back (``heartbeat``), is emitted as the Prefect event
``mn.node.<state>`` by the process that made it (mn_prefect.events).
"""

from __future__ import annotations

import math
import time

from pydantic import BaseModel, ConfigDict

from mn_prefect import events, notify
from mn_prefect.lifecycle import settings
from mn_prefect.model.node_status import LOST, RECONNECTED, SCHEDULABLE_STATES
from mn_prefect.store.base import ClusterStore

# The node states that signed notifications report (docs/events.md, "Notifications").
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
    The change is emitted as the Prefect event ``mn.node.<to_status>``, and a node that becomes ``healthy`` or
    ``offline`` is reported to the notification webhooks (ONLINE, OFFLINE)."""
    now = time.time() if now is None else now
    record = store.transition_node(node, to_status, from_statuses=(from_status,), now=now, reason=reason,
                                   eligible=eligible, heartbeat_before=heartbeat_before)
    if record is None:
        return None
    return _announce(Transition(node=node, from_status=from_status, to_status=to_status, reason=reason, at=now),
                     record.scheduling_eligible)


def heartbeat(store: ClusterStore, node: str, *, now: float | None = None) -> Transition | None:
    """One heartbeat of ``node``'s worker (``store.heartbeat``); the Transition when it brought a disconnected or
    offline node back to ``healthy``, announced like any state change. The status is read just before the beat: a
    sweep that lands between the two goes unannounced (the store's event log still records it)."""
    now = time.time() if now is None else now
    before = store.get_node(node)
    record = store.heartbeat(node, now=now)
    if before is None or before.record.status not in LOST or record.status != RECONNECTED:
        return None  # not a reconnect (an operator's change in between is theirs to announce)
    change = Transition(node=node, from_status=before.record.status, to_status=record.status,
                        reason=f"heartbeat received while {before.record.status}", at=now)
    return _announce(change, record.scheduling_eligible)


def _announce(change: Transition, eligible: bool) -> Transition:
    """Queued, never waited on: the Prefect event, and the webhooks' notification if any are configured."""
    events.node_state(change.node, change.to_status, reason=change.reason, from_status=change.from_status,
                      eligible=eligible)
    if change.to_status in _NOTIFIED:
        notify.publish(_NOTIFIED[change.to_status], f"mn.node.{change.to_status}", node=change.node,
                       reason=change.reason)
    return change


def advance_node_states(store: ClusterStore, *, now: float | None = None, heartbeat_timeout_s: float | None = None,
                        grace_s: float | None = None) -> list[Transition]:
    """One sweep over every node: ``healthy``/``joining`` nodes silent for more than ``heartbeat_timeout_s``
    become ``disconnected`` (their capacity is no longer offered); ``disconnected`` nodes silent for more than
    ``heartbeat_timeout_s + grace_s``, and disconnected for at least ``grace_s``, become ``offline``. The second
    condition is what keeps a store outage from taking live nodes offline: no heartbeat lands while the store is
    away, so the first sweep after it finds every node silent; they are only disconnected, and their next
    heartbeats (one interval, well within the grace) bring them back before any is judged lost. Times in seconds;
    the defaults come from ``settings``. Returns the transitions applied."""
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
            if target == "offline" and now - _disconnected_at(store, stored.record.name, now) < grace:
                break  # disconnected too recently (this very sweep, or just after a store outage): wait
            heard = "no heartbeat recorded" if math.isinf(silence) else f"no heartbeat for {silence:.0f} s"
            change = apply_transition(store, stored.record.name, status, target, reason=f"{heard} ({limit_text})",
                                      now=now, heartbeat_before=now - limit)
            if change is None:
                break  # a heartbeat or an operator changed the node since we read it: theirs stands
            applied.append(change)
            status = target
    return applied


def _disconnected_at(store: ClusterStore, node: str, now: float) -> float:
    """When ``node`` last became ``disconnected``, from the store's event log; when the log no longer says (it
    keeps the latest events only), long enough ago to count as past any grace."""
    found = [e.at for e in store.events(node=node, limit=50) if e.kind == "node.disconnected" and e.at <= now]
    return max(found, default=-math.inf)
