"""``mn-prefect up`` / ``down``: a whole lab on this machine, from nothing, in one command.

Starts a local Prefect server (SQLite) unless PREFECT_API_URL already answers, creates the ``mn`` pool,
starts one ``mn`` worker per node (the mock nodes of ``deployments/mock-nodes.json``; this machine itself
when it has GPUs), deploys ``deployments/prefect.yaml``, runs its examples, shows where each run went in a
live table, and prints the UI address. One lab per ``~/.mn-prefect``: its lock file says where it is, the
profile (``~/.mn-prefect/config``) tells other commands its store and server. Ctrl-C, SIGTERM or
``mn-prefect down`` stop everything it started.

It also creates one example Automation, so the loop from event to action is there to see: a node going offline
(the event ``mn.node.offline``) makes Prefect send an OFFLINE notification through an ``MNNotificationWebhook``
block (signed, retried) to a receiver in this process, which checks the signature, prints it and appends it to
``~/.mn-prefect/lab/notifications.jsonl``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml
from rich.table import Table

from mn_prefect import settings
from mn_prefect.credentials import is_own_flow
from mn_prefect.drivers import docker as docker_io
from mn_prefect.lab_logs import server_errors
from mn_prefect.lab_notifications import (
    AUTOMATION_NAME,
    WEBHOOK_BLOCK,
    NotificationReceiver,
    create_node_offline_automation,
    delete_node_offline_automation,
)
from mn_prefect.lifecycle.interrupted import release_interrupted
from mn_prefect.local_lab import (
    BIN,
    LabLock,
    LabRunning,
    PrefectServer,
    free_port,
    healthy,
    interrupts_deferred,
    read_lab_lock,
    start_worker,
    stop_processes,
    stop_stray_runs,
)
from mn_prefect.model.containers import DOCKER
from mn_prefect.model.issues import InvalidInput, Issue, Issues
from mn_prefect.model.states import TERMINAL_RUN_STATES

DEFAULT_PORT = 4200
PREFECT_PROFILE = "mn-lab"  # the Prefect profile `up` writes: `prefect profile use mn-lab` talks to the lab
LAB_IMAGE = "mn-prefect/lab:local"  # deployments/prefect.yaml's container example runs in it
STOP_SECONDS = {"workers": 5.0, "server": 3.0}  # both within the 10 s a stopped lab is given


class PortTaken(RuntimeError):
    pass


def _port_free(port: int) -> bool:
    """Whether the server can listen on ``port``: none listens there. Connections of a server just stopped, left in
    TIME_WAIT, do not count (the server binds with SO_REUSEADDR, and so does this check)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _server_port(asked: int | None, say) -> int:
    """``--port`` as given (0: any free port), refused by name when taken; without it, 4200 if free, else
    a free port, said out loud."""
    if asked == 0:
        return free_port()
    if asked is not None:
        if not _port_free(asked):
            raise PortTaken(f"--port {asked}: port {asked} on 127.0.0.1 is already in use; choose another port, "
                            "or leave --port out to use a free one")
        return asked
    if _port_free(DEFAULT_PORT):
        return DEFAULT_PORT
    port = free_port()
    say(f"port {DEFAULT_PORT} is in use; the Prefect server takes port {port} instead")
    return port


class _Interrupted(KeyboardInterrupt):
    """SIGTERM, delivered the way Ctrl-C is so that one cleanup path handles both."""


def _interrupt_on_sigterm() -> None:
    def handler(signum, frame):
        raise _Interrupted()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


CONTAINERS_FILE = "containers.yaml"  # beside prefect.yaml: the container example, deployed only where Docker answers


def _examples(prefect_yaml: Path, containers: bool
              ) -> tuple[str, list[tuple[Path, list[str]]], set[tuple[str, str]]]:
    """The pool, the Prefect files to deploy with the names of the deployments to deploy from each (prefect.yaml's
    but its container examples, and with ``containers`` CONTAINERS_FILE's beside it too) and the (name,
    entrypoint) of each example to run: not the lifecycle flows, which run on their schedule or on request."""
    files = [prefect_yaml, *([prefect_yaml.with_name(CONTAINERS_FILE)] if containers else [])]

    def in_container(d: dict[str, Any]) -> bool:
        resources = ((d.get("work_pool") or {}).get("job_variables") or {}).get("resources") or {}
        return resources.get("runtime_driver") == DOCKER

    pool, deploys, examples = "", [], set()
    for path in files:
        if not path.exists():
            continue
        spec = yaml.safe_load(path.read_text())["deployments"]
        deployed = [d for d in spec if containers or not in_container(d)]
        pool = pool or spec[0]["work_pool"]["name"]
        if deployed:
            deploys.append((path, [d["name"] for d in deployed]))
        examples |= {(d["name"], d["entrypoint"]) for d in deployed if not is_own_flow(d["entrypoint"])}
    return pool, deploys, examples


