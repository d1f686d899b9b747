"""The HTTP servers mn-prefect starts itself (a worker's and the cluster's metrics endpoints, the lab's notification
receiver) hold no thread for a client that does not talk: each read of a connection waits at most READ_TIMEOUT_S
(a request sent slowly, or never, is dropped), and at most MAX_CONNECTIONS are served at once; one past that is
closed at once, so that slow clients cannot pile up threads."""

from __future__ import annotations

import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64


class Bounded(ThreadingMixIn):
    """A threading server of at most ``max_connections`` connections at once (mix in before the server class)."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any):
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # type: ignore[attr-defined]  # full: closed, not queued behind the slow ones
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _QuietHandler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape is not worth a line


def serve_metrics(host: str, port: int, registry, paths: dict[str, Any] | None = None) -> WSGIServer:
    """Prometheus's exposition of ``registry`` at http://HOST:PORT/metrics in a daemon thread (what
    prometheus_client's start_http_server serves, with the read timeout and the connection cap above); ``paths``:
    other registries at their own paths (``{"/metrics/process": ...}``). Raises OSError when it cannot listen
    there."""
    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import _get_best_family

    family, addr = _get_best_family(host, port)

    class Server(Bounded, WSGIServer):
        address_family = family

    default = make_wsgi_app(registry)
    others = {path: make_wsgi_app(other) for path, other in (paths or {}).items()}

    def app(environ, start_response):
        return others.get(environ.get("PATH_INFO", ""), default)(environ, start_response)

    server = make_server(addr, port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="mn-metrics", daemon=True).start()
    return server
