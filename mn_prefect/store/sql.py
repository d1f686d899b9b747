"""SQLite (the embedded default) and PostgreSQL, through SQLModel/SQLAlchemy.

Atomicity: a commit decides with the one admission rule (store/admission.py) and applies conditionally:
on SQLite inside one ``BEGIN IMMEDIATE`` transaction (one writer at a time), on PostgreSQL through
``mn_apply``, which re-checks under row locks on the plan's nodes (commits on other nodes proceed in
parallel). Held keys also have a primary key (node, kind, key), so even a logic error could not double-book:
the insert would fail and the transaction roll back. What differs between the two lives in sql_dialects.py.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, cast

from sqlalchemy import Select, Table, TextClause, bindparam, delete, func, insert, or_, select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError

from mn_prefect.model.node import DEFAULT_GROUP, NodeRecord
from mn_prefect.model.node_status import check_transition, heartbeat_status, registered_status, transition_applies
from mn_prefect.model.placement import Placement
from mn_prefect.model.queues import QueueRecord, QueueSpec
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.quotas import Queues, is_account
from mn_prefect.store import admission, expiry, sql_queues
from mn_prefect.store.accounts import ACCOUNTS_GROUP, split_release
from mn_prefect.store.base import (
    CAPACITY,
    DUE_AT_ONCE,
    Booking,
    ChangeWatcher,
    ClusterSnapshot,
    CommitResult,
    Conflict,
    Event,
    GroupInfo,
    HistoryEntry,
    JobRecord,
    Lease,
    NodeNotRegistered,
    StaleLease,
    StoredNode,
    StoreInfo,
    StoreUnavailable,
    check_registrable,
)
from mn_prefect.store.booking import (
    NodeState,
    added,
    demand_by_node,
    fingerprint,
    parse_record as _record,
    reconnect_event,
    snapshot_of,
    stored_limits,
    transition_event,
    usage_of,
)
from mn_prefect.store.dimensions import CLAIM_KINDS, VIEW_CLAIM_KINDS
from mn_prefect.store.groups import check_deletable, check_group_name, group_in_use, unknown_group
from mn_prefect.store.records import ReservationRecord
from mn_prefect.store.repair import plan_repair
from mn_prefect.store.sql_dialects import dialect_for
from mn_prefect.store.sql_tables import (
    ACTIVE_RESERVATION,
    EXPIRES_AT,
    SCHEMA_VERSION,
    BookingRow,
    EventRow,
    GroupRow,
    HeldRow,
    HistoryRow,
    JobRow,
    LeaseRow,
    MetaRow,
    NodeRow,
    create_or_upgrade,
)
from mn_prefect.store.urls import StoreURL

log = logging.getLogger(__name__)

_NODE_COLUMNS = "name, record, status, eligible, last_heartbeat, used, version"
_NOT_ACCOUNTS = f" WHERE node_group <> '{ACCOUNTS_GROUP}'"  # queue and cohort accounts (store/accounts.py)


@functools.cache
def _node_rows(some: bool, lock: str, in_group: bool = False) -> TextClause:
    """The node rows (``some``: those named by the expanding parameter ``names``; ``in_group``: those of the
    group ``g``); built once, not per commit."""
    where = " WHERE name IN :names" if some else " WHERE node_group = :g" if in_group else _NOT_ACCOUNTS
    stmt = text(f"SELECT {_NODE_COLUMNS} FROM mn_nodes{where} ORDER BY name{lock}")
    return stmt.bindparams(bindparam("names", expanding=True)) if some else stmt


@functools.cache
def _held_rows(some: bool, in_group: bool = False, view: bool = False) -> TextClause:
    """The held keys of the nodes named, of a group's or of all; with ``view``, only the kinds a plan reads."""
    where = []
    if some:
        where.append("node IN :names")
    elif in_group:
        where.append("node IN (SELECT name FROM mn_nodes WHERE node_group = :g)")
    if view:
        where.append(f"kind IN ({', '.join(repr(kind) for kind in VIEW_CLAIM_KINDS)})")
    stmt = text("SELECT node, kind, key FROM mn_held" + (" WHERE " + " AND ".join(where) if where else ""))
    return stmt.bindparams(bindparam("names", expanding=True)) if some else stmt


# The record paths (nodes, limits, jobs, events, leases, history) as SQLAlchemy Core over the declared tables,
# each statement built once here (its cache key is memoised, so a call only looks its compiled form up). The
# commit path (reads, applies, usage, release) stays text() (above and in the methods), below the ORM for
# per-call CPU, and on PostgreSQL goes through pg_line.


def _table(row: Any) -> Table:
    return row.__table__  # SQLModel sets it when it declares the table (untyped)


