"""The SQL store's tables (SQLite and PostgreSQL alike), and the upgrade of a store written by an older version."""

from __future__ import annotations

import json

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlmodel import Field, SQLModel

from mn_prefect.model.placement import Placement
from mn_prefect.store.base import StoreError
from mn_prefect.store.booking import demands_json
from mn_prefect.store.repair import plan_repair

SCHEMA_VERSION = "6"

# A reservation record's expiry, read from its stored text (the expression ix_mn_jobs_expiry indexes: a query names
# it exactly so), and which rows are live reservations.
EXPIRES_AT = {"sqlite": "json_extract(spec, '$.expires_at')",
              "postgresql": "(spec::jsonb ->> 'expires_at')::double precision"}
ACTIVE_RESERVATION = "job_type = 'reservation' AND status = 'active'"


class NodeRow(SQLModel, table=True):
    __tablename__ = "mn_nodes"
    name: str = Field(primary_key=True)
    record: str
    status: str
    eligible: bool
    last_heartbeat: float | None = None
    used: str = Field("{}", description="JSON: what is booked here, per capacity dimension")
    version: int = Field(0, description="Grows with every change of record, status, eligibility or limits")
    node_group: str = Field("default", index=True, description="The record's group, for per-group reads")


class GroupRow(SQLModel, table=True):
    """A resource group; ``default`` is built in and has no row."""

    __tablename__ = "mn_groups"
    name: str = Field(primary_key=True)
    created_at: float


class HeldRow(SQLModel, table=True):
    """A claimed key (a device id, a port) on a node; the primary key makes a double claim impossible."""

    __tablename__ = "mn_held"
    node: str = Field(primary_key=True)
    kind: str = Field(primary_key=True)
    key: str = Field(primary_key=True)
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
    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(index=True)
    placements: str
    committed_at: float
    released_at: float | None = None


class JobRow(SQLModel, table=True):
    __tablename__ = "mn_jobs"
    job_id: str = Field(primary_key=True)
    name: str | None = None
    job_type: str | None = None
    status: str
    spec: str
    created_at: float
    updated_at: float


class EventRow(SQLModel, table=True):
    __tablename__ = "mn_events"
    id: int | None = Field(default=None, primary_key=True)
    at: float = Field(index=True)
    kind: str
    node: str | None = Field(default=None, index=True)
    job_id: str | None = Field(default=None, index=True)
    reason: str | None = None
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


class ChangeRow(SQLModel, table=True):
    """A change counter per topic (``capacity``, ``placed:<node>``), bumped in the transaction that makes the change:
    what SQLite's change watchers read (store/changes.py). PostgreSQL notifies instead and leaves it empty."""

    __tablename__ = "mn_changes"
    topic: str = Field(primary_key=True)
    seq: int = 0


TABLES = [SQLModel.metadata.tables[name] for name in (
    "mn_nodes", "mn_groups", "mn_held", "mn_bookings", "mn_history", "mn_jobs", "mn_events", "mn_leases", "mn_meta",
    "mn_changes")]
_OLD_USAGE = {"cpu_used": "cpu", "mem_used": "mem", "disk_used": "disk", "gpu_used": "gpu"}
_OLD_COLUMNS = [*_OLD_USAGE, "cpu_total", "mem_total", "disk_total", "gpu_total", "device_ids"]


class StoreNeedsUpgrade(StoreError):
    """A store this version cannot open as it stands; the message says what to run."""


def create_or_upgrade(conn: Connection) -> None:
    """Create the tables; a store written by an older version is upgraded in place, in the same transaction,
    keeping its nodes, bookings and records. Each step checks what is there, so running it again changes nothing:
    schema 1 (fixed usage columns, one table per claim kind; the first stores kept no totals and no demands),
    schema 1 and 2 (no per-GPU counters: every node's usage is summed again from its bookings), schema 2 (no
    groups: its nodes are in ``default``), schema 3 (no change counters: the table is created), schema 4 (no
    indexes of the records by status and kind, and of the reservations by expiry), schema 5 (the first of its
    stores have no index of the reservations by expiry). A store of a newer schema, or one whose upgrade fails,
    is refused with :class:`StoreNeedsUpgrade` and left as it was."""
    stored = _stored_version(conn)
    if stored is not None and stored > int(SCHEMA_VERSION):
        raise StoreNeedsUpgrade(
            f"the store has schema {stored}, written by a newer mn-prefect; this one knows schema "
            f"{SCHEMA_VERSION} at most: upgrade mn-prefect (pip install --upgrade mn-prefect) to open it")
    try:
        _upgrade(conn, stored)
    except DBAPIError as error:
        detail = str(getattr(error, "orig", error)).splitlines()[0]
        raise StoreNeedsUpgrade(
            f"the upgrade of the store from schema {stored} to {SCHEMA_VERSION} failed ({detail}); the store was "
            f"left as it was: open it with the mn-prefect version that wrote it and release its bookings, or "
            f"start a new store") from None


