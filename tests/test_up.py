"""The README's main job: `mn-prefect up` on a machine with no Prefect server configured, one lab at a time,
stopped by Ctrl-C, SIGTERM or `mn-prefect down`, and found by the other commands through the profile."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import pytest
import servers
from docker_daemon import DockerDaemon

from mn_prefect.drivers.container import NODE_LABEL
from mn_prefect.local_lab import descendants, interrupts_deferred, kill_tree, lab_processes

ROOT = Path(__file__).resolve().parents[1]
MN_PREFECT = str(Path(sys.executable).parent / "mn-prefect")
READY = "The lab keeps running"


def lab_env(home: Path, docker_host: str | None = None) -> dict[str, str]:
    """No Prefect server or store configured; mn-prefect's and Prefect's homes inside the test's folder. Docker
    only at ``docker_host`` (by default none answers, whatever this machine runs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MN_"))}
    env.update({"MN_PREFECT_HOME": str(home), "PREFECT_HOME": str(home / "prefect-client"),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "DOCKER_HOST": docker_host or f"unix://{home}/no-docker.sock"})
    return env


def mn(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([MN_PREFECT, *args], cwd=ROOT, env=lab_env(home), capture_output=True, text=True,
                          timeout=timeout)


def running(pid: int) -> bool:
    """Alive and not a zombie (a process that exited but was not reaped yet has nothing left to stop)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _server_and_workers(up_pid: int) -> list[int]:
    """The lab's long-lived processes (its example runs' processes come and go)."""
    def cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return ""

    return [pid for pid in descendants(up_pid) if re.search(r"(prefect|mn_prefect.lab_server) (server|worker) start", cmdline(pid))]


def profile(home: Path) -> dict:
    return tomllib.loads((home / "config").read_text())


class Up:
    """A long-running `mn-prefect up` (by default without example runs) whose output goes to a file the test
    reads."""

    def __init__(self, home: Path, *args: str, runs: int = 0, docker_host: str | None = None):
        servers.lab_only("`mn-prefect up`")
        self.home = home
        self.out_path = home / f"up-{time.monotonic_ns()}.out"
        home.mkdir(parents=True, exist_ok=True)
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen([MN_PREFECT, "up", "--runs", str(runs), "--port", "0", *args], cwd=ROOT,
                                         env=lab_env(home, docker_host), stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.out_path.read_text()

    def wait_until(self, text: str, timeout: float = 420) -> None:
        def seen():
            assert self.proc.poll() is None, f"`up` exited with {self.proc.returncode}:\n{self.output()[-3000:]}"
            return text in self.output()

        deadline = time.monotonic() + timeout
        while not seen():
            assert time.monotonic() < deadline, f"`up` did not print {text!r} in {timeout} s:\n{self.output()[-3000:]}"
            time.sleep(0.5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc, *lab_processes(self.home / "lab"))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The README's main job as it is: `mn-prefect up`, which runs the examples once and keeps the lab up, on
    a machine whose Docker daemon answers (so the container example runs too). The module's tests share it (a
    lab takes a while to start); the last one stops it with `mn-prefect down`."""
    daemon = DockerDaemon()
    home = tmp_path_factory.mktemp("lab")
    # The user's own Prefect profiles, with one of theirs active: `up` adds mn-lab beside it and changes nothing else.
    (home / "prefect-client").mkdir()
    (home / "prefect-client" / "profiles.toml").write_text('active = "mine"\n\n[profiles.mine]\n'
                                                          'PREFECT_SERVER_ANALYTICS_ENABLED = "false"\n')
    try:
        up = Up(home, "--timeout", "840", runs=1, docker_host=daemon.host)
        try:
            up.wait_until(READY, timeout=900)  # on busy cores the four example runs can take minutes to start
            yield up
        finally:
            mn(up.home, "down", timeout=60)
            up.kill()
        assert daemon.containers(label=NODE_LABEL) == []  # the lab's containers went with it
    finally:
        daemon.stop()


@pytest.fixture
def leaves_nothing(tmp_path):
    """Whatever a failed test left of its lab is killed (what `up` left is checked by the tests themselves)."""
    yield
    for pid in lab_processes(tmp_path / "lab"):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.mark.lab
def test_up_runs_the_examples_and_shows_where_each_run_went(lab):
    out = lab.output()
    # Only prefect.yaml's four examples run: the lifecycle deployments run on their own.
    assert "4 of 4 runs completed" in out, out[-4000:]
    assert "the nodes offer runtime_driver docker" in out
    assert re.search(r"container-hello.*COMPLETED.*(cpu-1|gpu-[12]).*docker", out)
    assert "Prefect UI: http://127.0.0.1:" in out
    assert re.search(r"cuda-inference.*COMPLETED.*gpu-[12].*GPU-", out)
    assert re.search(r"http-service.*COMPLETED.*http=\d+", out)
    assert re.search(r"scratch-writer.*COMPLETED.*scratch=/tmp", out)


@pytest.mark.lab
def test_up_starts_the_mirror_neuron_api_and_the_mn_command_sees_the_labs_nodes(lab, tmp_path):
    target = re.search(r"export MN_GRPC_TARGET=(127\.0\.0\.1:\d+)", lab.output()).group(1)
    assert profile(lab.home)["lab"]["mn_grpc_target"] == target
    env = {k: v for k, v in os.environ.items() if not k.startswith("MN_") and "proxy" not in k.lower()}
    env.update({"HOME": str(tmp_path), "MN_GRPC_TARGET": target, "MN_DISABLE_UPDATE_CHECK": "1"})
    listed = subprocess.run([str(Path(sys.executable).parent / "mn"), "node", "list"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stdout
    summary = json.loads(listed.stdout[listed.stdout.index("{"):])
    assert sorted(n["name"] for n in summary["nodes"]) == ["cpu-1", "gpu-1", "gpu-2"]


@pytest.mark.lab
def test_prefect_commands_reach_the_lab_through_its_prefect_profile(lab):
    """The README's "Using it with Prefect" in a second terminal: the `mn-lab` profile `up` wrote names the lab's
    server, and the user's own active profile is left as it was."""
    api_url = json.loads((lab.home / "lab" / "lab.lock").read_text())["api_url"]
    profiles = tomllib.loads((lab.home / "prefect-client" / "profiles.toml").read_text())
    assert profiles["profiles"]["mn-lab"] == {"PREFECT_API_URL": api_url}
    assert profiles.get("active") == "mine"  # as the user left it (the fixture's profiles file)
    assert "prefect profile use mn-lab" in lab.output() and f"export PREFECT_API_URL={api_url}" in lab.output()

    env = lab_env(lab.home)
    created = subprocess.run([str(Path(sys.executable).parent / "prefect"), "--profile", "mn-lab", "work-pool",
                              "create", "second-terminal", "--type", "mn"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)

    assert created.returncode == 0, created.stdout[-3000:] + created.stderr[-3000:]
    import httpx

    pool = httpx.get(f"{api_url}/work_pools/second-terminal", timeout=30)
    assert pool.status_code == 200 and pool.json()["type"] == "mn", pool.text
    assert "database is locked" not in created.stdout + created.stderr  # no temporary server was started


@pytest.mark.lab
def test_a_second_up_is_refused_and_leaves_the_running_lab_alone(lab):
    first = [lab.proc.pid, *_server_and_workers(lab.proc.pid)]
    assert len(first) == 5, first  # up, the Prefect server and three workers
    lock = json.loads((lab.home / "lab" / "lab.lock").read_text())

    second = mn(lab.home, "up", "--port", "0", "--runs", "0")

    assert second.returncode == 1, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"pid {lab.proc.pid}" in second.stderr and lock["ui_url"] in second.stderr
    assert "mn-prefect down" in second.stderr
    assert [pid for pid in first if not running(pid)] == []
    # The first lab's store is intact and its workers still heartbeat into it.
    from mn_prefect.store import open_store

    store = open_store(lock["store_url"])
    refused_at = time.time()
    servers.wait_for(lambda: all((n.last_heartbeat or 0) > refused_at for n in store.list_nodes()), timeout=30,
                     what="the first lab's three workers to heartbeat into its store after the refusal")
    assert sorted(n.record.name for n in store.list_nodes()) == ["cpu-1", "gpu-1", "gpu-2"]
    assert {g.name: g.nodes for g in store.list_groups()} == {"default": 0, "mn-lab": 3}  # up made the pool's group


@pytest.mark.lab
def test_store_commands_find_the_lab_store_through_the_profile(lab):
    store_file = lab.home / "lab" / "state.db"

    resources = mn(lab.home, "resource", "list", "--store", "--json")
    jobs = mn(lab.home, "--verbose", "job", "list", "--json")

    assert resources.returncode == 0, resources.stderr[-3000:]
    assert sorted(n["name"] for n in json.loads(resources.stdout)["nodes"]) == ["cpu-1", "gpu-1", "gpu-2"]
    assert jobs.returncode == 0, jobs.stderr[-3000:]
    assert json.loads(jobs.stdout) == []  # the lab ran no blueprint job; an unreadable store would exit 1
    assert f"store: sqlite:///{store_file} (from profile {lab.home / 'config'}" in jobs.stderr
    assert f"Prefect server: {json.loads((lab.home / 'lab' / 'lab.lock').read_text())['api_url']} (from profile" \
        in jobs.stderr


@pytest.mark.lab
def test_down_stops_the_lab_and_later_commands_no_longer_use_its_server(lab):
    """Last of the tests on the shared lab: it stops it, starts it again and stops that one with SIGTERM."""
    from mn_prefect.model.placement import PlacedResources, Placement
    from mn_prefect.store import open_store

    started = [lab.proc.pid, *descendants(lab.proc.pid)]
    store_file = lab.home / "lab" / "state.db"
    # A booking of a run the stop interrupts (as a scheduled lifecycle run's would be): nothing can use it after
    # the lab's workers and runs have ended, so the stop releases it and says why.
    store = open_store(f"sqlite:///{store_file}")
    interrupted = str(uuid.uuid4())  # a flow run's booking
    assert store.commit_plan(interrupted, [Placement(agent_id="interrupted-run", node="cpu-1",
                                                     resources=PlacedResources(cpu_cores=0.5))]).ok
    # An unknown owner's booking is kept (and named), and a team's keyed reservation outlives the lab.
    assert store.commit_plan("by-hand", [Placement(agent_id="by-hand", node="cpu-1",
                                                   resources=PlacedResources(cpu_cores=0.25))]).ok
    store.close()
    reserved = mn(lab.home, "reserve", "--resources", '{"cpu": 1}', "--for", "2h", "--key", "team-b", "--json")
    assert reserved.returncode == 0, reserved.stdout + reserved.stderr
    rid = json.loads(reserved.stdout)["reservation"]["id"]

    # The README's second terminal made the lab's profile active: stopping the lab switches back to the user's.
    prefect_file = lab.home / "prefect-client" / "profiles.toml"
    prefect_file.write_text(prefect_file.read_text().replace('active = "mine"', 'active = "mn-lab"'))

    down = mn(lab.home, "down", timeout=60)

    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    assert f"stopped the lab (pid {lab.proc.pid}" in down.stdout
    assert "switched back to mine" in " ".join(down.stdout.split()), down.stdout
    assert [p for p in started if running(p)] == []
    assert lab_processes(lab.home / "lab") == []
    assert profile(lab.home)["lab"]["status"] == "stopped"
    prefect_profiles = tomllib.loads((lab.home / "prefect-client" / "profiles.toml").read_text())
    assert prefect_profiles["active"] == "mine" and "mn-lab" in prefect_profiles["profiles"]  # the user's, as it was
    later = mn(lab.home, "--verbose", "job", "list", "--json")
    assert "Prefect server: none" in later.stderr
    assert f"store: sqlite:///{store_file} (from profile" in later.stderr
    # The store outlives the lab: the command read it (an unreadable store exits 1), and it still holds
    # the three nodes the lab's workers registered and the example runs' history.
    assert later.returncode == 0 and json.loads(later.stdout) == [], later.stderr[-3000:]
    store = open_store(f"sqlite:///{store_file}")
    assert sorted(n.record.name for n in store.list_nodes()) == ["cpu-1", "gpu-1", "gpu-2"]
    # Every run's booking was released, the interrupted one's too (by the stop, or by its node's sweep first: no
    # such flow run exists); the reservation and the unknown one were kept (tests/test_owners.py: the rule).
    assert sorted(store.active_jobs()) == sorted(["by-hand", rid])
    assert interrupted not in store.active_jobs()
    assert f"kept 1 reservation(s) with their capacity until they end: {rid}" in down.stdout + lab.output()
    assert "kept 1 booking(s) whose owner is unknown" in lab.output()
    store.close()

    # The next `up` finds the reservation still holding its core, and active; a SIGTERM stops all it started.
    again = Up(lab.home)
    try:
        again.wait_until(READY)
        listed = mn(lab.home, "reserve", "--list", "--json")
        [entry] = json.loads(listed.stdout)
        assert entry["id"] == rid and entry["status"] == "active", entry
        store = open_store(f"sqlite:///{store_file}")
        held = [p for p in store.active_placements(job_id=rid) if p.reserves == rid]
        assert sum(p.resources.cpu_cores for p in held) == 1
        store.close()
        _sigterm_stops_every_process(again)
    finally:
        again.kill()


def _sigterm_stops_every_process(up: Up) -> None:
    """A SIGTERM to a ready `up` stops every process it started, and the lab's profile says stopped."""
    started = [up.proc.pid, *descendants(up.proc.pid)]
    assert len(started) >= 5, started  # up, the Prefect server and three workers at least

    up.proc.send_signal(signal.SIGTERM)

    # README: within 10 s on an idle machine; here only that it happens (the suite runs on busy cores).
    up.proc.wait(60)
    servers.wait_for(lambda: not [p for p in started if running(p)], timeout=30, interval=0.2,
                     what=f"every process of the lab to end after SIGTERM: {[p for p in started if running(p)]}")
    assert lab_processes(up.home / "lab") == []
    assert "lab stopped" in up.output()
    assert profile(up.home)["lab"]["status"] == "stopped"


@pytest.mark.lab
def test_sigterm_while_starting_stops_what_was_started(tmp_path):
    up = Up(tmp_path)
    try:
        servers.wait_for(lambda: descendants(up.proc.pid), timeout=60, interval=0.1,
                         what="`up` to start the Prefect server")
        started = [up.proc.pid, *descendants(up.proc.pid)]

        up.proc.send_signal(signal.SIGTERM)

        assert up.proc.wait(60) == 128 + signal.SIGTERM, up.output()[-3000:]
        servers.wait_for(lambda: not [p for p in started if running(p)], timeout=30, interval=0.2,
                         what=f"every process of the lab to end after SIGTERM: {[p for p in started if running(p)]}")
        assert lab_processes(tmp_path / "lab") == []
    finally:
        up.kill()


@pytest.mark.lab
def test_exit_when_done_stops_everything_once_the_runs_are_over(tmp_path, leaves_nothing):
    result = subprocess.run([MN_PREFECT, "up", "--exit-when-done", "--port", "0", "--runs", "0"],
                            cwd=ROOT, env=lab_env(tmp_path), capture_output=True, text=True, timeout=580)

    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "0 of 0 runs completed" in result.stdout and "lab stopped" in result.stdout
    # No Docker daemon answers here: one line says so, and the container example is not deployed.
    assert (f"containers: off (no Docker daemon answers at unix://{tmp_path}/no-docker.sock: the socket does not "
            "exist (is Docker installed and its daemon started?)); the container example is not deployed") \
        in " ".join(result.stdout.split()), result.stdout
    assert "DockerException" not in result.stdout and "FileNotFoundError" not in result.stdout
    with sqlite3.connect(tmp_path / "lab" / "prefect" / "prefect.db") as db:
        deployed = sorted(name for (name,) in db.execute("SELECT name FROM deployment"))
    assert deployed == ["cuda-inference", "drain", "http-service", "reconcile", "scratch-writer"], deployed
    assert "The lab keeps running" not in result.stdout
    assert lab_processes(tmp_path / "lab") == []
    assert profile(tmp_path)["lab"]["status"] == "stopped"


def test_down_without_a_running_lab_says_so(tmp_path):
    result = mn(tmp_path, "down")

    assert result.returncode == 0 and "no lab is running" in result.stdout


def test_a_taken_port_is_refused_by_name(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        result = mn(tmp_path, "up", "--port", str(port), "--runs", "0")

    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"--port {port}: port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "Prefect server up" not in result.stdout


def test_the_lock_of_a_dead_up_is_taken_over(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "lab.lock").write_text(json.dumps({"pid": dead.pid, "ui_url": "http://127.0.0.1:1"}))
    with socket.socket() as taken:  # a taken port makes this `up` stop right after it takes the lock
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        result = mn(tmp_path, "up", "--port", str(port), "--runs", "0")

    assert "already running" not in result.stderr
    assert f"--port {port}" in result.stderr
    assert json.loads((tmp_path / "lab" / "lab.lock").read_text())["pid"] != dead.pid  # the new `up` took it


def test_an_interrupt_while_a_process_is_being_started_arrives_once_it_is_recorded():
    # `up` starts its server and workers inside interrupts_deferred(): Ctrl-C or SIGTERM during Popen (which
    # waits for the child's exec) would otherwise leave a process that nobody records and nobody stops.
    started = []
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # a known start, whatever ran here before
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # delivered now, without the deferral: this line would not finish
            started.append("recorded")
    assert started == ["recorded"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
    signal.signal(signal.SIGINT, before)


def test_prefect_deploy_all_deploys_only_what_runs_without_docker_and_up_adds_the_container_example_with_it():
    import yaml

    from mn_prefect.cli.up import CONTAINERS_FILE, _examples

    def drivers(name: str) -> dict[str, str | None]:
        spec = yaml.safe_load((ROOT / "deployments" / name).read_text())["deployments"]
        return {d["name"]: d["work_pool"]["job_variables"].get("resources", {}).get("runtime_driver") for d in spec}

    # `prefect deploy --all --prefect-file deployments/prefect.yaml` (the README's line) on a machine without Docker:
    # nothing in it asks for a driver such a machine lacks; the container example is in containers.yaml alone.
    assert "docker" not in drivers("prefect.yaml").values() and "container-hello" not in drivers("prefect.yaml")
    assert drivers(CONTAINERS_FILE) == {"container-hello": "docker"}
    prefect_yaml = ROOT / "deployments" / "prefect.yaml"
    pool, deploys, examples = _examples(prefect_yaml, containers=False)
    assert pool == "mn-lab" and [path.name for path, _ in deploys] == ["prefect.yaml"]
    assert ("container-hello", "flows/container_hello.py:container_hello") not in examples
    pool, deploys, examples = _examples(prefect_yaml, containers=True)
    assert [(path.name, names) for path, names in deploys][1] == (CONTAINERS_FILE, ["container-hello"])
    assert ("container-hello", "flows/container_hello.py:container_hello") in examples
    assert not any(entrypoint.startswith("mn_prefect.") for _, entrypoint in examples)