_NODES, _HELD, _BOOKINGS, _HISTORY, _JOBS, _EVENTS, _LEASES, _META, _GROUPS = map(_table, (
    NodeRow, HeldRow, BookingRow, HistoryRow, JobRow, EventRow, LeaseRow, MetaRow, GroupRow))

_NODE = select(_NODES).where(_NODES.c.name == bindparam("n"))
# FOR UPDATE on PostgreSQL; SQLite's compiler writes nothing (BEGIN IMMEDIATE already serialises writers).
_NODE_LOCKED = _NODE.with_for_update()
_ALL_NODES = select(_NODES).where(_NODES.c.node_group != ACCOUNTS_GROUP).order_by(_NODES.c.name)
_NODE_STATUS = select(_NODES.c.status, _NODES.c.eligible).where(_NODES.c.name == bindparam("n"))
_SET_STATUS = (update(_NODES).where(_NODES.c.name == bindparam("n"))
               .values(status=bindparam("s"), eligible=bindparam("e"), version=_NODES.c.version + 1))
_SET_HEARTBEAT = update(_NODES).where(_NODES.c.name == bindparam("n")).values(last_heartbeat=bindparam("h"))
_ALL_VERSIONS_UP = update(_NODES).values(version=_NODES.c.version + 1)
_LIMITS = select(_META.c.value).where(_META.c.key == "limits")
_JOB = select(_JOBS).where(_JOBS.c.job_id == bindparam("j"))
_DELETE_JOB = delete(_JOBS).where(_JOBS.c.job_id == bindparam("j"))
_JOBS_ALL = select(_JOBS).order_by(_JOBS.c.created_at)
_JOBS_IN = select(_JOBS).where(_JOBS.c.status == bindparam("s")).order_by(_JOBS.c.created_at)
_ADD_EVENT = insert(_EVENTS).inline()  # inline: no RETURNING of the new id (nothing reads it)
_HISTORY_OF = (select(_HISTORY.c.job_id, _HISTORY.c.placements, _HISTORY.c.committed_at, _HISTORY.c.released_at)
               .where(_HISTORY.c.job_id == bindparam("j")).order_by(_HISTORY.c.id))
_HISTORY_COLUMNS = (_HISTORY.c.job_id, _HISTORY.c.placements, _HISTORY.c.committed_at, _HISTORY.c.released_at)
_HISTORY_EVERY = select(*_HISTORY_COLUMNS).order_by(_HISTORY.c.id)
_HISTORY_SINCE = (select(*_HISTORY_COLUMNS)
                  .where(or_(_HISTORY.c.released_at.is_(None), _HISTORY.c.released_at >= bindparam("since")))
                  .order_by(_HISTORY.c.id))
_ACTIVE_JOBS = select(_BOOKINGS.c.job_id).order_by(_BOOKINGS.c.job_id)
_BOOKED = select(_BOOKINGS.c.job_id, _BOOKINGS.c.placements)
_BOOKED_ALL = _BOOKED.order_by(_BOOKINGS.c.job_id)
_BOOKED_JOB = _BOOKED.where(_BOOKINGS.c.job_id == bindparam("j")).order_by(_BOOKINGS.c.job_id)
_HELD_ALL = (select(_HELD.c.node, _HELD.c.kind, _HELD.c.key, _HELD.c.job_id)
             .order_by(_HELD.c.node, _HELD.c.kind, _HELD.c.key))
_LEASE_LOCKED = (select(_LEASES.c.owner, _LEASES.c.epoch, _LEASES.c.expires_at)
                 .where(_LEASES.c.name == bindparam("n")).with_for_update())
_LEASE_IS = (_LEASES.c.name == bindparam("n"), _LEASES.c.owner == bindparam("o"), _LEASES.c.epoch == bindparam("e"))
_RENEW_LEASE = update(_LEASES).where(*_LEASE_IS, _LEASES.c.expires_at > bindparam("now")).values(expires_at=bindparam("x"))
_EXPIRE_LEASE = update(_LEASES).where(*_LEASE_IS).values(expires_at=0)
# The upserts stay text(), built once: SQLAlchemy 2.0 does not cache the dialects' on_conflict_do_update
# constructs (no cache key), so each call compiled the statement again (BENCHMARKS.md, "Store records").
# SQLite and PostgreSQL spell INSERT ... ON CONFLICT ... DO UPDATE alike.
_UPSERT_NODE = text(  # a new record may change what fits: the version grows, so commits decided on it read again
    "INSERT INTO mn_nodes (name, record, status, eligible, last_heartbeat, used, version, node_group) "
    "VALUES (:n, :r, :s, :e, :h, '{}', 1, :g) ON CONFLICT (name) DO UPDATE SET record = :r, "
    "status = :s, eligible = :e, last_heartbeat = :h, version = mn_nodes.version + 1, node_group = :g")
