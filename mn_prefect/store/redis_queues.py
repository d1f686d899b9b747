"""Queue and cohort accounts on Redis: ``node:<account>`` hashes (record, status, version) with ``usage:<account>``,
listed in the ``accounts`` set and in no node set, so nothing that walks the nodes meets them."""

from __future__ import annotations

import json
from typing import Any

import redis

from mn_prefect.model.queues import QueueRecord, QueueSpec
from mn_prefect.scheduler.quotas import Queues, cohort_account, queue_account
from mn_prefect.store.accounts import COHORT_STATUS, QUEUE_STATUS, account_of, check_deletable, queues_of, settle
from mn_prefect.store.base import CAPACITY, StoreError

ATTEMPTS = 50


def pairs(flat: Any) -> dict[str, str]:
    """HGETALL as Lua returns it (a flat list, or {} when cjson encodes an empty table)."""
    if not isinstance(flat, list):
        return {}
    return dict(zip(flat[::2], flat[1::2], strict=True))


def from_snapshot(raw: dict) -> Queues:
    """The accounts a SNAPSHOT script read."""
    found = raw.get("accounts")
    accounts: list[dict] = found if isinstance(found, list) else []
    return queues_of(account_of(a["name"], a["record"], pairs(a["used"]), int(a["version"])) for a in accounts)


def read(client: Any, prefix: str, pipe: Any = None) -> Queues:
    """Every account (with ``pipe``, a pipeline in WATCH mode: each key read is watched)."""
    conn = pipe if pipe is not None else client
    names = sorted(conn.smembers(prefix + "accounts"))
    out = []
    for name in names:
        if pipe is not None:
            pipe.watch(f"{prefix}node:{name}", f"{prefix}usage:{name}")
        node = conn.hgetall(f"{prefix}node:{name}")
        if node.get("record"):
            out.append(account_of(name, node["record"], conn.hgetall(f"{prefix}usage:{name}"),
                                  int(node.get("version") or 0)))
    return queues_of(out)


def put(client: redis.Redis, prefix: str, name: str, spec: QueueSpec | None) -> QueueRecord | None:
    """Set queue ``name``'s settings (None: delete them) and its cohorts' quotas in one MULTI, under WATCH of every
    account read: a concurrent change to any of them makes it read and decide again."""
    for _ in range(ATTEMPTS):
        with client.pipeline() as pipe:
            try:
                pipe.watch(prefix + "accounts")
                now = read(client, prefix, pipe)
                if spec is None:
                    check_deletable(now.queues.get(name), name)
                queue_text, cohorts = settle({n: q.spec for n, q in now.queues.items()}, spec, name)
                nodes = pipe.smembers(prefix + "nodes")
                pipe.multi()
                for node in nodes:  # commits decided on cached accounts (ReadCache) read them again
                    pipe.hincrby(prefix + "node:" + str(node), "version", 1)
                _write(pipe, prefix, queue_account(name), queue_text, QUEUE_STATUS)
                for cohort, text in cohorts.items():
                    held = now.cohorts.get(cohort)
                    if text is None and held is not None and any(v > 0 for v in held.used.values()):
                        text = json.dumps({"name": cohort, "nominal": {}})  # kept until its runs end
                    _write(pipe, prefix, cohort_account(cohort), text, COHORT_STATUS)
                pipe.publish(prefix + "changes:" + CAPACITY, "1")  # a quota that grew may let waiting runs in
                pipe.execute()
            except redis.WatchError:
                continue
        if spec is None:
            return None
        return read(client, prefix).queues[name]
    raise StoreError(f"queue {name!r}: its settings kept changing underneath ({ATTEMPTS} tries); try again")


def _write(pipe: Any, prefix: str, account: str, text: str | None, status: str) -> None:
    key = f"{prefix}node:{account}"
    if text is None:
        pipe.delete(key, f"{prefix}usage:{account}")
        pipe.srem(prefix + "accounts", account)
        return
    pipe.hset(key, mapping={"record": text, "status": status, "eligible": "0"})
    pipe.hincrby(key, "version", 1)
    pipe.sadd(prefix + "accounts", account)
