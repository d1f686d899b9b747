"""What differs between SQLite and PostgreSQL, in one place each: connecting, transactions, row locks, and
how a commit's read and apply reach the database.

SQLite serialises writers (``BEGIN IMMEDIATE``): a commit reads, decides and writes inside one transaction,
so nothing can change between its read and its apply. PostgreSQL lets commits on different nodes run in
parallel: the read is one statement, the apply one function call (``mn_apply``) that re-checks what the
decision relied on under row locks, both on a connection kept for the hot path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import orjson
from sqlalchemy import event, text
from sqlalchemy.engine import Connection, Engine
from sqlmodel import create_engine

from mn_prefect.scheduler.quotas import is_account
from mn_prefect.store import failpoints, pg_functions, sqlite_line
from mn_prefect.store.accounts import account_of, queues_of
from mn_prefect.store.admission import Applied, CommitRead, ReadCache, Ticket
from mn_prefect.store.base import CAPACITY, ChangeWatcher, Lease, StoreUnavailable, placed_topic
from mn_prefect.store.booking import NodeState, RecordTexts, json_text, stored_limits
from mn_prefect.store.changes import PG_CHANNEL, PostgresChanges, SQLiteChanges
from mn_prefect.store.urls import StoreURL


class DialectStore(Protocol):
    """What a dialect needs of the store it serves (``sql.SQLStore``): how an error is said with the URL's password
    left out."""

    def safe_error(self, error: BaseException) -> str: ...


# A change counter bumped in the changing transaction (SQLite's watchers read them).
_BUMP = text("INSERT INTO mn_changes (topic, seq) VALUES (:t, 1) "
             "ON CONFLICT (topic) DO UPDATE SET seq = mn_changes.seq + 1")
_NOTIFY = text(f"SELECT pg_notify('{PG_CHANNEL}', :t)")


class SQLiteDialect:
    name = "sqlite"
    lock = ""  # BEGIN IMMEDIATE already serialises writers
    functions_tag = ""  # no server-side functions
    version_query = "SELECT sqlite_version()"

    def __init__(self) -> None:
        # Commits that fit what this process last read are decided before the write lock is taken, and the
        # transaction only checks and writes (store/sqlite_line.py).
        self.read_cache = ReadCache()
        self._line: sqlite_line.SQLiteLine | None = None

    def engine(self, url: StoreURL) -> Engine:
        assert url.path is not None  # a SQLite URL always names its file
        if url.path != ":memory:":
            Path(url.path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(f"sqlite:///{url.path}", connect_args={"timeout": 60, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None  # we issue BEGIN IMMEDIATE ourselves
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA busy_timeout=60000")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        self._line = sqlite_line.SQLiteLine(engine, url.path)
        return engine

    @contextmanager
    def transaction(self, engine: Engine, write: bool) -> Iterator[Connection]:
        with engine.connect() as conn:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield conn
            except BaseException:
                conn.exec_driver_sql("ROLLBACK")
                raise
            conn.exec_driver_sql("COMMIT")

    def create_functions(self, conn: Connection) -> None:
        pass

    def repeatable_read(self, conn: Connection) -> None:
        pass  # a SQLite transaction is one snapshot already

    @contextmanager
    def commit_session(self, store: DialectStore) -> Iterator[Any]:
        assert self._line is not None
        with self._line.transaction() as conn:
            yield sqlite_line.SQLiteSession(conn)

    def release(self, store: DialectStore, job_id: str, lease: Lease | None) -> int | None:
        assert self._line is not None
        return sqlite_line.release(self._line, job_id, lease)

    def changed(self, conn: Connection, topics: list[str]) -> None:
        """Announce ``topics`` (store/changes.py) in the transaction that made the change."""
        conn.execute(_BUMP, [{"t": topic} for topic in topics])

    def changes(self, url: StoreURL, node: str | None) -> ChangeWatcher:
        if url.path is None or url.path == ":memory:":
            raise ValueError("an in-memory SQLite store has no file another connection could watch")
        return SQLiteChanges(url.path, node)

    def close(self) -> None:
        if self._line is not None:
            self._line.close()


class PostgresDialect:
    name = "postgresql"
    functions_tag = pg_functions.TAG  # which functions a store has, kept in mn_meta
    lock = " FOR UPDATE"
    version_query = "SHOW server_version"

    def __init__(self, url: StoreURL):
        self.url = url
        self._hot: Any = None  # the autocommit connection commits and releases use (store/pg_line.py)
        self._announced = False  # an announcement was sent on it whose answer is not read yet
        self._hot_lock = threading.Lock()
        self.read_cache = ReadCache()  # commits that fit what this process last read need no read first
        self.records = RecordTexts()  # the commit path's reads leave out records known here

    def engine(self, url: StoreURL) -> Engine:
        from sqlalchemy.engine import URL

        (host, port), = url.hosts
        sa_url = URL.create("postgresql+psycopg", username=url.username, password=url.password,
                            host=host, port=port, database=url.database,
                            query={k: v for k, v in url.options.items() if k in ("sslmode", "application_name")})
        # No pre-ping (a round trip per call): a dropped connection is retried once in call() instead.
        engine = create_engine(sa_url, pool_size=2, max_overflow=4,
                               connect_args={"connect_timeout": int(url.options.get("connect_timeout", 10))})
        if failpoints.active("commit.half_written"):
            @event.listens_for(engine, "connect")
            def _failpoint(dbapi_connection: Any, _record: Any) -> None:
                # The apply function sleeps after writing; the server notices the killed client and rolls back.
                with dbapi_connection.cursor() as cursor:
                    cursor.execute("SET mn.failpoint = 'commit.half_written'")
                    cursor.execute("SET client_connection_check_interval = '100ms'")
                dbapi_connection.commit()
        self._engine = engine
        return engine

    @contextmanager
    def transaction(self, engine: Engine, write: bool) -> Iterator[Connection]:
        with engine.connect() as conn, conn.begin():
            yield conn

    def create_functions(self, conn: Connection) -> None:

        conn.exec_driver_sql("SELECT pg_advisory_xact_lock(4242)")  # one creator at a time
        for statement in pg_functions.DROP_OLD:
            conn.exec_driver_sql(statement)
        for function in pg_functions.FUNCTIONS:
            conn.exec_driver_sql(function)
        conn.execute(text("INSERT INTO mn_meta (key, value) VALUES ('functions', :v) "
                          "ON CONFLICT (key) DO UPDATE SET value = excluded.value"), {"v": self.functions_tag})

    def repeatable_read(self, conn: Connection) -> None:
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")  # one moment for every statement

    def call(self, store: DialectStore, statement: str, params: tuple) -> str | None:
        """One of the commit path's statements (pg_line.STATEMENTS) in autocommit on a connection kept for
        them: one round trip, atomic on the server. Reads, applies and releases are idempotent, so a call on a
        connection that turned out dead (a server restart) is simply sent again on a new one."""
        import psycopg  # here, not at the top: a SQLite or Redis store never loads the PostgreSQL driver

        from mn_prefect.store import pg_line

        with self._hot_lock:
            for attempt in (1, 2):
                try:
                    return pg_line.run(self._ready(), statement, params)
                except psycopg.IntegrityError:
                    raise  # the caller's to judge (a concurrent write won a race)
                except psycopg.OperationalError as error:
                    if self._hot is not None:
                        self._hot.close()
                    self._hot = None
                    if attempt == 2:
                        raise StoreUnavailable(store.safe_error(error)) from None
                except psycopg.Error as error:
                    raise StoreUnavailable(store.safe_error(error)) from None
        raise AssertionError("unreachable")

    def _ready(self) -> Any:
        """The hot connection (the caller holds ``_hot_lock``): connected and prepared, with the answer of an
        announcement sent before it read."""
        from mn_prefect.store import pg_line

        if self._hot is None or self._hot.closed:
            pooled = self._engine.raw_connection()
            self._hot = pooled.driver_connection
            # Ours alone: dropped, a pooled connection goes back to the pool, and an autocommit one
            # handed to a transaction would commit each of its statements on its own.
            pooled.detach()
            self._hot.autocommit = True
            self._announced = False
            pg_line.prepare(self._hot)
        elif self._announced:
            self._announced = False
            pg_line.drain(self._hot)
        return self._hot

    @contextmanager
    def commit_session(self, store: DialectStore) -> Iterator[Any]:
        yield _PostgresSession(self, store)

    def release(self, store: DialectStore, job_id: str, lease: Lease | None) -> int | None:
        name, owner, epoch = fence(lease)
        count, heard = -2, True
        while count == -2:  # the booking moved to nodes mn_release had not locked: nothing written, call again
            answer = (self.call(store, "mn_release", (job_id, time.time(), name, owner, epoch)) or "0").split()
            count, heard = int(answer[0]), answer[1:] != ["quiet"]
        if count > 0 and heard:  # "quiet": no change watcher listens (pg_functions.LISTENERS)
            self.announce(store, [CAPACITY])
        return count

    def announce(self, store: DialectStore, topics: list[str]) -> None:
        """Announce what a committed mn_apply or mn_release changed (pg_functions.ANNOUNCE says why not inside
        them). Never raises: the change is made, and a missed announcement only waits for the next poll.

        Sent without waiting for its answer (the commit returns one round trip sooner); the answer is read
        before the connection's next call, long arrived by then."""
        import psycopg

        from mn_prefect.store import pg_line

        with self._hot_lock:
            try:
                pg_line.send(self._ready(), "mn_announce", (topics,))
                self._announced = True
            except psycopg.Error:
                if self._hot is not None:
                    self._hot.close()
                self._hot = None

    def changed(self, conn: Connection, topics: list[str]) -> None:
        """Announce ``topics`` to the LISTENing watchers: delivered when the transaction commits, never on a rollback.
        Commits and full releases, the hot path, announce just after their function committed (``announce``)."""
        for topic in topics:
            conn.execute(_NOTIFY, {"t": topic})

    def changes(self, url: StoreURL, node: str | None) -> ChangeWatcher:
        return PostgresChanges(url, node)

    def close(self) -> None:
        if self._hot is not None:
            self._hot.close()
            self._hot = None


