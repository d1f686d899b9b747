"""Fault campaign: random faults against a live lab of ``mn`` workers, with invariants checked after each.

The lab: a Prefect server on PostgreSQL, W real ``prefect worker start --type mn`` processes, one per node of a
mock inventory (GPU and CPU nodes), each in a network namespace of its own that reaches the Prefect server and
the store through a veth link (tests/test_multihost.py's ``Network``), and a cluster store: SQLite (a file: a cut
link cuts the worker from the API only), Redis (a master, a replica and three Sentinels, AOF on) or PostgreSQL
(its own server, not the Prefect server's). The campaign keeps work in flight: plain probe runs (CPU, one GPU,
a port), blueprint jobs (two agents), a ``system`` job, and reservations with an expiry. A reconcile pass
(``mn_prefect.ops.flows.reconcile_once``, what the scheduled ``mn-reconcile`` flow runs) runs every 2 s, as an
operator would deploy it.

Faults, one at a time, chosen at random: ``worker`` (SIGKILL of one worker process, started again 0.5 s later;
its runs' processes live on), ``flowrun`` (SIGKILL of one flow-run process a worker started), ``store`` (SIGKILL
of the Redis master or of PostgreSQL, started again on the same port), ``prefect`` (SIGKILL of the Prefect
server's process group, started again on the same port), ``cut_short`` / ``cut_long`` (a worker's link down for
half the heartbeat timeout / for timeout + grace + 3 s), ``failover`` (``SENTINEL FAILOVER``).

Invariants, checked every ~0.5 s after a fault until they hold (recovery) or its bound passes (violation):
(a) ``audit`` of ``store.consistent_view()`` is sound; (b) every booking's owner is live (a flow run not in a
terminal state or a copy of it, a blueprint job not finished whose coordinator run is not terminal, a reservation
not ended), else the booking goes within heartbeat timeout + grace + one node sweep (10 s) + 10 s, counted from
when its node's link is back if it was cut (only that node's worker releases a part booked there) and from when
the Prefect API answers again if it was away (a run's end is read there); (c) each
reservation still holds what it was given until it ends; (d) no run is Scheduled or Pending more than
``--stuck`` seconds past its scheduled time; (e) at the end, after a drain, every run created is terminal (or
Running with a live booking, or booked with its flow-run process alive, or Paused for review by its recovery mode);
a run whose state changed within the booking bound of (b) when the drain ends (cancelled in its last seconds: a
reservation it ran inside ended), or whose flow-run process is alive, gets that bound past the drain to settle; a
Cancelling one the longer of that bound and the orphan grace + one node sweep + 10 s (its node's sweep Cancels a
Cancelling run whose process ended without saying so only once it has been Cancelling for the orphan grace).
Recovery time: from the injection until the fault is healed (processes back, every node healthy with a fresh
heartbeat, the API and the store answering) and (a)-(d) hold with no booking ownerless.

Usage: python benchmarks/faults.py [--backend sqlite|redis|postgres|all] [--faults N | --minutes M] [--seed S]
       [--workers W] [--json] [--write BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import servers  # noqa: E402
import test_multihost as multihost  # noqa: E402
from builders import gpu  # noqa: E402
from lab import TERMINAL, RetryingClient, create_run  # noqa: E402
from report import markdown_table, print_rows, provenance, require_positive, write_section  # noqa: E402

from mn_prefect.local_lab import BIN, descendants, healthy, stop_processes  # noqa: E402

POOL = "mn-faults"
FLOWS = ROOT / "tests" / "flows"
AGENT_PROBE = str(FLOWS / "agent_probe.py")
KINDS = ("worker", "flowrun", "store", "prefect", "cut_short", "cut_long", "failover")
BACKEND_KINDS = {"sqlite": ("worker", "flowrun", "prefect", "cut_short", "cut_long"),
                 "redis": KINDS, "postgres": ("worker", "flowrun", "store", "prefect", "cut_short", "cut_long")}
REDIS_PASSWORD = "faults-redis-secret"


class NetRedis(servers.RedisServer):
    """A redis-server (or Sentinel) listening on loopback and on the services' address, replicating and monitored
    through that address, so workers in their namespaces reach whichever is master."""

    def __init__(self, address: str, *args, **kwargs):
        self.address = address
        super().__init__(*args, **kwargs)

    def start(self) -> None:
        text = self.config.read_text()
        text = text.replace("bind 127.0.0.1\n", f"bind 127.0.0.1 {self.address}\n")
        text = text.replace("replicaof 127.0.0.1 ", f"replicaof {self.address} ")
        text = text.replace("sentinel monitor mnmaster 127.0.0.1 ", f"sentinel monitor mnmaster {self.address} ")
        self.config.write_text(text)
        super().start()

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=None if self.sentinel else self.password,
                           socket_timeout=1)


def fleet(n: int, scratch: Path) -> list[dict]:
    """W nodes: every other one has GPUs (two, then one), the rest are CPU nodes; each its own port range."""
    nodes = []
    for i in range(n):
        node = {"name": f"n{i + 1}", "cpu_cores": 8, "memory_mb": 32768, "host_paths": [str(scratch)],
                "dynamic_port_range": [21000 + 1000 * i, 21999 + 1000 * i]}
        if i % 2 == 0:
            count = 2 if i % 4 == 0 else 1
            node["devices"] = [gpu(f"GPU-{i + 1}{chr(97 + k)}", k, 16384) for k in range(count)]
        nodes.append(node)
    return nodes


class FaultLab:
    """The processes of one campaign (see the module's docstring)."""

    def __init__(self, home: Path, backend: str, workers: int, *, timeout: float, grace: float):
        self.home, self.backend = home, backend
        self.liveness = {"MN_HEARTBEAT_SECONDS": "1", "MN_HEARTBEAT_TIMEOUT_SECONDS": f"{timeout:g}",
                         "MN_DISCONNECT_GRACE_SECONDS": f"{grace:g}"}
        os.environ.update(self.liveness)  # the reconcile passes this process runs judge silence the same way
        self.nodes = fleet(workers, home / "scratch")
        (home / "scratch").mkdir(parents=True, exist_ok=True)
        self.out = home / "out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.hosts = [n["name"] for n in self.nodes]
        self.workers: dict[str, subprocess.Popen] = {}
        self.redis: list[NetRedis] = []
        self.sentinels: list[NetRedis] = []
        self.store_pg = None
        self.server_proc = None
        multihost.HOSTS = tuple(self.hosts)  # the namespaces Network.create wires: one per node
        self.net = multihost.Network.create()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    # -- start ------------------------------------------------------------------------------------------------
    def _start(self) -> None:
        address = self.net.service_address
        self.pg = multihost.SharedPostgres(address)  # the Prefect server's database
        self.pg.create_database("prefect")
        if self.backend == "sqlite":
            self.store_url = f"sqlite:///{self.home / 'state.db'}"
        elif self.backend == "redis":
            master = NetRedis(address, self.home / "redis-a", password=REDIS_PASSWORD, appendonly=True)
            replica = NetRedis(address, self.home / "redis-b", password=REDIS_PASSWORD, appendonly=True,
                               replica_of=master.port)
            self.redis = [master, replica]
            self.sentinels = [NetRedis(address, self.home / f"sentinel-{i}", password=REDIS_PASSWORD,
                                       sentinel_of=(master.port, "mnmaster")) for i in range(3)]
            servers.wait_for(lambda: all(s.client().execute_command("SENTINEL", "replicas", "mnmaster")
                                         for s in self.sentinels), timeout=30, what="sentinels to see the replica")
            hosts = ",".join(f"{address}:{s.port}" for s in self.sentinels)
            self.store_url = f"redis+sentinel://:{REDIS_PASSWORD}@{hosts}/mnmaster/0?retry_seconds=30&socket_timeout=1"
        else:
            self.store_pg = multihost.SharedPostgres(address)
            self.store_pg.create_database("mnstore")
            self.store_url = self.store_pg.url_at("mnstore")
        self.port = servers.free_port()
        self.api_url = f"http://{address}:{self.port}/api"
        self.env = multihost.ops_env(self.home, self.api_url, self.store_url, **self.liveness)
        os.environ.update({"PREFECT_API_URL": self.api_url, "MN_STORE_URL": self.store_url,
                           "PREFECT_HOME": str(self.home / "ops"), "MN_PREFECT_HOME": str(self.home / "ops" / "mn")})
        self.start_server()
        self.http = RetryingClient(base_url=self.api_url, timeout=30)  # the workload's: it waits out a fault
        self.quick = httpx.Client(base_url=self.api_url, timeout=5)  # the checks': a down API is "not healed yet"
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", POOL, "--type", "mn"], env=self.env, check=True,
                       capture_output=True, timeout=120)
        for host in self.hosts:
            self.workers[host] = self.start_worker(host)
        from mn_prefect.store import open_store

        self.store = open_store(self.store_url)
        servers.wait_for(lambda: {n.record.name for n in self.store.list_nodes()} >= set(self.hosts), timeout=180,
                         interval=0.5, what="every worker registered")

    def start_server(self) -> None:
        """``prefect server start`` on the services' address, its database in PostgreSQL (as test_multihost's)."""
        env = {**self.env, "PREFECT_HOME": str(self.home / "server"),
               "PREFECT_API_DATABASE_CONNECTION_URL": self.pg.url_at("prefect", driver="postgresql+asyncpg")}
        log = open(self.home / "server.log", "a")
        self.server_proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host",
                                             self.net.service_address, "--port", str(self.port)], env=env,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 240
        while not healthy(self.api_url):
            if self.server_proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Prefect server did not start; see {self.home / 'server.log'}")
            time.sleep(0.3)

    def start_worker(self, host: str) -> subprocess.Popen:
        """One worker in ``host``'s namespace, with its own home, inventory file and log (as test_multihost's)."""
        home = self.home / host
        home.mkdir(exist_ok=True)
        node = next(n for n in self.nodes if n["name"] == host)
        inventory = home / "node.json"
        inventory.write_text(json.dumps(node))
        env = {**self.env, "PREFECT_HOME": str(home / "prefect"), "MN_PREFECT_HOME": str(home / "mn"),
               "MN_INVENTORY_FILE": str(inventory), "PREFECT_WORKER_QUERY_SECONDS": "1",
               "PREFECT_WORKER_PREFETCH_SECONDS": "0"}
        command = self.net.command(host, [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "mn",
                                          "--name", f"mn-{host}"])
        log = open(home / "worker.log", "a")
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return proc

    # -- faults -----------------------------------------------------------------------------------------------
    def link(self, host: str, up: bool) -> None:
        tag = self.net.lan[2:-3]
        multihost.ip("link", "set", f"mn{tag}{host}i", "up" if up else "down", netns=self.net.namespaces[host])

    def kill_server(self) -> None:
        try:
            os.killpg(self.server_proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.server_proc.wait(10)

    def redis_master(self) -> NetRedis:
        for sentinel in self.sentinels:
            try:
                _, port = sentinel.client().execute_command("SENTINEL", "get-master-addr-by-name", "mnmaster")
                return next(r for r in self.redis if r.port == int(port))
            except Exception:
                continue
        raise RuntimeError("no sentinel names a master")

    def redis_healthy(self) -> bool:
        """One master that every sentinel names, and the other server replicating from it with its link up."""
        master = self.redis_master()
        if master.client().info("replication").get("role") != "master":
            return False
        replica = next(r for r in self.redis if r is not master)
        info = replica.client().info("replication")
        return info.get("role") == "slave" and info.get("master_link_status") == "up" and \
            int(info.get("master_port", 0)) == master.port

    def flow_run_processes(self) -> list[tuple[str, int, str]]:
        """(host, pid, flow run id) of each flow-run process a worker started (PREFECT__FLOW_RUN_ID in its env)."""
        found = []
        for host, worker in self.workers.items():
            if worker.poll() is not None:
                continue
            for pid in descendants(worker.pid):
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError):
                    continue
                run = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"PREFECT__FLOW_RUN_ID=")]
                if run and parent == worker.pid:
                    found.append((host, pid, run[0]))
        return found

    def stop(self) -> None:
        stop_processes([w for w in self.workers.values()], timeout=5)
        if self.server_proc is not None:
            self.kill_server()
        if hasattr(self, "store"):
            try:
                self.store.close()
            except Exception:
                pass
        for server in [*self.sentinels, *self.redis]:
            server.kill()
        for pg in (getattr(self, "pg", None), self.store_pg):
            if pg is not None:
                pg.cleanup()
        self.net.remove()


