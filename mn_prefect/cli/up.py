"""``mn-prefect up``: a whole lab on this machine, from nothing, in one command.

Starts a local Prefect server (SQLite) unless PREFECT_API_URL already answers, creates the ``mn`` pool,
starts one ``mn`` worker per node (the mock nodes of ``deployments/mock-nodes.json``; this machine itself
when it has GPUs), deploys ``deployments/prefect.yaml``, runs every example, shows where each run went in a
live table, and prints the UI address. Ctrl-C stops everything it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import yaml
from rich.live import Live
from rich.table import Table

from mn_prefect.inventory import detect_devices
from mn_prefect.local_lab import BIN, PrefectServer, free_port, healthy, start_worker, stop_process
from mn_prefect.model.issues import InvalidInput, Issue, Issues
from mn_prefect.model.node import parse_nodes
from mn_prefect.store import open_store
from mn_prefect.store.urls import home
from mn_prefect.worker.visibility import summary

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _port(preferred: int) -> int:
    if preferred == 0:
        return free_port()
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            return free_port()


def _http(api_url: str) -> httpx.Client:
    transport = httpx.HTTPTransport(retries=3)
    return httpx.Client(base_url=api_url, timeout=30, transport=transport)


def _request(client: httpx.Client, method: str, url: str, **kwargs) -> httpx.Response:
    for attempt in range(20):  # the SQLite-backed server answers 503 while its database is busy
        response = client.request(method, url, **kwargs)
        if response.status_code not in (429, 503):
            return response
        time.sleep(0.25 * (attempt + 1))
    return response


def _lab_nodes(nodes_file: Path) -> list[dict | None]:
    issues = Issues()
    raw = json.loads(nodes_file.read_text())
    records = parse_nodes(raw, nodes_file.name, issues)
    issues.raise_if_any()
    mock = [r.model_dump(mode="json") for r in records]
    if detect_devices():  # real GPUs here: this machine is a node, the mock CPU nodes keep it company
        return [None] + [n for n in mock if not n.get("devices")]
    return mock


def _table(runs: list[dict], api_ui: str) -> Table:
    table = Table(title=f"mn-prefect lab: placements ({api_ui})", title_justify="left")
    for column in ("run", "deployment", "state", "node", "devices", "ports", "volumes"):
        table.add_column(column)
    style = {"COMPLETED": "green", "FAILED": "red", "CRASHED": "red", "RUNNING": "cyan", "SCHEDULED": "yellow"}
    for run in runs:
        placement = run.get("placement") or {}
        state = run.get("state", "SCHEDULED")
        table.add_row(run["name"], run["deployment"], f"[{style.get(state, 'white')}]{state}[/]",
                      placement.get("node", "-"), ", ".join(placement.get("devices") or []) or "-",
                      ", ".join(f"{k}={v}" for k, v in (placement.get("ports") or {}).items()) or "-",
                      ", ".join(f"{k}={v}" for k, v in (placement.get("volumes") or {}).items()) or "-")
    return table


def up(project: Path, nodes_file: Path, port: int, runs_per_deployment: int, exit_when_done: bool,
       timeout: float) -> int:
    from mn_prefect.cli.render import console

    prefect_yaml = project / "deployments" / "prefect.yaml"
    if not prefect_yaml.exists():
        raise InvalidInput([Issue(str(prefect_yaml),
                                  "not found: run `mn-prefect up` from the mn-prefect checkout or pass --project")])
    lab_home = home() / "lab"
    stops = []
    try:
        api_url = os.environ.get("PREFECT_API_URL")
        if api_url and healthy(api_url):
            env, ui_url = dict(os.environ), api_url.rsplit("/api", 1)[0]
            console.print(f"using the Prefect server at {api_url}")
        else:
            with console.status("starting a local Prefect server (SQLite)..."):
                server = PrefectServer(lab_home / "prefect", _port(port), ui=True)
            stops.append(server.stop)
            env, api_url, ui_url = server.env, server.api_url, server.ui_url
            console.print(f"Prefect server up at {ui_url}")
        client = _http(api_url)
        pool = yaml.safe_load(prefect_yaml.read_text())["deployments"][0]["work_pool"]["name"]
        if _request(client, "GET", f"/work_pools/{pool}").status_code == 404:
            from mn_prefect.worker import MNWorker

            _request(client, "POST", "/work_pools/", json={
                "name": pool, "type": "mn", "base_job_template": MNWorker.get_default_base_job_template()
            }).raise_for_status()
        console.print(f"work pool [bold]{pool}[/] (type mn)")

        store_url = f"sqlite:///{lab_home / 'state.db'}"
        (lab_home / "state.db").unlink(missing_ok=True)
        nodes = _lab_nodes(nodes_file)
        workers = [start_worker(env, pool, node, store_url, lab_home / "workers") for node in nodes]
        stops.extend(lambda w=w: stop_process(w) for w in workers)
        store = open_store(store_url)
        with console.status(f"starting {len(workers)} mn workers..."):
            deadline = time.monotonic() + 120
            while len(store.list_nodes()) < len(workers):
                if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                    raise RuntimeError(f"the workers did not start; see {lab_home / 'workers'}")
                time.sleep(0.5)
        for stored in store.list_nodes():
            r = stored.record
            console.print(f"  node [bold]{r.name}[/]: {r.cpu_cores:g} cores, {r.memory_mb:g} MB, "
                          f"{', '.join(f'{d.id} ({d.model})' for d in r.devices) or 'no GPUs'}")

        with console.status("deploying deployments/prefect.yaml..."):
            deploy = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all", "--prefect-file",
                                     str(prefect_yaml)], cwd=project, env=env, capture_output=True, text=True)
        if deploy.returncode != 0:
            raise RuntimeError(f"prefect deploy failed:\n{deploy.stdout[-2000:]}{deploy.stderr[-2000:]}")
        deployments = _request(client, "POST", "/deployments/filter", json={}).json()
        runs = []
        # The lifecycle deployments run on their own (reconcile on its schedule; drain when someone asks).
        examples = [d for d in deployments if not (d.get("entrypoint") or "").startswith("flows/ops.py")]
        for deployment in sorted(examples, key=lambda d: d["name"]):
            for _ in range(runs_per_deployment):
                created = _request(client, "POST", f"/deployments/{deployment['id']}/create_flow_run", json={})
                created.raise_for_status()
                runs.append({"id": created.json()["id"], "name": created.json()["name"], "deployment": deployment["name"]})

        deadline = time.monotonic() + timeout
        with Live(_table(runs, ui_url), console=console, refresh_per_second=2) as live:
            while True:
                for run in runs:
                    data = _request(client, "GET", f"/flow_runs/{run['id']}").json()
                    run["state"] = data["state"]["type"]
                    history = store.history(run["id"])
                    if history:
                        run["placement"] = summary(history[-1].placements[0])
                live.update(_table(runs, ui_url))
                if all(r["state"] in TERMINAL for r in runs) or time.monotonic() > deadline:
                    break
                time.sleep(1)
        completed = sum(r["state"] == "COMPLETED" for r in runs)
        console.print()
        console.print(f"{completed} of {len(runs)} runs completed. Prefect UI: [bold]{ui_url}[/] "
                      f"(work pool {pool}: {ui_url}/work-pools/work-pool/{pool})")
        if not exit_when_done:
            console.print("The lab keeps running: deploy and run more, or press Ctrl-C to stop everything.")
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        return 0 if completed == len(runs) else 1
    finally:
        with console.status("stopping the lab..."):
            for stop in reversed(stops):
                stop()
