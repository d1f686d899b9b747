"""The HTTP servers mn-prefect starts (mn_prefect/http_serving.py): slow clients cannot pile up threads. A metrics
endpoint with its connections all taken by clients that never send closes one more at once, answers again when
they go, and drops a client that sends nothing after the read timeout."""

from __future__ import annotations

import socket

import httpx
from prometheus_client import CollectorRegistry, Gauge

from mn_prefect import http_serving


def metrics_server(monkeypatch, cap: int, timeout_s: float):
    monkeypatch.setattr(http_serving.Bounded, "max_connections", cap)
    monkeypatch.setattr(http_serving._QuietHandler, "timeout", timeout_s)
    registry = CollectorRegistry()
    Gauge("mn_test_up", "a gauge of the test", registry=registry).set(1)
    return http_serving.serve_metrics("127.0.0.1", 0, registry)


def test_past_the_cap_a_connection_is_closed_at_once_and_the_endpoint_answers_once_they_go(monkeypatch):
    server = metrics_server(monkeypatch, cap=3, timeout_s=600)
    port = server.server_port
    try:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        extra.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert extra.recv(4096) == b""  # closed unanswered: no thread waits on it
        extra.close()
        for conn in silent:
            conn.close()
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert response.status_code == 200 and "mn_test_up 1.0" in response.text
    finally:
        server.shutdown()
        server.server_close()


def test_a_client_that_sends_nothing_is_dropped_after_the_read_timeout(monkeypatch):
    server = metrics_server(monkeypatch, cap=1, timeout_s=0.5)
    port = server.server_port
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as silent:
            assert silent.recv(4096) == b""  # the server gave up on it and closed it
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)  # its one slot is free again
        assert response.status_code == 200
    finally:
        server.shutdown()
        server.server_close()
