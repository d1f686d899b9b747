"""Bookings by owner, for the layers that place and release: the typed owners and their release rules
(``mn_prefect.model.bookings``), the store-aware classification of a bare booking id, and ``release``, the one
function every release goes through (``mn_prefect.store.releasing``): it refuses, with ReleaseRefused and nothing
changed, a release its owner's rule does not allow."""

from __future__ import annotations

from mn_prefect.model.bookings import (
    WHYS,
    FlowRun,
    JobBooking,
    Owner,
    ReleaseRefused,
    Reservation,
    StepAttempt,
    SystemCopy,
    Unknown,
    Why,
    job_booking,
    may_release,
    owning_job,
    parse,
)
from mn_prefect.model.recovery import SYSTEM_TYPES
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import JobState, get_record
from mn_prefect.store.releasing import release

__all__ = ["WHYS", "FlowRun", "JobBooking", "Owner", "ReleaseRefused", "Reservation", "StepAttempt", "SystemCopy",
           "Unknown", "Why", "classify", "job_booking", "may_release", "parse", "release"]


def classify(store: ClusterStore, booking: str) -> Owner:
    """``booking``'s owner as the store tells it: what the id alone tells (``parse``), but a blueprint job's
    booking (by its job's record: the job's own, a system job's copy, a moved agent's), a UUID included."""
    owner = parse(booking)
    if isinstance(owner, (Reservation, StepAttempt)):
        return owner
    job = get_record(store, owning_job(booking), JobState)
    if job is not None:
        return job_booking(job.job_id, booking, system=job.job_type in SYSTEM_TYPES)
    return owner
