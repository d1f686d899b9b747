"""Several machines, on this one: the deployment of deployments/multihost run for real.

A Prefect server whose database is a real PostgreSQL, the cluster store on the same PostgreSQL server (its own
database), and three ``mn`` workers, each with its own mock inventory, home and address. Where this process may
create network namespaces (root on Linux), each worker lives in a namespace of its own and reaches the server and
the store only through a virtual link, as a separate machine would; otherwise each worker stands for a machine
on its own loopback address (127.0.0.2-4, in its node record) and shares this machine's network.

A gang job (two agents too big to share a node, booked together in one commit) spans two of the hosts; a plain run
sits on one of them. That host is killed (SIGKILL: its worker and everything it started); the heartbeat timeout and
the reconciler (the real ``mn-prefect node reconcile``, run from this process as an operator would) mark it
offline and re-place its runs on the survivors, where they run again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import servers
from lab import RetryingClient, create_run

from mn_prefect.local_lab import BIN, healthy, kill_tree, stop_process, stop_processes
from mn_prefect.placement.job_state import load_job
from mn_prefect.store import open_store

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab

FLOWS = Path(__file__).parent / "flows"
AGENT_PROBE = str(FLOWS / "agent_probe.py")
POOL = "mn-fleet"
HOSTS = ("h1", "h2", "h3")
LOST = "h1"
# Each worker beats every second; a node is disconnected after 6 s of silence and offline 4 s later. Generous
# next to the beat, so that a survivor on a loaded machine is never taken for lost.
# The API asks for basic auth, as deployments/multihost/server.env sets it: every host and the CLI send it.
API_USER, API_PASSWORD = "admin", "fleet-api-secret"
LIVENESS = {"MN_HEARTBEAT_SECONDS": "1", "MN_HEARTBEAT_TIMEOUT_SECONDS": "6", "MN_DISCONNECT_GRACE_SECONDS": "4"}


def ops_env(home: Path, api_url: str, store_url: str, **extra: str) -> dict[str, str]:
    """The environment of the operator's processes (server, workers, CLI): this lab's API and store, homes under
    ``home / "ops"``, analytics and the UI off."""
    return {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false", "PREFECT_HOME": str(home / "ops"),
            "MN_PREFECT_HOME": str(home / "ops" / "mn"), "MN_STORE_URL": store_url, **extra}


def netns_available() -> bool:
    """Whether this process may create network namespaces (``ip netns add`` needs root and a Linux kernel)."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    probe = f"mnprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return False
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True


def ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(command)}: {result.stderr}"


def free_subnet(start: int) -> str:
    """A /24 of 198.18.0.0/15 that no interface of this machine has an address in (another run's, say), searched
    from ``start``: the first three octets."""
    taken = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for n in range(start, start + 512):
        subnet = f"198.{18 + (n // 256) % 2}.{n % 256}"
        if f" {subnet}." not in taken:
            return subnet
    raise AssertionError("no free /24 in 198.18.0.0/15 for the test network")


