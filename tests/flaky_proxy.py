"""A loopback HTTP proxy in front of a real Prefect server that fails chosen requests on purpose.

Everything else is forwarded as is (one upstream connection per request; websocket upgrades, which Prefect's
events client uses, are piped both ways). A fault answers a matching request with an HTTP status (503, 504...)
or resets the connection, ``times`` times, without sending it on; ``Fault.hits`` counts what it failed. A
fault with ``delivered=True`` sends the request on and loses the server's answer instead: the server did the
work, the client hears an error.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Fault:
    method: str
    path: str  # a regular expression the whole request path must match
    status: int | None = 503  # None: reset the connection instead of answering
    times: int = 1
    body: str | None = None  # a regular expression the request body must contain
    delivered: bool = False  # True: the server gets the request; only its answer is replaced by the fault
    hits: list[str] = field(default_factory=list)  # the paths it failed

    def matches(self, method: str, path: str, body: bytes) -> bool:
        return (len(self.hits) < self.times and method == self.method and re.fullmatch(self.path, path) is not None
                and (self.body is None or re.search(self.body, body.decode("utf-8", "replace")) is not None))


class FlakyProxy:
    def __init__(self, upstream_api_url: str):
        parts = urlsplit(upstream_api_url)
        self.upstream = (parts.hostname, parts.port)
        self.api_path = parts.path
        self.faults: list[Fault] = []
        self.seen: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="flaky-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.api_path}"

    def fail(self, method: str, path: str, *, status: int | None = 503, times: int = 1,
             body: str | None = None, delivered: bool = False) -> Fault:
        fault = Fault(method, path, status, times, body, delivered)
        with self._lock:
            self.faults.append(fault)
        return fault

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # -- the event loop thread ------------------------------------------------------------------------------

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def _fault_for(self, method: str, path: str, body: bytes) -> Fault | None:
        with self._lock:
            self.seen.append((method, path))
            for fault in self.faults:
                if fault.matches(method, path, body):
                    fault.hits.append(path)
                    return fault
        return None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _one_request(self, reader, writer) -> bool:
        """Forward (or fail) one request; True when the client's connection may carry another."""
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers = [tuple(part.strip() for part in line.split(":", 1)) for line in lines[1:] if ":" in line]
        named = {k.lower(): v for k, v in headers}
        upgrade = "upgrade" in named.get("connection", "").lower()
        body = b""
        if "chunked" in named.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                chunk = await reader.readexactly(size + 2)
                body += size_line + chunk
                if size == 0:
                    break
        else:
            body = await reader.readexactly(int(named.get("content-length", "0")))
        fault = self._fault_for(method, urlsplit(target).path, body)
        if fault is not None and fault.delivered:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            try:
                up_writer.write(head + body)
                await up_writer.drain()
                await up_reader.readuntil(b"\r\n\r\n")  # the server has answered: it did the work
            finally:
                up_writer.close()
        if fault is not None:
            if fault.status is None:  # a reset: RST instead of FIN, and no answer at all
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return False
            text = b'{"exception_message": "injected by the test proxy"}'
            writer.write(f"HTTP/1.1 {fault.status} Injected\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(text)}\r\nconnection: close\r\n\r\n".encode() + text)
            await writer.drain()
            return False
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        try:
            if upgrade:
                up_writer.write(head + body)
                await up_writer.drain()
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)
                return False
            kept = [(k, v) for k, v in headers if k.lower() not in ("connection", "keep-alive")]
            request = "\r\n".join([lines[0], *(f"{k}: {v}" for k, v in kept), "connection: close", "", ""])
            up_writer.write(request.encode("latin-1") + body)
            await up_writer.drain()
            await _pipe(up_reader, writer)  # the server closes after its answer: it was asked to
            return False
        finally:
            up_writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        if writer.can_write_eof():
            try:
                writer.write_eof()
            except (OSError, RuntimeError):
                pass
