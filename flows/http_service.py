"""A CPU flow with a dynamic port: serves HTTP on the port the scheduler booked and calls itself once."""

import http.server
import threading
import urllib.request

from prefect import flow, get_run_logger

import mn_prefect
from mn_prefect.decorators import requires


@requires(cpu=1, memory_mb=512, ports=[{"label": "http", "protocol": "http"}])
@flow(name="http-service")
def http_service() -> str:
    allocation = mn_prefect.allocation()
    port = allocation.port("http")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
            status = response.status
    finally:
        server.shutdown()
    get_run_logger().info("served HTTP on %s:%d (MN_PORT_HTTP), self-check %d", allocation.node, port, status)
    return f"{allocation.node}:{port}"
