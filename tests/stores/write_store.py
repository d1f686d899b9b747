"""Write a small SQLite store with the mn_prefect on PYTHONPATH and print its SQL dump (tests/stores/*.sql).

Run it with an older commit's code to keep a store of that commit's schema, from an unpacked copy of it:
``git archive <commit> mn_prefect tests/builders.py | tar -x -C /tmp/old`` then, outside the repository,
``PYTHONPATH=/tmp/old:/tmp/old/tests python tests/stores/write_store.py /tmp/old.db "<commit>" > schema-N.sql``.
It only calls what every schema's code has: two nodes, two bookings (one holding a GPU and a port), one record.
"""

import sqlite3
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


def main(path: str, written_by: str) -> None:
    store = open_store(f"sqlite:///{path}")
    store.register_node(node("g-1", cpu=8, memory=16384, devices=[gpu("g0", 0), gpu("g1", 1)]), now=1000.0)
    store.register_node(node("c-1", cpu=4, memory=8192), now=1000.0)
    commit(store, "job-gpu", cpu_cores=2, memory_mb=1024, gpu=1, ports=[{"label": "api", "port": 8080}])
    commit(store, "job-cpu", cpu_cores=1, memory_mb=512)
    store.put_job(JobRecord(job_id="rec-1", name="train", job_type="batch", status="running", spec={"steps": 3}))
    store.close()
    print(f"-- A store written by mn_prefect at {written_by} (tests/stores/write_store.py).")
    for line in sqlite3.connect(path).iterdump():
        print(line)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