@dataclass
class Network:
    """Where the shared services listen and where each host sits.

    With namespaces: a namespace ``lan`` holds a bridge (no address: nothing on it routes anywhere), each host
    namespace has one end of a veth pair on it, and so does this machine, whose end carries the services' address.
    The subnet is taken from 198.18.0.0/15 (reserved for network tests, never routed) and chosen per process, so
    two runs at once do not collide. Without namespaces: every address is on loopback."""

    service_address: str
    host_address: dict[str, str]
    namespaces: dict[str, str] = field(default_factory=dict)  # host -> namespace name
    lan: str | None = None

    @classmethod
    def create(cls) -> Network:
        if not netns_available():
            return cls("127.0.0.1", {h: f"127.0.0.{i + 2}" for i, h in enumerate(HOSTS)})
        tag = os.getpid() % 100000
        subnet = free_subnet(tag)
        net = cls(f"{subnet}.1", {h: f"{subnet}.{i + 2}" for i, h in enumerate(HOSTS)},
                  {h: f"mn{tag}{h}" for h in HOSTS}, lan=f"mn{tag}lan")
        try:
            net._wire(tag)
        except BaseException:
            net.remove()
            raise
        return net

    def _wire(self, tag: int) -> None:
        assert self.lan
        ip("netns", "add", self.lan)
        ip("link", "add", "br0", "type", "bridge", netns=self.lan)
        ip("link", "set", "br0", "up", netns=self.lan)
        ends = {"svc": (None, self.service_address), **{h: (self.namespaces[h], self.host_address[h]) for h in HOSTS}}
        for name, (netns, address) in ends.items():
            if netns:
                ip("netns", "add", netns)
                ip("link", "set", "lo", "up", netns=netns)
            outer, inner = f"mn{tag}{name}", f"mn{tag}{name}i"  # 15 characters at most
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            ip("link", "set", outer, "netns", self.lan)
            ip("link", "set", outer, "master", "br0", netns=self.lan)
            ip("link", "set", outer, "up", netns=self.lan)
            if netns:
                ip("link", "set", inner, "netns", netns)
            ip("addr", "add", f"{address}/24", "dev", inner, netns=netns)
            ip("link", "set", inner, "up", netns=netns)

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` as run on ``host``: inside its namespace when there is one."""
        netns = self.namespaces.get(host)
        return ["ip", "netns", "exec", netns, *argv] if netns else argv

    def host_of(self, pid: int) -> str | None:
        """The host whose namespace process ``pid`` lives in (None: this machine's own, or no namespaces)."""
        try:
            inode = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return None
        found = [h for h, n in self.namespaces.items() if os.stat(f"/run/netns/{n}").st_ino == inode]
        return found[0] if found else None

    def remove(self) -> None:
        """Deleting the namespaces deletes the veth pairs with them (this machine's end included)."""
        for netns in [*self.namespaces.values(), self.lan]:
            if netns:
                subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        if self.lan:  # the kernel deletes the pairs a moment later: the next network of this process reuses names
            svc = f"{self.lan[:-3]}svci"  # the services' end, left in this namespace
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and subprocess.run(["ip", "link", "show", svc],
                                                                 capture_output=True).returncode == 0:
                time.sleep(0.1)


class SharedPostgres(servers.PostgresServer):
    """The PostgreSQL server both the Prefect server and the cluster store use, listening on loopback and on the
    services' address, and accepting password logins from the hosts' subnet."""

    def __init__(self, address: str):
        self.address = address
        super().__init__()

    def start(self) -> None:
        hba = self.data / "pg_hba.conf"
        subnet = self.address.rsplit(".", 1)[0] + ".0/24"
        if subnet not in hba.read_text():
            with hba.open("a") as f:
                f.write(f"host all all {subnet} scram-sha-256\n")
        listen = ",".join(dict.fromkeys(["127.0.0.1", self.address]))
        opts = (f"-c listen_addresses={listen} -c port={self.port} -k {self.base} -c max_connections=300 "
                "-c shared_buffers=64MB")
        self._run([servers.pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.base / "log"), "-o", opts, "-w",
                   "-t", "600", "start"])

    def url_at(self, database: str, *, driver: str = "postgresql") -> str:
        return f"{driver}://{self.user}:{self.password}@{self.address}:{self.port}/{database}"


class Fleet:
    """The deployment of deployments/multihost: server, store, three hosts each running one ``mn`` worker."""

    def __init__(self, home: Path):
        self.home = home
        self.out = home / "out"
        self.out.mkdir(parents=True)
        self.net = Network.create()
        self.workers: dict[str, subprocess.Popen] = {}
        self.server_proc: subprocess.Popen | None = None
        try:
            self.pg = SharedPostgres(self.net.service_address)
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self.pg.create_database("prefect")
        self.pg.create_database("mnstore")
        self.store_url = self.pg.url_at("mnstore")
        self.port = servers.free_port()
        self.api_url = f"http://{self.net.service_address}:{self.port}/api"
        self.env = ops_env(self.home, self.api_url, self.store_url,
                           PREFECT_API_AUTH_STRING=f"{API_USER}:{API_PASSWORD}", **LIVENESS)
        self.start_server()
        self.http = RetryingClient(base_url=self.api_url, timeout=60, auth=(API_USER, API_PASSWORD))
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", POOL, "--type", "mn"], env=self.env, check=True,
                       capture_output=True, timeout=120)
        for host in HOSTS:
            self.workers[host] = self.start_worker(host)
        store = open_store(self.store_url)
        servers.wait_for(lambda: {n.record.name for n in store.list_nodes()} >= set(HOSTS), timeout=180,
                         interval=0.5, what="three workers registered")
        self.store = store

    def inventory(self, host: str) -> dict:
        """A host's own node record: 8 cores (two 5-core agents never share one), its address as a label."""
        return {"name": host, "cpu_cores": 8, "memory_mb": 16384, "labels": {"address": self.net.host_address[host]}}

    def start_worker(self, host: str) -> subprocess.Popen:
        """One ``prefect worker start --type mn`` on ``host``: its own home, inventory file and log, reaching the
        Prefect server and the store at the services' address."""
        home = self.home / host
        home.mkdir(exist_ok=True)
        inventory = home / "node.json"
        inventory.write_text(json.dumps(self.inventory(host)))
        env = {**self.env, "PREFECT_HOME": str(home / "prefect"), "MN_PREFECT_HOME": str(home / "mn"),
               "MN_INVENTORY_FILE": str(inventory), "PREFECT_WORKER_QUERY_SECONDS": "1",
               "PREFECT_WORKER_PREFETCH_SECONDS": "0"}
        command = self.net.command(host, [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "mn",
                                          "--name", f"mn-{host}"])
        log = open(home / "worker.log", "a")
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_server(self) -> None:
        """``prefect server start`` on the services' address, its database in PostgreSQL (migrated at first start)."""
        env = {**self.env, "PREFECT_HOME": str(self.home / "server"),
               "PREFECT_API_DATABASE_CONNECTION_URL": self.pg.url_at("prefect", driver="postgresql+asyncpg"),
               "PREFECT_SERVER_API_AUTH_STRING": f"{API_USER}:{API_PASSWORD}"}
        self.server_log = open(self.home / "server.log", "a")
        self.server_proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host",
                                             self.net.service_address, "--port", str(self.port)], env=env,
                                            stdout=self.server_log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 240  # migrations on a fresh PostgreSQL database take a while
        while not healthy(self.api_url):
            assert self.server_proc.poll() is None, f"the Prefect server exited; see {self.home / 'server.log'}"
            assert time.monotonic() < deadline, f"the Prefect server never answered; see {self.home / 'server.log'}"
            time.sleep(0.5)

    def stop_server(self) -> None:
        stop_process(self.server_proc)
        self.server_log.close()

    def sweep(self) -> list[dict]:
        """One node-state sweep (``mn-prefect node states``), as the reconcile flow starts with: the changes."""
        result = subprocess.run([str(BIN / "mn-prefect"), "node", "states", "--json"], env=self.env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        return json.loads(result.stdout)

    def kill_host(self, host: str) -> None:
        """The machine is gone: its worker and every process it started, at once."""
        kill_tree(self.workers[host])

    def reconcile(self) -> dict:
        """One pass of the real reconciler, from this machine (the operator's), as the scheduled flow would run."""
        result = subprocess.run([str(BIN / "mn-prefect"), "node", "reconcile", "--json", "--store-url",
                                 self.store_url], env=self.env, capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr
        return json.loads(result.stdout)

    def deploy_probe(self, job_variables: dict) -> str:
        from prefect.flows import Flow
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api_url, PREFECT_API_AUTH_STRING: f"{API_USER}:{API_PASSWORD}"}):
            flow = Flow.from_source(source=str(FLOWS), entrypoint="probe.py:probe")
            return str(flow.deploy(name=f"d-{uuid.uuid4().hex[:8]}", work_pool_name=POOL,
                                   job_variables=job_variables, print_next_steps=False))

    def run(self, deployment_id: str, **parameters) -> str:
        return create_run(self.http, deployment_id, self.out, **parameters)

    def start_job(self, raw: dict, coordinator: dict) -> tuple[str, str]:
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        from mn_prefect.jobs.deploy import compile_blueprint, start_job

        with temporary_settings({PREFECT_API_URL: self.api_url, PREFECT_API_AUTH_STRING: f"{API_USER}:{API_PASSWORD}"}):
            with get_client(sync_client=True) as client:
                job_id, run = start_job(client, compile_blueprint(raw), POOL, job_variables=coordinator)
        return job_id, str(run.id)

    def state(self, run_id: str) -> str:
        return self.http.get(f"/flow_runs/{run_id}").json()["state"]["type"]

    def stop(self) -> None:
        stop_processes(list(self.workers.values()), timeout=15)  # at once, a second SIGINT for an idle one
        if self.server_proc is not None:
            self.stop_server()
        if hasattr(self, "store"):
            self.store.close()
        if hasattr(self, "pg"):
            self.pg.cleanup()
        self.net.remove()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("multihost"))
    yield fleet
    fleet.stop()


def agent(name: str, out: Path, on: str) -> dict:
    """A service agent of 5 cores that records what it was given and runs until cancelled."""
    return {"node_id": name, "config": {"command": [sys.executable, AGENT_PROBE, str(out), "--forever"]},
            "resources": {"cpu_cores": 5, "memory_mb": 256}, "policies": {"scheduler": {"preferred_node": on}}}


def attempts(out: Path, agent_id: str) -> list[dict]:
    found = sorted(out.glob(f"{agent_id}.*.json"), key=lambda p: int(p.stem.rsplit(".", 1)[1]))
    return [json.loads(p.read_text()) for p in found]


def started(out: Path, run_id: str) -> dict | None:
    path = out / f"{run_id}.started"
    return json.loads(path.read_text()) if path.exists() else None


def test_each_worker_registers_its_own_node_from_its_own_host(fleet):
    nodes = {n.record.name: n.record for n in fleet.store.list_nodes()}
    assert set(nodes) == set(HOSTS)
    for host in HOSTS:
        assert nodes[host].status == "healthy"
        assert nodes[host].labels["address"] == fleet.net.host_address[host]
        if fleet.net.namespaces:  # the worker process really is on that host's network, not this machine's
            assert fleet.net.host_of(fleet.workers[host].pid) == host


def test_a_gang_spans_two_hosts_and_a_lost_hosts_work_moves_to_the_survivors(fleet):
    out = fleet.out
    gang = {"job_name": "fleet-gang", "policies": {"job_type": "service", "recovery_mode": "cluster_recover"},
            "nodes": [agent("left", out, "h1"), agent("right", out, "h2")]}
    job_id, coordinator_run = fleet.start_job(gang, coordinator={"preferred_node": "h3"})
    plain_run = fleet.run(fleet.deploy_probe({"preferred_node": LOST, "recovery_mode": "cluster_recover",
                                              "resources": {"cpu_cores": 1, "memory_mb": 128}}), seconds=600)
    servers.wait_for(lambda: attempts(out, "left") and attempts(out, "right") and started(out, plain_run),
                     timeout=240, interval=0.5, what="both agents and the plain run to start")

    gang_booking = fleet.store.active_placements(job_id=job_id)  # one booking, committed as one plan
    assert sorted((p.agent_id, p.node) for p in gang_booking) == [("left", "h1"), ("right", "h2")]
    first_left, first_right = attempts(out, "left")[0], attempts(out, "right")[0]
    assert (first_left["env"]["MN_NODE"], first_right["env"]["MN_NODE"]) == ("h1", "h2")
    if fleet.net.namespaces:
        assert fleet.net.host_of(first_left["pid"]) == "h1" and fleet.net.host_of(first_right["pid"]) == "h2"
    assert [p.node for p in fleet.store.active_placements(job_id=plain_run)] == [LOST]

    fleet.kill_host(LOST)
    (out / f"{plain_run}.started").unlink()
    passes = []
    deadline = time.monotonic() + 240
    while not (len(attempts(out, "left")) >= 2 and started(out, plain_run)):
        assert time.monotonic() < deadline, f"the lost host's work never moved: {passes[-3:]}"
        passes.append(fleet.reconcile())
        time.sleep(2)

    assert fleet.store.get_node(LOST).record.status == "offline"
    assert fleet.store.active_placements(node=LOST) == []  # nothing stays booked on the lost host
    moved_left = attempts(out, "left")[1]
    assert moved_left["env"]["MN_NODE"] == "h3"  # the only survivor with 5 cores free
    assert moved_left["env"]["MN_AGENT_ATTEMPT"] == "2"
    assert len(attempts(out, "right")) == 1  # the other half of the gang kept running where it was
    if fleet.net.namespaces:
        assert fleet.net.host_of(moved_left["pid"]) == "h3"
        assert fleet.net.host_of(started(out, plain_run)["pid"]) in {"h2", "h3"}
    [moved_plain] = fleet.store.active_placements(job_id=plain_run)
    assert moved_plain.node in {"h2", "h3"}
    job = load_job(fleet.store, job_id)
    assert {a: t.node for a, t in job.agents.items()} == {"left": "h3", "right": "h2"}
    assert len(job.agents["left"].reschedules_ms) == 1 and job.agents["right"].reschedules_ms == []

    for run_id in (coordinator_run, plain_run):
        fleet.http.post(f"/flow_runs/{run_id}/set_state", json={"state": {"type": "CANCELLING"}, "force": True})
    servers.wait_for(lambda: fleet.store.active_placements() == [], timeout=180, interval=1,
                     what="every booking released after the cancels")


def test_the_prefect_server_keeps_its_state_in_postgresql(fleet):
    import psycopg

    with psycopg.connect(fleet.pg.url("prefect")) as conn:
        pools = conn.execute("SELECT name, type FROM work_pool WHERE name = %s", (POOL,)).fetchall()
        workers = {row[0] for row in conn.execute("SELECT name FROM worker")}
    assert pools == [(POOL, "mn")]
    assert {f"mn-{h}" for h in HOSTS} <= workers
    assert httpx.get(f"{fleet.api_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{fleet.api_url}/work_pools/{POOL}", timeout=10).status_code == 401  # the rest needs the auth


def test_hosts_stay_healthy_while_the_prefect_server_is_down_and_work_resumes_after(fleet):
    alive = [h for h in HOSTS if fleet.workers[h].poll() is None]
    fleet.stop_server()
    try:
        down_until = time.monotonic() + 4 + sum(float(LIVENESS[k]) for k in ("MN_HEARTBEAT_TIMEOUT_SECONDS",
                                                                               "MN_DISCONNECT_GRACE_SECONDS"))
        changes = []
        while time.monotonic() < down_until:  # long enough for a silent host to go offline, and sweeps after that
            time.sleep(2)
            changes += fleet.sweep()
    finally:
        fleet.start_server()
    assert [c for c in changes if c["node"] in alive] == []  # the heartbeats need only the store
    assert all(fleet.store.get_node(h).record.status == "healthy" for h in alive)
    assert all(fleet.workers[h].poll() is None for h in alive)  # no worker gave up on the missing API
    after = fleet.run(fleet.deploy_probe({"resources": {"cpu_cores": 1, "memory_mb": 128}}), seconds=0)
    done = servers.wait_for(lambda: fleet.state(after) in {"COMPLETED", "FAILED", "CRASHED"} and fleet.state(after),
                            timeout=240, interval=1, what="a run after the server came back")
    assert done == "COMPLETED"
    assert json.loads((fleet.out / f"{after}.json").read_text())["env"]["MN_NODE"] in alive


def test_the_multihost_files_describe_what_the_product_accepts():
    import yaml

    from mn_prefect.inventory import local_node
    from mn_prefect.jobs.deploy import compile_blueprint
    from mn_prefect.worker.variables import MNVariables

    files = Path(__file__).resolve().parents[1] / "deployments" / "multihost"
    spec = yaml.safe_load((files / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:  # what the pool's schema would accept
        assert deployment["work_pool"]["name"] == POOL
        MNVariables.model_validate(deployment["work_pool"]["job_variables"])
    gang = compile_blueprint(json.loads((files / "gang.json").read_text()), local_checks=False).blueprint
    assert [a.resources.cpu_cores for a in gang.agents] == [5, 5]  # five cores each: no 8-core host holds both
    node = local_node({"MN_INVENTORY_FILE": str(files / "node.json")})  # this machine, as the file overrides it
    assert (node.name, node.group, node.labels["address"]) == ("gpu-a", POOL, "10.0.0.11")
    for env_file in ("server.env", "worker.env"):
        for line in (files / env_file).read_text().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.partition("=")
                assert name.startswith(("PREFECT_", "MN_")) and value, f"{env_file}: {line}"
