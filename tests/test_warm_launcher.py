"""Warm starts (mn_prefect.worker.warm_launcher, warm_start): a real launcher process forks each run; what the run
sees is compared key by key with the same module started cold, as ``python -m``; exits, signals and a launcher
killed mid-run; a preload that does not import. The lab test at the end runs flows through a real worker."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import servers

from mn_prefect.worker import warm_start
from mn_prefect.worker.warm_launcher import MAX_MESSAGE
from mn_prefect.worker.warm_start import WarmLaunchers, WarmUnavailable

PROBE = '''
import json, os, sys
STATE = []
STATE.append(len(STATE))
data = {"env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv, "path": sys.path, "state": STATE,
        "name": __name__, "orig_argv": sys.orig_argv[1:], "group_leader": os.getpgid(0) == os.getpid(),
        "session_leader": os.getsid(0) == os.getpid(), "gpu_loaded": "libcuda" in open("/proc/self/maps").read()}
open(os.environ["PROBE_OUT"], "w").write(json.dumps(data))
while os.environ.get("PROBE_HOLD") and not os.path.exists(os.environ["PROBE_HOLD"]):
    import time
    time.sleep(0.05)
if os.environ.get("PROBE_BURN"):  # this much CPU, in seconds
    import time
    while time.process_time() < float(os.environ["PROBE_BURN"]):
        pass
if os.environ.get("PROBE_EXIT"):
    os._exit(int(os.environ["PROBE_EXIT"]))
'''


class _Log:
    def __init__(self):
        self.lines: list[str] = []

    def warning(self, message, *args):
        self.lines.append(message % args)

    debug = info = warning


@pytest.fixture(scope="module")
def launchers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("warm")
    log = _Log()
    found = WarmLaunchers(logger=log, node="n1", folder=folder / "w")
    found.start(())
    servers.wait_for(lambda: _ready(found, ()), timeout=120, what="the warm launcher ready")
    yield found
    found.close()


def _ready(launchers: WarmLaunchers, preload) -> bool:
    try:
        launchers.pick(preload, dict(os.environ))
        return True
    except WarmUnavailable:
        return False


@pytest.fixture
def probe_dir(tmp_path):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    work = tmp_path / "work"
    work.mkdir()
    return tmp_path


def _env(probe_dir: Path, out: str, **extra) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(probe_dir), "PROBE_OUT": str(probe_dir / out),
            "CUDA_VISIBLE_DEVICES": "3", **extra}


def _warm(launchers: WarmLaunchers, env: dict, cwd: Path, *argv: str) -> tuple[socket.socket, int]:
    launcher = launchers.pick((), env)
    conn, pid = warm_start._request_run(launcher, {"argv": ["-m", "probe_mod", *argv], "env": env, "cwd": str(cwd),
                                                    "rlimits": {}, "umask": 0o022}, [1, 2])
    conn.send(b'{"go": true}')
    return conn, pid


def _exit(conn: socket.socket) -> int:
    conn.settimeout(120)
    return json.loads(conn.recv(MAX_MESSAGE))["exit"]


def test_a_warm_run_sees_what_a_cold_one_sees_key_by_key(launchers, probe_dir):
    cwd = probe_dir / "work"
    conn, _pid = _warm(launchers, _env(probe_dir, "warm.json"), cwd, "a1", "--x")
    assert _exit(conn) == 0
    cold = subprocess.run([sys.executable, "-m", "probe_mod", "a1", "--x"], env=_env(probe_dir, "cold.json"),
                          cwd=cwd, start_new_session=True)
    assert cold.returncode == 0
    warm, cold_seen = (json.loads((probe_dir / f).read_text()) for f in ("warm.json", "cold.json"))
    assert warm.keys() == cold_seen.keys()
    for key in warm:
        if key == "env":
            differ = {k for k in warm["env"].keys() | cold_seen["env"].keys()
                      if warm["env"].get(k) != cold_seen["env"].get(k)}
            assert differ == {"PROBE_OUT"}, differ
        else:
            assert warm[key] == cold_seen[key], key
    assert warm["env"]["CUDA_VISIBLE_DEVICES"] == "3" and warm["group_leader"] and warm["session_leader"]
    assert warm["name"] == "__main__" and not warm["gpu_loaded"]


def test_two_warm_runs_share_no_module_state(launchers, probe_dir):
    for out in ("one.json", "two.json"):
        conn, _ = _warm(launchers, _env(probe_dir, out), probe_dir)
        assert _exit(conn) == 0
    assert [json.loads((probe_dir / f).read_text())["state"] for f in ("one.json", "two.json")] == [[0], [0]]
    assert "probe_mod" not in json.dumps(launchers.pick((), dict(os.environ)).preload)


def test_the_exit_code_is_the_runs_own(launchers, probe_dir):
    conn, _ = _warm(launchers, _env(probe_dir, "x.json", PROBE_EXIT="3"), probe_dir)
    assert _exit(conn) == 3


def _children_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime: waited-for children


def _zombies(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, NotADirectoryError):
            continue
        if fields[0] == "Z" and int(fields[1]) == parent:
            found.append(int(entry.name))
    return found


def test_a_warm_runs_cpu_is_counted_to_its_launcher_and_no_keeper_is_left_a_zombie(launchers, probe_dir):
    """Process accounting sees a warm run as it sees a cold one under the worker: the launcher waits for each
    keeper (which waited for its run), so their CPU is added to the launcher's children's."""
    launcher_pid = launchers.pick((), dict(os.environ)).hello()["pid"]
    before = _children_cpu_s(launcher_pid)
    conn, _ = _warm(launchers, _env(probe_dir, "burn.json", PROBE_BURN="0.5"), probe_dir)
    assert _exit(conn) == 0
    servers.wait_for(lambda: _children_cpu_s(launcher_pid) - before >= 0.5, timeout=30,
                     what="the run's CPU in its launcher's children's")
    servers.wait_for(lambda: not _zombies(launcher_pid), timeout=30, what="the ended keeper reaped")


def test_a_signal_to_the_process_group_stops_a_warm_run(launchers, probe_dir):
    hold = probe_dir / "never"
    conn, pid = _warm(launchers, _env(probe_dir, "held.json", PROBE_HOLD=str(hold)), probe_dir)
    servers.wait_for(lambda: (probe_dir / "held.json").exists(), timeout=60, what="the run started")
    os.killpg(pid, signal.SIGTERM)  # Prefect's cancellation: the group, then SIGKILL after the grace
    assert _exit(conn) == -signal.SIGTERM


def test_a_launcher_killed_mid_run_loses_no_run(tmp_path, probe_dir):
    own = WarmLaunchers(logger=_Log(), node="n1", folder=tmp_path / "w")
    own.start(())
    try:
        servers.wait_for(lambda: _ready(own, ()), timeout=120, what="the warm launcher ready")
        hold = probe_dir / "open"
        conn, pid = _warm(own, _env(probe_dir, "mid.json", PROBE_HOLD=str(hold), PROBE_EXIT="7"), probe_dir)
        servers.wait_for(lambda: (probe_dir / "mid.json").exists(), timeout=60, what="the run started")
        launcher = own.pick((), dict(os.environ))
        launcher.process.kill()
        launcher.process.wait(30)
        hold.write_text("go")
        assert _exit(conn) == 7  # its keeper outlived the launcher and reported the run's end
        with pytest.raises(WarmUnavailable, match="starting"):  # the next run starts cold; a new launcher starts
            own.pick((), dict(os.environ))
        assert own._launchers[()].alive()
    finally:
        own.close()


def test_a_preload_that_does_not_import_is_said_once_and_runs_start_cold(tmp_path):
    log = _Log()
    own = WarmLaunchers(logger=log, node="n1", folder=tmp_path / "w")
    preload = ("json", "no_such_module_for_mn_tests")
    own.start(preload)
    try:
        def said() -> bool:
            try:
                own.pick(preload, dict(os.environ))
            except WarmUnavailable as why:
                return "did not import" in str(why)
            return False

        servers.wait_for(said, timeout=120, what="the failed preload reported")
        with pytest.raises(WarmUnavailable, match="did not import"):
            own.pick(preload, dict(os.environ))
        said_lines = [line for line in log.lines if "no_such_module_for_mn_tests" in line]
        assert len(said_lines) == 1 and "ModuleNotFoundError" in said_lines[0]
        assert not own._launchers[preload].alive()  # stopped, not restarted
    finally:
        own.close()


def test_a_launcher_from_an_older_install_is_replaced(launchers, monkeypatch):
    monkeypatch.setattr(launchers, "_stamp", "older")
    with pytest.raises(WarmUnavailable, match="older install"):
        launchers.pick((), dict(os.environ))
    servers.wait_for(lambda: _ready(launchers, ()), timeout=120, what="the new launcher ready")


def test_interpreter_start_up_variables_that_differ_start_cold(launchers):
    with pytest.raises(WarmUnavailable, match="start-up variables"):
        launchers.pick((), {**os.environ, "PYTHONHASHSEED": "123"})


def test_the_socket_is_the_workers_alone(launchers):
    launcher = launchers.pick((), dict(os.environ))
    assert launcher.socket_path.stat().st_mode & 0o777 == 0o600


def test_a_bad_preload_name_is_refused_naming_the_field():
    from pydantic import ValidationError

    from mn_prefect.worker.variables import MNVariables

    with pytest.raises(ValidationError, match="preload"):
        MNVariables(preload=["numpy; rm -rf"])
    assert MNVariables().warm_start is False and MNVariables(preload=["torch.nn"]).preload == ["torch.nn"]


def test_a_worker_that_never_says_go_gets_nothing_started(launchers, probe_dir):
    launcher = launchers.pick((), dict(os.environ))
    env = _env(probe_dir, "nogo.json")
    conn, pid = warm_start._request_run(launcher, {"argv": ["-m", "probe_mod"], "env": env, "cwd": str(probe_dir),
                                                    "rlimits": {}, "umask": 0o022}, [1, 2])
    conn.close()  # a worker that gave up: the keeper ends the run before it starts
    servers.wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), timeout=60, what="the run ended")
    assert not (probe_dir / "nogo.json").exists()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# -- through a real worker and Prefect server ---------------------------------------------------------------------

LAB_FLEET = [{"name": "warm-1", "cpu_cores": 20, "memory_mb": 65536, "dynamic_port_range": [29100, 29199]}]
WARM_PROBE = "warm_probe.py:warm_probe"
# What differs between two runs of a deployment whatever starts them (their ids, their allocation: its cores).
PER_RUN = {"MN_ALLOCATION_JSON", "PREFECT__CONTROL_TOKEN", "PREFECT__CONTROL_PORT", "PREFECT__DEPLOYMENT_ID", "PREFECT__DEPLOYMENT_NAME"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from lab import Lab

    lab = Lab(tmp_path_factory.mktemp("warmlab"), fleet=LAB_FLEET)
    yield lab
    lab.stop()


@pytest.fixture(scope="module")
def warm_deployment(lab):
    deployment = lab.deploy({"resources": {"cpu": 1}, "warm_start": True}, entrypoint=WARM_PROBE)
    # The pool's launcher starts with the first warm run (which starts cold): until one is warm.
    for _ in range(30):
        run_id = lab.run(deployment)
        assert lab.wait(run_id)["state"]["type"] == "COMPLETED"
        if json.loads((lab.out / f"{run_id}.json").read_text())["warm"]:
            return deployment
    raise AssertionError("no run of the warm deployment was started warm")


def _pulled(path: str) -> str:
    return re.sub(r"^.*/tmp\w+prefect$", "<pulled>", path)


def _record(lab, run_id: str) -> dict:
    return json.loads((lab.out / f"{run_id}.json").read_text())


@pytest.mark.lab
def test_a_warm_started_flow_sees_what_a_cold_one_sees(lab, warm_deployment):
    cold_deployment = lab.deploy({"resources": {"cpu": 1}}, entrypoint=WARM_PROBE)
    runs = [lab.run(d) for d in (warm_deployment, cold_deployment)]
    for run_id in runs:
        assert lab.wait(run_id)["state"]["type"] == "COMPLETED"
    warm, cold = (_record(lab, r) for r in runs)
    assert (warm["warm"], cold["warm"]) == (True, False)
    assert warm["env"].keys() == cold["env"].keys()
    assert {k for k in warm["env"] if warm["env"][k] != cold["env"][k]} <= PER_RUN
    for key in ("argv", "state", "main"):
        assert warm[key] == cold[key], key
    # The process group Prefect gives a cold start of a deployment with its own command: the worker's.
    assert warm["pgid"] == cold["pgid"] == os.getpgid(lab.workers[0].pid)
    # Each run's flow code is pulled to a temporary folder of its own: the same entry, each run its own folder.
    assert [_pulled(p) for p in warm["path"]] == [_pulled(p) for p in cold["path"]]
    assert warm["state"] == [0]  # its flow module was imported afresh


@pytest.mark.lab
def test_a_warm_run_that_exits_3_is_crashed_with_that_code(lab, warm_deployment):
    run_id = lab.run(warm_deployment, exit_code=3)
    state = lab.wait(run_id)["state"]
    assert _record(lab, run_id)["warm"]
    assert state["type"] == "CRASHED" and "status code: 3" in state["message"], state


@pytest.mark.lab
def test_cancelling_a_warm_run_stops_it(lab, warm_deployment):
    run_id = lab.run(warm_deployment, hold_until=str(lab.out / "never-opened"))
    servers.wait_for(lambda: (lab.out / f"{run_id}.json").exists(), timeout=120, what="the run started")
    assert _record(lab, run_id)["warm"]
    lab.http.post(f"/flow_runs/{run_id}/set_state", json={"state": {"type": "CANCELLING"}, "force": True})
    assert lab.wait(run_id)["state"]["type"] == "CANCELLED"
    pid = _record(lab, run_id)["pid"]
    servers.wait_for(lambda: _zombie(pid), timeout=60, what="the flow process gone")


@pytest.mark.lab
def test_the_launcher_killed_mid_run_loses_no_run(lab, warm_deployment):
    from mn_prefect.local_lab import descendants

    gate = lab.out / "launcher-gate"
    run_id = lab.run(warm_deployment, hold_until=str(gate))
    servers.wait_for(lambda: (lab.out / f"{run_id}.json").exists(), timeout=120, what="the run started")
    assert _record(lab, run_id)["warm"]
    # A flow process forked by the launcher shows the launcher's command line too: not it.
    launchers = [pid for pid in descendants(lab.workers[0].pid) if _launcher(pid) and pid != _record(lab, run_id)["pid"]]
    assert launchers
    for pid in launchers:
        os.kill(pid, signal.SIGKILL)
    gate.write_text("open")
    assert lab.wait(run_id)["state"]["type"] == "COMPLETED"
    after = lab.run(warm_deployment)  # cold while a new launcher starts
    assert lab.wait(after)["state"]["type"] == "COMPLETED"


def _launcher(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"mn_prefect.worker.warm_launcher" in cmdline and os.getpgid(pid) == pid


@pytest.mark.lab
def test_twenty_warm_starts_at_once_on_a_20_core_node(lab, warm_deployment):
    gate = lab.out / "twenty-gate"
    runs = [lab.run(warm_deployment, hold_until=str(gate)) for _ in range(20)]
    # All twenty placed together (1 core each of 20) and running at once, each forked by the launcher.
    servers.wait_for(lambda: all((lab.out / f"{r}.json").exists() for r in runs), timeout=300, interval=1,
                     what="twenty warm runs started")
    records = [_record(lab, r) for r in runs]
    assert all(record["warm"] for record in records)
    assert len({record["pid"] for record in records}) == 20
    gate.write_text("open")
    assert [lab.wait(r, timeout=180)["state"]["type"] for r in runs] == ["COMPLETED"] * 20
