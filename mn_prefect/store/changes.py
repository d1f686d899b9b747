"""Change watchers, one per backend (the contract is ``ChangeWatcher`` in store/base.py).

Each reads what its backend's writers announce in the same atomic step as the change:

- Redis: the scripts PUBLISH on ``<prefix>changes:capacity`` and ``<prefix>changes:placed:<node>``; the watcher
  holds one subscribed connection.
- PostgreSQL: ``pg_notify('mn_changes', 'capacity' | 'placed:<node>')`` in the changing transaction (delivered at
  its commit, never for a rollback), or, for commits and full releases, in a transaction of its own just after
  theirs (pg_functions.ANNOUNCE says why), sent only while a watcher is registered in ``mn_listeners``; the
  watcher holds one connection that LISTENs and registers its session there.
- SQLite: a counter row per topic in ``mn_changes``, bumped in the changing transaction; the watcher reads
  ``PRAGMA data_version`` every 100 ms (no I/O when nothing was written) and the counters when it moved.

A watcher that lost its connection reconnects on its next ``wait`` and reports both kinds, since a change may have
gone by unheard.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

from mn_prefect.store.base import CAPACITY, PLACED, placed_topic
from mn_prefect.store.urls import StoreURL

BOTH = frozenset({CAPACITY, PLACED})
NONE: frozenset[str] = frozenset()
PG_CHANNEL = "mn_changes"
SQLITE_POLL_SECONDS = 0.1
RECONNECT_PAUSE_SECONDS = 1.0  # between attempts when the backend does not answer, so a waiter never spins


def kind_of(topic: str) -> str:
    """``capacity`` or ``placed`` (the node after the colon is the filter's business)."""
    return topic.split(":", 1)[0]


def topics_for(node: str | None) -> tuple[str, ...] | None:
    """The topics a watcher of ``node`` hears; None: every topic (every node's commits)."""
    return (CAPACITY, placed_topic(node)) if node is not None else None


def _heard(topics: tuple[str, ...] | None, topic: str) -> bool:
    return topics is None or topic in topics


class SQLiteChanges:
    """Watches a SQLite store file from its own connection (another process's commits included)."""

    def __init__(self, path: str, node: str | None):
        self._topics = topics_for(node)
        self._closed = threading.Event()
        self._conn = sqlite3.connect(path, timeout=5, isolation_level=None, check_same_thread=False)
        self._version: int | None = None
        self._seen = self._counters()

    def _counters(self) -> dict[str, int]:
        if self._topics is None:
            rows = self._conn.execute("SELECT topic, seq FROM mn_changes")
        else:
            marks = ", ".join("?" for _ in self._topics)
            rows = self._conn.execute(f"SELECT topic, seq FROM mn_changes WHERE topic IN ({marks})", self._topics)
        return {topic: seq for topic, seq in rows}

    def _look(self) -> frozenset[str]:
        version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        if version == self._version:
            return NONE  # nobody wrote since the last look
        self._version = version
        counters = self._counters()
        kinds = frozenset(kind_of(t) for t, seq in counters.items() if self._seen.get(t) != seq)
        self._seen = counters
        return kinds

    def wait(self, timeout: float) -> frozenset[str]:
        deadline = time.monotonic() + timeout
        while not self._closed.is_set():
            try:
                kinds = self._look()
            except sqlite3.Error:  # a locked or replaced file: say so, and let the waiter read
                self._closed.wait(min(RECONNECT_PAUSE_SECONDS, max(timeout, 0.0)))
                return BOTH
            left = deadline - time.monotonic()
            if kinds or left <= 0:
                return kinds
            self._closed.wait(min(SQLITE_POLL_SECONDS, left))
        return NONE

    def close(self) -> None:
        self._closed.set()
        self._conn.close()


class PostgresChanges:
    """LISTENs on ``mn_changes`` on its own autocommit connection."""

    def __init__(self, url: StoreURL, node: str | None):
        self._url = url
        self._topics = topics_for(node)
        self._conn: Any = None
        self._connect()

    def _connect(self) -> None:
        import psycopg
        from psycopg.conninfo import make_conninfo

        (host, port), = self._url.hosts
        options = {k: v for k, v in self._url.options.items() if k in ("sslmode", "application_name")}
        conninfo = make_conninfo(host=host, port=port, user=self._url.username, password=self._url.password,
                                 dbname=self._url.database,
                                 connect_timeout=int(self._url.options.get("connect_timeout", 10)), **options)
        self._conn = psycopg.connect(conninfo, autocommit=True)
        self._conn.execute(f"LISTEN {PG_CHANNEL}")
        # Registered once listening (pg_functions.LISTENERS: commits announce only while someone listens); the
        # pids of sessions that are gone are removed on the way.
        try:
            self._conn.execute("INSERT INTO mn_listeners (pid, since) VALUES (pg_backend_pid(), "
                               "extract(epoch FROM now())) ON CONFLICT (pid) DO NOTHING")
            self._conn.execute("DELETE FROM mn_listeners WHERE pid NOT IN (SELECT pid FROM pg_stat_activity)")
        except psycopg.errors.UndefinedTable:  # a store whose functions predate it: its commits always announce
            pass

    def _kinds(self, timeout: float, stop_after: int | None) -> set[str]:
        return {kind_of(note.payload) for note in self._conn.notifies(timeout=timeout, stop_after=stop_after)
                if _heard(self._topics, note.payload)}

    def wait(self, timeout: float) -> frozenset[str]:
        import psycopg

        deadline = time.monotonic() + timeout
        try:
            if self._conn is None:
                self._connect()
                return BOTH
            kinds: set[str] = set()
            while not kinds and (left := deadline - time.monotonic()) > 0:
                kinds = self._kinds(left, 1)  # notifications of other nodes' commits are skipped
            return frozenset(kinds | self._kinds(0.0, None)) if kinds else NONE  # a burst, reported once
        except psycopg.Error:
            self._drop()
            time.sleep(min(RECONNECT_PAUSE_SECONDS, max(timeout, 0.0)))
            return BOTH

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.execute("DELETE FROM mn_listeners WHERE pid = pg_backend_pid()")
            except Exception:  # a lost connection: its pid goes when the next watcher registers
                pass
            self._conn.close()
        self._conn = None

    def close(self) -> None:
        self._drop()


class RedisChanges:
    """Subscribes to the store's change channels on its own connection."""

    def __init__(self, client: Any, prefix: str, node: str | None):
        self._client = client
        self._base = prefix + "changes:"
        self._topics = topics_for(node)
        self._pubsub: Any = None
        self._subscribe()

    def _subscribe(self) -> None:
        pubsub = self._client.pubsub()
        if self._topics is None:
            pubsub.psubscribe(self._base + "*")
        else:
            pubsub.subscribe(*(self._base + t for t in self._topics))
        self._pubsub = pubsub
        wanted, deadline = len(self._topics or ("*",)), time.monotonic() + 5
        while wanted and time.monotonic() < deadline:  # subscribed for sure: a change from now on is heard
            message = pubsub.get_message(timeout=0.5)
            if message is not None and message["type"] in ("subscribe", "psubscribe"):
                wanted -= 1

    def _kind(self, message: dict | None) -> str | None:
        if message is None or message["type"] not in ("message", "pmessage"):
            return None
        return kind_of(str(message["channel"])[len(self._base):])

    def wait(self, timeout: float) -> frozenset[str]:
        import redis

        deadline = time.monotonic() + timeout
        try:
            if self._pubsub is None:
                self._subscribe()
                return BOTH
            kinds: set[str] = set()
            while not kinds and (left := deadline - time.monotonic()) > 0:
                kind = self._kind(self._pubsub.get_message(timeout=left))
                kinds |= {kind} if kind else set()
            while kinds and (message := self._pubsub.get_message(timeout=0)) is not None:  # a burst, reported once
                kind = self._kind(message)
                kinds |= {kind} if kind else set()
            return frozenset(kinds)
        except (redis.RedisError, OSError):
            self._drop()
            time.sleep(min(RECONNECT_PAUSE_SECONDS, max(timeout, 0.0)))
            return BOTH

    def _drop(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except Exception:  # closing a dead connection: nothing more to do
                pass
        self._pubsub = None

    def close(self) -> None:
        self._drop()
