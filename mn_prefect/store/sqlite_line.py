"""The commit path on SQLite: a connection of its own, statements through the sqlite3 module, writers queued on
a lock file.

A commit and a full release are each one write transaction (``BEGIN IMMEDIATE``). Through SQLAlchemy a
statement cost about 60 us of client CPU (its cache key, parameter binding, the result object) and a commit ran
a dozen; through the sqlite3 module's own statement cache, a few microseconds each.

SQLite lets one writer in at a time, and a writer that finds the lock taken sleeps in SQLite's busy handler (1,
2, 5, 10... ms), however soon the lock is free again: with eight writers on two cores most of their time went
to those sleeps. So the commit path's writers first queue on an exclusive ``flock`` of a file beside the
database (``<file>-writers``): the kernel wakes the next one the moment the holder lets go. ``BEGIN IMMEDIATE``
stays the guarantee (other writers, of other paths or older versions, take no flock and simply wait in SQLite).

A commit decides outside the transaction on the records it last read (``admission.ReadCache``) and applies inside
it only if nothing it relied on changed: every node still has the version read, every dimension stays under its
ceiling, no claimed key is held, every needed key is (the same compare-and-apply as the Redis script and
``mn_apply``). The transaction holds SQLite's lock for those checks and the writes only; when a check fails it
answers with the state it read, and the commit decides on that.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from mn_prefect.scheduler.quotas import is_account
from mn_prefect.store.accounts import account_of, queues_of
from mn_prefect.store.admission import Applied, CommitRead, Ticket
from mn_prefect.store.base import CAPACITY, Lease, placed_topic
from mn_prefect.store.booking import NodeState, added, json_text, parse_record, stored_limits
from mn_prefect.store.dimensions import CLAIM_KINDS
from mn_prefect.store.failpoints import failpoint

_BUMP = "INSERT INTO mn_changes (topic, seq) VALUES (?, 1) ON CONFLICT (topic) DO UPDATE SET seq = mn_changes.seq + 1"
_HELD = "SELECT 1 FROM mn_held WHERE node = ? AND kind = ? AND key = ?"
_SET_USED = "UPDATE mn_nodes SET used = ? WHERE name = ?"


def _marks(count: int) -> str:
    return ",".join("?" * count)


class SQLiteLine:
    """The commit path's connection and its writers' queue (see the module docstring)."""

    def __init__(self, engine: Engine, path: str):
        self._engine = engine
        self._path = path
        self._conn: sqlite3.Connection | None = None
        self._pooled: Any = None
        self._queue: int | None = None  # the lock file's descriptor; None: SQLite's busy handler alone
        self._pid = 0
        self._lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():  # a forked child opens its own
            pooled = self._engine.raw_connection()  # the engine's pragmas: WAL, busy timeout, no implicit BEGIN
            conn = pooled.driver_connection
            self._queue = None
            if self._path != ":memory:":  # an in-memory database is the pool's one connection: not detached
                pooled.detach()  # ours alone, never handed to another transaction
                try:
                    self._queue = os.open(f"{self._path}-writers", os.O_RDWR | os.O_CREAT, 0o644)
                except OSError:
                    pass
            self._pooled, self._conn, self._pid = pooled, conn, os.getpid()
        assert self._conn is not None
        return self._conn

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; sqlite3's errors come out as SQLAlchemy's (what the store's callers handle)."""
        with self._lock:
            try:
                conn = self._connect()
                if self._queue is not None:
                    fcntl.flock(self._queue, fcntl.LOCK_EX)
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        yield conn
                        conn.execute("COMMIT")
                    except BaseException:
                        if conn.in_transaction:
                            conn.execute("ROLLBACK")
                        raise
                finally:
                    if self._queue is not None:
                        fcntl.flock(self._queue, fcntl.LOCK_UN)
            except sqlite3.IntegrityError as error:
                raise IntegrityError(None, None, error) from None
            except sqlite3.OperationalError as error:
                raise OperationalError(None, None, error) from None
            except sqlite3.Error as error:
                raise DBAPIError(None, None, error) from None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
                if self._queue is not None:
                    os.close(self._queue)
            self._conn = self._pooled = self._queue = None


def _lease_ok(conn: sqlite3.Connection, lease: Lease | None) -> bool:
    if lease is None:
        return True
    row = conn.execute("SELECT owner, epoch, expires_at FROM mn_leases WHERE name = ?", (lease.name,)).fetchone()
    return row is not None and row[0] == lease.owner and row[1] == lease.epoch and row[2] > time.time()


