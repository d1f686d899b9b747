"""The commit path's line to a standalone Redis: one connection, scripts sent as packed EVALSHA commands, the
replies read straight off its socket.

A commit or a release is one script call. Through redis-py's client a call cost about 120 us of client CPU
(pool or single-connection bookkeeping, its retry wrapper, per-command metrics), and through the connection's
own send and parse about 25 us, more than the commit's admission decision; on a 2-core machine with eight
committing processes that CPU is throughput. Here a call is: pack the arguments, one ``sendall``, and a small
RESP reader over ``recv`` for the script's answer (a string, an integer, nil or an array of them). redis-py's
Connection still connects, authenticates, selects the database and wraps TLS. Retries stay with the store's
``_call``: a connection error or timeout drops the connection (its state is unknown mid-reply) and raises
redis-py's exception for it, and the next call reconnects. Behind Sentinel the store keeps using redis-py's
client, the path failover is tested on.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import BusyLoadingError, NoScriptError, ReadOnlyError, ResponseError

_ERRORS = {"NOSCRIPT": NoScriptError, "READONLY": ReadOnlyError, "LOADING": BusyLoadingError}


def pack(*parts: Any) -> bytes:
    """One RESP command of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        out.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


class _Reply:
    """One reply read off the socket (RESP2, and RESP3's types but pushes and attributes)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = sock.recv(65536)
        self.pos = 0

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise redis.ConnectionError("Connection closed by server.")
        self.buf = self.buf[self.pos:] + chunk
        self.pos = 0

    def _line(self) -> bytes:
        while (end := self.buf.find(b"\r\n", self.pos)) < 0:
            self._more()
        line = self.buf[self.pos:end]
        self.pos = end + 2
        return line

    def read(self) -> Any:
        if not self.buf:
            raise redis.ConnectionError("Connection closed by server.")
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind in (b"$", b"="):  # a bulk string; RESP3's verbatim one starts with its format ("txt:")
            size = int(rest)
            if size < 0:
                return None
            while len(self.buf) - self.pos < size + 2:
                self._more()
            data = self.buf[self.pos:self.pos + size]
            self.pos += size + 2
            return data.decode() if kind == b"$" else data[4:].decode()
        if kind in (b"*", b"~"):  # an array; RESP3's set
            size = int(rest)
            return None if size < 0 else [self.read() for _ in range(size)]
        if kind == b"%":  # RESP3's map
            return {self.read(): self.read() for _ in range(int(rest))}
        if kind == b":":
            return int(rest)
        if kind == b",":
            return float(rest)
        if kind == b"#":
            return rest == b"t"
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            message = rest.decode()
            code = message.split(" ", 1)[0]
            return _ERRORS.get(code, ResponseError)(message[len(code) + 1:] if code in _ERRORS else message)
        if kind == b"_":
            return None
        raise redis.exceptions.InvalidResponse(f"unexpected reply type {kind!r} from a commit-path script")


class ScriptLine:
    def __init__(self, pool: redis.ConnectionPool):
        self._pool = pool
        self._conn: Any = None
        self._lock = threading.Lock()

    def _call(self, sock: socket.socket, command: bytes) -> Any:
        sock.sendall(command)
        answer = _Reply(sock).read()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def run(self, script: Script, args: list[Any]) -> Any:
        """The script's answer to ``args`` (EVALSHA; the script itself when the server does not have it)."""
        def call(sock: socket.socket) -> Any:
            try:
                return self._call(sock, pack("EVALSHA", script.sha, 0, *args))
            except NoScriptError:  # a restarted or flushed server: send the script itself once
                return self._call(sock, pack("EVAL", script.script, 0, *args))

        return self._exchange(call)

    def command(self, *parts: Any) -> Any:
        """A plain command's answer (a string, an integer, nil or an array of them)."""
        return self._exchange(lambda sock: self._call(sock, pack(*parts)))

    def _exchange(self, call) -> Any:
        with self._lock:
            if self._conn is None:
                self._conn = self._pool.get_connection()  # connects (and authenticates) now
            conn = self._conn
            try:
                if conn._sock is None:
                    conn.connect()
                return call(conn._sock)
            except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
                conn.disconnect()  # mid-reply its state is unknown; the next call reconnects
                if isinstance(error, redis.RedisError):
                    raise
                if isinstance(error, TimeoutError):
                    raise redis.TimeoutError(f"Timeout reading from the commit line: {error}") from None
                raise redis.ConnectionError(f"Error on the commit line: {error}") from None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._pool.release(self._conn)
                self._conn = None
