"""A reservation's end, announced: the store ends it (``mn_prefect.store.expiry``: its booking released, its
record marked, the store's event) and publishes nothing; this announces each end it made, here or in a commit
(``CommitResult.ended``): the Prefect event ``mn.reservation.<status>`` and, for an expiry, a DEALLOCATION
notification. The Placer and the reservations module both end reservations through it."""

from __future__ import annotations

from mn_prefect import events, notify
from mn_prefect.store import expiry
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import ReservationRecord, put_record

EVENT_PREFIX = "mn.reservation."


def expire_due(store: ClusterStore, *, now: float | None = None, force: bool = False) -> list[ReservationRecord]:
    """End every reservation whose time is up (release its booking, mark it expired, record the event) and
    announce each end; the ones ended. Cheap when nothing can be due (``store.expiry.expire_due``)."""
    return announce_ended(store, expiry.expire_due(store, now=now, force=force))


def end(store: ClusterStore, record: ReservationRecord, status: str, reason: str, *,
        now: float | None = None) -> ReservationRecord:
    """Release the reservation's booking and mark it ``status`` (released or expired), with the event."""
    return announce(store, expiry.end(store, record, status, reason, now=now))


def announce_ended(store: ClusterStore, records: list[ReservationRecord]) -> list[ReservationRecord]:
    """Announce the ends the store made (``expire_due``, a commit's ``CommitResult.ended``); the records."""
    return [announce(store, record) for record in records]


def announce(store: ClusterStore, record: ReservationRecord) -> ReservationRecord:
    """Announce a reservation's end: ``mn.reservation.<status>`` to Prefect (the record marked announced when
    it was queued) and, for an expiry, a DEALLOCATION notification."""
    if emit(record.status, record, record.reason):
        record = record.model_copy(update={"announced": True})
        put_record(store, record)
    if record.status == "expired":
        notify.publish("DEALLOCATION", EVENT_PREFIX + record.status, node=",".join(record.nodes) or None,
                       job_id=record.job_id, reason=record.reason)
    return record


def emit(what: str, record: ReservationRecord, reason: str | None = None) -> bool:
    """``mn.reservation.<what>`` to Prefect, about the reservation and related to its nodes; whether it was
    queued (False where no Prefect server is configured). Never raises (the store's event log is the source of
    truth)."""
    return events.reservation(what, record.job_id, name=record.name, nodes=record.nodes, reason=reason,
                              payload={"expires_at": record.expires_at, "nodes": record.nodes, "group": record.group,
                                       "resources": record.resources})
