"""Write a small store with the mn_prefect on PYTHONPATH and print its SQL dump (tests/stores/*.sql).

Run it with an older commit's code to keep a store of that commit's schema, from a checkout of it:
``git worktree add --detach /tmp/old <commit>`` then
``PYTHONPATH=/tmp/old:/tmp/old/tests python tests/stores/write_store.py /tmp/old.db "<commit>" > schema-N.sql``
(a SQLite store), or, with a PostgreSQL URL of an empty database in place of the path,
``... write_store.py postgresql://user:password@host:port/db "<commit>" > pg-schema-N.sql`` (pg_dump's plain SQL,
one INSERT a row, no owners or grants). It only calls what every schema's code has: two nodes, two bookings (one
holding a GPU and a port), one record.
"""

import glob
import shutil
import sqlite3
import subprocess
import sys

from builders import gpu, node

from mn_prefect.model.resources import resource_request
from mn_prefect.scheduler import Ask, plan_asks
from mn_prefect.store import JobRecord, open_store


def commit(store, job_id: str, **resources) -> None:
    snap = store.snapshot()
    plan = plan_asks([Ask(agent_id="w", request=resource_request(resources))], snap.nodes, snap.holds,
                     job_type="batch", limits=snap.limits)
    assert plan.status == "runnable_now", plan.reason
    result = store.commit_plan(job_id, list(plan.placements))
    assert result.ok, result


def pg_dump() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_dump"))
    path = found[-1] if found else shutil.which("pg_dump")
    assert path, "pg_dump is required to dump a PostgreSQL store"
    return path


def main(target: str, written_by: str) -> None:
    url = target if "://" in target else f"sqlite:///{target}"
    store = open_store(url)
    store.register_node(node("g-1", cpu=8, memory=16384, devices=[gpu("g0", 0), gpu("g1", 1)]), now=1000.0)
    store.register_node(node("c-1", cpu=4, memory=8192), now=1000.0)
    commit(store, "job-gpu", cpu_cores=2, memory_mb=1024, gpu=1, ports=[{"label": "api", "port": 8080}])
    commit(store, "job-cpu", cpu_cores=1, memory_mb=512)
    store.put_job(JobRecord(job_id="rec-1", name="train", job_type="batch", status="running", spec={"steps": 3}))
    store.close()
    print(f"-- A store written by mn_prefect at {written_by} (tests/stores/write_store.py).")
    if url.startswith("sqlite"):
        for line in sqlite3.connect(target).iterdump():
            print(line)
        return
    dump = subprocess.run([pg_dump(), "--inserts", "--no-owner", "--no-privileges", "--no-comments", target],
                          check=True, capture_output=True, text=True).stdout
    # the version lines and psql's restrict guard (a random key a dump) are left out: the dump is plain SQL
    print("\n".join(line for line in dump.splitlines()
                    if not line.startswith(("-- Dumped ", "\\restrict ", "\\unrestrict "))))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
