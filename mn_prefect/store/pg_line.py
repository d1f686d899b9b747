"""The commit path's statements on PostgreSQL: prepared once per connection, run through libpq.

A commit, a commit's read and a release are each one call of a server-side function (store/pg_functions.py)
on an autocommit connection kept for them; the announcement that follows a commit or a release is sent without
waiting for its answer (``send``), which is read before the connection's next call (``drain``). Through psycopg's cursor such a call costs about 70 us of client
CPU (query conversion, parameter adaptation, prepared-statement bookkeeping, the result's loaders); through
libpq's own prepared-statement call (``PGconn.exec_prepared``, psycopg's public low-level interface, which
releases the GIL while it waits) about 25 us. Parameters go as text; errors become psycopg's exception
classes by their SQLSTATE, so callers handle them as before.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import pq

# name -> statement; the casts give the parameters their types (they are sent as text)
STATEMENTS = {
    "mn_read": "SELECT mn_read($1::text[], $2, $3, $4::jsonb)",
    "mn_apply": "SELECT mn_apply($1, $2, $3::jsonb, $4, $5::float8, $6, $7, $8::bigint)",
    "mn_release": "SELECT mn_release_heard($1, $2::float8, $3, $4, $5::bigint)",
    "mn_announce": "SELECT mn_announce($1::text[])",
}


def text_array(items: list[str]) -> str:
    return "{" + ",".join('"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"' for item in items) + "}"


def _text(value: Any) -> str:
    if isinstance(value, list):
        return text_array(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def prepare(conn: psycopg.Connection) -> None:
    for name, sql in STATEMENTS.items():
        _check(conn, conn.pgconn.prepare(name.encode(), sql.encode()), pq.ExecStatus.COMMAND_OK)


def run(conn: psycopg.Connection, name: str, params: tuple) -> str | None:
    """The one value the statement returns, as text (None for SQL NULL)."""
    encoding = conn.info.encoding
    result = conn.pgconn.exec_prepared(name.encode(), [_text(p).encode(encoding) for p in params])
    _check(conn, result, pq.ExecStatus.TUPLES_OK)
    value = result.get_value(0, 0)
    return None if value is None else value.decode(encoding)


def send(conn: psycopg.Connection, name: str, params: tuple) -> None:
    """Send the statement and return without its answer: ``drain`` reads it before the connection's next call."""
    encoding = conn.info.encoding
    conn.pgconn.send_query_prepared(name.encode(), [_text(p).encode(encoding) for p in params])


def drain(conn: psycopg.Connection) -> None:
    """Read and drop the answers of what ``send`` sent (an announcement's count: nothing to act on)."""
    while conn.pgconn.get_result() is not None:
        pass


def _check(conn: psycopg.Connection, result: pq.abc.PGresult, expected: pq.ExecStatus) -> None:
    if result.status == expected:
        return
    message = (result.error_message or conn.pgconn.error_message).decode(errors="replace").strip()
    if conn.pgconn.status == pq.ConnStatus.BAD:
        raise psycopg.OperationalError(message or "the connection to the server was lost")
    state = result.error_field(pq.DiagnosticField.SQLSTATE)
    error_class = psycopg.errors.lookup(state.decode()) if state else psycopg.DatabaseError
    raise error_class(message)
