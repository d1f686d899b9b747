"""The lab's requests to its server ride out what a busy or restarting server does (mn_prefect/cli/up.py,
``_request``): connections reset or refused and 503s are tried again with backoff, and only a server gone for the
whole patience raises. A real loopback server that resets its first connections (an RST: SO_LINGER 0)."""

from __future__ import annotations

import socket
import struct
import threading

import httpx
import pytest

from mn_prefect.cli.up import _request


class Resetting:
    """Resets the first ``resets`` connections, answers each later one ``200 {"ok": true}``."""

    def __init__(self, resets: int):
        self.resets, self.accepted = resets, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                conn.recv(65536)
                if self.accepted <= self.resets:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue  # closed with linger 0: the client reads "connection reset by peer"
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n"
                             b"Connection: close\r\n\r\n{\"ok\": true}")

    def close(self) -> None:
        self.sock.close()


def test_connection_resets_are_tried_again_and_the_answer_comes_through():
    server, waits = Resetting(resets=3), []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as client:
            response = _request(client, "GET", "/health", sleep=waits.append)
        assert response.status_code == 200 and response.json() == {"ok": True}
        assert server.accepted == 4 and waits == [0.25, 0.5, 1.0]  # backoff between the tries
    finally:
        server.close()


def test_a_server_gone_for_the_whole_patience_raises_naming_the_reset():
    server = Resetting(resets=10**9)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as client:
            with pytest.raises(httpx.TransportError) as raised:
                _request(client, "GET", "/health", patience_s=1.0)
        assert "reset" in str(raised.value).lower() and server.accepted >= 2
    finally:
        server.close()


def test_a_refused_connection_is_tried_again_until_the_patience_ends():
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there: refused
    waits: list[float] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        with pytest.raises(httpx.ConnectError):
            _request(client, "GET", "/health", patience_s=3.0, sleep=waits.append)
    assert waits[:3] == [0.25, 0.5, 1.0]


def test_a_port_whose_server_just_stopped_is_free_and_a_listened_one_is_not():
    from mn_prefect.cli.up import _port_free

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    assert not _port_free(port)  # listened on
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server's side closes first: its connection waits in TIME_WAIT on the port
    client.close()
    listener.close()
    assert _port_free(port)  # as `up --port P` right after `down` finds it