class Workload:
    """Keeps work in flight in a thread of its own: probe runs, blueprint jobs, a system job, reservations."""

    def __init__(self, lab: FaultLab, rng: random.Random, *, hold: tuple[float, float]):
        self.lab, self.rng, self.hold = lab, rng, hold
        self.runs: dict[str, dict] = {}  # flow run id -> {"kind", "created"}
        self.jobs: dict[str, str] = {}  # blueprint job id -> coordinator run id
        self.reservations: dict[str, dict] = {}  # id -> {"expires_at", "placements": [(node, cpu, gpus)]}
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.deployments = {
            "cpu": lab_deploy(lab, {"resources": {"cpu": 1, "memory_mb": 256}, "recovery_mode": "cluster_recover"}),
            "gpu": lab_deploy(lab, {"resources": {"cpu": 1, "gpu": 1}, "recovery_mode": "cluster_recover"}),
            "port": lab_deploy(lab, {"resources": {"cpu": 0.5, "ports": [{"label": "api"}]},
                                     "recovery_mode": "cluster_recover"}),
            "system": lab_deploy(lab, {"job_type": "system", "resources": {"cpu": 0.5, "memory_mb": 128}}),
            "inside": lab_deploy(lab, {"resources": {"cpu": 0.5, "memory_mb": 128}}),
        }
        self.bundle, self.bundle_deployment = deploy_lab_bundle(lab)
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(60)

    def in_flight(self, states: dict[str, dict]) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for run_id, info in list(self.runs.items()):
            state = states.get(run_id)
            if state is None or state["type"] not in TERMINAL:
                counts[info["kind"]] += 1
        return counts

    def _loop(self) -> None:
        wanted = {"cpu": 3, "gpu": 1, "port": 1, "system": 1, "blueprint": 1, "bundle": 1, "inside": 1}
        while not self.stopping.is_set():
            try:
                states = run_states(self.lab, list(self.runs))
                counts = self.in_flight(states)
                for kind, want in wanted.items():
                    if counts.get(kind, 0) < want and not self.stopping.is_set():
                        self.create(kind)
                live = [r for r, info in self.reservations.items() if not info.get("ended")
                        and info["expires_at"] > time.time()]
                if len(live) < 2 and not self.stopping.is_set():
                    self.reserve()
            except Exception as error:  # the API or the store is down (a fault): try again soon
                self.errors.append(f"{type(error).__name__}: {error}")
            self.stopping.wait(1.0)

    def create(self, kind: str) -> None:
        seconds = round(self.rng.uniform(*self.hold), 1)
        if kind == "blueprint":
            job_id, run_id = self.start_blueprint(seconds)
            with self.lock:
                self.jobs[job_id] = run_id
        elif kind == "bundle":
            run_id = self.start_bundle()
        elif kind == "inside":
            run_id = self.start_inside(seconds)
            if run_id is None:
                return
        else:
            run_id = create_run(self.lab.http, self.lab_deployment(kind), self.lab.out, seconds=seconds)
        with self.lock:
            self.runs[run_id] = {"kind": kind, "created": time.time()}

    def lab_deployment(self, kind: str) -> str:
        return self.deployments[kind]

    def start_blueprint(self, seconds: float) -> tuple[str, str]:
        from prefect.client.orchestration import get_client

        from mn_prefect.jobs.deploy import compile_blueprint, start_job

        def agent(name: str) -> dict:
            return {"node_id": name, "config": {"command": [sys.executable, AGENT_PROBE, str(self.lab.out),
                                                            "--sleep", str(seconds)]},
                    "resources": {"cpu_cores": 0.5, "memory_mb": 64}}

        raw = {"job_name": "faults", "policies": {"recovery_mode": "cluster_recover"},
               "nodes": [agent("left"), agent("right")]}
        with api(self.lab), get_client(sync_client=True) as client:
            job_id, run = start_job(client, compile_blueprint(raw), POOL)
        return job_id, str(run.id)

    def start_bundle(self) -> str:
        from prefect.client.orchestration import get_client

        from mn_prefect.bundles.deploy import start_bundle

        with api(self.lab), get_client(sync_client=True) as client:
            run, _ = start_bundle(client, self.bundle, self.bundle_deployment)
        return str(run.id)

    def start_inside(self, seconds: float) -> str | None:
        """A run placed inside one of the live reservations (None when none has 10 s left)."""
        with self.lock:
            live = [rid for rid, info in self.reservations.items()
                    if not info.get("ended") and info["expires_at"] > time.time() + 10]
        if not live:
            return None
        response = self.lab.http.post(f"/deployments/{self.deployments['inside']}/create_flow_run", json={
            "parameters": {"out_dir": str(self.lab.out), "seconds": min(seconds, 3.0)},
            "job_variables": {"reservation": self.rng.choice(live)}, "idempotency_key": uuid.uuid4().hex})
        response.raise_for_status()
        return response.json()["id"]

    def reserve(self) -> None:
        from mn_prefect.model.resources import resource_request
        from mn_prefect.placement import reservations

        resources = {"cpu_cores": 1, "memory_mb": 512}
        seconds = self.rng.uniform(15, 40)
        reserved = reservations.reserve(self.lab.store, resource_request(resources), resources, seconds,
                                        group=POOL, name="faults")
        if reserved.record is None:
            return
        rid = reserved.record.job_id
        placements = self.lab.store.active_placements(job_id=rid)
        with self.lock:
            self.reservations[rid] = {"expires_at": reserved.record.expires_at, "created": time.time(),
                                      "held": sorted(holding(p) for p in placements)}


