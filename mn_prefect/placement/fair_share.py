"""The fleet's fair-share state in the store: every queue's decaying past use (scheduler/fairshare.py), kept as a
``FairShareRecord`` that the pool's announcer moves on from the queues' accounts and every worker reads."""

from __future__ import annotations

import time

from mn_prefect.scheduler.fairshare import Usage
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import FAIR_SHARE_ID, FairShareRecord, get_record, put_record


def read_usage(store: ClusterStore) -> Usage:
    """The past use as last moved on (none yet: nothing in the past)."""
    record = get_record(store, FAIR_SHARE_ID, FairShareRecord)
    if record is None:
        return Usage(at=time.time())
    return Usage(half_life_s=record.half_life_s, at=record.at, decayed=record.decayed)


def advance(store: ClusterStore, now: float | None = None) -> Usage:
    """Move the past use on to ``now``: what each queue's account holds now is taken as what it held since the
    last move (the announcer moves it every few seconds)."""
    now = time.time() if now is None else now
    record = get_record(store, FAIR_SHARE_ID, FairShareRecord) or FairShareRecord(job_id=FAIR_SHARE_ID, at=now)
    usage = Usage(half_life_s=record.half_life_s, at=record.at or now, decayed=record.decayed)
    usage.advance(now, {name: q.used for name, q in store.queues().queues.items()})
    put_record(store, record.model_copy(update={"at": now, "decayed": usage.decayed, "updated_at": now}))
    return usage


def set_half_life(store: ClusterStore, half_life_s: float) -> FairShareRecord:
    """Set how fast past use is forgotten (0: only what queues hold now counts); the past use is kept."""
    if half_life_s < 0:
        raise ValueError(f"half_life_s: must be at least 0, got {half_life_s:g}")
    record = get_record(store, FAIR_SHARE_ID, FairShareRecord) or FairShareRecord(job_id=FAIR_SHARE_ID,
                                                                                  at=time.time())
    record = record.model_copy(update={"half_life_s": half_life_s, "updated_at": time.time()})
    put_record(store, record)
    return record
