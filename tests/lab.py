"""The lab the Prefect-facing tests share: a real Prefect server, a real store file and three real ``mn``
worker processes with mock inventories (two GPU nodes and a CPU node)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import prefect_env
import servers
from builders import gpu

from mn_prefect.store import open_store

FLOWS = Path(__file__).parent / "flows"
ROOT = Path(__file__).resolve().parents[1]
POOL = "mn-lab"  # the prefix of a lab's pool's name: a lab's pool is ``lab.pool`` (``mn-lab-<module>-<hex>``)
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def nodes(scratch: Path) -> list[dict]:
    return [
        {"name": "gpu-1", "cpu_cores": 16, "memory_mb": 65536, "host_paths": [str(scratch)],
         "dynamic_port_range": [21000, 21999],
         "devices": [gpu("GPU-1a", 0, 24576, caps=("fp16", "bf16", "fp8")), gpu("GPU-1b", 1, 16384, caps=("fp16",))]},
        {"name": "gpu-2", "cpu_cores": 32, "memory_mb": 131072, "host_paths": [str(scratch)],
         "dynamic_port_range": [22000, 22999],
         "devices": [gpu("GPU-2a", 0, 40960, caps=("fp16", "bf16", "tf32"))]},
        {"name": "cpu-1", "cpu_cores": 8, "memory_mb": 32768, "dynamic_port_range": [23000, 23999]},
    ]


class RetryingClient(httpx.Client):
    """The Prefect server on SQLite answers 503 when its database is busy, and on a loaded machine may not
    answer within the timeout at all; Prefect's own client retries both. Requests that create something
    carry an idempotency key (see ``Lab.run``), so sending one again cannot create it twice."""

    def request(self, *args, **kwargs):
        for attempt in range(20):
            try:
                response = super().request(*args, **kwargs)
            except httpx.TimeoutException:
                if attempt == 19:
                    raise
                time.sleep(0.25 * (attempt + 1))
                continue
            if response.status_code not in (429, 503):
                return response
            time.sleep(0.25 * (attempt + 1))
        return response


def create_run(http: httpx.Client, deployment_id: str, out: Path, **parameters) -> str:
    """A run of a probe deployment that writes its record to ``out``; its id."""
    response = http.post(f"/deployments/{deployment_id}/create_flow_run",
                         json={"parameters": {"out_dir": str(out), **parameters}, "idempotency_key": uuid.uuid4().hex})
    response.raise_for_status()
    return response.json()["id"]


def module_tag() -> str:
    """A short name for the test module now running (``worker`` for tests/test_worker.py), for pool names."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]
    stem = Path(current).stem.removeprefix("test_") if current else "lab"
    return re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")[:24] or "lab"


def unique_pool_name(prefix: str = POOL) -> str:
    """``<prefix>-<module>-<hex>``: a work pool name no other module (or lab) on a shared server uses."""
    return f"{prefix}-{module_tag()}-{uuid.uuid4().hex[:6]}"