def holding(p) -> tuple:
    return (p.node, p.resources.cpu_cores, p.resources.memory_mb, tuple(sorted(d.id for d in p.allocation.devices)))


def api(lab: FaultLab):
    """Prefect's client settings pointing at the lab's server (per thread: settings live in a context)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings({PREFECT_API_URL: lab.api_url})


def lab_deploy(lab: FaultLab, job_variables: dict) -> str:
    import contextlib

    from prefect.flows import Flow

    with api(lab), contextlib.redirect_stdout(sys.stderr):  # deploy prints its table: keep --json clean
        flow = Flow.from_source(source=str(FLOWS), entrypoint="probe.py:probe")
        return str(flow.deploy(name=f"d-{uuid.uuid4().hex[:8]}", work_pool_name=POOL, job_variables=job_variables,
                               print_next_steps=False))


def deploy_lab_bundle(lab: FaultLab):
    """A two-step MirrorNeuron bundle (a step that works a few seconds, then one that answers at once) deployed on
    the pool: its runs place each step attempt as a booking of its own."""
    import contextlib

    from bundle_builders import step, write_bundle
    from prefect.client.orchestration import get_client

    from mn_prefect.bundles.bundle import load_bundle
    from mn_prefect.bundles.deploy import deploy_bundle

    folder = write_bundle(lab.home / "bundles", "faults-bundle", [step("work", mode="sleep:4"), step("answer")],
                          [("work", "answer")], sink_from="answer")
    bundle = load_bundle(folder)
    with api(lab), get_client(sync_client=True) as client, contextlib.redirect_stdout(sys.stderr):
        deployment_id, _ = deploy_bundle(client, bundle, POOL, runs_root=str(lab.home / "bundle-runs"))
    return bundle, deployment_id


def run_states(lab: FaultLab, ids: list[str], http: httpx.Client | None = None) -> dict[str, dict]:
    """The current state (type, message, timestamp, scheduled time) of each run of ``ids`` and its copies, plus every
    other run that is not terminal (system copies, blueprint agents), with tags, by id."""
    out: dict[str, dict] = {}
    http = http or lab.http
    for i in range(0, len(ids), 200):
        chunk = ids[i:i + 200]
        response = http.post("/flow_runs/filter", json={"flow_runs": {"id": {"any_": chunk}}, "limit": 200})
        response.raise_for_status()
        for run in response.json():
            out[run["id"]] = _state(run)
    offset = 0
    while True:
        response = http.post("/flow_runs/filter", json={
            "flow_runs": {"state": {"type": {"not_any_": sorted(TERMINAL)}}}, "limit": 200, "offset": offset})
        response.raise_for_status()
        page = response.json()
        for run in page:
            out[run["id"]] = _state(run)
        if len(page) < 200:
            return out
        offset += 200


def _state(run: dict) -> dict:
    state = run["state"] or {}
    details = state.get("state_details") or {}
    return {"type": state.get("type"), "name": state.get("name"), "message": state.get("message"),
            "timestamp": state.get("timestamp"), "scheduled": details.get("scheduled_time") or run.get(
                "next_scheduled_start_time"), "tags": run.get("tags") or []}


def _epoch(stamp: str | None) -> float | None:
    from datetime import datetime

    if not stamp:
        return None
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class Checker:
    """The invariants (a)-(d) at one instant; ownerless bookings are remembered from one check to the next."""

    def __init__(self, lab: FaultLab, work: Workload, *, booking_bound: float, stuck: float):
        self.lab, self.work = lab, work
        self.booking_bound, self.stuck = booking_bound, stuck
        self.ownerless: dict[str, float] = {}
        # A host whose link is cut, and when it comes back: a part booked there can only be released by that
        # host's worker, which cannot read the run's end while it is cut off, so its clock starts at the heal.
        self.cut_until: dict[str, float] = {}
        # When the Prefect API last failed to answer: a run's end is read there, by the workers as by this
        # checker, so no booking's clock runs while it is away.
        self.api_away_at = 0.0

    def check(self) -> dict:
        """{"violations": [...], "pending": [...]} -- pending: what is not yet healed (not a violation yet)."""
        from mn_prefect.placement.job_state import load_job, owning_job
        from mn_prefect.placement.reservations import is_reservation
        from mn_prefect.store.audit import audit
        from mn_prefect.store.records import ReservationRecord, WorkflowRecord, get_record

        now = time.time()
        violations, pending = [], []
        store = self.lab.store
        with self.work.lock:  # what existed before the view was read (one made after is judged next time)
            my_runs = dict(self.work.runs)
            my_reservations = {k: dict(v) for k, v in self.work.reservations.items()}
        view = store.consistent_view()
        violations += [f"(a) {p}" for p in audit(view)]
        try:
            states = run_states(self.lab, list(my_runs), self.lab.quick)
        except Exception as error:
            states = None
            self.api_away_at = now
            pending.append(f"Prefect API: {type(error).__name__}")
        copies_of = defaultdict(list)
        if states is not None:
            for state in states.values():
                for tag in state["tags"]:
                    if tag.startswith("mn-copy-of:"):
                        copies_of[tag.split(":", 1)[1]].append(state)
        # (b) every booking has a live owner, or goes within the bound
        seen = set()
        for booking, placements in view["bookings"].items():
            owner = owning_job(booking)
            live = None
            if is_reservation(owner):
                record = get_record(store, owner, ReservationRecord)
                live = record is not None and record.status == "active" and record.expires_at > now - 1
                if record is not None and record.status == "active" and record.expires_at <= now - 1:
                    live = now - record.expires_at < self.booking_bound  # ended by the next placer or reconcile
            elif "#" in booking and states is not None:  # a bundle step attempt: its bundle run's
                workflow = get_record(store, booking.split("#", 1)[0], WorkflowRecord)
                run = states.get(workflow.flow_run_id) if workflow and workflow.flow_run_id else None
                live = workflow is not None and workflow.status in ("pending", "running") and (
                    run is None and workflow.flow_run_id not in my_runs or run is not None
                    and run["type"] not in TERMINAL)
                owner = workflow.flow_run_id if workflow else owner
            elif states is not None:
                job = load_job(store, owner)
                if job is not None:
                    coordinator = states.get(job.flow_run_id) if job.flow_run_id else None
                    live = not job.finished and (coordinator is None and job.flow_run_id not in my_runs
                                                   or coordinator is not None and coordinator["type"] not in TERMINAL)
                else:
                    state = states.get(owner)
                    live = (state is not None and state["type"] not in TERMINAL) or any(
                        c["type"] not in TERMINAL for c in copies_of.get(owner, []))
                    if state is None and owner not in my_runs:
                        live = True  # not ours and not found (the reconcile flow's own bookings, say): no judgement
            if live is None:
                continue
            seen.add(booking)
            if live:
                self.ownerless.pop(booking, None)
                continue
            nodes = sorted({p.node for p in placements})
            since = max([self.ownerless.setdefault(booking, now), self.api_away_at,
                         *(self.cut_until.get(n, 0.0) for n in nodes)])
            owner_state = (states or {}).get(owner, {}).get("type")
            what = f"booking {booking} on {nodes} (owner {owner} {owner_state}) ownerless for {now - since:.0f} s"
            if now - since > self.booking_bound:
                violations.append("(b) " + what)
            elif now - since > 3:  # a run's booking goes just after its end: only a lingering one is waited on
                pending.append(what)
        for booking in list(self.ownerless):
            if booking not in seen and booking not in view["bookings"]:
                self.ownerless.pop(booking)
        # (c) reservations keep what they hold until they end
        for rid, info in my_reservations.items():
            if info.get("ended") or info["expires_at"] <= now + 0.5:
                continue
            record = get_record(store, rid, ReservationRecord)
            held = sorted(holding(p) for p in view["bookings"].get(rid, []))
            if info["expires_at"] <= time.time() + 1:
                continue  # it ends while this check runs
            if record is None or record.status != "active" or held != info["held"]:
                try:
                    history = [(e.kind, e.reason) for e in store.events(job_id=rid, limit=10)]
                except Exception:
                    history = []
                violations.append(f"(c) reservation {rid} (ends in {info['expires_at'] - now:.0f} s) status "
                                  f"{record.status if record else None} ({record.reason if record else ''}); holds "
                                  f"{held}, was given {info['held']}; created {now - info['created']:.1f} s ago; "
                                  f"events {history}")
        # (d) no run stuck Scheduled or Pending past the bound
        if states is not None:
            for run_id, info in my_runs.items():
                state = states.get(run_id)
                if state is None or state["type"] not in ("SCHEDULED", "PENDING"):
                    continue
                since = max(filter(None, [_epoch(state["timestamp"]), _epoch(state["scheduled"]), info["created"]]))
                if now - since > self.stuck:
                    violations.append(f"(d) run {run_id} ({info['kind']}) {state['name']} for {now - since:.0f} s: "
                                      f"{state['message']}")
        return {"violations": violations, "pending": pending}


class Campaign:
    def __init__(self, args, backend: str, home: Path):
        self.args, self.backend = args, backend
        self.rng = random.Random(f"{args.seed}-{backend}")
        self.kinds = BACKEND_KINDS[backend]
        self.lab = FaultLab(home, backend, args.workers, timeout=args.timeout, grace=args.grace)
        try:
            self._set_up(args)
        except BaseException:  # the lab's servers and workers are running: a failed set-up must not leave them
            self.lab.stop()
            raise

    def _set_up(self, args) -> None:
        self.work = Workload(self.lab, self.rng, hold=(3, 12))
        self.booking_bound = args.timeout + args.grace + 10 + 10
        # A Cancelling run whose process ended without saying Cancelled (stopped, its booking released) is Cancelled
        # by its node's sweep once Cancelling for the orphan grace (worker/sweeps.py, crash_lost_running): it
        # settles within that grace + one node sweep + 10 s, which may be longer than the booking bound.
        from mn_prefect.lifecycle.settings import orphan_pending_s
        from mn_prefect.worker.sweeps import NODE_BOOKINGS_SWEEP_SECONDS

        self.cancel_bound = max(self.booking_bound, orphan_pending_s() + NODE_BOOKINGS_SWEEP_SECONDS + 10)
        self.checker = Checker(self.lab, self.work, booking_bound=self.booking_bound, stuck=args.stuck)
        self.results: list[dict] = []
        self.between: dict[str, str] = {}  # violations seen while no fault was open
        self.progress = self.task = None
        self.stop_reconcile = threading.Event()
        self.reconcile_errors = 0
        self.reconciler = threading.Thread(target=self._reconcile_loop, daemon=True)

    def _reconcile_loop(self) -> None:
        from prefect.client.orchestration import get_client

        from mn_prefect.ops.flows import reconcile_once
        from mn_prefect.store import open_store

        store = open_store(self.lab.store_url)
        while not self.stop_reconcile.is_set():
            try:
                with api(self.lab), get_client(sync_client=True) as client:
                    reconcile_once(store, client, owner="faults-campaign")
            except Exception:
                self.reconcile_errors += 1
            self.stop_reconcile.wait(2.0)

    # -- one fault ----------------------------------------------------------------------------------------------
    def inject(self, kind: str) -> tuple[dict, float, callable]:
        """Do the fault; returns (details, when to heal, how to heal)."""
        lab, rng, now = self.lab, self.rng, time.time()
        if kind == "worker":
            host = rng.choice(lab.hosts)
            lab.workers[host].kill()
            lab.workers[host].wait(10)
            return {"host": host}, now + 0.5, lambda: lab.workers.__setitem__(host, lab.start_worker(host))
        if kind == "flowrun":
            procs = lab.flow_run_processes()
            if not procs:
                return {"skipped": "no flow-run process"}, now, lambda: None
            host, pid, run_id = rng.choice(procs)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return {"host": host, "run": run_id}, now, lambda: None
        if kind == "store":
            if self.backend == "redis":
                master = lab.redis_master()
                master.kill(signal.SIGKILL)
                return {"port": master.port}, now + 0.5, master.start
            lab.store_pg.kill()
            return {}, now + 0.5, lab.store_pg.start
        if kind == "prefect":
            lab.kill_server()
            return {}, now + 0.5, lab.start_server
        if kind in ("cut_short", "cut_long"):
            host = rng.choice(lab.hosts)
            lab.link(host, False)
            length = self.args.timeout / 2 if kind == "cut_short" else self.args.timeout + self.args.grace + 3
            self.checker.cut_until[host] = now + length
            return {"host": host, "seconds": length}, now + length, lambda: lab.link(host, True)
        if kind == "failover":
            before = lab.redis_master().port
            lab.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", "mnmaster")
            return {"from_port": before}, now, lambda: None
        raise ValueError(kind)

    def infra(self) -> dict:
        """The state of the processes and services, read once per check (see ``not_healed``)."""
        lab = self.lab
        state = {"exited": [f"worker {h} exited {w.returncode}" for h, w in lab.workers.items() if w.poll() is not None],
                 "api": healthy(lab.api_url), "nodes": None, "other": []}
        try:
            state["nodes"] = [(n.record.name, n.record.status, n.last_heartbeat or 0) for n in lab.store.list_nodes()]
        except Exception as error:
            state["other"].append(f"store: {type(error).__name__}")
        if self.backend == "redis":
            try:
                if not lab.redis_healthy():
                    state["other"].append("redis replication not settled")
            except Exception as error:
                state["other"].append(f"redis: {type(error).__name__}: {str(error)[:80]}")
        return state

    @staticmethod
    def not_healed(state: dict, since: float) -> list[str]:
        """What is not back since ``since``: processes, node health with a heartbeat after it, the API, the store."""
        problems = list(state["exited"]) + list(state["other"])
        if not state["api"]:
            problems.append("Prefect API not healthy")
        for name, status, beat in state["nodes"] or []:
            if status != "healthy" or beat < since:
                problems.append(f"node {name} {status}")
        return problems

    def busy(self, kind: str, open_faults: list[dict]) -> set:
        """The targets of faults not yet recovered: a new fault never hits one of them."""
        taken = set()
        for f in open_faults:
            if f["kind"] in ("store", "failover"):
                taken.add("store")
            elif f["kind"] == "prefect":
                taken.add("prefect")
            elif "host" in f["details"] and f["kind"] != "flowrun":
                taken.add(f["details"]["host"])
        return taken

    def inject_free(self, kind: str, open_faults: list[dict]) -> dict | None:
        taken = self.busy(kind, open_faults)
        if kind in ("store", "failover") and "store" in taken or kind == "prefect" and "prefect" in taken:
            return None
        if kind in ("worker", "cut_short", "cut_long"):
            free = [h for h in self.lab.hosts if h not in taken]
            if not free:
                return None
            saved = self.lab.hosts
            self.lab.hosts = free
            try:
                details, heal_at, heal = self.inject(kind)
            finally:
                self.lab.hosts = saved
        else:
            details, heal_at, heal = self.inject(kind)
        fault = {"kind": kind, "details": details, "at": time.time(), "heal_at": heal_at, "heal": heal,
                 "healed_at": None, "violations": {}, "waited": [], "recovery_s": None}
        # Healed on time by a thread of its own: a check slowed by another fault never delays it.
        threading.Timer(max(0.0, heal_at - time.time()), self._heal, [fault]).start()
        return fault

    @staticmethod
    def _heal(fault: dict) -> None:
        try:
            fault["heal"]()
        except Exception as error:
            fault["violations"]["heal"] = f"campaign error healing: {type(error).__name__}: {error}"
        fault["healed_at"] = time.time()

    def close(self, fault: dict, recovered: float | None) -> None:
        if self.backend == "redis" and fault["kind"] in ("store", "failover"):
            try:
                fault["details"]["master_after"] = self.lab.redis_master().port
            except Exception:
                pass
        result = {"kind": fault["kind"], "details": fault["details"], "at": fault["at"], "recovery_s": recovered,
                  "violations": list(fault["violations"].values()), "last_waited_on": fault["waited"][:5],
                  "overlapped": fault.get("overlapped", 0)}
        self.results.append(result)
        if self.progress is not None:
            recovery = "not recovered" if recovered is None else f"recovered in {recovered:.1f} s"
            self.progress.console.print(
                f"{self.backend} #{len(self.results)} {fault['kind']} {fault['details']}: {recovery}; "
                f"{len(result['violations'])} violations {result['violations'][:3]}"
                + (f"; waited on {fault['waited'][:3]}" if recovered is None or recovered > 30 else ""))
            self.progress.update(self.task, advance=1, description=f"{self.backend}: {fault['kind']} "
                                 f"({sum(len(r['violations']) for r in self.results)} violations)")

    def run(self, progress=None, task=None) -> dict:
        """Inject faults (every ``--every`` s on average, or the next once the last recovered with --every 0) and
        follow each until it recovered or its bound passed."""
        args = self.args
        self.progress, self.task = progress, task
        self.work.start()
        self.reconciler.start()
        servers.wait_for(lambda: self.lab.flow_run_processes(), timeout=120, interval=0.5, what="runs in flight")
        deadline = time.time() + args.minutes * 60 if args.minutes else None
        order = self._order()
        injected = 0
        open_faults: list[dict] = []
        next_at = time.time()
        while True:
            now = time.time()
            more = (deadline is None and injected < args.faults) or (deadline is not None and now < deadline)
            if not more and not open_faults:
                break
            if more and now >= next_at and (args.every > 0 or not open_faults):
                kind = order[injected] if injected < len(order) else self.rng.choice(self.kinds)
                if kind == "flowrun" and not self.lab.flow_run_processes():
                    kind = None if injected < len(order) else self.rng.choice([k for k in self.kinds if k != "flowrun"])
                fault = None
                if kind is not None:
                    try:
                        fault = self.inject_free(kind, open_faults)
                    except Exception as error:
                        self.close({"kind": kind, "details": {"error": f"{type(error).__name__}: {error}"}, "at": now,
                                    "violations": {"x": f"campaign error injecting: {type(error).__name__}: {error}"},
                                    "waited": []}, None)
                        injected += 1
                if fault is not None:
                    for other in open_faults:
                        other["overlapped"] = other.get("overlapped", 0) + 1
                    fault["overlapped"] = len(open_faults)
                    open_faults.append(fault)
                    injected += 1
                    gap = self.rng.uniform(args.every / 2, args.every * 1.5) if args.every > 0 else 0
                    next_at = time.time() + gap
            state = self.infra()
            try:
                check = self.checker.check()
            except Exception as error:
                import traceback

                where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in
                                    reversed(traceback.extract_tb(error.__traceback__)[-3:]))
                check = {"violations": [], "pending": [f"check failed: {type(error).__name__}: {error} ({where})"]}
            if open_faults:
                newest = open_faults[-1]
                known = {k for f in open_faults for k in f["violations"]}
                for v in check["violations"]:
                    if _key(v) not in known:
                        newest["violations"][_key(v)] = v
            elif check["violations"]:
                for v in check["violations"]:
                    self.between.setdefault(_key(v), v)
            for fault in list(open_faults):
                if fault["healed_at"] is None:
                    continue
                waiting = self.not_healed(state, fault["healed_at"]) + check["pending"]
                if not waiting and not check["violations"]:
                    open_faults.remove(fault)
                    self.close(fault, time.time() - fault["at"])
                elif time.time() > fault["healed_at"] + args.bound:
                    for p in self.own(fault, waiting, open_faults):
                        fault["violations"].setdefault(_key(p), f"not recovered within {args.bound:g} s: {p}")
                    open_faults.remove(fault)
                    self.close(fault, None)
                else:
                    fault["waited"] = waiting or check["violations"]
            time.sleep(0.3)
        return self.finish()

    @staticmethod
    def own(fault: dict, waiting: list[str], open_faults: list[dict]) -> list[str]:
        """What still keeps ``fault`` from recovering at its bound that is not another open fault's doing: a
        process, node, API or store that another fault has down is that fault's to recover, and an ownerless
        booking has a bound of its own (invariant (b))."""
        others = [f for f in open_faults if f is not fault]
        hosts = {f["details"]["host"] for f in others if "host" in f["details"] and f["kind"] != "flowrun"}
        kinds = {f["kind"] for f in others}
        mine = []
        for p in waiting:
            words = p.split()
            if p.startswith("booking "):
                continue
            if words[0] in ("worker", "node") and len(words) > 1 and words[1] in hosts:
                continue
            if ("Prefect API" in p or p.startswith("check failed")) and "prefect" in kinds:
                continue
            if p.startswith(("store", "redis")) and kinds & {"store", "failover"}:
                continue
            mine.append(p)
        return mine

    def _order(self) -> list[str]:
        """Every kind once first (in a random order), so a short campaign injects each; then at random."""
        kinds = list(self.kinds)
        self.rng.shuffle(kinds)
        return kinds

    def _settle_s(self, state: dict) -> float:
        """How long after its last change a run not Running may still be settling before (e) judges it."""
        return self.cancel_bound if state["type"] == "CANCELLING" else self.booking_bound

    def finish(self) -> dict:
        """Stop making work, let what is in flight end, then (e): every run terminal or legitimately running."""
        self.work.stop()
        deadline = time.time() + self.args.drain
        lost = []
        final_violations = []
        while True:
            try:
                states = run_states(self.lab, list(self.work.runs))
                open_runs = {r: states.get(r) for r in self.work.runs
                             if states.get(r) is None or states[r]["type"] not in TERMINAL}
            except Exception:
                open_runs = {r: None for r in self.work.runs}
            now = time.time()
            # A run whose state just changed is settling (a Cancelling run's worker stops it and releases it):
            # it gets the booking bound from its change, past the drain, before (e) judges it. So does a run whose
            # flow-run process is alive (on a loaded machine a process may take tens of seconds to begin its flow).
            alive = {run for _, _, run in self.lab.flow_run_processes()}
            settling = [r for r, state in open_runs.items() if state is not None and state["type"] not in
                        ("RUNNING", "PAUSED") and ((_epoch(state["timestamp"]) or 0) + self._settle_s(state) > now
                                                   or r in alive)]
            if not open_runs or now > deadline and (not settling or now > deadline + self.cancel_bound):
                break
            time.sleep(2)
        for run_id, state in open_runs.items():  # judged on the processes the last pass read, and on each run's
            booked = self.lab.store.active_placements(job_id=run_id)  # booking and then its state read again:
            try:  # a run that ended between the pass and its booking's read is seen released AND ended, never
                state = run_states(self.lab, [run_id]).get(run_id, state)  # "Running, unbooked"
            except Exception:
                pass
            if state is not None and state["type"] in TERMINAL:
                continue
            if state is not None and (state["type"] == "RUNNING" or run_id in alive) and booked:
                continue  # running, or its process still starting: the booking is held for a live process
            if state is not None and state["type"] == "PAUSED" and "paused for review" in (state["message"] or ""):
                continue  # its node was lost and its recovery mode (local_restart) waits for a person: by design
                # (a node only disconnected keeps the booking: its process may still run there)
            lost.append(f"(e) run {run_id} ({self.work.runs[run_id]['kind']}) ended the campaign "
                        f"{state['name'] if state else 'unknown'}: {state['message'] if state else ''}; booked {booked}")
        try:
            final = self.checker.check()
            final_violations = final["violations"]
        except Exception as error:
            final_violations = [f"final check failed: {error}"]
        self.stop_reconcile.set()
        self.reconciler.join(30)
        finals = Counter_([s["type"] for s in run_states(self.lab, list(self.work.runs)).values()
                           if s is not None]) if self.work.runs else {}
        final_violations += [f"between faults: {v}" for v in self.between.values()]
        return {"lost": lost, "final_violations": final_violations, "runs": len(self.work.runs),
                "reservations": len(self.work.reservations), "blueprint_jobs": len(self.work.jobs),
                "final_states": finals, "workload_errors": len(self.work.errors),
                "reconcile_errors": self.reconcile_errors}


def Counter_(items) -> dict:
    out: dict = defaultdict(int)
    for item in items:
        out[item] += 1
    return dict(out)


def _key(text: str) -> str:
    """A violation's identity across checks (its measured seconds change)."""
    import re

    return re.sub(r"\d+(\.\d+)? s\b", "", text)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))], 1)


