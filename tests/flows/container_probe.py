"""A flow for the docker driver's tests: records what it sees from inside its container (limits, env, mounts),
and can serve on its booked port, hold until a file appears, or allocate past its memory limit."""

import http.server
import json
import os
import threading
import time
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

LIMIT_FILES = {  # cgroup v1, then v2
    "memory": ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory.max"),
    "memswap": ("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes", "/sys/fs/cgroup/memory.swap.max"),
    "cpu_quota": ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu.max"),
    "cpuset": ("/sys/fs/cgroup/cpuset/cpuset.cpus", "/sys/fs/cgroup/cpuset.cpus"),
}


def _read_first(paths):
    for path in paths:
        try:
            return Path(path).read_text().strip()
        except OSError:
            continue
    return None


def _serve(port: int, until: Path) -> None:
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"hello from {os.environ.get('MN_NODE')}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@flow(name="container-probe")
def container_probe(out_dir: str, mode: str = "record", hold_until: str = "") -> str:
    run_id = str(flow_run.id)
    out = Path(out_dir)
    print(f"hello from the container of {run_id}")
    record = {
        "env": dict(os.environ),
        "in_container": os.path.exists("/.dockerenv"),
        "pid1": Path("/proc/1/cmdline").read_bytes().split(b"\0")[0].decode(),
        "limits": {name: _read_first(paths) for name, paths in LIMIT_FILES.items()},
    }
    try:  # the run's folder for its preemption notice and checkpoints is mounted read-write
        from mn_prefect import checkpointed

        record["checkpointed"] = checkpointed()
    except OSError as error:
        record["checkpointed"] = f"{type(error).__name__}: errno {error.errno}"
    models = os.environ.get("MN_VOLUME_MODELS_TARGET")
    if models:
        try:
            (Path(models) / "written").write_text("x")
            record["ro_write"] = "allowed"
        except OSError as error:
            record["ro_write"] = f"{type(error).__name__}: errno {error.errno}"
    (out / f"{run_id}.started").write_text("started")
    if mode == "serve":
        server = _serve(int(os.environ["MN_PORT_API"]), Path(hold_until))
        (out / f"{run_id}.serving").write_text(os.environ["MN_PORT_API"])
    while hold_until and not Path(hold_until).exists():
        time.sleep(0.1)
    if mode == "serve":
        server.shutdown()
    if mode == "hog":
        hog = bytearray(512 * 1024 * 1024)  # touched page by page: the kernel must find the memory
        for i in range(0, len(hog), 4096):
            hog[i] = 1
    (out / f"{run_id}.json").write_text(json.dumps(record))
    return run_id
