"""Kill-to-replaced time after node loss, over repeated trials, with the real lab.

One local Prefect server, three ``mn`` workers (mock inventories), a SQLite store. Each trial: a
``cluster_recover`` run starts on the victim node; the victim's worker and every process it started are
SIGKILLed; the reconcile pass (``mn_prefect.ops.flows.reconcile_once``, what the scheduled flow runs) is
called every ``--interval`` seconds. Measured from the kill: ``replaced`` = a new booking for the run on
another node, ``running`` = the run started again there. The run must complete (a lost run counts as a
failure); then the victim's worker is started again and the next trial begins.

Target (issue 5/5): median replaced <= heartbeat timeout + grace + one reconcile interval + 5 s.

Usage: python benchmarks/recovery.py [--trials 10] [--timeout 4] [--grace 3] [--interval 2] [--json] [--write BENCHMARKS.md]

``--failover``: Redis Sentinel failover instead (no Prefect): SIGKILL of the master to the next commit
succeeding on the promoted replica (tests/test_store_reliability.py checks that it resumes, not how fast).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from api import request  # noqa: E402
from report import print_rows, provenance, write_section  # noqa: E402

from mn_prefect.local_lab import BIN, PrefectServer, kill_tree, start_worker, stop_process  # noqa: E402
from mn_prefect.store import open_store  # noqa: E402

NODES = json.loads((ROOT / "deployments" / "mock-nodes.json").read_text())
VICTIM = NODES[-1]["name"]
POOL = "bench-recovery"


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


def run_trials(args, progress, task) -> list[dict]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from mn_prefect.ops.flows import reconcile_once

    home = Path(tempfile.mkdtemp(prefix="mn-bench-recovery-"))
    out = home / "out"
    out.mkdir()
    os.environ["MN_HEARTBEAT_TIMEOUT_SECONDS"] = str(args.timeout)
    os.environ["MN_DISCONNECT_GRACE_SECONDS"] = str(args.grace)
    server = PrefectServer(home / "prefect")
    store_url = f"sqlite:///{home / 'state.db'}"
    workers = {}
    try:
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", POOL, "--type", "mn"], env=server.env,
                       check=True, capture_output=True)
        for node in NODES:
            workers[node["name"]] = start_worker(server.env, POOL, node, store_url, home)
        store = open_store(store_url)
        _wait(lambda: len(store.list_nodes()) == len(NODES), 90, "workers to register")
        deploy = subprocess.run(
            [str(BIN / "python"), "-c",
             "from prefect.flows import Flow;"
             f"print(Flow.from_source(source={str(ROOT / 'benchmarks' / 'flows')!r}, entrypoint='hold.py:hold')"
             f".deploy(name='hold', work_pool_name={POOL!r}, print_next_steps=False, job_variables="
             f"{{'resources': {{'cpu_cores': 1}}, 'preferred_node': {VICTIM!r}, 'recovery_mode': 'cluster_recover'}}))"],
            env=server.env, capture_output=True, text=True, check=True)
        deployment = deploy.stdout.strip().splitlines()[-1]
        http = httpx.Client(base_url=server.api_url, timeout=30)
        rows = []
        with temporary_settings({PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
            for trial in range(1, args.trials + 1):
                response = request(http, "POST", f"/deployments/{deployment}/create_flow_run",
                                   json={"parameters": {"out_dir": str(out), "seconds": args.hold}})
                response.raise_for_status()
                run_id = response.json()["id"]
                try:
                    _wait(lambda run_id=run_id: (out / f"{run_id}.{VICTIM}.started").exists(), 120, "the run to start on the victim")
                except TimeoutError:
                    state = request(http, "GET", f"/flow_runs/{run_id}").json()["state"]
                    raise RuntimeError(f"trial {trial}: run {run_id} did not start on {VICTIM}: {state['type']} "
                                       f"{state.get('message')}; bookings {store.active_placements(job_id=run_id)}; "
                                       f"started files {sorted(p.name for p in out.iterdir())[-4:]}") from None
                killed = time.time()
                kill_tree(workers[VICTIM])
                replaced = running = None
                next_pass = time.monotonic()
                while running is None:
                    if time.monotonic() >= next_pass:
                        reconcile_once(store, client)
                        next_pass += args.interval
                    if replaced is None and any(p.node != VICTIM for p in store.active_placements(job_id=run_id)):
                        replaced = time.time() - killed
                    moved = [p for p in out.glob(f"{run_id}.*.started") if f".{VICTIM}." not in p.name]
                    if moved:
                        running = json.loads(moved[0].read_text())["start"] - killed
                    if time.time() - killed > 180:
                        break
                    time.sleep(0.1)
                final = _wait(lambda run_id=run_id: (s := request(http, "GET", f"/flow_runs/{run_id}").json()["state"]["type"]) in
                              ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") and s, 180, "the run to end")
                rows.append({"trial": trial, "replaced_s": round(replaced, 2) if replaced else None,
                             "running_s": round(running, 2) if running else None, "final": final})
                workers[VICTIM] = start_worker(server.env, POOL, NODES[-1], store_url, home)
                _wait(lambda killed=killed: store.get_node(VICTIM).record.status == "healthy"
                      and store.get_node(VICTIM).last_heartbeat > killed + 1, 90, "the victim to come back")
                progress.advance(task)
        return rows
    finally:
        for worker in workers.values():
            stop_process(worker)
        server.stop()


def failover_trials(args) -> list[dict]:
    """Redis Sentinel failover (``--failover``): a master, a replica and three sentinels on loopback; each trial
    SIGKILLs the master and measures how long the next commit (``place_and_commit``, which blocks through the
    failover) takes to succeed on the promoted replica. The killed server comes back as the new replica."""
    import signal

    sys.path.insert(0, str(ROOT / "tests"))
    import servers
    import store_workload

    from mn_prefect.model.resources import resource_request
    from mn_prefect.placement.placing import place_and_commit
    from mn_prefect.scheduler import Ask

    home = Path(tempfile.mkdtemp(prefix="mn-bench-failover-"))
    password = "bench-secret"
    redis = {"a": servers.RedisServer(home / "a", password=password)}
    redis["b"] = servers.RedisServer(home / "b", password=password, replica_of=redis["a"].port)
    sentinels = [servers.RedisServer(home / f"s{i}", password=password, sentinel_of=(redis["a"].port, "mnmaster"))
                 for i in range(3)]
    rows = []
    try:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in sentinels)
        url = f"redis+sentinel://:{password}@{hosts}/mnmaster/0?retry_seconds=60&socket_timeout=0.5"
        _wait(lambda: all(s.client().execute_command("SENTINEL", "get-master-addr-by-name", "mnmaster")
                          for s in sentinels), 30, "sentinels")
        store_workload.prepare(url)
        store = open_store(url)
        ask = Ask(agent_id="a", request=resource_request({"cpu_cores": 0.01}))
        for trial in range(1, args.trials + 1):
            master_port = int(store.client.connection_pool.get_master_address()[1])
            master = next(r for r in redis.values() if r.port == master_port)
            replica = next(r for r in redis.values() if r is not master)
            _wait(lambda replica=replica, master=master:
                  replica.client().info("replication").get("master_link_status") == "up"
                  and replica.client().info("replication")["master_repl_offset"]
                  >= master.client().info("replication")["master_repl_offset"], 60, "the replica to catch up")
            killed = time.monotonic()
            master.kill(signal.SIGKILL)
            result = place_and_commit(store, f"after-failover-{trial}", [ask])
            resumed = time.monotonic() - killed
            promoted = store.client.connection_pool.get_master_address()[1] == replica.port
            rows.append({"trial": trial, "resumed_s": round(resumed, 2), "placed": result.placed,
                         "promoted_replica": promoted})
            store.release(f"after-failover-{trial}")
            master.start()  # sentinel turns the old master into a replica of the new one
    finally:
        for server in [*sentinels, *redis.values()]:
            server.kill()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=4.0, help="heartbeat timeout, s")
    parser.add_argument("--grace", type=float, default=3.0, help="disconnect grace, s")
    parser.add_argument("--interval", type=float, default=2.0, help="reconcile interval, s")
    parser.add_argument("--hold", type=float, default=6.0, help="how long each run works, s")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write")
    parser.add_argument("--failover", action="store_true",
                        help="measure Redis Sentinel failover instead: master kill to the next commit, s")
    args = parser.parse_args()
    if args.failover:
        rows = failover_trials(args)
        resumed = [r["resumed_s"] for r in rows]
        summary = {"trials": len(rows), "median_resumed_s": round(statistics.median(resumed), 2),
                   "max_resumed_s": max(resumed), "failed_commits": sum(not r["placed"] for r in rows)}
        if args.json:
            print(json.dumps({"trials": rows, "summary": summary}, indent=2))
        else:
            print_rows("master kill to the next commit, per trial", rows)
            print_rows("summary", [summary])
        if args.write:
            body = (provenance("recovery.py") + "\n\n| trials | median resumed s | max resumed s | failed commits |\n"
                    f"| ---: | ---: | ---: | ---: |\n| {len(rows)} | {summary['median_resumed_s']} | "
                    f"{summary['max_resumed_s']} | {summary['failed_commits']} |\n\nResumed: from SIGKILL of the "
                    "Redis master to the next commit succeeding on the replica Sentinel promoted (down-after 1 s, "
                    "one master, one replica, three sentinels on loopback).")
            write_section(args.write, "failover", body)
        return
    with Progress(transient=True) as progress:
        task = progress.add_task("recovery trials", total=args.trials)
        rows = run_trials(args, progress, task)
    replaced = [r["replaced_s"] for r in rows if r["replaced_s"] is not None]
    running = [r["running_s"] for r in rows if r["running_s"] is not None]
    target = args.timeout + args.grace + args.interval + 5
    lost = sum(r["final"] != "COMPLETED" for r in rows)
    summary = {"trials": len(rows), "median_replaced_s": round(statistics.median(replaced), 2),
               "max_replaced_s": max(replaced), "median_running_s": round(statistics.median(running), 2),
               "max_running_s": max(running), "target_s": target, "lost_runs": lost,
               "heartbeat_timeout_s": args.timeout, "grace_s": args.grace, "interval_s": args.interval}
    if args.json:
        print(json.dumps({"trials": rows, "summary": summary}, indent=2))
    else:
        print_rows("kill-to-replaced, per trial", rows)
        print_rows("summary", [summary])
    if args.write:
        lines = ["| trials | heartbeat timeout s | grace s | reconcile interval s | median replaced s | max replaced s "
                 "| median running again s | max running again s | target s | lost runs |",
                 "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
                 f"| {len(rows)} | {args.timeout:g} | {args.grace:g} | {args.interval:g} | "
                 f"{summary['median_replaced_s']} | {summary['max_replaced_s']} | {summary['median_running_s']} | "
                 f"{summary['max_running_s']} | {target:g} | {lost} |"]
        body = (provenance("recovery.py") + "\n\n" + "\n".join(lines) +
                "\n\nReplaced: a new booking for the run on another node. Running again: the run started there "
                "(after the `batch` reschedule delay, constant 5 s, and process start-up).")
        write_section(args.write, "recovery", body)


if __name__ == "__main__":
    main()
