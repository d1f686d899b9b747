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

Writes whose answer nobody waits for (a record, an event) can go *ahead* of the next call: queued by the thread
that makes them and sent in the same ``sendall`` as that thread's next call, in order, so a write and the commit
after it cost one round trip, not two. Such a write is sent as EVAL (never NOSCRIPT: a write ahead of a commit
never fails where the commit would not). Its answer is read before the call's own; an error in it is raised
after the call's answer was read, the line in step. A connection lost mid-exchange keeps the writes for the
call's retry (a write ahead is idempotent, or an event that may then appear twice).
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
        self._ahead: dict[int, list[bytes]] = {}  # per thread: writes to send ahead of its next call

    @staticmethod
    def _call(sock: socket.socket, command: bytes, ahead: list[bytes]) -> Any:
        sock.sendall(b"".join(ahead) + command if ahead else command)
        reply = _Reply(sock)
        failed = [answer for answer in (reply.read() for _ in ahead) if isinstance(answer, Exception)]
        answer = reply.read() if command else None
        if failed:
            raise failed[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def run(self, script: Script, args: list[Any]) -> Any:
        """The script's answer to ``args`` (EVALSHA; the script itself when the server does not have it)."""
        def call(sock: socket.socket, ahead: list[bytes]) -> Any:
            try:
                return self._call(sock, pack("EVALSHA", script.sha, 0, *args), ahead)
            except NoScriptError:  # a restarted or flushed server: send the script itself once (the writes
                return self._call(sock, pack("EVAL", script.script, 0, *args), [])  # ahead went through)

        return self._exchange(call)

    def command(self, *parts: Any) -> Any:
        """A plain command's answer (a string, an integer, nil or an array of them)."""
        return self._exchange(lambda sock, ahead: self._call(sock, pack(*parts), ahead))

    def write_ahead(self, *parts: Any) -> None:
        """Queue a write (a plain command, or EVAL with its script) to go ahead of this thread's next call."""
        with self._lock:
            self._ahead.setdefault(threading.get_ident(), []).append(pack(*parts))

    def flush(self) -> None:
        """Send this thread's writes ahead now, if any are queued (their answers read, an error raised)."""
        if self._ahead.get(threading.get_ident()):
            self._exchange(lambda sock, ahead: self._call(sock, b"", ahead))

    def drop_ahead(self) -> None:
        """Forget this thread's queued writes (their block ended in an error that left them unsent)."""
        with self._lock:
            self._ahead.pop(threading.get_ident(), None)

    def _exchange(self, call) -> Any:
        with self._lock:
            if self._conn is None:
                self._conn = self._pool.get_connection()  # connects (and authenticates) now
            conn = self._conn
            me = threading.get_ident()
            ahead = self._ahead.get(me, [])
            try:
                if conn._sock is None:
                    conn.connect()
                answer = call(conn._sock, ahead)
                self._ahead.pop(me, None)
                return answer
            except (ReadOnlyError, BusyLoadingError):
                raise  # a replica or a loading server wrote nothing: the writes ahead go again with the retry
            except redis.ResponseError:
                self._ahead.pop(me, None)  # the writes ahead were answered (one of them, or the call, failed)
                raise
            except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
                conn.disconnect()  # mid-reply its state is unknown; the next call reconnects (and sends them again)
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
