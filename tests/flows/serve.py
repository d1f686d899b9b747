"""A flow that serves HTTP on its booked port (MN_PORT_<LABEL>) for the health-check tests: /healthz answers 200
until the file ``sick_when`` exists, then 500."""

import http.server
import json
import os
import threading
import time
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run


@flow(name="serve")
def serve(out_dir: str, label: str = "HTTP", sick_when: str = "", seconds: float = 120.0) -> str:
    run_id = str(flow_run.id)
    port = int(os.environ[f"MN_PORT_{label}"])

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            sick = bool(sick_when) and Path(sick_when).exists()
            self.send_response(500 if sick else 200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (Path(out_dir) / f"{run_id}.started").write_text(json.dumps({"pid": os.getpid(), "port": port}))
    time.sleep(seconds)
    server.shutdown()
    return run_id
