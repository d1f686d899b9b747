"""The errors a lab's Prefect server logs, counted and named (mn_prefect/lab_logs.py), and `down` saying them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import servers

from mn_prefect.lab_logs import server_errors
from mn_prefect.local_lab import read_lab_lock

LOG = """\
01:19:07.100 | INFO    | uvicorn.access - 127.0.0.1 - "GET /api/health HTTP/1.1" 200
01:19:07.773 | ERROR   | uvicorn.error - Exception in ASGI application
Traceback (most recent call last):
  File "x.py", line 1, in f
sqlite3.OperationalError: database is locked

The above exception was the direct cause of the following exception:

sqlalchemy.exc.OperationalError: (sqlite3.OperationalError) database is locked
01:19:08.000 | WARNING | prefect.server - slow
01:19:09.000 | ERROR   | prefect.server - Encountered exception in request:
Traceback (most recent call last):
sqlite3.OperationalError: database is locked
01:19:10.000 | ERROR   | uvicorn.error - Exception in ASGI application
Traceback (most recent call last):
asyncio.exceptions.CancelledError
TimeoutError
01:19:11.000 | ERROR   | prefect.server.services - lease 9f3779ed-f667-4512-8e83-aa779240b1d4 not found
01:19:12.000 | INFO    | prefect.server - done
"""


def test_errors_are_counted_and_named_by_their_cause_else_their_last_exception_else_their_message(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(LOG)

    found = server_errors(log)

    assert dict(found.by_name) == {"database is locked": 2, "TimeoutError": 1,
                                   "lease <id> not found": 1}
    assert found.sentence() == (f"the lab's Prefect server logged 4 error(s) (2 'database is locked', 1 "
                                f"'TimeoutError', 1 'lease <id> not found'): see {log}")


def test_a_log_without_errors_or_no_log_says_nothing(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("01:19:07.100 | INFO    | prefect.server - started\n")

    assert server_errors(log).sentence() == "" and server_errors(tmp_path / "none.log").total == 0


HOLDER = """
import signal, sys, time
from pathlib import Path
from mn_prefect.local_lab import LabLock
lock = LabLock.acquire(Path(sys.argv[1]))
lock.record(ui_url="http://127.0.0.1:1/", store_url="sqlite:///x.db")
signal.signal(signal.SIGTERM, lambda *_: (lock.release(), sys.exit(0)))
while True:
    time.sleep(0.1)
"""


def test_down_names_the_errors_the_stopped_labs_server_logged(tmp_path):
    """A process holding the lab's lock stands for `up` (down signals it and waits for the lock)."""
    lab_home = tmp_path / "lab"
    (lab_home / "prefect").mkdir(parents=True)
    (lab_home / "prefect" / "server.log").write_text(LOG)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(lab_home)])
    try:
        servers.wait_for(lambda: (read_lab_lock(lab_home) or {}).get("ui_url"), timeout=60, what="the lock held")
        env = {"MN_PREFECT_HOME": str(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect-client"),
               "HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
        down = subprocess.run([str(Path(sys.executable).parent / "mn-prefect"), "down"], env=env,
                              capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped the lab" in down.stdout
    assert "the lab's Prefect server logged 4 error(s) (2 'database is locked'" in " ".join(down.stdout.split())
