"""What a lab's stop leaves booked: its workers and runs have ended, so a booking still owned by one of its flow
runs, blueprint jobs or bundle steps belongs to interrupted work, released by ``release_interrupted`` (``mn-prefect
up`` calls it when the lab stops and when it starts again)."""

from __future__ import annotations

import time


def release_interrupted(store_url: str) -> tuple[list[str], list[str], list[str]]:
    """After a lab stopped, its workers and runs have all ended: a booking still owned by one of its flow runs,
    blueprint jobs or bundle steps belongs to work the stop interrupted, and nothing can use it any more: it is
    released, with an event saying why. A reservation is owned by nobody the stop ended: it keeps its capacity
    until it expires or is released, across ``down`` and ``up`` (one whose time is up is ended as expired). A
    booking whose owner cannot be told is kept. (released, reservations kept, unknown owners kept)."""
    from mn_prefect.placement import bookings
    from mn_prefect.placement.reservations import expire_due
    from mn_prefect.store import open_store
    from mn_prefect.store.base import Event

    released: list[str] = []
    kept: list[str] = []
    unknown: list[str] = []
    store = open_store(store_url)
    try:
        expire_due(store, force=True)
        for job in store.active_jobs():
            owner = bookings.classify(store, job)
            if not bookings.may_release(owner, "lab_stopped"):  # a reservation, or a booking of no known owner
                (kept if isinstance(owner, bookings.Reservation) else unknown).append(job)
            elif bookings.release(store, owner, "lab_stopped"):
                released.append(job)
                store.record_event(Event(kind="job.released", job_id=job, at=time.time(),
                                         reason=f"the lab was stopped while its {owner.words} "
                                                "held the booking"))
    finally:
        store.close()
    return released, kept, unknown