# A registration reads its group FOR SHARE and a delete FOR UPDATE (PostgreSQL; SQLite's BEGIN IMMEDIATE already
# serialises them): a node can never join a group that a concurrent delete removes.
_GROUP_SHARED = select(_GROUPS.c.name).where(_GROUPS.c.name == bindparam("g")).with_for_update(read=True)
_GROUP_LOCKED = select(_GROUPS.c.name).where(_GROUPS.c.name == bindparam("g")).with_for_update()
_ADD_GROUP = text("INSERT INTO mn_groups (name, created_at) VALUES (:g, :t) ON CONFLICT (name) DO NOTHING")
_ALL_GROUPS = select(_GROUPS.c.name, _GROUPS.c.created_at).order_by(_GROUPS.c.name)
_GROUP_COUNTS = select(_NODES.c.node_group, func.count()).group_by(_NODES.c.node_group)
_NODES_IN_GROUP = select(_NODES.c.name).where(_NODES.c.node_group == bindparam("g"))
_DROP_GROUP = delete(_GROUPS).where(_GROUPS.c.name == bindparam("g"))
_UPSERT_LIMITS = text("INSERT INTO mn_meta (key, value) VALUES ('limits', :v) ON CONFLICT (key) DO UPDATE SET value = :v")
_UPSERT_JOB = text(
    "INSERT INTO mn_jobs (job_id, name, job_type, status, spec, created_at, updated_at) "
    "VALUES (:j, :n, :t, :s, :spec, :c, :u) ON CONFLICT (job_id) DO UPDATE SET name = :n, job_type = :t, "
    "status = :s, spec = :spec, updated_at = :u")
_UPSERT_LEASE = text("INSERT INTO mn_leases (name, owner, epoch, expires_at) VALUES (:n, :o, :e, :x) "
                     "ON CONFLICT (name) DO UPDATE SET owner = :o, epoch = :e, expires_at = :x")


@functools.cache
def _events(by_node: bool, by_job: bool) -> Select:
    """The newest events first (the caller turns them round), optionally of one node and/or one job."""
    stmt = select(_EVENTS)
    if by_node:
        stmt = stmt.where(_EVENTS.c.node == bindparam("n"))
    if by_job:
        stmt = stmt.where(_EVENTS.c.job_id == bindparam("j"))
    return stmt.order_by(_EVENTS.c.id.desc()).limit(bindparam("l"))


