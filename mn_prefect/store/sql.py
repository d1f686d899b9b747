"""SQLite (the embedded default) and PostgreSQL, through SQLModel/SQLAlchemy.

Atomicity: a commit runs in one transaction that first locks what it reads: ``BEGIN IMMEDIATE`` on SQLite
(one writer at a time), ``SELECT ... FOR UPDATE`` on the plan's node rows on PostgreSQL (commits on other
nodes proceed in parallel). Held devices and ports also have primary keys (node, device) and (node, port),
so even a logic error could not double-book: the insert would fail and the transaction roll back.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from sqlalchemy import bindparam, event, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlmodel import Field, SQLModel, create_engine

from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Placement
from mn_prefect.scheduler.limits import Limits
from mn_prefect.store.base import (
    Booking,
    ClusterSnapshot,
    CommitResult,
    Conflict,
    Event,
    HistoryEntry,
    JobRecord,
    Lease,
    NodeNotRegistered,
    StaleLease,
    StoredNode,
    StoreInfo,
    StoreUnavailable,
)
from mn_prefect.store.booking import (
    NodeState,
    admission_conflict,
    check_transition,
    demand_by_node,
    fingerprint,
    heartbeat_status,
    parse_record as _record,
    reconnect_event,
    registered_status,
    snapshot_nodes,
    transition_applies,
    transition_event,
)
from mn_prefect.store import failpoints
from mn_prefect.store.failpoints import failpoint
from mn_prefect.store.urls import StoreURL

SCHEMA_VERSION = "1"


class NodeRow(SQLModel, table=True):
    __tablename__ = "mn_nodes"
    name: str = Field(primary_key=True)
    record: str
    status: str
    eligible: bool
    last_heartbeat: Optional[float] = None
    cpu_used: float = 0.0
    mem_used: float = 0.0
    disk_used: float = 0.0
    gpu_used: int = 0
    # Capacity columns let PostgreSQL's commit function check admission without parsing the record.
    cpu_total: float = 0.0
    mem_total: float = 0.0
    disk_total: float = 0.0
    gpu_total: int = 0
    device_ids: str = "[]"


class HeldDeviceRow(SQLModel, table=True):
    __tablename__ = "mn_held_devices"
    node: str = Field(primary_key=True)
    device_id: str = Field(primary_key=True)
    job_id: str = Field(index=True)


class HeldPortRow(SQLModel, table=True):
    __tablename__ = "mn_held_ports"
    node: str = Field(primary_key=True)
    port_key: str = Field(primary_key=True)
    job_id: str = Field(index=True)


class BookingRow(SQLModel, table=True):
    __tablename__ = "mn_bookings"
    job_id: str = Field(primary_key=True)
    fingerprint: str
    placements: str
    demands: str = "{}"
    committed_at: float


class HistoryRow(SQLModel, table=True):
    __tablename__ = "mn_history"
    id: Optional[int] = Field(default=None, primary_key=True)
    job_id: str = Field(index=True)
    placements: str
    committed_at: float
    released_at: Optional[float] = None


class JobRow(SQLModel, table=True):
    __tablename__ = "mn_jobs"
    job_id: str = Field(primary_key=True)
    name: Optional[str] = None
    job_type: Optional[str] = None
    status: str
    spec: str
    created_at: float
    updated_at: float


class EventRow(SQLModel, table=True):
    __tablename__ = "mn_events"
    id: Optional[int] = Field(default=None, primary_key=True)
    at: float = Field(index=True)
    kind: str
    node: Optional[str] = Field(default=None, index=True)
    job_id: Optional[str] = Field(default=None, index=True)
    reason: Optional[str] = None
    data: str = "{}"


class LeaseRow(SQLModel, table=True):
    __tablename__ = "mn_leases"
    name: str = Field(primary_key=True)
    owner: str
    epoch: int
    expires_at: float


class MetaRow(SQLModel, table=True):
    __tablename__ = "mn_meta"
    key: str = Field(primary_key=True)
    value: str


_PG_COMMIT = "SELECT mn_commit(%s, %s, %s::jsonb, %s, %s, %s, %s, %s)"
_PG_RELEASE = "SELECT mn_release(%s, %s, %s, %s, %s)"
_NODE_COLUMNS = "name, record, status, eligible, last_heartbeat, cpu_used, mem_used, disk_used, gpu_used"
class SQLStore:
    """The store on SQLite or PostgreSQL."""

    def __init__(self, url: StoreURL, *, create: bool = True):
        self.url = url
        self.backend = url.backend
        self.sqlite = url.backend == "sqlite"
        self.engine = self._engine()
        self._hot = None  # PostgreSQL: the connection commits and releases use
        self._hot_lock = threading.Lock()
        if create:
            self._guard(self._create)

    def __repr__(self) -> str:
        return f"SQLStore({self.url.safe!r})"

    # -- plumbing -------------------------------------------------------------------------------------

    def _engine(self) -> Engine:
        if self.sqlite:
            if self.url.path != ":memory:":
                Path(self.url.path).parent.mkdir(parents=True, exist_ok=True)
            engine = create_engine(f"sqlite:///{self.url.path}", connect_args={"timeout": 60, "check_same_thread": False})

            @event.listens_for(engine, "connect")
            def _pragmas(dbapi_connection, _record):
                dbapi_connection.isolation_level = None  # we issue BEGIN IMMEDIATE ourselves
                cursor = dbapi_connection.cursor()
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute("PRAGMA synchronous=NORMAL")
                cursor.execute("PRAGMA busy_timeout=60000")
                cursor.execute("PRAGMA foreign_keys=ON")
                cursor.close()

            return engine
        (host, port), = self.url.hosts
        from sqlalchemy.engine import URL

        sa_url = URL.create("postgresql+psycopg", username=self.url.username, password=self.url.password,
                            host=host, port=port, database=self.url.database,
                            query={k: v for k, v in self.url.options.items() if k in ("sslmode", "application_name")})
        # No pre-ping (a round trip per call): a dropped connection is retried once in _call_pg instead.
        engine = create_engine(sa_url, pool_size=2, max_overflow=4,
                               connect_args={"connect_timeout": int(self.url.options.get("connect_timeout", 10))})
        if failpoints.active("commit.half_written"):
            @event.listens_for(engine, "connect")
            def _failpoint(dbapi_connection, _record):
                # The commit function sleeps after writing; the server notices the killed client and rolls back.
                with dbapi_connection.cursor() as cursor:
                    cursor.execute("SET mn.failpoint = 'commit.half_written'")
                    cursor.execute("SET client_connection_check_interval = '100ms'")
                dbapi_connection.commit()
        return engine

    def _guard(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except IntegrityError:
            raise
        except DBAPIError as error:
            raise StoreUnavailable(self._safe_error(error)) from None

    def _safe_error(self, error: BaseException) -> str:
        detail = str(getattr(error, "orig", error)).splitlines()[0] if str(error) else type(error).__name__
        if self.url.password:
            detail = detail.replace(self.url.password, "***")
        return f"{self.backend} store {self.url.safe} failed: {detail}"

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            if self.sqlite:
                conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
                try:
                    yield conn
                except BaseException:
                    conn.exec_driver_sql("ROLLBACK")
                    raise
                conn.exec_driver_sql("COMMIT")
            else:
                with conn.begin():
                    yield conn

    def _create(self) -> None:
        with self._tx() as conn:
            SQLModel.metadata.create_all(conn, tables=[m.__table__ for m in (
                NodeRow, HeldDeviceRow, HeldPortRow, BookingRow, HistoryRow, JobRow, EventRow, LeaseRow, MetaRow)])
            conn.execute(text("INSERT INTO mn_meta (key, value) VALUES ('schema_version', :v) ON CONFLICT (key) DO NOTHING"),
                         {"v": SCHEMA_VERSION})
            if not self.sqlite:
                from mn_prefect.store import pg_functions

                conn.exec_driver_sql("SELECT pg_advisory_xact_lock(4242)")  # one creator at a time
                conn.exec_driver_sql(pg_functions.COMMIT)
                conn.exec_driver_sql(pg_functions.RELEASE)

    def close(self) -> None:
        if self._hot is not None:
            self._hot.close()
            self._hot = None
        self.engine.dispose()

    def check(self) -> StoreInfo:
        try:
            with self._tx(write=False) as conn:
                version = conn.exec_driver_sql("SELECT sqlite_version()" if self.sqlite else "SHOW server_version").scalar()
                counts = {
                    name: conn.exec_driver_sql(f"SELECT COUNT(*) FROM {table}").scalar()
                    for name, table in (("nodes", "mn_nodes"), ("active_jobs", "mn_bookings"), ("held_devices", "mn_held_devices"),
                                        ("held_ports", "mn_held_ports"), ("jobs", "mn_jobs"), ("events", "mn_events"),
                                        ("leases", "mn_leases"))
                }
            return StoreInfo(backend=self.backend, url=self.url.safe, reachable=True, version=str(version), counts=counts)
        except DBAPIError as error:
            return StoreInfo(backend=self.backend, url=self.url.safe, reachable=False, error=self._safe_error(error))

    # -- nodes ----------------------------------------------------------------------------------------

    def register_node(self, record: NodeRecord, *, now: float | None = None) -> NodeRecord:
        now = time.time() if now is None else now
        with self._tx() as conn:
            row = conn.execute(text("SELECT status, eligible FROM mn_nodes WHERE name = :n"), {"n": record.name}).first()
            status, eligible = registered_status(record, row[0] if row else None, bool(row[1]) if row else None)
            stored = record.model_copy(update={"status": status, "scheduling_eligible": eligible})
            conn.execute(text(
                "INSERT INTO mn_nodes (name, record, status, eligible, last_heartbeat, cpu_used, mem_used, disk_used, gpu_used, "
                "cpu_total, mem_total, disk_total, gpu_total, device_ids) "
                "VALUES (:n, :r, :s, :e, :h, 0, 0, 0, 0, :ct, :mt, :dt, :gt, :ids) ON CONFLICT (name) DO UPDATE SET record = :r, "
                "status = :s, eligible = :e, last_heartbeat = :h, cpu_total = :ct, mem_total = :mt, disk_total = :dt, "
                "gpu_total = :gt, device_ids = :ids"),
                {"n": record.name, "r": stored.model_dump_json(), "s": status, "e": eligible, "h": now,
                 "ct": record.cpu_cores, "mt": record.memory_mb, "dt": record.disk_mb, "gt": len(record.gpu_devices),
                 "ids": json.dumps([d.id for d in record.devices])})
        return stored

    def _node_row(self, conn: Connection, name: str):
        """The node's row for a read-modify-write: locked on PostgreSQL (SQLite's BEGIN IMMEDIATE already
        serialises writers), so a heartbeat and a state change never overwrite each other."""
        lock = "" if self.sqlite else " FOR UPDATE"
        row = conn.execute(text(f"SELECT {_NODE_COLUMNS} FROM mn_nodes WHERE name = :n{lock}"), {"n": name}).first()
        if row is None:
            raise NodeNotRegistered(f"node {name!r} is not registered")
        return row

    def heartbeat(self, name: str, *, now: float | None = None) -> NodeRecord:
        now = time.time() if now is None else now
        with self._tx() as conn:
            row = self._node_row(conn, name)
            status = heartbeat_status(row.status)
            conn.execute(text("UPDATE mn_nodes SET last_heartbeat = :h, status = :s WHERE name = :n"),
                         {"h": now, "s": status, "n": name})
            if status != row.status:
                self._insert_event(conn, reconnect_event(name, row.status, now, row.last_heartbeat))
        return _record(row.record, status, row.eligible)

    def transition_node(self, name: str, to_status: str, *, from_statuses: tuple[str, ...], now: float | None = None,
                        reason: str | None = None, eligible: bool | None = None,
                        heartbeat_before: float | None = None) -> NodeRecord | None:
        check_transition(to_status, tuple(from_statuses))
        now = time.time() if now is None else now
        with self._tx() as conn:
            row = self._node_row(conn, name)
            if not transition_applies(row.status, row.last_heartbeat, tuple(from_statuses), heartbeat_before):
                return None
            new_eligible = row.eligible if eligible is None else eligible
            conn.execute(text("UPDATE mn_nodes SET status = :s, eligible = :e WHERE name = :n"),
                         {"s": to_status, "e": new_eligible, "n": name})
            self._insert_event(conn, transition_event(name, row.status, to_status, now, reason))
        return _record(row.record, to_status, new_eligible)

    def set_node_status(self, name: str, status: str, *, eligible: bool | None = None) -> NodeRecord:
        with self._tx() as conn:
            row = self._node_row(conn, name)
            new_eligible = row.eligible if eligible is None else eligible
            conn.execute(text("UPDATE mn_nodes SET status = :s, eligible = :e WHERE name = :n"),
                         {"s": status, "e": new_eligible, "n": name})
        return _record(row.record, status, new_eligible)

    def get_node(self, name: str) -> StoredNode | None:
        with self._tx(write=False) as conn:
            row = conn.execute(text(f"SELECT {_NODE_COLUMNS} FROM mn_nodes WHERE name = :n"), {"n": name}).first()
        return StoredNode(record=_record(row.record, row.status, row.eligible), last_heartbeat=row.last_heartbeat) if row else None

    def list_nodes(self) -> list[StoredNode]:
        with self._tx(write=False) as conn:
            rows = conn.execute(text(f"SELECT {_NODE_COLUMNS} FROM mn_nodes ORDER BY name")).all()
        return [StoredNode(record=_record(r.record, r.status, r.eligible), last_heartbeat=r.last_heartbeat) for r in rows]

    # -- limits ---------------------------------------------------------------------------------------

    def _limits(self, conn: Connection) -> Limits:
        value = conn.execute(text("SELECT value FROM mn_meta WHERE key = 'limits'")).scalar()
        return Limits.model_validate_json(value) if value else Limits()

    def get_limits(self) -> Limits:
        with self._tx(write=False) as conn:
            return self._limits(conn)

    def set_limits(self, limits: Limits) -> None:
        with self._tx() as conn:
            conn.execute(text("INSERT INTO mn_meta (key, value) VALUES ('limits', :v) ON CONFLICT (key) DO UPDATE SET value = :v"),
                         {"v": limits.model_dump_json()})

    # -- placements -----------------------------------------------------------------------------------

    def _states(self, conn: Connection, names: list[str] | None, *, lock: bool) -> list[NodeState]:
        """Node rows (locked on PostgreSQL when asked) with what is held on them."""
        where = " WHERE name IN :names" if names is not None else ""
        lock_sql = " FOR UPDATE" if lock and not self.sqlite else ""
        stmt = text(f"SELECT {_NODE_COLUMNS} FROM mn_nodes{where} ORDER BY name{lock_sql}")
        params: dict = {}
        if names is not None:
            stmt = stmt.bindparams(bindparam("names", expanding=True))
            params["names"] = names
        rows = conn.execute(stmt, params).all()
        states = {r.name: NodeState(record=_record(r.record, r.status, r.eligible), cpu=r.cpu_used, mem=r.mem_used,
                                    disk=r.disk_used, gpu=r.gpu_used) for r in rows}
        for table, column, attr in (("mn_held_devices", "device_id", "devices"), ("mn_held_ports", "port_key", "ports")):
            held = text(f"SELECT node, {column} FROM {table}" + (" WHERE node IN :names" if names is not None else ""))
            if names is not None:
                held = held.bindparams(bindparam("names", expanding=True))
            for node, key in conn.execute(held, params):
                if node in states:
                    getattr(states[node], attr).add(key)
        return list(states.values())

    def _check_lease(self, conn: Connection, lease: Lease | None, now: float) -> None:
        if lease is None:
            return
        row = conn.execute(text("SELECT owner, epoch, expires_at FROM mn_leases WHERE name = :n"), {"n": lease.name}).first()
        if row is None or row.owner != lease.owner or row.epoch != lease.epoch or row.expires_at <= now:
            raise StaleLease(f"lease {lease.name!r} epoch {lease.epoch} held by {lease.owner!r} is no longer current")

    def commit_plan(self, job_id: str, placements: list[Placement], *, lease: Lease | None = None) -> CommitResult:
        placements = list(placements)
        fp = fingerprint(placements)
        demands = demand_by_node(placements)
        now = time.time()
        if not self.sqlite:
            return self._commit_pg(job_id, placements, fp, demands, now, lease)
        try:
            with self._tx() as conn:
                self._check_lease(conn, lease, now)
                states = self._states(conn, sorted(demands), lock=True)
                existing = conn.execute(text("SELECT fingerprint FROM mn_bookings WHERE job_id = :j"), {"j": job_id}).scalar()
                if existing is not None:
                    if existing == fp:
                        return CommitResult(ok=True, job_id=job_id, already_committed=True, placements=placements)
                    return CommitResult(ok=False, job_id=job_id,
                                        conflict=Conflict(reason=f"job {job_id} already holds a different booking",
                                                                      job_booked=True))
                conflict = admission_conflict(states, self._limits(conn), placements)
                if conflict is not None:
                    return CommitResult(ok=False, job_id=job_id, conflict=Conflict(node=conflict[0], reason=conflict[1]))
                failpoint("commit.after_reads")
                body = json.dumps([p.model_dump(mode="json") for p in placements])
                conn.execute(text("INSERT INTO mn_bookings (job_id, fingerprint, placements, demands, committed_at) "
                                  "VALUES (:j, :f, :p, :d, :t)"),
                             {"j": job_id, "f": fp, "p": body, "t": now,
                              "d": json.dumps({n: d.as_json() for n, d in demands.items()})})
                devices = [{"n": n, "d": dev, "j": job_id} for n, d in demands.items() for dev in d.devices]
                ports = [{"n": n, "k": key, "j": job_id} for n, d in demands.items() for key in d.ports]
                if devices:
                    conn.execute(text("INSERT INTO mn_held_devices (node, device_id, job_id) VALUES (:n, :d, :j)"), devices)
                failpoint("commit.half_written")
                if ports:
                    conn.execute(text("INSERT INTO mn_held_ports (node, port_key, job_id) VALUES (:n, :k, :j)"), ports)
                conn.execute(text(
                    "UPDATE mn_nodes SET cpu_used = ROUND(CAST(cpu_used + :c AS NUMERIC), 6), "
                    "mem_used = ROUND(CAST(mem_used + :m AS NUMERIC), 6), disk_used = ROUND(CAST(disk_used + :d AS NUMERIC), 6), "
                    "gpu_used = gpu_used + :g WHERE name = :n"),
                    [{"c": d.cpu, "m": d.mem, "d": d.disk, "g": d.gpu, "n": n} for n, d in demands.items()])
                conn.execute(text("INSERT INTO mn_history (job_id, placements, committed_at) VALUES (:j, :p, :t)"),
                             {"j": job_id, "p": body, "t": now})
        except IntegrityError:
            # A concurrent commit of the same job or the same device/port won the race: nothing was written.
            return CommitResult(ok=False, job_id=job_id, conflict=Conflict(reason="a concurrent commit booked it first"))
        except DBAPIError as error:
            raise StoreUnavailable(self._safe_error(error)) from None
        return CommitResult(ok=True, job_id=job_id, placements=placements)

    def _fence(self, lease: Lease | None) -> dict:
        return {"ln": lease.name if lease else "", "lo": lease.owner if lease else "", "le": lease.epoch if lease else 0}

    def _call_pg(self, sql: str, params: tuple):
        """One function call in autocommit on a connection kept for the hot path: one round trip, atomic on
        the server, prepared after a few calls. Commit and release are idempotent, so a call on a connection
        that turned out dead (a server restart) is simply sent again on a new one."""
        import psycopg

        with self._hot_lock:
            for attempt in (1, 2):
                try:
                    if self._hot is None or self._hot.closed:
                        pooled = self.engine.raw_connection()
                        self._hot = pooled.driver_connection
                        # Ours alone: dropped, a pooled connection goes back to the pool, and an autocommit one
                        # handed to _tx would commit each statement of a transaction on its own.
                        pooled.detach()
                        self._hot.autocommit = True
                    if failpoints.active("commit.half_written"):
                        failpoints.reached("commit.half_written")
                    return self._hot.execute(sql, params).fetchone()[0]
                except psycopg.OperationalError as error:
                    if self._hot is not None:
                        self._hot.close()
                    self._hot = None
                    if attempt == 2:
                        raise StoreUnavailable(self._safe_error(error)) from None

    def _commit_pg(self, job_id, placements, fp, demands, now, lease) -> CommitResult:
        import psycopg

        body = json.dumps([p.model_dump(mode="json") for p in placements])
        params = {"j": job_id, "f": fp, "d": json.dumps({n: d.as_json() for n, d in demands.items()}), "p": body,
                  "t": now, **self._fence(lease)}
        try:
            outcome, node, reason = self._call_pg(_PG_COMMIT, (params["j"], params["f"], params["d"], params["p"],
                                                               params["t"], params["ln"], params["lo"], params["le"]))
        except psycopg.errors.IntegrityError:
            return CommitResult(ok=False, job_id=job_id, conflict=Conflict(reason="a concurrent commit booked it first"))
        except psycopg.Error as error:
            raise StoreUnavailable(self._safe_error(error)) from None
        if outcome == "stale_lease":
            raise StaleLease(f"lease {lease.name!r} epoch {lease.epoch} held by {lease.owner!r} is no longer current")
        if outcome == "already":
            return CommitResult(ok=True, job_id=job_id, already_committed=True, placements=placements)
        if outcome == "conflict":
            return CommitResult(ok=False, job_id=job_id, conflict=Conflict(
                node=node or None, reason=reason, job_booked=reason.endswith("already holds a different booking")))
        return CommitResult(ok=True, job_id=job_id, placements=placements)

    def _release_pg(self, job_id: str, lease: Lease | None) -> int:
        fence = self._fence(lease)
        count = -2
        while count == -2:  # the booking moved to nodes mn_release had not locked: nothing written, call again
            count = self._call_pg(_PG_RELEASE, (job_id, time.time(), fence["ln"], fence["lo"], fence["le"]))
        if count == -1:
            raise StaleLease(f"lease {lease.name!r} epoch {lease.epoch} is no longer current")
        return count

    def release(self, job_id: str, *, lease: Lease | None = None, node: str | None = None) -> int:
        now = time.time()
        if not self.sqlite and node is None:
            import psycopg

            try:
                return self._release_pg(job_id, lease)
            except psycopg.Error as error:
                raise StoreUnavailable(self._safe_error(error)) from None
        try:
            with self._tx() as conn:
                self._check_lease(conn, lease, now)
                lock = ""
                if not self.sqlite:  # (only a partial release comes here) the node row, then the booking row,
                    lock = " FOR UPDATE"  # in the order of commits and mn_release
                    conn.execute(text("SELECT name FROM mn_nodes WHERE name = :n FOR UPDATE"), {"n": node})
                body = conn.execute(text(f"SELECT placements FROM mn_bookings WHERE job_id = :j{lock}"),
                                    {"j": job_id}).scalar()
                if body is None:
                    return 0
                placements = [Placement.model_validate(p) for p in json.loads(body)]
                gone = [p for p in placements if node is None or p.node == node]
                kept = [p for p in placements if node is not None and p.node != node]
                if not gone:
                    return 0
                demands = demand_by_node(gone)
                # Clamp at zero: MAX(x, 0) is scalar in SQLite, GREATEST in PostgreSQL.
                top = "MAX" if self.sqlite else "GREATEST"
                conn.execute(text(
                    f"UPDATE mn_nodes SET cpu_used = {top}(ROUND(CAST(cpu_used - :c AS NUMERIC), 6), 0), "
                    f"mem_used = {top}(ROUND(CAST(mem_used - :m AS NUMERIC), 6), 0), "
                    f"disk_used = {top}(ROUND(CAST(disk_used - :d AS NUMERIC), 6), 0), "
                    f"gpu_used = {top}(gpu_used - :g, 0) WHERE name = :n"),
                    [{"c": d.cpu, "m": d.mem, "d": d.disk, "g": d.gpu, "n": n} for n, d in demands.items()])
                if kept:  # only this node's share goes; the rest of the booking stays as it was
                    for table in ("mn_held_devices", "mn_held_ports"):
                        conn.execute(text(f"DELETE FROM {table} WHERE job_id = :j AND node = :n"), {"j": job_id, "n": node})
                    conn.execute(text("UPDATE mn_bookings SET placements = :p, demands = :d, fingerprint = :f "
                                      "WHERE job_id = :j"),
                                 {"j": job_id, "p": json.dumps([k.model_dump(mode="json") for k in kept]),
                                  "f": fingerprint(kept),
                                  "d": json.dumps({n: d.as_json() for n, d in demand_by_node(kept).items()})})
                    return len(gone)
                conn.execute(text("DELETE FROM mn_held_devices WHERE job_id = :j"), {"j": job_id})
                conn.execute(text("DELETE FROM mn_held_ports WHERE job_id = :j"), {"j": job_id})
                conn.execute(text("DELETE FROM mn_bookings WHERE job_id = :j"), {"j": job_id})
                conn.execute(text("UPDATE mn_history SET released_at = :t WHERE job_id = :j AND released_at IS NULL"),
                             {"t": now, "j": job_id})
                return len(placements)
        except DBAPIError as error:
            raise StoreUnavailable(self._safe_error(error)) from None

    def active_placements(self, *, node: str | None = None, job_id: str | None = None) -> list[Placement]:
        sql, params = "SELECT job_id, placements FROM mn_bookings", {}
        if job_id is not None:
            sql, params = sql + " WHERE job_id = :j", {"j": job_id}
        with self._tx(write=False) as conn:
            rows = conn.execute(text(sql + " ORDER BY job_id"), params).all()
        out = []
        for row in rows:
            for p in json.loads(row.placements):
                placement = Placement.model_validate(p)
                if node is None or placement.node == node:
                    out.append(placement.model_copy(update={"job_id": row.job_id}))
        return out

    def active_jobs(self) -> list[str]:
        with self._tx(write=False) as conn:
            return [r[0] for r in conn.execute(text("SELECT job_id FROM mn_bookings ORDER BY job_id"))]

    def bookings(self) -> list[Booking]:
        with self._tx(write=False) as conn:
            devices = conn.execute(text("SELECT node, device_id, job_id FROM mn_held_devices")).all()
            ports = conn.execute(text("SELECT node, port_key, job_id FROM mn_held_ports")).all()
        return ([Booking(node=n, kind="device", key=k, job_id=j) for n, k, j in devices]
                + [Booking(node=n, kind="port", key=k, job_id=j) for n, k, j in ports])

    def snapshot(self) -> ClusterSnapshot:
        with self._tx(write=False) as conn:
            states = self._states(conn, None, lock=False)
            limits = self._limits(conn)
        nodes, holds = snapshot_nodes(states)
        return ClusterSnapshot(nodes=nodes, holds=holds, limits=limits)

    def consistent_view(self) -> dict:
        """Everything the independent checker needs, read in one transaction (one snapshot)."""
        with self._tx(write=False) as conn:
            if not self.sqlite:  # READ COMMITTED would let each statement see a different moment
                conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            states = self._states(conn, None, lock=False)
            bookings = conn.execute(text("SELECT job_id, placements FROM mn_bookings")).all()
            devices = conn.execute(text("SELECT node, device_id, job_id FROM mn_held_devices")).all()
            ports = conn.execute(text("SELECT node, port_key, job_id FROM mn_held_ports")).all()
            limits = self._limits(conn)
        return {
            "nodes": {s.record.name: {"record": s.record, "cpu": s.cpu, "mem": s.mem, "disk": s.disk, "gpu": s.gpu}
                      for s in states},
            "bookings": {j: [Placement.model_validate(p) for p in json.loads(body)] for j, body in bookings},
            "held": [("device", n, k, j) for n, k, j in devices] + [("port", n, k, j) for n, k, j in ports],
            "limits": limits,
        }

    def history(self, job_id: str) -> list[HistoryEntry]:
        with self._tx(write=False) as conn:
            rows = conn.execute(text("SELECT job_id, placements, committed_at, released_at FROM mn_history "
                                     "WHERE job_id = :j ORDER BY id"), {"j": job_id}).all()
        return [HistoryEntry(job_id=r.job_id, placements=[Placement.model_validate(p) for p in json.loads(r.placements)],
                             committed_at=r.committed_at, released_at=r.released_at) for r in rows]

    # -- jobs and events ------------------------------------------------------------------------------

    def put_job(self, job: JobRecord) -> None:
        with self._tx() as conn:
            conn.execute(text(
                "INSERT INTO mn_jobs (job_id, name, job_type, status, spec, created_at, updated_at) "
                "VALUES (:j, :n, :t, :s, :spec, :c, :u) ON CONFLICT (job_id) DO UPDATE SET name = :n, job_type = :t, "
                "status = :s, spec = :spec, updated_at = :u"),
                {"j": job.job_id, "n": job.name, "t": job.job_type, "s": job.status, "spec": json.dumps(job.spec),
                 "c": job.created_at, "u": time.time()})

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._tx(write=False) as conn:
            row = conn.execute(text("SELECT * FROM mn_jobs WHERE job_id = :j"), {"j": job_id}).mappings().first()
        return _job(row) if row else None

    def list_jobs(self, *, status: str | None = None) -> list[JobRecord]:
        sql, params = "SELECT * FROM mn_jobs", {}
        if status is not None:
            sql, params = sql + " WHERE status = :s", {"s": status}
        with self._tx(write=False) as conn:
            return [_job(r) for r in conn.execute(text(sql + " ORDER BY created_at"), params).mappings()]

    @staticmethod
    def _insert_event(conn: Connection, event: Event) -> None:
        conn.execute(text("INSERT INTO mn_events (at, kind, node, job_id, reason, data) VALUES (:a, :k, :n, :j, :r, :d)"),
                     {"a": event.at, "k": event.kind, "n": event.node, "j": event.job_id, "r": event.reason,
                      "d": json.dumps(event.data)})

    def record_event(self, event: Event) -> None:
        with self._tx() as conn:
            self._insert_event(conn, event)

    def events(self, *, node: str | None = None, job_id: str | None = None, limit: int = 100) -> list[Event]:
        clauses, params = [], {"l": limit}
        if node is not None:
            clauses.append("node = :n")
            params["n"] = node
        if job_id is not None:
            clauses.append("job_id = :j")
            params["j"] = job_id
        where = (" WHERE " + " AND ".join(clauses)) if clauses else ""
        with self._tx(write=False) as conn:
            rows = conn.execute(text(f"SELECT * FROM mn_events{where} ORDER BY id DESC LIMIT :l"), params).mappings().all()
        return [Event(kind=r["kind"], at=r["at"], node=r["node"], job_id=r["job_id"], reason=r["reason"],
                      data=json.loads(r["data"] or "{}")) for r in reversed(rows)]

    # -- leases ---------------------------------------------------------------------------------------

    def acquire_lease(self, name: str, owner: str, ttl_s: float, *, now: float | None = None) -> Lease | None:
        now = time.time() if now is None else now
        with self._tx() as conn:
            row = conn.execute(text("SELECT owner, epoch, expires_at FROM mn_leases WHERE name = :n"
                                    + ("" if self.sqlite else " FOR UPDATE")), {"n": name}).first()
            if row is not None and row.expires_at > now and row.owner != owner:
                return None
            if row is not None and row.expires_at > now and row.owner == owner:
                epoch = row.epoch  # already ours: a renewal
            else:
                epoch = (row.epoch if row is not None else 0) + 1
            conn.execute(text("INSERT INTO mn_leases (name, owner, epoch, expires_at) VALUES (:n, :o, :e, :x) "
                              "ON CONFLICT (name) DO UPDATE SET owner = :o, epoch = :e, expires_at = :x"),
                         {"n": name, "o": owner, "e": epoch, "x": now + ttl_s})
        return Lease(name=name, owner=owner, epoch=epoch, expires_at=now + ttl_s)

    def renew_lease(self, lease: Lease, ttl_s: float, *, now: float | None = None) -> Lease | None:
        now = time.time() if now is None else now
        with self._tx() as conn:
            updated = conn.execute(text("UPDATE mn_leases SET expires_at = :x WHERE name = :n AND owner = :o AND epoch = :e "
                                        "AND expires_at > :now"),
                                   {"x": now + ttl_s, "n": lease.name, "o": lease.owner, "e": lease.epoch, "now": now}).rowcount
        return lease.model_copy(update={"expires_at": now + ttl_s}) if updated else None

    def release_lease(self, lease: Lease) -> bool:
        with self._tx() as conn:
            # Expire rather than delete: the epoch must keep growing for fencing.
            return bool(conn.execute(text("UPDATE mn_leases SET expires_at = 0 WHERE name = :n AND owner = :o AND epoch = :e"),
                                     {"n": lease.name, "o": lease.owner, "e": lease.epoch}).rowcount)


def _job(row) -> JobRecord:
    return JobRecord(job_id=row["job_id"], name=row["name"], job_type=row["job_type"], status=row["status"],
                     spec=json.loads(row["spec"] or "{}"), created_at=row["created_at"], updated_at=row["updated_at"])