class _PostgresSession:
    def __init__(self, dialect: PostgresDialect, store: DialectStore):
        self.dialect = dialect
        self.store = store

    def read(self, job_id: str, nodes: list[str], lease: Lease | None) -> CommitRead:
        known = json_text(self.dialect.records.known(nodes))
        answer = self.dialect.call(self.store, "mn_read", (nodes, job_id, lease.name if lease else "", known))
        return self._parsed(orjson.loads(answer or "{}"), lease, any(is_account(n) for n in nodes))

    def _parsed(self, raw: dict[str, Any], lease: Lease | None, asked_accounts: bool) -> CommitRead:
        held: dict[str, dict[str, set[str]]] = {}
        for node, kind, key in raw["held"]:
            held.setdefault(node, {}).setdefault(kind, set()).add(key)
        records = self.dialect.records
        states = [NodeState(record=records.record(n["name"], n["version"], n["record"], n["status"], n["eligible"]),
                            used=orjson.loads(n["used"]), held=held.get(n["name"], {}), version=n["version"])
                  for n in raw["nodes"] if not is_account(n["name"])]
        accounts = [account_of(n["name"], records.text(n["name"], n["version"], n["record"]), orjson.loads(n["used"]),
                               n["version"]) for n in raw["nodes"] if is_account(n["name"])]
        limits = stored_limits(raw["limits"])
        lease_ok = True
        if lease is not None:
            owner, epoch, expires = raw["lease"] or (None, None, 0)
            lease_ok = owner == lease.owner and epoch == lease.epoch and expires > time.time()
        return CommitRead(states=states, limits=limits, booked=raw["booked"], lease_ok=lease_ok,
                          queues=queues_of(accounts) if asked_accounts else None)

    def apply(self, ticket: Ticket, lease: Lease | None) -> tuple[Applied, CommitRead | None]:
        import psycopg

        if failpoints.active("commit.half_written"):
            failpoints.reached("commit.half_written")
        try:
            answer = self.dialect.call(self.store, "mn_apply", (
                ticket.job_id, ticket.fingerprint, ticket.plan_json(), ticket.placements, ticket.now, *fence(lease)))
        except psycopg.IntegrityError:
            return "changed", None  # a concurrent commit of the same job booked first: read again
        if answer == "ok":
            self.dialect.announce(self.store, [placed_topic(node) for node in ticket.demands])
            return "ok", None
        if answer == "ok quiet":  # no change watcher listens (pg_functions.LISTENERS): nothing to announce
            return "ok", None
        if answer == "stale_lease":
            return "stale_lease", None
        # changed: the state mn_apply found (mn_read's JSON), to decide again without another trip
        return "changed", self._parsed(orjson.loads(answer or "{}"), lease, any(is_account(n) for n in ticket.demands))


def fence(lease: Lease | None) -> tuple[str, str, int]:
    return (lease.name, lease.owner, lease.epoch) if lease else ("", "", 0)


def dialect_for(url: StoreURL) -> SQLiteDialect | PostgresDialect:
    return SQLiteDialect() if url.backend == "sqlite" else PostgresDialect(url)
