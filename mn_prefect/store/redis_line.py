"""The commit path's line to a standalone Redis: one connection, scripts sent as packed EVALSHA commands.

A commit or a release is one script call. Through redis-py's client a call costs about 120 us of client CPU
(pool or single-connection bookkeeping, its retry wrapper, per-command metrics), more than the commit's
whole admission decision; on a 2-core machine with eight committing processes that CPU is throughput. Here a
call is: pack the arguments, send, let the connection's parser read the reply (redis-py's Connection still
does connecting, AUTH, SELECT, TLS and RESP parsing). Retries stay with the store's ``_call``: a connection
error or timeout drops the connection (its state is unknown mid-reply) and raises, and the next call
reconnects. Behind Sentinel the store keeps using redis-py's client, the path failover is tested on.
"""

from __future__ import annotations

import threading
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError


def pack(*parts: Any) -> bytes:
    """One RESP command of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        out.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


class ScriptLine:
    def __init__(self, pool: redis.ConnectionPool):
        self._pool = pool
        self._conn: Any = None
        self._lock = threading.Lock()

    def run(self, script: Script, args: list[Any]) -> Any:
        with self._lock:
            if self._conn is None:
                self._conn = self._pool.get_connection()  # connects (and authenticates) now
            conn = self._conn
            try:
                try:
                    conn.send_packed_command([pack("EVALSHA", script.sha, 0, *args)])
                    return conn.read_response()
                except NoScriptError:  # a restarted or flushed server: send the script itself once
                    conn.send_packed_command([pack("EVAL", script.script, 0, *args)])
                    return conn.read_response()
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                conn.disconnect()  # mid-reply its state is unknown; the next call reconnects
                raise

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._pool.release(self._conn)
                self._conn = None
