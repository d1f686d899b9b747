"""Scheduling eligibility across maintenance (docs/operating.md): a node taken out of service (maintenance, or a
drain, which ends in maintenance) is not scheduling-eligible, and leaving maintenance gives it back the
eligibility it had before.

The store keeps one eligibility per node, with no room for the one before, so the one before is kept as an
event (``maintenance.eligibility``) written right after the node went out of service. Leaving reads the node's
events back, newest first, to the latest such event; when it meets the node's way out of service first (it went
out before this existed, or the process stopped between the two writes) there is nothing to restore and the
node keeps the eligibility it has: an ineligible node never becomes eligible by accident.
"""

from __future__ import annotations

import time

from mn_prefect.model.node_status import OUT_OF_SERVICE
from mn_prefect.store.base import ClusterStore, Event

KEPT = "maintenance.eligibility"
# How many of the node's newest events each read fetches, widening until the kept one (or the node's way out of
# service) is found. Each read is one query on SQL; on Redis it scans up to 20 times its limit of the whole
# stream, so the last one reads all of it (the stream keeps about 100,000 events). Usually the first one finds it.
_READS = (100, 1_000, 10_000)


def keep_eligibility(store: ClusterStore, node: str, eligible: bool, from_status: str, *,
                     now: float | None = None) -> None:
    """Record that ``node``, which just went from ``from_status`` out of service, was ``eligible`` before.
    Nothing when it was already out of service (maintenance to draining, say): the first one stands."""
    if from_status in OUT_OF_SERVICE:
        return
    store.record_event(Event(kind=KEPT, at=time.time() if now is None else now, node=node,
                             reason=f"scheduling eligibility before {from_status} -> out of service",
                             data={"eligible": eligible, "from": from_status}))


def eligibility_before(store: ClusterStore, node: str) -> bool | None:
    """The eligibility ``node`` had when it last went out of service; None when its events do not say."""
    for limit in _READS:
        events = store.events(node=node, limit=limit)
        for event in reversed(events):  # newest first
            if event.kind == KEPT:
                return bool(event.data.get("eligible"))
            if (event.kind.startswith("node.") and event.data.get("to") in OUT_OF_SERVICE
                    and event.data.get("from") not in OUT_OF_SERVICE):
                return None  # it went out of service, and nothing was kept after
    return None