class SQLStore:
    """The store on SQLite or PostgreSQL."""

    def __init__(self, url: StoreURL, *, create: bool = True):
        self.url = url
        self.backend = url.backend
        self.dialect = dialect_for(url)
        self.engine = self.dialect.engine(url)
        if create:
            self._guard(self._create)

    def __repr__(self) -> str:
        return f"SQLStore({self.url.safe!r})"

    # -- plumbing -------------------------------------------------------------------------------------

    def _guard(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except IntegrityError:
            raise
        except DBAPIError as error:
            raise StoreUnavailable(self.safe_error(error)) from None

    def safe_error(self, error: BaseException) -> str:
        detail = str(getattr(error, "orig", error)).splitlines()[0] if str(error) else type(error).__name__
        if self.url.password:
            detail = detail.replace(self.url.password, "***")
        return f"{self.backend} store {self.url.safe} failed: {detail}"

    @contextmanager
    def tx(self, write: bool = True) -> Iterator[Connection]:
        with self.dialect.transaction(self.engine, write) as conn:
            yield conn

    def _create(self) -> None:
        if self._current():
            return
        with self.tx() as conn:
            create_or_upgrade(conn)
            self.dialect.create_functions(conn)

    def _current(self) -> bool:
        """Whether the tables are this version's and the server-side functions (PostgreSQL) these: then opening
        the store is one read, and it does not replace the functions under other processes' running commits
        (each replacement makes every session compile them again)."""
        try:
            with self.tx(write=False) as conn:
                meta = dict(conn.execute(text(
                    "SELECT key, value FROM mn_meta WHERE key IN ('schema_version', 'functions')")).tuples().all())
        except DBAPIError:
            return False  # no store here yet (or none reachable: creating it says which)
        return meta.get("schema_version") == SCHEMA_VERSION and meta.get("functions", "") == self.dialect.functions_tag

    def close(self) -> None:
        self.dialect.close()
        self.engine.dispose()

    def check(self) -> StoreInfo:
        try:
            with self.tx(write=False) as conn:
                version = conn.exec_driver_sql(self.dialect.version_query).scalar()
                counts = {
                    name: int(conn.exec_driver_sql(f"SELECT COUNT(*) FROM {table}{where}").scalar() or 0)
                    for name, table, where in (
                        ("nodes", "mn_nodes", _NOT_ACCOUNTS), ("active_jobs", "mn_bookings", ""),
                        ("held_devices", "mn_held", " WHERE kind = 'device'"),
                        ("held_ports", "mn_held", " WHERE kind = 'port'"), ("jobs", "mn_jobs", ""),
                        ("events", "mn_events", ""), ("leases", "mn_leases", ""))
                }
            return StoreInfo(backend=self.backend, url=self.url.safe, reachable=True, version=str(version), counts=counts)
        except DBAPIError as error:
            return StoreInfo(backend=self.backend, url=self.url.safe, reachable=False, error=self.safe_error(error))

    # -- nodes ----------------------------------------------------------------------------------------

    def register_node(self, record: NodeRecord, *, now: float | None = None) -> NodeRecord:
        now = time.time() if now is None else now
        check_registrable(record)
        with self.tx() as conn:
            if record.group != DEFAULT_GROUP and conn.execute(_GROUP_SHARED, {"g": record.group}).first() is None:
                raise unknown_group(record.group, record.name)
            row = conn.execute(_NODE_STATUS, {"n": record.name}).first()
            status, eligible = registered_status(record, row[0] if row else None, bool(row[1]) if row else None)
            stored = record.model_copy(update={"status": status, "scheduling_eligible": eligible})
            conn.execute(_UPSERT_NODE, {"n": record.name, "r": stored.model_dump_json(), "s": status, "e": eligible,
                                        "h": now, "g": record.group})
            self.dialect.changed(conn, [CAPACITY])  # a node joined, came back or changed what it offers
        return stored

    def _node_row(self, conn: Connection, name: str):
        """The node's row for a read-modify-write, locked on PostgreSQL (SQLite's BEGIN IMMEDIATE already
        serialises writers), so a heartbeat and a state change never overwrite each other."""
        row = conn.execute(_NODE_LOCKED, {"n": name}).first()
        if row is None:
            raise NodeNotRegistered(f"node {name!r} is not registered")
        return row

    def _set_status(self, conn: Connection, name: str, status: str, eligible: bool) -> None:
        conn.execute(_SET_STATUS, {"s": status, "e": eligible, "n": name})
        self.dialect.changed(conn, [CAPACITY])  # the node may take runs now (or no longer)

    def heartbeat(self, name: str, *, now: float | None = None) -> NodeRecord:
        now = time.time() if now is None else now
        with self.tx() as conn:
            row = self._node_row(conn, name)
            status = heartbeat_status(row.status)
            conn.execute(_SET_HEARTBEAT, {"h": now, "n": name})
            if status != row.status:
                self._set_status(conn, name, status, row.eligible)
                self._insert_event(conn, reconnect_event(name, row.status, now, row.last_heartbeat))
        return _record(row.record, status, row.eligible)

    def transition_node(self, name: str, to_status: str, *, from_statuses: tuple[str, ...], now: float | None = None,
                        reason: str | None = None, eligible: bool | None = None,
                        heartbeat_before: float | None = None) -> NodeRecord | None:
        check_transition(to_status, tuple(from_statuses))
        now = time.time() if now is None else now
        with self.tx() as conn:
            row = self._node_row(conn, name)
            if not transition_applies(row.status, row.last_heartbeat, tuple(from_statuses), heartbeat_before):
                return None
            new_eligible = row.eligible if eligible is None else eligible
            self._set_status(conn, name, to_status, new_eligible)
            self._insert_event(conn, transition_event(name, row.status, to_status, now, reason))
        return _record(row.record, to_status, new_eligible)

    def set_node_status(self, name: str, status: str, *, eligible: bool | None = None) -> NodeRecord:
        with self.tx() as conn:
            row = self._node_row(conn, name)
            new_eligible = row.eligible if eligible is None else eligible
            self._set_status(conn, name, status, new_eligible)
        return _record(row.record, status, new_eligible)

    def get_node(self, name: str) -> StoredNode | None:
        with self.tx(write=False) as conn:
            row = conn.execute(_NODE, {"n": name}).first()
        return StoredNode(record=_record(row.record, row.status, row.eligible), last_heartbeat=row.last_heartbeat) if row else None

    def list_nodes(self) -> list[StoredNode]:
        with self.tx(write=False) as conn:
            rows = conn.execute(_ALL_NODES).all()
        return [StoredNode(record=_record(r.record, r.status, r.eligible), last_heartbeat=r.last_heartbeat) for r in rows]

    # -- groups ---------------------------------------------------------------------------------------

    def create_group(self, name: str, *, now: float | None = None) -> bool:
        check_group_name(name)
        if name == DEFAULT_GROUP:
            return False
        with self.tx() as conn:
            return bool(conn.execute(_ADD_GROUP, {"g": name, "t": time.time() if now is None else now}).rowcount)

    def list_groups(self) -> list[GroupInfo]:
        with self.tx(write=False) as conn:
            created = dict(conn.execute(_ALL_GROUPS).tuples().all())
            counts = dict(conn.execute(_GROUP_COUNTS).tuples().all())
        groups = [GroupInfo(name=DEFAULT_GROUP, nodes=counts.get(DEFAULT_GROUP, 0))]
        return sorted(groups + [GroupInfo(name=g, nodes=counts.get(g, 0), created_at=t) for g, t in created.items()],
                      key=lambda g: g.name)

    def delete_group(self, name: str) -> None:
        check_deletable(name)
        with self.tx() as conn:
            if conn.execute(_GROUP_LOCKED, {"g": name}).first() is None:
                raise unknown_group(name)
            nodes = list(conn.execute(_NODES_IN_GROUP, {"g": name}).scalars())
            if nodes:
                raise group_in_use(name, nodes)
            conn.execute(_DROP_GROUP, {"g": name})

    # -- limits ---------------------------------------------------------------------------------------

    def _limits(self, conn: Connection) -> Limits:
        value = conn.execute(_LIMITS).scalar()
        return stored_limits(value)

    def get_limits(self) -> Limits:
        with self.tx(write=False) as conn:
            return self._limits(conn)

    def set_limits(self, limits: Limits) -> None:
        with self.tx() as conn:
            conn.execute(_UPSERT_LIMITS, {"v": limits.model_dump_json()})
            conn.execute(_ALL_VERSIONS_UP)  # every node's ceilings changed
            self.dialect.changed(conn, [CAPACITY])

    # -- placements -----------------------------------------------------------------------------------

    def _states(self, conn: Connection, names: list[str] | None, *, lock: bool,
                group: str | None = None, view: bool = False) -> list[NodeState]:
        """Node rows (locked on PostgreSQL when asked; all, those ``names``, or those of ``group``) with what is
        held on them (with ``view``, the kinds a plan reads: dimensions.VIEW_CLAIM_KINDS)."""
        some, in_group = names is not None, names is None and group is not None
        params: dict[str, Any] = {"names": names} if some else {"g": group} if in_group else {}
        rows = conn.execute(_node_rows(some, self.dialect.lock if lock else "", in_group), params)
        states = {r.name: NodeState(record=_record(r.record, r.status, r.eligible), used=json.loads(r.used),
                                    held={kind: set() for kind in CLAIM_KINDS}, version=r.version)
                  for r in rows if not is_account(r.name)}
        for node, kind, key in conn.execute(_held_rows(some, in_group, view), params):
            if node in states:
                states[node].held.setdefault(kind, set()).add(key)
        return list(states.values())

    def _lease_ok(self, conn: Connection, lease: Lease | None, now: float) -> bool:
        if lease is None:
            return True
        row = conn.execute(text("SELECT owner, epoch, expires_at FROM mn_leases WHERE name = :n"), {"n": lease.name}).first()
        return row is not None and row.owner == lease.owner and row.epoch == lease.epoch and row.expires_at > now

    def _check_lease(self, conn: Connection, lease: Lease | None, now: float) -> None:
        if not self._lease_ok(conn, lease, now):
            assert lease is not None
            raise StaleLease(f"lease {lease.name!r} epoch {lease.epoch} held by {lease.owner!r} is no longer current")

    def commit_plan(self, job_id: str, placements: list[Placement], *, lease: Lease | None = None,
                    event: Event | None = None) -> CommitResult:
        ended: list[ReservationRecord] = []
        try:
            result = admission.commit(self, job_id, placements, lease, time.time(), self.dialect.read_cache,
                                      expire=lambda: self._expire_due(ended))
        except IntegrityError:
            # The primary keys are the last line (they cannot trip under BEGIN IMMEDIATE): nothing was written.
            result = CommitResult(ok=False, job_id=job_id,
                                  conflict=Conflict(reason="a concurrent commit booked it first"))
        except DBAPIError as error:
            raise StoreUnavailable(self.safe_error(error)) from None
        result.ended = ended
        if event is not None and result.ok and not result.already_committed:
            self.record_event(event)
        return result

    def _expire_due(self, ended: list[ReservationRecord]) -> bool:
        """End the reservations whose time is up (for a commit they would refuse); whether any was."""
        newly = expiry.expire_due(self)
        ended += newly
        return bool(newly)

    def commit_session(self):
        return self.dialect.commit_session(self)

    def add_usage(self, conn: Connection, amounts: dict[str, dict[str, float]], sign: int = 1) -> None:
        """Add (sign 1) or take away (-1) each node's amounts to what is booked there (rows locked on PostgreSQL)."""
        rows = conn.execute(text(f"SELECT name, used FROM mn_nodes WHERE name IN :names ORDER BY name{self.dialect.lock}")
                            .bindparams(bindparam("names", expanding=True)), {"names": sorted(amounts)}).all()
        conn.execute(text("UPDATE mn_nodes SET used = :u WHERE name = :n"),
                     [{"n": name, "u": json.dumps(added(json.loads(used), amounts[name], sign))} for name, used in rows])

    def _free(self, conn: Connection, job_id: str, demands: dict[str, dict]) -> None:
        """Take a booking's (or one node's share of it) amounts off its nodes and drop its claims there."""
        nodes = sorted(demands)
        self.add_usage(conn, {name: demands[name]["add"] for name in nodes}, -1)
        conn.execute(text("DELETE FROM mn_held WHERE job_id = :j AND node IN :names")
                     .bindparams(bindparam("names", expanding=True)), {"j": job_id, "names": nodes})
        self.dialect.changed(conn, [CAPACITY])

    def release(self, job_id: str, *, lease: Lease | None = None, node: str | None = None) -> int:
        now = time.time()
        if node is None:
            count = self.dialect.release(self, job_id, lease)
            if count == -1:
                assert lease is not None
                raise StaleLease(f"lease {lease.name!r} epoch {lease.epoch} is no longer current")
            if count is not None:
                return count
        try:
            with self.tx() as conn:
                self._check_lease(conn, lease, now)
                if node is not None:  # the node row, then the booking row, in the order of commits and mn_release
                    conn.execute(text(f"SELECT name FROM mn_nodes WHERE name = :n{self.dialect.lock}"), {"n": node})
                booking = conn.execute(text(f"SELECT placements, demands FROM mn_bookings WHERE job_id = :j"
                                            f"{self.dialect.lock}"), {"j": job_id}).first()
                if booking is None:
                    return 0
                if node is None:  # all of it: the booking's own demands say what to free (no placement parsed)
                    self._free(conn, job_id, json.loads(booking.demands))
                    self._close(conn, job_id, now)
                    return len(json.loads(booking.placements))
                placements = [Placement.model_validate(p) for p in json.loads(booking.placements)]
                gone = [p for p in placements if p.node == node]
                kept = [p for p in placements if p.node != node]
                if not gone:
                    return 0
                charged_gone, charged_kept = split_release(json.loads(booking.demands), gone)
                self._free(conn, job_id, {**{n: d.as_json() for n, d in demand_by_node(gone).items()}, **charged_gone})
                if kept:  # only this node's share goes; the rest of the booking stays as it was
                    conn.execute(text("UPDATE mn_bookings SET placements = :p, demands = :d, fingerprint = :f "
                                      "WHERE job_id = :j"),
                                 {"j": job_id, "p": json.dumps([k.model_dump(mode="json") for k in kept]),
                                  "f": fingerprint(kept),
                                  "d": json.dumps({**{n: d.as_json() for n, d in demand_by_node(kept).items()},
                                                   **charged_kept})})
                    return len(gone)
                self._close(conn, job_id, now)
                return len(gone)
        except DBAPIError as error:
            raise StoreUnavailable(self.safe_error(error)) from None

    def _close(self, conn: Connection, job_id: str, now: float) -> None:
        """The booking is gone: drop it, and mark its history entry released."""
        conn.execute(text("DELETE FROM mn_bookings WHERE job_id = :j"), {"j": job_id})
        conn.execute(text("UPDATE mn_history SET released_at = :t WHERE job_id = :j AND released_at IS NULL"),
                     {"t": now, "j": job_id})

    def active_placements(self, *, node: str | None = None, job_id: str | None = None) -> list[Placement]:
        with self.tx(write=False) as conn:
            rows = (conn.execute(_BOOKED_ALL) if job_id is None else conn.execute(_BOOKED_JOB, {"j": job_id})).all()
        out = []
        for row in rows:
            for p in json.loads(row.placements):
                placement = Placement.model_validate(p)
                if node is None or placement.node == node:
                    out.append(placement.model_copy(update={"job_id": row.job_id}))
        return out

    def active_jobs(self) -> list[str]:
        with self.tx(write=False) as conn:
            return [r[0] for r in conn.execute(_ACTIVE_JOBS)]

    def _held(self, conn: Connection) -> list[tuple[str, str, str, str]]:
        return [(kind, node, key, job) for node, kind, key, job in
                conn.execute(_HELD_ALL)]

    def bookings(self) -> list[Booking]:
        with self.tx(write=False) as conn:
            held = self._held(conn)
        return [Booking(node=n, kind=kind, key=k, job_id=j) for kind, n, k, j in held]

    def snapshot(self, *, group: str | None = None) -> ClusterSnapshot:
        with self.tx(write=False) as conn:
            states = self._states(conn, None, lock=False, group=group, view=True)
            limits = self._limits(conn)
            queues = sql_queues.read(conn)
        return snapshot_of(states, limits, queues, group)

    # -- queues (store/accounts.py) -------------------------------------------------------------------

    def queues(self) -> Queues:
        with self.tx(write=False) as conn:
            return sql_queues.read(conn)

    def set_queue(self, spec: QueueSpec) -> QueueRecord:
        return cast(QueueRecord, self._put_queue(spec.name, spec))

    def delete_queue(self, name: str) -> None:
        self._put_queue(name, None)

    def _put_queue(self, name: str, spec: QueueSpec | None) -> QueueRecord | None:
        with self.tx() as conn:
            record = sql_queues.put(conn, self.dialect.lock, name, spec)
            self.dialect.changed(conn, [CAPACITY])  # a quota that grew may let waiting runs in
        return record

    def consistent_view(self) -> dict:
        """Everything the independent checker needs, read in one transaction (one snapshot)."""
        with self.tx(write=False) as conn:
            self.dialect.repeatable_read(conn)
            states = self._states(conn, None, lock=False)
            bookings = conn.execute(_BOOKED).all()
            held = self._held(conn)
            limits = self._limits(conn)
        return {
            "nodes": {s.record.name: {"record": s.record, **usage_of(s)} for s in states},
            "bookings": {j: [Placement.model_validate(p) for p in json.loads(body)] for j, body in bookings},
            "held": held,
            "limits": limits,
        }

    def repair_derived(self, *, dry_run: bool = False) -> list[str]:
        """Make the usage counters and held claims agree with the live bookings (store/repair.py), in one
        transaction: on SQLite under BEGIN IMMEDIATE, on PostgreSQL with every node row locked first (as commits
        and releases lock the rows of their nodes before they touch bookings, claims or counters), so nothing
        changes between the read and the writes. One line per fix (with ``dry_run``, per fix it would make)."""
        try:
            with self.tx(write=not dry_run) as conn:
                if dry_run:
                    self.dialect.repeatable_read(conn)
                lock = "" if dry_run else self.dialect.lock
                used = {name: json.loads(u) for name, u in
                        conn.execute(text(f"SELECT name, used FROM mn_nodes{_NOT_ACCOUNTS} ORDER BY name{lock}"))
                        .tuples()}
                bookings = {j: [Placement.model_validate(p) for p in json.loads(body)]
                            for j, body in conn.execute(_BOOKED).tuples()}
                fix = plan_repair(used, bookings, self._held(conn))
                if dry_run or not fix.writes:
                    return fix.lines
                if fix.drop:
                    conn.execute(text("DELETE FROM mn_held WHERE node = :n AND kind = :k AND key = :key AND job_id = :j"),
                                 [{"k": kind, "n": n, "key": key, "j": job} for kind, n, key, job in fix.drop])
                if fix.add:
                    conn.execute(text("INSERT INTO mn_held (node, kind, key, job_id) VALUES (:n, :k, :key, :j)"),
                                 [{"k": kind, "n": n, "key": key, "j": job} for kind, n, key, job in fix.add])
                if fix.usage:
                    conn.execute(text("UPDATE mn_nodes SET used = :u WHERE name = :n"),
                                 [{"n": n, "u": json.dumps(u)} for n, u in fix.usage.items()])
                self.dialect.changed(conn, [CAPACITY])  # what was held in error may fit something now
            return fix.lines
        except DBAPIError as error:
            raise StoreUnavailable(self.safe_error(error)) from None

    def changes(self, *, node: str | None = None) -> ChangeWatcher:
        return self.dialect.changes(self.url, node)

    def replicate(self, timeout_ms: int = 2000) -> int | None:
        return None  # a committed transaction is durable on its own

    def pipelined(self) -> AbstractContextManager[None]:
        return nullcontext()  # each write is a transaction of its own, committed at once

    def announce(self, topics: list[str]) -> None:
        try:
            with self.tx() as conn:
                self.dialect.changed(conn, topics)
        except Exception as error:  # the polls find what a lost announcement would have woken
            log.warning("could not announce %s: %s", ", ".join(topics), self.safe_error(error))

    def history(self, job_id: str) -> list[HistoryEntry]:
        with self.tx(write=False) as conn:
            rows = conn.execute(_HISTORY_OF, {"j": job_id}).all()
        return [HistoryEntry(job_id=r.job_id, placements=[Placement.model_validate(p) for p in json.loads(r.placements)],
                             committed_at=r.committed_at, released_at=r.released_at) for r in rows]

    def history_since(self, since: float | None = None) -> list[HistoryEntry]:
        with self.tx(write=False) as conn:
            rows = (conn.execute(_HISTORY_EVERY) if since is None else
                    conn.execute(_HISTORY_SINCE, {"since": since})).all()
        return [HistoryEntry(job_id=r.job_id, placements=[Placement.model_validate(p) for p in json.loads(r.placements)],
                             committed_at=r.committed_at, released_at=r.released_at) for r in rows]

    # -- jobs and events ------------------------------------------------------------------------------

    def put_job(self, job: JobRecord) -> None:
        with self.tx() as conn:
            conn.execute(_UPSERT_JOB, {"j": job.job_id, "n": job.name, "t": job.job_type, "s": job.status,
                                       "spec": json.dumps(job.spec), "c": job.created_at, "u": time.time()})

    def get_job(self, job_id: str) -> JobRecord | None:
        with self.tx(write=False) as conn:
            row = conn.execute(_JOB, {"j": job_id}).mappings().first()
        return _job(row) if row else None

    def delete_job(self, job_id: str) -> bool:
        with self.tx() as conn:
            return conn.execute(_DELETE_JOB, {"j": job_id}).rowcount > 0

    def list_jobs(self, *, status: str | None = None) -> list[JobRecord]:
        with self.tx(write=False) as conn:
            rows = conn.execute(_JOBS_ALL) if status is None else conn.execute(_JOBS_IN, {"s": status})
            return [_job(r) for r in rows.mappings()]

    def reservations_due(self, now: float) -> tuple[list[JobRecord], float]:
        expires, active = EXPIRES_AT[self.dialect.name], ACTIVE_RESERVATION
        with self.tx(write=False) as conn:
            rows = conn.execute(text(f"SELECT * FROM mn_jobs WHERE {active} AND {expires} <= :now "
                                     f"ORDER BY {expires} LIMIT {DUE_AT_ONCE}"), {"now": now}).mappings().all()
            first = conn.execute(text(f"SELECT MIN({expires}) FROM mn_jobs WHERE {active} AND {expires} > :now"),
                                 {"now": now}).scalar()
        if len(rows) == DUE_AT_ONCE:  # more may be due: the caller asks again at once
            first = now
        return [_job(r) for r in rows], math.inf if first is None else float(first)

    @staticmethod
    def _insert_event(conn: Connection, event: Event) -> None:
        conn.execute(_ADD_EVENT, {"at": event.at, "kind": event.kind, "node": event.node, "job_id": event.job_id,
                                  "reason": event.reason, "data": json.dumps(event.data)})

    def record_event(self, event: Event) -> None:
        with self.tx() as conn:
            self._insert_event(conn, event)

    def events(self, *, node: str | None = None, job_id: str | None = None, limit: int = 100) -> list[Event]:
        stmt = _events(node is not None, job_id is not None)
        with self.tx(write=False) as conn:
            rows = conn.execute(stmt, {"l": limit, "n": node, "j": job_id}).mappings().all()
        return [Event(kind=r["kind"], at=r["at"], node=r["node"], job_id=r["job_id"], reason=r["reason"],
                      data=json.loads(r["data"] or "{}")) for r in reversed(rows)]

    # -- leases ---------------------------------------------------------------------------------------

    def acquire_lease(self, name: str, owner: str, ttl_s: float, *, now: float | None = None) -> Lease | None:
        now = time.time() if now is None else now
        with self.tx() as conn:
            row = conn.execute(_LEASE_LOCKED, {"n": name}).first()
            if row is not None and row.expires_at > now and row.owner != owner:
                return None
            if row is not None and row.expires_at > now and row.owner == owner:
                epoch = row.epoch  # already ours: a renewal
            else:
                epoch = (row.epoch if row is not None else 0) + 1
            conn.execute(_UPSERT_LEASE, {"n": name, "o": owner, "e": epoch, "x": now + ttl_s})
        return Lease(name=name, owner=owner, epoch=epoch, expires_at=now + ttl_s)

    def renew_lease(self, lease: Lease, ttl_s: float, *, now: float | None = None) -> Lease | None:
        now = time.time() if now is None else now
        with self.tx() as conn:
            updated = conn.execute(_RENEW_LEASE, {"x": now + ttl_s, "n": lease.name, "o": lease.owner, "e": lease.epoch,
                                                  "now": now}).rowcount
        return lease.model_copy(update={"expires_at": now + ttl_s}) if updated else None

    def release_lease(self, lease: Lease) -> bool:
        with self.tx() as conn:
            # Expire rather than delete: the epoch must keep growing for fencing.
            return bool(conn.execute(_EXPIRE_LEASE, {"n": lease.name, "o": lease.owner, "e": lease.epoch}).rowcount)


def _job(row) -> JobRecord:
    return JobRecord(job_id=row["job_id"], name=row["name"], job_type=row["job_type"], status=row["status"],
                     spec=json.loads(row["spec"] or "{}"), created_at=row["created_at"], updated_at=row["updated_at"])

