"""Ending a reservation in the store: release its booking, mark its record ended, log the event.

This is the durable part only. The store publishes nothing: announcing an end (the Prefect event, the
DEALLOCATION notification, the record's ``announced`` flag) is for the caller, which gets the records ended
(``mn_prefect.placement.ending``; a commit reports the reservations it ended in ``CommitResult.ended``).
"""

from __future__ import annotations

import math
import time

from mn_prefect.model.bookings import Reservation
from mn_prefect.store.base import ClusterStore, Event
from mn_prefect.store.records import ReservationRecord, from_row, put_record
from mn_prefect.store.releasing import release

MIN_SECONDS = 1.0  # the shortest reservation: what lets a process skip looking for expired ones (expire_due)

# Per store object: when its reservations were last listed and the earliest expiry then seen. A reservation
# lasts at least MIN_SECONDS, so one created since the listing cannot expire before listed_at + MIN_SECONDS.
_LISTED: dict[int, tuple[float, float]] = {}


def expire_due(store: ClusterStore, *, now: float | None = None, force: bool = False) -> list[ReservationRecord]:
    """End every reservation whose time is up (release its booking, mark it expired, record the event); the
    ones ended, for the caller to announce. Cheap when nothing can be due: it asks the store only when one it
    knows of is due or one it may not know of could be, and then reads the due ones alone (an index of the
    expiries: ``reservations_due``), not every reservation."""
    now = time.time() if now is None else now
    listed_at, earliest = _LISTED.get(id(store), (-math.inf, -math.inf))
    if not force and now < min(earliest, listed_at + MIN_SECONDS):
        return []
    rows, earliest = store.reservations_due(now)
    due = [r for r in map(from_row, rows) if isinstance(r, ReservationRecord) and r.expires_at <= now]
    ended = [end(store, r, "expired", f"expired at {clock(r.expires_at)}", now=now) for r in due]
    _LISTED[id(store)] = (now, earliest)
    return ended


def end(store: ClusterStore, record: ReservationRecord, status: str, reason: str, *,
        now: float | None = None) -> ReservationRecord:
    """Release the reservation's booking and mark it ``status`` (released or expired), with the store's event;
    the record as written (not yet announced)."""
    now = time.time() if now is None else now
    release(store, Reservation(record.job_id), "reservation_ended")
    record = record.model_copy(update={"status": status, "reason": reason, "ended_at": now, "updated_at": now})
    put_record(store, record)
    store.record_event(Event(kind=f"reservation.{status}", at=now, job_id=record.job_id, reason=reason,
                             data={"nodes": record.nodes, "group": record.group}))
    return record


def clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
