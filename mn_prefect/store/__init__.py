"""Durable cluster state: SQLite (default), PostgreSQL, or Redis (with Sentinel), behind one contract.

``open_store(url)`` picks the backend from the URL (default: ``MN_STORE_URL``, else a SQLite file under
``~/.mn-prefect``).
"""

from __future__ import annotations

from mn_prefect.store.base import (
    ClusterStore,
    CommitResult,
    Conflict,
    Event,
    JobRecord,
    Lease,
    StaleLease,
    StoreError,
    StoreUnavailable,
)
from mn_prefect.store.records import (
    DrainRecord,
    FlowRunRecord,
    InvalidRecord,
    JobState,
    Record,
    StepResultRecord,
    WorkflowRecord,
    from_row,
    get_record,
    list_records,
    put_record,
    to_row,
)
from mn_prefect.store.urls import default_url, parse_store_url, redact


def open_store(url: str | None = None) -> ClusterStore:
    parsed = parse_store_url(url or default_url())
    if parsed.backend in ("sqlite", "postgresql"):
        from mn_prefect.store.sql import SQLStore

        return SQLStore(parsed)
    from mn_prefect.store.redis_store import RedisStore

    return RedisStore(parsed)


__all__ = ["ClusterStore", "CommitResult", "Conflict", "DrainRecord", "Event", "FlowRunRecord", "InvalidRecord",
           "JobRecord", "JobState", "Lease", "Record", "StaleLease", "StepResultRecord", "StoreError",
           "StoreUnavailable", "WorkflowRecord", "default_url", "from_row", "get_record", "list_records",
           "open_store", "parse_store_url", "put_record", "redact", "to_row"]