def summarize(backend: str, results: list[dict], final: dict) -> list[dict]:
    rows = []
    for kind in KINDS:
        mine = [r for r in results if r["kind"] == kind and "skipped" not in r["details"]]
        if not mine and kind not in BACKEND_KINDS[backend]:
            continue
        times = [r["recovery_s"] for r in mine if r["recovery_s"] is not None]
        rows.append({"backend": backend, "fault": kind, "injected": len(mine),
                     "violations": sum(len(r["violations"]) for r in mine),
                     "recovered": len(times), "p50_s": percentile(times, 50), "p99_s": percentile(times, 99),
                     "max_s": round(max(times), 1) if times else None})
    rows.append({"backend": backend, "fault": "end of campaign (e)", "injected": 0,
                 "violations": len(final["lost"]) + len(final["final_violations"]), "recovered": 0,
                 "p50_s": None, "p99_s": None, "max_s": None})
    return rows


def run_campaign(args, backend: str, progress=None) -> dict:
    home = Path(tempfile.mkdtemp(prefix=f"mn-faults-{backend}-"))
    task = progress.add_task(f"{backend}: starting", total=args.faults if not args.minutes else None) \
        if progress is not None else None
    campaign = Campaign(args, backend, home)
    try:
        final = campaign.run(progress, task)
    finally:
        campaign.stop_reconcile.set()
        campaign.work.stopping.set()
        campaign.lab.stop()
    return {"backend": backend, "home": str(home), "rows": summarize(backend, campaign.results, final),
            "faults": campaign.results, "final": final}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="sqlite", choices=["sqlite", "redis", "postgres", "all"])
    p.add_argument("--faults", type=int, default=20, help="faults per backend (unless --minutes)")
    p.add_argument("--minutes", type=float, default=0, help="inject for this long per backend instead")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--timeout", type=float, default=5.0, help="heartbeat timeout, s")
    p.add_argument("--grace", type=float, default=3.0, help="disconnect grace, s")
    p.add_argument("--bound", type=float, default=60.0, help="after a fault is healed, how long to recover, s")
    p.add_argument("--stuck", type=float, default=75.0, help="(d): longest a run may stay Scheduled/Pending, s")
    p.add_argument("--drain", type=float, default=120.0, help="at the end, how long runs get to end, s")
    p.add_argument("--every", type=float, default=0,
                   help="a fault every this many s on average while others recover (0: the next once the last "
                        "recovered)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write", help="write the 'Fault campaign' section of this file (BENCHMARKS.md)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    from rich.console import Console
    from rich.progress import Progress

    p = parser()
    args = p.parse_args(argv)
    require_positive(p, args, "workers", "timeout", "bound", "stuck")
    if args.workers < 2:
        p.error("--workers must be at least 2")
    backends = ["sqlite", "redis", "postgres"] if args.backend == "all" else [args.backend]
    campaigns = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        for backend in backends:
            campaigns.append(run_campaign(args, backend, progress))
    rows = [row for c in campaigns for row in c["rows"]]
    if args.json:
        print(json.dumps({"rows": rows, "campaigns": campaigns}, indent=2, default=str))
    else:
        print_rows("fault campaign", rows)
        for c in campaigns:
            for r in c["faults"]:
                for v in r["violations"]:
                    print(f"{c['backend']} {r['kind']} {r['details']}: {v}")
            for v in c["final"]["lost"] + c["final"]["final_violations"]:
                print(f"{c['backend']} end: {v}")
    if args.write:
        write(args, rows, campaigns)
    return campaigns


def write(args, rows: list[dict], campaigns: list[dict]) -> None:
    table = markdown_table(["backend", "fault", "injected", "violations", "recovered", "recovery p50 s",
                            "recovery p99 s", "max s"],
                           [[r["backend"], r["fault"], r["injected"], r["violations"], r["recovered"],
                             "" if r["p50_s"] is None else r["p50_s"], "" if r["p99_s"] is None else r["p99_s"],
                             "" if r["max_s"] is None else r["max_s"]] for r in rows])
    runs = ", ".join(f"{c['backend']}: {c['final']['runs']} runs, {c['final']['blueprint_jobs']} blueprint jobs, "
                     f"{c['final']['reservations']} reservations" for c in campaigns)
    body = "\n".join([
        "## Fault campaign" + ("" if args.backend == "all" else f" ({args.backend})"), "",
        provenance("faults.py", f"{os.cpu_count()} cores", f"{args.workers} workers in network namespaces",
                   "Prefect server on PostgreSQL"), "",
        *table, "",
        f"Heartbeat every 1 s, timeout {args.timeout:g} s, grace {args.grace:g} s; reconcile pass every 2 s. "
        f"Recovery: from the injection until the fault is healed (processes back, nodes healthy with a fresh "
        f"heartbeat, API and store answering) and invariants (a)-(d) hold with no booking ownerless; a fault not "
        f"recovered {args.bound:g} s after it was healed counts what was still wrong as violations. Bounds: an "
        f"ownerless booking must go within timeout + grace + 20 s; no run Scheduled/Pending over {args.stuck:g} s. "
        f"Work in flight: {runs}. See benchmarks/faults.py for the faults and invariants.",
    ])
    marker = "fault-campaign" if args.backend == "all" else f"fault-campaign-{args.backend}"
    write_section(args.write, marker, body)


if __name__ == "__main__":
    main()