class Lab:
    def __init__(self, home: Path, store_url: str | None = None, *, fleet: list[dict] | None = None,
                 worker_env: dict[str, str] | None = None, pools: dict[str, list[dict]] | None = None,
                 server: prefect_env.PrefectServer | None = None, private_server: bool = False,
                 pools_with_prefect_command: bool = False):
        """``fleet``: the nodes of the lab's one pool ``self.pool`` (default ``nodes(home / "scratch")``); ``pools``:
        instead, several ``mn`` pools on the one store, each with its nodes (``self.pools`` maps each name given to
        the pool's real name); ``worker_env``: added to every worker's.

        The lab runs on ``server``, else on this test process's shared Prefect server (prefect_env.shared_server),
        else, with ``private_server``, on a Prefect server of its own that ``stop`` stops. Its pools are its own
        (``mn-lab-<module>-<hex>``): the labs that share a server never see each other's pools, workers or runs.
        Events are about node names other labs use too: read them ``occurred`` since ``self.since``.
        ``pools_with_prefect_command``: the lab's pools are made by Prefect's own ``prefect work-pool create``."""
        self.home = home
        self.scratch = home / "scratch"
        self.scratch.mkdir(parents=True)
        self.out = home / "out"
        self.out.mkdir()
        self.since = datetime.now(UTC).isoformat()  # events before this are other labs'
        self.private_server = server is None and private_server
        self.server = server or (prefect_env.PrefectServer(home) if private_server else prefect_env.shared_server())
        self.store_url = store_url or f"sqlite:///{home / 'state.db'}"
        pools = pools or {POOL: fleet if fleet is not None else nodes(self.scratch)}
        self.pools = {name: unique_pool_name(name) for name in pools}
        self.pool = next(iter(self.pools.values()))
        self.http = RetryingClient(base_url=self.server.api_url, timeout=60)
        self.created_pools: list[str] = []
        for pool in self.pools.values():
            self.create_pool(pool, with_prefect_command=pools_with_prefect_command)
        self.pool_of = {n["name"]: self.pools[pool] for pool, members in pools.items() for n in members}
        self.nodes = [n for members in pools.values() for n in members]
        self.worker_env = worker_env
        self.workers = [prefect_env.start_worker(self.server, self.pool_of[n["name"]], n, self.store_url, home,
                                                 extra_env=worker_env) for n in self.nodes]
        store = open_store(self.store_url)
        servers.wait_for(lambda: len(store.list_nodes()) == len(self.nodes), timeout=90,
                         what=f"{len(self.nodes)} workers registered")
        self.store = store

    def create_pool(self, name: str, *, with_prefect_command: bool = False) -> str:
        """An ``mn`` work pool with the ``mn`` type's default template (its first worker creates its group): through
        Prefect's API, or ``with_prefect_command`` through ``prefect work-pool create --type mn`` (a new interpreter
        that loads Prefect's CLI: seconds of CPU a pool; the pool is the same)."""
        if with_prefect_command:
            subprocess.run([str(prefect_env.BIN / "prefect"), "work-pool", "create", name, "--type", "mn"],
                           env=self.server.env, check=True, capture_output=True)
        else:
            from mn_prefect.worker import MNWorker

            created = self.http.post("/work_pools/", json={
                "name": name, "type": "mn", "base_job_template": MNWorker.get_default_base_job_template()})
            assert created.status_code == 201, created.text
        self.created_pools.append(name)
        return name

    def new_pool(self, prefix: str) -> str:
        """One more ``mn`` pool of this lab, named ``<prefix>-<module>-<hex>``; ``stop`` removes it."""
        return self.create_pool(unique_pool_name(prefix))

    def deploy(self, job_variables: dict, name: str | None = None, entrypoint: str = "probe.py:probe",
               pool: str | None = None, work_queue: str | None = None) -> str:
        """A deployment of a flow in ``flows/``, in ``pool`` (default: this lab's pool ``self.pool``) and its work
        queue ``work_queue`` (default: the pool's default queue)."""
        from prefect.flows import Flow
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.server.api_url}):
            flow = Flow.from_source(source=str(FLOWS), entrypoint=entrypoint)
            return str(flow.deploy(name=name or f"d-{uuid.uuid4().hex[:8]}", work_pool_name=pool or self.pool,
                                   work_queue_name=work_queue, job_variables=job_variables, print_next_steps=False))

    def run(self, deployment_id: str, **parameters) -> str:
        return create_run(self.http, deployment_id, self.out, **parameters)

    def flow_run(self, run_id: str) -> dict:
        return self.http.get(f"/flow_runs/{run_id}").json()

    def wait(self, run_id: str, states=TERMINAL, timeout: float = 120) -> dict:
        return servers.wait_for(lambda: (r := self.flow_run(run_id))["state"]["type"] in states and r,
                                timeout=timeout, interval=0.5, what=f"run {run_id} to reach {states}")

    def told_to_wait(self, runs, timeout: float = 120) -> None:
        """Until a worker has looked at each of ``runs`` and told it why it waits (its state message, ``mn ...``):
        a refusal seen, where a fixed sleep would only prove that nothing happened in time."""
        servers.wait_for(lambda: all((self.flow_run(r)["state"].get("message") or "").startswith("mn ") for r in runs),
                         timeout=timeout, interval=0.5, what=f"the {len(runs)} waiting runs told why they wait")

    def started(self, runs) -> list[str]:
        """Those of ``runs`` whose probe flow has started (it writes ``<run>.started`` first)."""
        return [r for r in runs if (self.out / f"{r}.started").exists()]

    def record(self, run_id: str) -> dict:
        return json.loads((self.out / f"{run_id}.json").read_text())

    def events(self, run_id: str, prefix: str) -> list[dict]:
        """The events about (or related to) a run whose name starts with ``prefix``. Poll it at most twice a second:
        a tight loop of event queries starves the server's event writer, and the awaited event never lands."""
        body = {"filter": {"related": {"id": [f"prefect.flow-run.{run_id}"]}, "event": {"prefix": [prefix]},
                           "occurred": {"since": self.since}}, "limit": 50}
        return self.http.post("/events/filter", json=body).json().get("events", [])

    def logs(self, run_id: str) -> list[str]:
        """The messages of a run's logs, as the Prefect UI shows them."""
        body = {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}
        return [entry["message"] for entry in self.http.post("/logs/filter", json=body).json()]

    def wait_for_log(self, run_id: str, *texts: str, timeout: float = 60) -> list[str]:
        """The run's log messages once one contains any of ``texts``: a worker's lines about a run reach the API
        in batches, after the run may have ended; AssertionError with the messages seen when none does in time."""
        seen: list[str] = []

        def arrived() -> bool:
            seen[:] = self.logs(run_id)
            return any(text in line for line in seen for text in texts)

        try:
            servers.wait_for(arrived, timeout=timeout, interval=0.5,
                             what=f"{' or '.join(map(repr, texts))} in run {run_id}'s logs")
        except TimeoutError as error:
            raise AssertionError(f"{error}; the run's logs: {seen}") from None
        return seen

    def booked(self, run_id: str) -> list:
        return self.store.active_placements(job_id=run_id)

    def worker_of(self, name: str):
        return self.workers[[n["name"] for n in self.nodes].index(name)]

    def restart_worker(self, name: str) -> None:
        """Start the node's worker again (after a test killed it); its heartbeat brings the node back."""
        index = [n["name"] for n in self.nodes].index(name)
        self.workers[index] = prefect_env.start_worker(self.server, self.pool_of[name], self.nodes[index],
                                                       self.store_url, self.home, extra_env=self.worker_env)

    def stop(self) -> None:
        """Stop the lab's workers; a private server is stopped, a shared one only rid of this lab's pools and
        deployments (so that its schedules make no more runs)."""
        prefect_env.stop_processes(self.workers, timeout=15)  # all at once: an idle worker ignores the first SIGINT
        if self.private_server:
            self.server.stop()
        else:
            self._remove_pools()
        self.http.close()

    def _remove_pools(self) -> None:
        """Runs of the lab that are not over are Cancelled first: left Cancelling in a pool that no longer exists,
        the server's cancellation cleanup would warn about each of them ("unroutable flow run") until the
        session ends."""
        pools = self.created_pools
        try:
            body = {"work_pools": {"name": {"any_": pools}}}
            unfinished = {"work_pools": {"name": {"any_": pools}},
                          "flow_runs": {"state": {"type": {"any_": ["SCHEDULED", "PENDING", "RUNNING", "CANCELLING",
                                                                    "PAUSED"]}}}}
            found = self.http.post("/flow_runs/filter", json=unfinished)
            for run in found.json() if found.status_code == 200 else []:
                self.http.post(f"/flow_runs/{run['id']}/set_state",
                               json={"state": {"type": "CANCELLED", "message": "the lab stopped"}, "force": True})
            for deployment in self.http.post("/deployments/filter", json=body).json():
                self.http.delete(f"/deployments/{deployment['id']}")
            for pool in pools:
                self.http.delete(f"/work_pools/{pool}")
        except httpx.HTTPError:  # best effort: what is left stays in pools no other lab uses
            pass