def _stored_version(conn: Connection) -> int | None:
    """The schema the store was written with (None: no store here yet)."""
    if not inspect(conn).has_table("mn_meta"):
        return None
    value = conn.execute(text("SELECT value FROM mn_meta WHERE key = 'schema_version'")).scalar()
    return None if value is None else int(value)


def _upgrade(conn: Connection, stored: int | None) -> None:
    SQLModel.metadata.create_all(conn, tables=TABLES)
    conn.execute(text("INSERT INTO mn_meta (key, value) VALUES ('schema_version', :v) ON CONFLICT (key) DO NOTHING"),
                 {"v": SCHEMA_VERSION})
    columns = {c["name"] for c in inspect(conn).get_columns("mn_nodes")}
    if "used" not in columns:
        _upgrade_from_1(conn, columns)
    if "node_group" not in columns:  # records of schema 2 name no group: the model reads them as default
        conn.exec_driver_sql("ALTER TABLE mn_nodes ADD COLUMN node_group VARCHAR NOT NULL DEFAULT 'default'")
        conn.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_mn_nodes_node_group ON mn_nodes (node_group)")
    if stored is not None and stored <= 2:
        _recount_usage(conn)
    # The live records of a kind (list_jobs by status) without reading every record ever made, and the active
    # reservations by expiry (reservations_due: the ones due and the next expiry, without parsing any record).
    conn.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_mn_jobs_status_type ON mn_jobs (status, job_type)")
    conn.exec_driver_sql(f"CREATE INDEX IF NOT EXISTS ix_mn_jobs_expiry ON mn_jobs (({EXPIRES_AT[conn.dialect.name]})) "
                         f"WHERE {ACTIVE_RESERVATION}")
    conn.execute(text("UPDATE mn_meta SET value = :v WHERE key = 'schema_version'"), {"v": SCHEMA_VERSION})


def _upgrade_from_1(conn: Connection, columns: set[str]) -> None:
    """Usage columns become one JSON text, the per-kind claim tables one held table; bookings get their demands
    (the first stores kept none)."""
    conn.exec_driver_sql("ALTER TABLE mn_nodes ADD COLUMN used VARCHAR NOT NULL DEFAULT '{}'")
    conn.exec_driver_sql("ALTER TABLE mn_nodes ADD COLUMN version INTEGER NOT NULL DEFAULT 0")
    for row in conn.execute(text(f"SELECT name, {', '.join(_OLD_USAGE)} FROM mn_nodes")).mappings():
        used = {dim: float(row[column]) for column, dim in _OLD_USAGE.items()}
        conn.execute(text("UPDATE mn_nodes SET used = :u WHERE name = :n"), {"u": json.dumps(used), "n": row["name"]})
    for column in (c for c in _OLD_COLUMNS if c in columns):
        conn.exec_driver_sql(f"ALTER TABLE mn_nodes DROP COLUMN {column}")
    for kind, table, column in (("device", "mn_held_devices", "device_id"), ("port", "mn_held_ports", "port_key")):
        conn.execute(text(f"INSERT INTO mn_held (node, kind, key, job_id) SELECT node, :k, {column}, job_id FROM {table}"),
                     {"k": kind})
        conn.exec_driver_sql(f"DROP TABLE {table}")
    if "demands" not in {c["name"] for c in inspect(conn).get_columns("mn_bookings")}:
        conn.exec_driver_sql("ALTER TABLE mn_bookings ADD COLUMN demands VARCHAR NOT NULL DEFAULT '{}'")


def _recount_usage(conn: Connection) -> None:
    """Each booking's demands and each node's usage computed again from the booked placements, as a commit
    today writes them: stores of schema 1 and 2 kept no per-GPU counters (``share:``, ``gmem:``), so a GPU held
    whole read as free to share and its release would have freed too little."""
    bookings = {}
    for job_id, body in conn.execute(text("SELECT job_id, placements FROM mn_bookings")).all():
        conn.execute(text("UPDATE mn_bookings SET demands = :d WHERE job_id = :j"), {"d": demands_json(body), "j": job_id})
        bookings[job_id] = [Placement.model_validate(p) for p in json.loads(body)]
    used = {name: json.loads(u) for name, u in conn.execute(text("SELECT name, used FROM mn_nodes")).all()}
    fix = plan_repair(used, bookings, [])  # the claims moved over as they were: only the counters are written
    if fix.usage:
        conn.execute(text("UPDATE mn_nodes SET used = :u WHERE name = :n"),
                     [{"n": n, "u": json.dumps(u)} for n, u in fix.usage.items()])