class SQLiteSession:
    """A commit inside one write transaction of the line: the read, and the conditional apply."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def read(self, job_id: str, nodes: list[str], lease: Lease | None) -> CommitRead:
        conn = self.conn
        booked = conn.execute("SELECT fingerprint FROM mn_bookings WHERE job_id = ?", (job_id,)).fetchone()
        rows = conn.execute("SELECT name, record, status, eligible, used, version FROM mn_nodes "
                            f"WHERE name IN ({_marks(len(nodes))}) ORDER BY name", nodes).fetchall()
        states = {name: NodeState(record=parse_record(record, status, bool(eligible)), used=orjson.loads(used),
                                  held={kind: set() for kind in CLAIM_KINDS}, version=version)
                  for name, record, status, eligible, used, version in rows if not is_account(name)}
        if states:
            for node, kind, key in conn.execute(
                    f"SELECT node, kind, key FROM mn_held WHERE node IN ({_marks(len(states))})", list(states)):
                states[node].held.setdefault(kind, set()).add(key)
        limits = conn.execute("SELECT value FROM mn_meta WHERE key = 'limits'").fetchone()
        accounts = any(is_account(n) for n in nodes)
        return CommitRead(states=list(states.values()), limits=stored_limits(limits[0] if limits else None),
                          booked=booked[0] if booked else None, lease_ok=_lease_ok(conn, lease),
                          queues=queues_of(account_of(name, record, orjson.loads(used), version)
                                           for name, record, _, _, used, version in rows if is_account(name))
                          if accounts else None)

    def apply(self, ticket: Ticket, lease: Lease | None) -> tuple[Applied, CommitRead | None]:
        conn, job_id = self.conn, ticket.job_id
        if not _lease_ok(conn, lease):
            return "stale_lease", None
        nodes = list(ticket.demands)
        found = self._unchanged(ticket)
        if found is None:
            return "changed", self.read(job_id, nodes, lease)  # the state found: decide again without another trip
        usage = [(json_text(added(used, ticket.demands[name].add)), name) for name, used in found.items()]
        conn.execute("INSERT INTO mn_bookings (job_id, fingerprint, placements, demands, committed_at) "
                     "VALUES (?, ?, ?, ?, ?)", (job_id, ticket.fingerprint, ticket.placements, ticket.plan_json(),
                                                ticket.now))
        claims = [(n, kind, key, job_id) for n, d in ticket.demands.items() for kind, keys in d.claim.items()
                  for key in keys]
        if claims:
            conn.executemany("INSERT INTO mn_held (node, kind, key, job_id) VALUES (?, ?, ?, ?)", claims)
        failpoint("commit.half_written")
        conn.executemany(_SET_USED, usage)
        conn.execute("INSERT INTO mn_history (job_id, placements, committed_at) VALUES (?, ?, ?)",
                     (job_id, ticket.placements, ticket.now))
        conn.executemany(_BUMP, [(placed_topic(node),) for node in nodes])
        return "ok", None

    def _unchanged(self, ticket: Ticket) -> dict[str, dict[str, float]] | None:
        """The ticket's nodes' usage as read, if everything the ticket was decided on still holds (under the write
        lock: it cannot change before the apply writes); None when anything changed."""
        conn = self.conn
        if conn.execute("SELECT 1 FROM mn_bookings WHERE job_id = ?", (ticket.job_id,)).fetchone() is not None:
            return None
        nodes = list(ticket.demands)
        found = {name: (version, used) for name, version, used in conn.execute(
            f"SELECT name, version, used FROM mn_nodes WHERE name IN ({_marks(len(nodes))})", nodes)}
        usage: dict[str, dict[str, float]] = {}
        for name, demand in ticket.demands.items():
            row = found.get(name)
            if row is None or row[0] != ticket.versions[name]:
                return None
            used, ceiling = orjson.loads(row[1]), ticket.ceilings[name]
            if any(used.get(dim, 0.0) + amount > ceiling[dim] + 1e-9 for dim, amount in demand.add.items()):
                return None
            for kind, keys in demand.claim.items():
                if any(conn.execute(_HELD, (name, kind, key)).fetchone() is not None for key in keys):
                    return None
            for kind, keys in demand.need.items():  # keys that must still be held (the reservation a run lands in)
                if any(conn.execute(_HELD, (name, kind, key)).fetchone() is None for key in keys):
                    return None
            usage[name] = used
        return usage


def release(line: SQLiteLine, job_id: str, lease: Lease | None) -> int:
    """A whole booking's release in one write transaction: how many placements it had, 0 when none, -1 when
    the lease is no longer current (nothing written)."""
    with line.transaction() as conn:
        if not _lease_ok(conn, lease):
            return -1
        booking = conn.execute("SELECT placements, demands FROM mn_bookings WHERE job_id = ?", (job_id,)).fetchone()
        if booking is None:
            return 0
        demands = orjson.loads(booking[1])  # the booking's own demands say what to free (no placement parsed)
        nodes = sorted(demands)
        rows = conn.execute(f"SELECT name, used FROM mn_nodes WHERE name IN ({_marks(len(nodes))})", nodes)
        conn.executemany(_SET_USED, [(json_text(added(orjson.loads(used), demands[name]["add"], -1)), name)
                                     for name, used in rows.fetchall()])
        conn.execute(f"DELETE FROM mn_held WHERE job_id = ? AND node IN ({_marks(len(nodes))})", [job_id, *nodes])
        conn.execute(_BUMP, (CAPACITY,))
        conn.execute("DELETE FROM mn_bookings WHERE job_id = ?", (job_id,))
        conn.execute("UPDATE mn_history SET released_at = ? WHERE job_id = ? AND released_at IS NULL",
                     (time.time(), job_id))
        return len(orjson.loads(booking[0]))