def _lab_docker(say) -> dict[str, str] | None:
    """The workers' environment for containers when a Docker daemon answers (the lab image imported from an
    empty root filesystem, this machine's Python mounted read-only); None, said out loud, when none does."""
    problem = docker_io.daemon_problem()
    if problem is not None:
        say(f"containers: off ({problem}); the container example is not deployed (where a Docker daemon answers: "
            f"prefect deploy --all --prefect-file deployments/{CONTAINERS_FILE})", soft_wrap=True, highlight=False)
        return None
    docker_io.build_toolchain_image(LAB_IMAGE)
    say(f"docker: a daemon answers; lab image {LAB_IMAGE} (an empty root filesystem, this machine's Python "
        "mounted read-only); the nodes offer runtime_driver docker")
    return {docker_io.TOOLCHAIN_VAR: ":".join(docker_io.default_toolchain())}


DEFAULT_PROFILE = "default"  # the Prefect profile to switch back to: `up` creates it when the user has none
BEFORE_FIELD = "prefect_profile_before"  # the lab's field (~/.mn-prefect/config) naming it
RESTORED_FIELD = "prefect_profile_restored"  # the profile the lab's stop made active again


def _ensure_default_profile(user, merged) -> None:
    """Add DEFAULT_PROFILE to the user's profiles ``user`` when no profile has that name: what a fresh Prefect
    install has active (its ``ephemeral`` profile: a temporary server per command), so that `prefect profile use
    default` works on any machine."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_ENABLED

    if DEFAULT_PROFILE in merged.names:
        return
    shipped = merged.profiles_by_name.get("ephemeral")
    user.update_profile(DEFAULT_PROFILE, dict(shipped.settings) if shipped is not None and shipped.settings
                        else {PREFECT_SERVER_EPHEMERAL_ENABLED: True})


def record_prefect_profile(api_url: str) -> tuple[Path, str]:
    """Write (or update) Prefect's profile PREFECT_PROFILE with the lab's API URL, in the user's profiles file;
    which profile is active is left as it was. A DEFAULT_PROFILE is added when the user has none. Returns the file
    and the profile to switch back to (the one active now; DEFAULT_PROFILE when the user's file names none or names
    the lab's), which the lab's profile keeps for `down`."""
    from prefect.settings import PREFECT_API_URL, get_current_settings
    from prefect.settings.profiles import load_profiles, save_profiles

    profiles = load_profiles(include_defaults=False)  # only the user's own file: its active profile is kept
    merged = load_profiles(include_defaults=True)
    before = profiles.active_name if profiles.active_name not in (None, PREFECT_PROFILE) else DEFAULT_PROFILE
    if before not in merged.names:
        before = DEFAULT_PROFILE
    _ensure_default_profile(profiles, merged)
    profiles.update_profile(PREFECT_PROFILE, {PREFECT_API_URL: api_url})
    save_profiles(profiles)
    settings.record_lab_fields(**{BEFORE_FIELD: before})
    path = get_current_settings().profiles_path
    assert path is not None  # save_profiles wrote there
    return path, before


def restore_prefect_profile() -> str | None:
    """When the user's active Prefect profile is the lab's (PREFECT_PROFILE), make the one active before `up`
    active again (DEFAULT_PROFILE when it is unknown or gone, created when missing), so that Prefect's CLI no
    longer calls a stopped server. Returns the profile made active, None when the lab's was not active."""
    from prefect.settings.profiles import load_profiles, save_profiles

    profiles = load_profiles(include_defaults=False)
    if profiles.active_name != PREFECT_PROFILE:
        return None
    merged = load_profiles(include_defaults=True)
    lab = settings.read_profile().get(settings.LAB)
    target = lab.get(BEFORE_FIELD) if isinstance(lab, dict) else None
    if not isinstance(target, str) or target == PREFECT_PROFILE or target not in merged.names:
        target = DEFAULT_PROFILE
        _ensure_default_profile(profiles, merged)
    profiles.set_active(target, check=False)  # a profile of Prefect's own file (ephemeral, local) counts too
    save_profiles(profiles)
    if isinstance(lab, dict):
        settings.record_lab_fields(**{RESTORED_FIELD: target})
    return target


def _restore_prefect_profile_said(say: Callable[..., None]) -> None:
    """restore_prefect_profile, said in one line; a profiles file that cannot be read or written is said too and
    never stops the lab's stop."""
    try:
        restored = restore_prefect_profile()
    except Exception as error:
        say(f"[yellow]the active Prefect profile may still be {PREFECT_PROFILE}[/] ({type(error).__name__}: {error}): "
            f"[bold]prefect profile use {DEFAULT_PROFILE}[/] switches back", soft_wrap=True, highlight=False)
        return
    if restored is not None:
        say(f"the active Prefect profile was {PREFECT_PROFILE} (the stopped lab's server): switched back to "
            f"[bold]{restored}[/]", soft_wrap=True, highlight=False)


def _http(api_url: str) -> httpx.Client:
    transport = httpx.HTTPTransport(retries=3)
    return httpx.Client(base_url=api_url, timeout=60, transport=transport)


REQUEST_PATIENCE_S = 90.0  # how long one request of the lab's is tried again before the server counts as gone


def _request(client: httpx.Client, method: str, url: str, *, patience_s: float | None = None,
             sleep: Callable[[float], None] = time.sleep, **kwargs) -> httpx.Response:
    """One request to the lab's server, tried again with backoff for ``patience_s`` (REQUEST_PATIENCE_S) through
    what a busy or restarting server does: a 503 or 429 (the SQLite-backed server answers 503 while its database is
    busy), a late answer, a connection refused or reset. Every POST here carries an idempotency key or is a read,
    so twice is once. Only a server gone for all that time raises, its last error naming why."""
    deadline = time.monotonic() + (REQUEST_PATIENCE_S if patience_s is None else patience_s)
    delay = 0.25
    while True:
        try:
            response = client.request(method, url, **kwargs)
        except httpx.TransportError:  # timeouts, refused and reset connections, a dropped answer
            if time.monotonic() + delay > deadline:
                raise
        else:
            if response.status_code not in (429, 502, 503) or time.monotonic() + delay > deadline:
                return response
        sleep(delay)
        delay = min(delay * 2, 5.0)


def _lab_nodes(nodes_file: Path) -> Sequence[dict[str, Any] | None]:
    from mn_prefect.inventory import detect_devices
    from mn_prefect.model.node import parse_nodes

    issues = Issues()
    raw = json.loads(nodes_file.read_text())
    records = parse_nodes(raw, nodes_file.name, issues)
    issues.raise_if_any()
    # A node's group is left out unless the file names one: the worker then reports its pool's group.
    mock = [r.model_dump(mode="json", exclude=None if "group" in r.model_fields_set else {"group"}) for r in records]
    if detect_devices():  # real GPUs here: this machine is a node, the mock CPU nodes keep it company
        return [None] + [n for n in mock if not n.get("devices")]
    return mock


def _table(runs: list[dict], api_ui: str) -> Table:
    table = Table(title=f"mn-prefect lab: placements ({api_ui})", title_justify="left")
    for column in ("run", "deployment", "state", "node", "driver", "devices", "ports", "volumes"):
        table.add_column(column)
    style = {"COMPLETED": "green", "FAILED": "red", "CRASHED": "red", "RUNNING": "cyan", "SCHEDULED": "yellow"}
    for run in runs:
        placement = run.get("placement") or {}
        state = run.get("state", "SCHEDULED")
        table.add_row(run["name"], run["deployment"], f"[{style.get(state, 'white')}]{state}[/]",
                      placement.get("node", "-"), placement.get("runtime_driver") or "-",
                      ", ".join(placement.get("devices") or []) or "-",
                      ", ".join(f"{k}={v}" for k, v in (placement.get("ports") or {}).items()) or "-",
                      ", ".join(f"{k}={v}" for k, v in (placement.get("volumes") or {}).items()) or "-")
    return table


class _Lab:
    """What this ``up`` started, so that one cleanup stops exactly that, whenever it is interrupted."""

    def __init__(self, lab_home: Path, lock: LabLock):
        self.home, self.lock = lab_home, lock
        self.server: PrefectServer | None = None
        self.workers: list[subprocess.Popen] = []
        self.mn_api: subprocess.Popen | None = None  # the MirrorNeuron API, when the mirrorneuron extra is installed
        self.metrics: subprocess.Popen | None = None  # `mn-prefect metrics serve`: the cluster's Prometheus metrics
        self.deploys: list[subprocess.Popen] = []  # `prefect deploy` of deployments/prefect.yaml (...), while they run
        self.began = time.time()
        self.store_url: str | None = None
        self.released: list[str] = []  # bookings the stop released (runs it interrupted)
        self.kept: list[str] = []  # reservations: they outlive the lab
        self.unknown: list[str] = []  # bookings whose owner cannot be told: kept
        self.receiver: NotificationReceiver | None = None
        self.automation_on: str | None = None  # the server the example Automation was created on

    def stop(self) -> None:
        stop_processes(self.workers + self._helpers(), STOP_SECONDS["workers"])
        stop_stray_runs(self.home)  # runs of a worker killed earlier: not the descendants of any worker now
        self._release_interrupted()
        self._remove_automation()
        if self.server is not None:
            self.server.stop(STOP_SECONDS["server"])

    def _remove_automation(self) -> None:
        """The Automation calls this process's receiver: on a server that outlives the lab it would only fail."""
        if self.receiver is not None:
            self.receiver.stop()
        if self.automation_on is not None and self.server is None:
            try:
                delete_node_offline_automation(self.automation_on)
            except Exception:  # the server is away: nothing calls the receiver then either
                pass

    def _release_interrupted(self) -> None:
        if self.store_url is not None:
            self.released, self.kept, self.unknown = release_interrupted(self.store_url)

    def _helpers(self) -> list[subprocess.Popen]:
        return [p for p in (self.mn_api, self.metrics, *self.deploys) if p is not None]

    def _record_pids(self) -> None:
        pids = [p.pid for p in self.workers + self._helpers()] + ([self.server.proc.pid] if self.server else [])
        self.lock.record(pids=pids)

    def _serve(self, what: str, log_name: str, args: list[str], env: dict[str, str]) -> Callable[[], int]:
        """Start ``mn-prefect ARGS --port P`` on a free loopback port P (recorded in the lock); returns a wait
        for it to listen, which gives P."""
        port = free_port()
        log = open(self.home / log_name, "w")
        with interrupts_deferred():
            proc = subprocess.Popen([str(BIN / "mn-prefect"), *args, "--port", str(port)], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            setattr(self, what, proc)
        self._record_pids()

        def listening() -> int:
            deadline = time.monotonic() + 60
            while not _listening(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"`mn-prefect {' '.join(args[:2])}` did not start; see {self.home / log_name}")
                time.sleep(0.2)
            return port

        return listening

    def _start_metrics(self, env: dict[str, str], store_url: str, say: Callable[[str], None]) -> Callable[[], None]:
        """``mn-prefect metrics serve`` on a free loopback port: every node's capacity, use and state for
        Prometheus (docs/operating.md); each worker serves its own beside it. Returns the wait for it."""
        listening = self._serve("metrics", "metrics.log", ["metrics", "serve", "--store-url", store_url], env)

        def ready() -> None:
            say(f"Prometheus metrics of the cluster: [bold]http://127.0.0.1:{listening()}/metrics[/] (each worker's "
                "own: `mn-prefect metrics targets`)")

        return ready

    def _start_mn_api(self, env: dict[str, str], pool: str, store_url: str,
                      say: Callable[[str], None]) -> Callable[[], None]:
        """The MirrorNeuron API on a free loopback port, for the ``mn`` command and mn_sdk (the mirrorneuron
        extra); its address is printed and kept in the profile. Returns the wait for it."""
        import importlib.util

        if importlib.util.find_spec("grpc") is None or importlib.util.find_spec("mn_sdk") is None:
            return lambda: say("MirrorNeuron API: not started (pip install 'mn-prefect[mirrorneuron]' for the mn "
                               "command and SDK)")
        listening = self._serve("mn_api", "mn-api.log", ["mn-api", "serve", "--pool", pool, "--store-url",
                                                         store_url], env)

        def ready() -> None:
            target = f"127.0.0.1:{listening()}"
            settings.record_mn_api(target)
            say(f"MirrorNeuron API up: [bold]export MN_GRPC_TARGET={target}[/] (then `mn node list`, "
                f"`mn blueprint run --folder DIR`)")

        return ready

    def _start_deploy(self, project: Path, prefect_yaml: Path, names: list[str], env: dict[str, str]
                      ) -> Callable[[], None]:
        """``prefect deploy`` of ``names`` from ``prefect_yaml``, started now; returns the wait for it."""
        log_path = self.home / ("deploy.log" if not self.deploys else f"deploy-{prefect_yaml.stem}.log")
        log = open(log_path, "w")
        with interrupts_deferred():
            deploy = subprocess.Popen(
                [str(BIN / "prefect"), "--no-prompt", "deploy", *(a for n in names for a in ("--name", n)),
                 "--prefect-file", str(prefect_yaml)], cwd=project, env={**env, "PWD": str(project)}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
            self.deploys.append(deploy)
        self._record_pids()

        def done() -> None:
            if deploy.wait() != 0:
                raise RuntimeError(f"prefect deploy of {prefect_yaml.name} failed:\n{log_path.read_text()[-4000:]}")

        return done

    def start(self, project: Path, prefect_yaml: Path, nodes_file: Path, port: int | None,
              runs_per_deployment: int, timeout: float) -> int:
        from rich.live import Live

        from mn_prefect.cli.render import console
        from mn_prefect.store import open_store
        from mn_prefect.worker.visibility import summary

        api_url = os.environ.get(settings.API_URL_VAR)
        if api_url and healthy(api_url):
            env, ui_url = dict(os.environ), api_url.rsplit("/api", 1)[0]
            console.print(f"using the Prefect server at {api_url}"
                          + (f" (from PREFECT_API_URL; --port {port} is not used)" if port is not None else ""))
        else:
            server_port = _server_port(port, console.print)
            with console.status("starting a local Prefect server (SQLite)..."):
                self.server = PrefectServer(self.home / "prefect", server_port, ui=True)
            self._record_pids()
            env, api_url, ui_url = self.server.env, self.server.api_url, self.server.ui_url
            console.print(f"Prefect server up at {ui_url}")
        # Reused when a stopped lab left it: it may hold another lab's history, never deleted from here.
        store_url = self.store_url = f"sqlite:///{self.home / 'state.db'}"
        self.lock.record(api_url=api_url, ui_url=ui_url, store_url=store_url)
        settings.record_lab(pid=os.getpid(), store_url=store_url, prefect_api_url=api_url, ui_url=ui_url,
                            lab_home=self.home)
        try:
            profiles, before = record_prefect_profile(api_url)
        except Exception as error:  # the user's profiles file cannot be read or written: the lab runs without it
            console.print(f"[yellow]the Prefect profile {PREFECT_PROFILE} was not written[/] ({type(error).__name__}: "
                          f"{error}): in another terminal, [bold]export PREFECT_API_URL={api_url}[/]", soft_wrap=True,
                          highlight=False)
        else:
            console.print(f"Prefect profile [bold]{PREFECT_PROFILE}[/] ({profiles}) points at this server: in another "
                          f"terminal, [bold]prefect profile use {PREFECT_PROFILE}[/] or [bold]export PREFECT_API_URL="
                          f"{api_url}[/] (switch back: [bold]prefect profile use {before}[/]; stopping the lab "
                          "does it when the lab's profile is active)", soft_wrap=True, highlight=False)
        client = _http(api_url)
        with console.status("looking for a Docker daemon..."):
            docker_env = _lab_docker(console.print)
        pool, deployed, examples = _examples(prefect_yaml, containers=docker_env is not None)
        if _request(client, "GET", f"/work_pools/{pool}").status_code == 404:
            from mn_prefect.worker import MNWorker

            created = _request(client, "POST", "/work_pools/", json={
                "name": pool, "type": "mn", "base_job_template": MNWorker.get_default_base_job_template()})
            if created.status_code != 409:  # 409: a try whose answer was lost created it
                created.raise_for_status()
        store = open_store(store_url)
        store.create_group(pool)  # an mn pool's runs go to the nodes of its group (docs/operating.md)
        console.print(f"work pool [bold]{pool}[/] (type mn, resource group {pool}); store {store_url}")
        # What takes a while starts at once and is waited for together: the workers, `prefect deploy`, the
        # MirrorNeuron API and the metrics server each start an interpreter of their own.
        nodes = _lab_nodes(nodes_file)
        started_at = time.time()
        for node in nodes:
            with interrupts_deferred():
                self.workers.append(start_worker(env, pool, node, store_url, self.home / "workers",
                                                 extra_env={**(docker_env or {}), "MN_METRICS_PORT": "0"}))
            self._record_pids()
        deploys_done = [self._start_deploy(project, path, names, env) for path, names in deployed]
        mn_api_ready = self._start_mn_api(env, pool, store_url, console.print)
        metrics_ready = self._start_metrics(env, store_url, console.print)
        self.receiver = NotificationReceiver(self.home / "notifications.jsonl", console.print)
        try:
            with console.status("creating the example Automation..."):
                create_node_offline_automation(api_url, self.receiver.url, self.receiver.secret)
        except Exception as error:  # an example: the lab runs without it
            console.print(f"[yellow]the example Automation was not created[/]: {type(error).__name__}: {error}",
                          soft_wrap=True, highlight=False)
        else:
            self.automation_on = api_url
            console.print(f"Automation [bold]{AUTOMATION_NAME}[/]: a node going offline sends a signed notification "
                          f"through the block {WEBHOOK_BLOCK!r} to {self.receiver.url} "
                          f"(printed here, kept in {self.receiver.path})", soft_wrap=True, highlight=False)

        def fresh():  # a reused store also lists the nodes of earlier labs: count only this lab's heartbeats
            return [n for n in store.list_nodes() if (n.last_heartbeat or 0) >= started_at]

        with console.status(f"starting {len(self.workers)} mn workers..."):
            deadline = time.monotonic() + 120
            while len(fresh()) < len(self.workers):
                if time.monotonic() > deadline or any(w.poll() is not None for w in self.workers):
                    raise RuntimeError(f"the workers did not start; see {self.home / 'workers'}")
                time.sleep(0.5)
        for stored in fresh():
            r = stored.record
            console.print(f"  node [bold]{r.name}[/]: {r.cpu_cores:g} cores, {r.memory_mb:g} MB, "
                          f"{', '.join(f'{d.id} ({d.model})' for d in r.devices) or 'no GPUs'}")

        mn_api_ready()
        metrics_ready()
        with console.status("deploying deployments/prefect.yaml..."):
            for done in deploys_done:
                done()
        names = [name for _, file_names in deployed for name in file_names]
        console.print(f"deployed {', '.join(names)} ({len(names)} deployments) in "
                      f"{time.time() - self.began:.0f} s since `up` started", soft_wrap=True, highlight=False)
        deployments = _request(client, "POST", "/deployments/filter", json={
            "work_pools": {"name": {"any_": [pool]}}}).json()
        # Only prefect.yaml's examples: never the lifecycle flows or a blueprint job's internal deployments.
        chosen = [d for d in deployments if (d["name"], d.get("entrypoint")) in examples]
        runs = []
        for deployment in sorted(chosen, key=lambda d: d["name"]):
            for _ in range(runs_per_deployment):
                created = _request(client, "POST", f"/deployments/{deployment['id']}/create_flow_run",
                                   json={"idempotency_key": uuid.uuid4().hex})
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
                if all(r["state"] in TERMINAL_RUN_STATES for r in runs) or time.monotonic() > deadline:
                    break
                if self.workers and all(w.poll() is not None for w in self.workers):
                    raise RuntimeError(f"every mn worker has exited; see {self.home / 'workers'}")
                time.sleep(1)
        completed = sum(r["state"] == "COMPLETED" for r in runs)
        console.print()
        console.print(f"{completed} of {len(runs)} runs completed. Prefect UI: [bold]{ui_url}[/] "
                      f"(work pool {pool}: {ui_url}/work-pools/work-pool/{pool})")
        return 0 if completed == len(runs) else 1


def up(project: Path, nodes_file: Path, port: int | None, runs_per_deployment: int, exit_when_done: bool,
       timeout: float) -> int:
    """Run the lab. Exit status: 0 when every example run completed (also when stopped afterwards), 1 when
    one did not, the port is taken or another lab runs here, 128+signal when stopped before the runs ended."""
    from mn_prefect.cli.render import console, errors

    _interrupt_on_sigterm()
    prefect_yaml = project / "deployments" / "prefect.yaml"
    if not prefect_yaml.exists():
        raise InvalidInput([Issue(str(prefect_yaml),
                                  "not found: run `mn-prefect up` from the mn-prefect checkout or pass --project")])
    try:
        lock = LabLock.acquire(settings.home() / "lab")
    except LabRunning as running:
        errors.print(f"[red]refused[/]: {running}", soft_wrap=True, highlight=False)
        return 1
    lab = _Lab(settings.home() / "lab", lock)
    result = None
    try:
        result = lab.start(project, prefect_yaml, nodes_file, port, runs_per_deployment, timeout)
        if said := server_errors(lab_server_log(lab.home)).sentence():
            console.print(said, soft_wrap=True, highlight=False)
        if not exit_when_done:
            console.print("The lab keeps running: deploy and run more; Ctrl-C or `mn-prefect down` stops everything.")
            while True:
                time.sleep(3600)
    except PortTaken as error:
        errors.print(f"[red]error[/]: {error}", soft_wrap=True, highlight=False)
        return 1
    except KeyboardInterrupt as interrupt:
        if result is None:
            return 128 + (signal.SIGTERM if isinstance(interrupt, _Interrupted) else signal.SIGINT)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        with console.status("stopping the lab..."):
            lab.stop()
        settings.mark_lab_stopped(os.getpid())
        console.print("lab stopped: every process it started has ended"
                      + (f"; released the bookings of {len(lab.released)} interrupted run(s): {', '.join(lab.released)}"
                         if lab.released else "")
                      + (f"; kept {len(lab.kept)} reservation(s) with their capacity until they end: "
                         f"{', '.join(lab.kept)}" if lab.kept else "")
                      + (f"; kept {len(lab.unknown)} booking(s) whose owner is unknown (see `mn-prefect store audit`): "
                         f"{', '.join(lab.unknown)}" if lab.unknown else ""), soft_wrap=True, highlight=False)
        if said := server_errors(lab_server_log(lab.home)).sentence():
            console.print(said, soft_wrap=True, highlight=False)
        _restore_prefect_profile_said(console.print)
        lock.release()
    return result


def lab_server_log(lab_home: Path) -> Path:
    """The log of the lab's Prefect server (written afresh at each start)."""
    return lab_home / "prefect" / "server.log"


def down(timeout: float) -> int:
    """Stop the running lab: SIGTERM to its ``up`` (which stops what it started), then wait for it."""
    from mn_prefect.cli.render import console, errors

    lab_home = settings.home() / "lab"
    info = read_lab_lock(lab_home)
    if info is None:
        settings.mark_lab_stopped()  # an `up` killed outright left the profile saying running
        console.print(f"no lab is running ({lab_home / LabLock.FILE} is not held)")
        _restore_prefect_profile_said(console.print)
        return 0
    pid = info.get("pid")
    where = info.get("ui_url") or "still starting"
    if isinstance(pid, int):  # a lock file without a pid: nothing to signal
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    with console.status(f"stopping the lab (pid {pid}, {where})..."):
        while read_lab_lock(lab_home) is not None or settings.process_alive(pid):
            if time.monotonic() > deadline:
                errors.print(f"[red]error[/]: the lab (pid {pid}) did not stop within {timeout:g} s; "
                             f"see it with `ps -g {pid}`, or end it with `kill -9 {pid}`", soft_wrap=True)
                return 1
            time.sleep(0.2)
    settings.mark_lab_stopped(pid)
    console.print(f"stopped the lab (pid {pid}, {where}); its store stays at {info.get('store_url', '?')}",
                  soft_wrap=True, highlight=False)
    if said := server_errors(lab_server_log(lab_home)).sentence():
        console.print(said, soft_wrap=True, highlight=False)
    lab = settings.read_profile().get(settings.LAB)
    restored = lab.get(RESTORED_FIELD) if isinstance(lab, dict) and lab.get("pid") == pid else None
    if restored:  # the lab's `up` switched back as it stopped: say so here, where the user is
        console.print(f"the active Prefect profile was {PREFECT_PROFILE} (the stopped lab's server): switched back to "
                      f"[bold]{restored}[/]", soft_wrap=True, highlight=False)
    else:
        _restore_prefect_profile_said(console.print)
    return 0


def lab_down(timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the lab to stop.")] = 30
             ) -> None:
    """Stop the lab `mn-prefect up` runs here (its server, workers and runs) and mark it stopped in the
    profile; exit 0 when none is left running, 1 when it did not stop in time."""
    raise typer.Exit(down(timeout))
