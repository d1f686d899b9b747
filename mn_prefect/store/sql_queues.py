"""Queue and cohort accounts on SQLite and PostgreSQL: rows of ``mn_nodes`` in the group ``@accounts``."""

from __future__ import annotations

import json

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

from mn_prefect.model.queues import QueueRecord, QueueSpec
from mn_prefect.scheduler.quotas import Queues, cohort_account, queue_account
from mn_prefect.store.accounts import (
    ACCOUNTS_GROUP,
    COHORT_STATUS,
    QUEUE_STATUS,
    account_of,
    check_deletable,
    queues_of,
    settle,
)

_ALL = text(f"SELECT name, record, used, version FROM mn_nodes WHERE node_group = '{ACCOUNTS_GROUP}' ORDER BY name")
_SOME = text("SELECT name, record, used, version FROM mn_nodes WHERE name IN :names ORDER BY name").bindparams(
    bindparam("names", expanding=True))
_UPSERT = text(
    "INSERT INTO mn_nodes (name, record, status, eligible, last_heartbeat, used, version, node_group) "
    f"VALUES (:n, :r, :s, :e, NULL, '{{}}', 1, '{ACCOUNTS_GROUP}') "
    "ON CONFLICT (name) DO UPDATE SET record = :r, version = mn_nodes.version + 1")
_DELETE = text("DELETE FROM mn_nodes WHERE name = :n")
_VERSIONS_UP = text("UPDATE mn_nodes SET version = version + 1")


def read(conn: Connection, names: list[str] | None = None) -> Queues:
    """Every account (or those ``names``) as the connection sees them."""
    rows = conn.execute(_ALL) if names is None else conn.execute(_SOME, {"names": names})
    return queues_of(account_of(r.name, r.record, json.loads(r.used), r.version) for r in rows)


def put(conn: Connection, lock: str, name: str, spec: QueueSpec | None) -> QueueRecord | None:
    """Set queue ``name``'s settings (None: delete them) and its cohorts' quotas, in the caller's transaction;
    every account row is locked first (PostgreSQL) so two changes to one cohort never interleave."""
    conn.execute(text(f"SELECT name FROM mn_nodes WHERE node_group = '{ACCOUNTS_GROUP}' ORDER BY name{lock}"))
    now = read(conn)
    if spec is None:
        check_deletable(now.queues.get(name), name)
    queue_text, cohorts = settle({n: q.spec for n, q in now.queues.items()}, spec, name)
    if queue_text is None:
        conn.execute(_DELETE, {"n": queue_account(name)})
    else:
        conn.execute(_UPSERT, {"n": queue_account(name), "r": queue_text, "s": QUEUE_STATUS, "e": False})
    for cohort, cohort_text in cohorts.items():
        held = now.cohorts.get(cohort)
        if cohort_text is None and (held is None or not any(v > 0 for v in held.used.values())):
            conn.execute(_DELETE, {"n": cohort_account(cohort)})
        else:  # a cohort left empty while its runs still hold something keeps its account until they end
            conn.execute(_UPSERT, {"n": cohort_account(cohort), "r": cohort_text or json.dumps(
                {"name": cohort, "nominal": {}}), "s": COHORT_STATUS, "e": False})
    conn.execute(_VERSIONS_UP)  # every node's: commits decided on cached accounts (admission.ReadCache) read again
    if spec is None:
        return None
    return read(conn, [queue_account(name)]).queues[name]
