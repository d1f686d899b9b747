"""MirrorNeuron's own clients, unmodified, against mn-prefect: the real ``mn`` command (mirrorneuron-cli) and
``mn_sdk.Client`` talk to ``mn-prefect mn-api serve`` in front of a lab (a real Prefect server, three real mn
workers, a store file), and what they change shows in what mn-prefect's own command line and store report."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import grpc
import prefect_env
import pytest
import servers
from lab import Lab

pytestmark = pytest.mark.lab  # a Prefect server and three workers

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "bundles"
BIN = Path(sys.executable).parent
MN_PREFECT = str(BIN / "mn-prefect")
MN = str(BIN / "mn")
NO_PROXY = ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


class ApiServer:
    """``mn-prefect mn-api serve`` as a real process on a free loopback port."""

    def __init__(self, lab: Lab, home: Path, *, pool: str | None = None, token: str | None = None,
                 host: str = "127.0.0.1"):
        home.mkdir(parents=True, exist_ok=True)
        env = {**lab.server.env, "MN_STORE_URL": lab.store_url, "MN_PREFECT_HOME": str(home / ".mn-prefect")}
        env.pop("MN_GRPC_AUTH_TOKEN", None)
        if token:
            env["MN_GRPC_AUTH_TOKEN"] = token
        self.bundles = home / "jobs"
        self.log = open(home / "mn-api.log", "w+")
        self.proc = subprocess.Popen([MN_PREFECT, "mn-api", "serve", "--host", host, "--port", "0", "--pool",
                                      pool or lab.pool, "--bundles-root", str(self.bundles)],
                                     env=env, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True)
        line = self.proc.stdout.readline()
        match = re.fullmatch(r"export MN_GRPC_TARGET=(\S+)\n", line)
        assert match, f"no address from the API server: {line!r}; log: {(home / 'mn-api.log').read_text()}"
        self.target = match.group(1)

    def stop(self) -> None:
        prefect_env.stop_process(self.proc)
        self.log.close()


def mn_env(home: Path, target: str, token: str | None = None) -> dict[str, str]:
    """An environment for the ``mn`` command alone: its own HOME (no ~/.mn of the machine), no update check, plain
    output, no proxy between it and loopback."""
    env = {k: v for k, v in os.environ.items() if k not in NO_PROXY and not k.startswith("MN_")}
    env.update({"HOME": str(home), "MN_HOME": str(home / ".mn"), "MN_GRPC_TARGET": target,
                "MN_DISABLE_UPDATE_CHECK": "1", "MN_CLI_OUTPUT": "plain", "NO_COLOR": "1", "COLUMNS": "160",
                "MN_RUN_BACKGROUND_EVENT_RELAY": "0", "MN_GRPC_TIMEOUT_SECONDS": "120"})
    if token:
        env["MN_GRPC_AUTH_TOKEN"] = token
    return env


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The bundle runs' run stores go to ``lab.runs_root`` (the workers' MN_RUNS_ROOT), not the machine's ~/.mn."""
    home = tmp_path_factory.mktemp("mn-clients")
    runs_root = home / "runs"
    lab = Lab(home, worker_env={"MN_RUNS_ROOT": str(runs_root)})
    lab.runs_root = runs_root
    yield lab
    lab.stop()


@pytest.fixture(scope="module")
def api(lab, tmp_path_factory):
    server = ApiServer(lab, tmp_path_factory.mktemp("mn-api"))
    yield server
    server.stop()


@pytest.fixture
def mn(api, tmp_path):
    home = tmp_path / "home"
    home.mkdir()

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([MN, *args], env=mn_env(home, api.target), cwd=home, capture_output=True, text=True,
                              timeout=timeout)
    return run


def mn_prefect(lab: Lab, *args: str) -> dict | list:
    done = subprocess.run([MN_PREFECT, *args, "--json", "--store-url", lab.store_url], capture_output=True, text=True,
                          env={**lab.server.env}, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def node(lab: Lab, name: str) -> dict:
    return next(n for n in mn_prefect(lab, "node", "list") if n["name"] == name)


def payloads_of(bundle: Path) -> dict[str, bytes]:
    """What the clients send of a bundle: each file under payloads/, by its path there."""
    return {str(p.relative_to(bundle / "payloads")): p.read_bytes()
            for p in (bundle / "payloads").rglob("*") if p.is_file()}


def printed_json(out: str):
    """The JSON document the ``mn`` command printed (after any lines of its own)."""
    return json.loads(out[out.index("{"):])


def test_node_list_shows_the_labs_nodes_with_their_mirror_neuron_ids(lab, mn):
    done = mn("node", "list")
    assert done.returncode == 0, done.stdout
    summary = printed_json(done.stdout)
    nodes = {n["name"]: n for n in summary["nodes"]}
    assert set(nodes) == {"gpu-1", "gpu-2", "cpu-1"}
    assert nodes["gpu-1"]["node_id"] == "mirror_neuron@gpu-1" and nodes["gpu-1"]["gpu_count"] == 2
    assert all(n["status"] == "healthy" for n in nodes.values())


def test_maintenance_set_through_mn_shows_in_mn_prefects_node_list_and_unknown_nodes_change_nothing(lab, mn):
    done = mn("node", "maintenance", "mirror_neuron@gpu-2", "--enable", "--reason", "firmware")
    assert done.returncode == 0 and "Status: maintenance" in done.stdout, done.stdout
    assert node(lab, "gpu-2")["status"] == "maintenance" and not node(lab, "gpu-2")["scheduling_eligible"]
    unknown = mn("node", "maintenance", "gpu-9", "--enable", "--reason", "x")
    assert unknown.returncode == 2 and "MN_NOT_FOUND" in unknown.stdout, unknown.stdout
    done = mn("node", "maintenance", "gpu-2", "--disable", "--reason", "done")
    assert done.returncode == 0 and "Status: healthy" in done.stdout, done.stdout
    assert node(lab, "gpu-2")["status"] == "healthy" and node(lab, "gpu-2")["scheduling_eligible"]
    assert {n["status"] for n in mn_prefect(lab, "node", "list")} == {"healthy"}


def test_drain_dry_run_wait_and_undrain_through_mn(lab, mn):
    preview = mn("node", "drain", "cpu-1", "--reason", "kernel", "--deadline", "30m", "--dry-run")
    assert preview.returncode == 0 and "node:cpu-1: dry_run" in preview.stdout, preview.stdout
    assert node(lab, "cpu-1")["status"] == "healthy"  # a dry run changes nothing
    drained = mn("node", "drain", "cpu-1", "--reason", "kernel", "--deadline", "30m", "--wait")
    assert drained.returncode == 0 and "Node drain successful" in drained.stdout, drained.stdout
    assert node(lab, "cpu-1")["status"] == "maintenance"  # a completed drain ends in maintenance
    system_too = mn("--debug", "node", "drain", "gpu-1", "--reason", "all", "--include-system-jobs")
    assert system_too.returncode == 2 and "MN_INVALID_ARGUMENT" in system_too.stdout, system_too.stdout
    assert "ignore_system_jobs" in system_too.stdout and node(lab, "gpu-1")["status"] == "healthy"
    not_draining = mn("--debug", "node", "undrain", "gpu-1", "--reason", "x")
    assert not_draining.returncode == 1 and "MN_FAILED_PRECONDITION" in not_draining.stdout, not_draining.stdout
    assert node(lab, "gpu-1")["status"] == "healthy"
    back = mn("node", "undrain", "cpu-1", "--reason", "patched", "--mark-eligible")
    assert back.returncode == 0 and "Status: healthy" in back.stdout, back.stdout
    assert node(lab, "cpu-1")["status"] == "healthy" and node(lab, "cpu-1")["scheduling_eligible"]
    reconciled = mn("node", "reconcile", "gpu-1", "--reason", "check", "--dry-run")
    assert reconciled.returncode == 0 and "Node reconcile successful" in reconciled.stdout, reconciled.stdout


def plan(lab: Lab, request: dict) -> dict:
    done = subprocess.run([MN_PREFECT, "plan", "--request", json.dumps(request), "--store-url", lab.store_url],
                          capture_output=True, text=True, env=lab.server.env)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return json.loads(done.stdout)


def test_limits_set_through_mn_bind_the_scheduler(lab, mn):
    ask = {"cpu_cores": 10, "memory_mb": 1024}
    assert plan(lab, ask)["status"] == "runnable_now"
    try:
        done = mn("resource", "set", "--cpu", "25", "--memory", "75")
        assert done.returncode == 0 and "Resource set successful" in done.stdout, done.stdout
        assert printed_json(done.stdout)["limits"]["cpu"] == 25
        limited = plan(lab, ask)  # 25% of the largest node's 32 cores is 8: a 10-core run fits nowhere now
        assert limited["status"] == "not_runnable" and "insufficient cpu" in limited["reason"], limited
        bad = mn("resource", "set", "--cpu", "150")
        assert bad.returncode == 2 and "MN_INVALID_ARGUMENT" in bad.stdout, bad.stdout
        assert mn_prefect(lab, "resource", "list", "--store")["limits"]["cpu"] == 25  # the refusal changed nothing
    finally:
        assert mn("resource", "set", "--cpu", "100", "--memory", "100").returncode == 0


def test_resource_list_through_mn(lab, api, tmp_path):
    """``mn resource list`` also asks a local model runner at host.docker.internal: it runs in a network namespace
    of its own (loopback only) with an API server beside it, so no lookup leaves the machine."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**mn_env(home, "127.0.0.1:55061"), "MN_STORE_URL": lab.store_url,
           "MN_PREFECT_HOME": str(tmp_path / ".mn-prefect"), "PATH": f"{BIN}:{os.environ['PATH']}"}
    script = (f"ip link set lo up\n"
              f"{MN_PREFECT} mn-api serve --port 55061 --pool {lab.pool} > {tmp_path}/api.out 2> {tmp_path}/api.err &\n"
              f"api=$!\n"
              f"for i in $(seq 150); do grep -q export {tmp_path}/api.out && break; sleep 0.2; done\n"
              f"{MN} resource list; status=$?\n"
              f"kill -INT $api; wait $api; exit $status\n")
    done = subprocess.run(["unshare", "--net", "sh", "-c", script], env=env, cwd=home, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr + (tmp_path / "api.err").read_text()
    doc = printed_json(done.stdout)
    assert {n["name"] for n in doc["nodes"]} == {"gpu-1", "gpu-2", "cpu-1"}
    assert doc["totals"]["cpu_cores"] == 56 and doc["totals"]["gpu_count"] == 3


BUNDLES = ["demo_dag_linear", "demo_retry_recovery", "demo_dag_scatter_gather", "demo_resource_allocation"]


def test_the_demo_bundles_run_from_mn_as_the_prefect_flow_runs_mn_prefect_reports(lab, api, tmp_path):
    """``mn blueprint run --folder`` on each demo bundle at once, each followed live to its end; then ``mn job
    status``, ``mn job list`` and ``mn run status`` against what mn-prefect and Prefect say of the same runs."""
    expected = json.loads((EXAMPLES / "EXPECTED.json").read_text())
    running = {}
    for name in BUNDLES:
        home = tmp_path / name
        home.mkdir()
        before = len(list(api.bundles.glob("job_*")))
        proc = running[name] = subprocess.Popen([MN, "blueprint", "run", "--folder", str(EXAMPLES / name)],
                                                env=mn_env(home, api.target), cwd=home, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True)
        # The next starts once this one's job is created: the runs overlap, their deployments are written one
        # after another (a Prefect server on SQLite answers concurrent deployment writes with 503s and back-offs).
        servers.wait_for(lambda n=before, p=proc: len(list(api.bundles.glob("job_*"))) > n or p.poll() is not None,
                         timeout=120, interval=0.2, what=f"the job of {name} to be created")
    runs = {}
    for name, proc in running.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        assert re.search(r"Status: +Completed", out), f"{name}: {out[-3000:]}"
        runs[name] = re.search(rf"({name}-[0-9a-f]+)", out).group(1)

    def mn(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([MN, *args], env=mn_env(tmp_path, api.target), cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)

    listed = mn("job", "list")
    assert listed.returncode == 0, listed.stdout
    ours = {j["flow_run_id"]: j for j in mn_prefect(lab, "job", "list")}
    for name, run_id in runs.items():
        status = mn("job", "status", run_id)
        assert status.returncode == 0, status.stdout
        job = printed_json(status.stdout)["job"]
        assert job["status"] == "completed" and job["flow_run_url"].endswith(job["flow_run_id"])
        want = {sid: text.split()[0] for sid, text in expected[name]["steps"].items()}
        assert {sid: step["state"] for sid, step in job["steps"].items()} == want, name
        assert re.search(rf"{run_id} .* completed", listed.stdout), listed.stdout
        # mn-prefect's own view of the same flow run, and Prefect's
        assert ours[job["flow_run_id"]]["status"] == "completed"
        assert ours[job["flow_run_id"]]["job_id"] == job["mn_prefect_job_id"]
        flow_run = lab.flow_run(job["flow_run_id"])
        assert flow_run["state"]["type"] == "COMPLETED" and f"mn-run:{run_id}" in flow_run["tags"]
        assert not lab.booked(job["flow_run_id"])  # everything it booked is released
    run = mn("run", "status", ours[job["flow_run_id"]]["job_id"])  # mn-prefect's job id finds the same run
    assert run.returncode == 0 and printed_json(run.stdout)["run_id"] == run_id, run.stdout


def test_three_mn_runs_of_a_bundle_at_the_default_timeout_are_three_rows_from_one_deployment(lab, api, tmp_path):
    """``mn blueprint run --folder`` three times with the command's own 10 s deadline (no MN_GRPC_TIMEOUT_SECONDS):
    each run is its own row in ``mn job list`` and ``mn-prefect job list`` (its own mn-prefect job id, though
    ``mn``'s run ids all begin with the bundle's id), and all three ran from the bundle's one deployment."""
    env = mn_env(tmp_path, api.target)
    del env["MN_GRPC_TIMEOUT_SECONDS"]
    runs = []
    for _ in range(3):
        done = subprocess.run([MN, "blueprint", "run", "--folder", str(EXAMPLES / "demo_dag_linear")], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        out = done.stdout + done.stderr
        assert done.returncode == 0 and re.search(r"Status: +Completed", out), out[-3000:]
        runs.append(re.search(r"(demo_dag_linear-[0-9a-f]+)", out).group(1))
    jobs = [printed_json(subprocess.run([MN, "job", "status", r], env=env, cwd=tmp_path, capture_output=True,
                                        text=True, timeout=120).stdout)["job"] for r in runs]
    assert len({j["mn_prefect_job_id"] for j in jobs}) == 3, [j["mn_prefect_job_id"] for j in jobs]
    listed = subprocess.run([MN, "job", "list"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert all(r in listed.stdout for r in runs), listed.stdout
    ours = {j["flow_run_id"]: j for j in mn_prefect(lab, "job", "list")}
    assert {ours[j["flow_run_id"]]["job_id"] for j in jobs} == {j["mn_prefect_job_id"] for j in jobs}
    deployments = {lab.flow_run(j["flow_run_id"])["deployment_id"] for j in jobs}
    assert len(deployments) == 1, deployments
    named = lab.http.get(f"/deployments/{deployments.pop()}").json()["name"]
    assert named == f"api-{lab.pool}-demo-dag-linear", named


# The standard run store a demo's README names as its evidence (the manifests' contract.outputs)
RUN_STORE = {"run.json", "config.json", "inputs.json", "events.jsonl", "errors.jsonl", "timeline.jsonl",
             "observability_summary.json", "result.json", "final_artifact.json"}


def materialized(folder: Path, into: Path) -> Path:
    """The bundle as MirrorNeuron's demo suite hands it to `mn schedule create` and `mn trigger create` (commands that
    take a bundle already lowered to the runtime's shape: ``flow``, ``entrypoints``, ``graph_id`` beside the rest)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    workflow, agents = manifest.get("workflow") or {}, manifest.get("agents") or {}
    if workflow.get("workflow_id"):
        manifest["graph_id"] = workflow["workflow_id"]
    manifest["flow"] = {"nodes": agents.get("nodes", []), "edges": agents.get("edges", []),
                        "steps": workflow.get("steps", []), "graph": {"edges": workflow.get("edges", [])},
                        **{k: workflow[k] for k in ("entrypoint", "source", "sink", "mode", "execution", "dynamic",
                                                    "policy", "state") if k in workflow}}
    manifest["entrypoints"] = agents.get("entrypoints", [])
    manifest["initial_inputs"] = (manifest.get("runtime") or {}).get("initial_inputs", {})
    into.mkdir(parents=True)
    (into / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    shutil.copytree(folder / "payloads", into / "payloads")
    return into


def run_stores(home: Path, run_id: str) -> list[Path]:
    """Where a run sent by `mn blueprint run` keeps its store: first the one the command gave the run (its shared
    storage, ``MN_RUNS_ROOT`` in the submitted manifest), where the steps, the runner and its human gate write; then
    the command's own copy, ``~/.mn/runs/<run>``."""
    return [*home.glob(f".mn/shared/submissions/*/outputs/runs/{run_id}"), home / ".mn" / "runs" / run_id]


def _status(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "run.json").read_text()).get("status")
    except (OSError, ValueError):  # not there yet, or being written
        return None


def completed_run(home: Path, run_id: str) -> Path:
    """The run's store once its run.json says it is over, as MirrorNeuron's demo suite checks it: completed, with
    every file of the standard run store and the demo's final artifact."""
    def ended() -> Path | None:
        return next((d for d in run_stores(home, run_id) if _status(d) in ("completed", "failed", "cancelled")), None)
    try:
        run_dir = servers.wait_for(ended, timeout=240, interval=0.5, what=f"run {run_id}")
    except TimeoutError:
        seen = {str(d): (_status(d), sorted(p.name for p in d.iterdir()) if d.is_dir() else None)
                for d in run_stores(home, run_id)}
        raise AssertionError(f"run {run_id} never ended in its store: {json.dumps(seen, indent=1)}") from None
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed", run_dir
    assert RUN_STORE <= {p.name for p in run_dir.iterdir()}, sorted(p.name for p in run_dir.iterdir())
    final = json.loads((run_dir / "final_artifact.json").read_text())
    assert (final["schema_version"], final["type"]) == ("mn.blueprint.final_artifact.v1", "runtime_demo_result")
    return run_dir


def test_the_lifecycle_demos_pass_mirror_neurons_demo_suite_checks_through_mn(lab, api, tmp_path):
    """The four lifecycle demos driven by `mn` against mn-prefect, each checked as MirrorNeuron's own demo suite
    (mn-blueprints' scripts/run_demo_suite.py) checks it:
    - human approval: `mn blueprint run --folder` asks (the demo waits 15 s for an answer); `mn blueprint human
      respond --runs-root` answers in the run's store; the flow run was Paused in Prefect meanwhile; the run
      completes with its standard run store and the answer recorded;
    - service health: run detached on a port set with `--set`; `mn service resolve demo-health` finds it; after
      `mn job cancel` it is no longer resolvable;
    - periodic schedule: `mn schedule create --cron`, listed, `mn schedule run-now` dispatches a child job, `mn
      schedule delete` removes it;
    - event trigger: `mn trigger create --filter-json`; a non-matching `mn event emit` dispatches nothing, a matching
      one dispatches a job; `mn trigger delete` removes it."""
    home = tmp_path / "home"
    home.mkdir()
    env = mn_env(home, api.target)

    def mn(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([MN, *args], env=env, cwd=home, capture_output=True, text=True, timeout=180)
        assert not check or done.returncode == 0, f"mn {' '.join(args)}: {done.stdout[-3000:]}{done.stderr[-2000:]}"
        return done

    def copied(name: str) -> Path:
        return Path(shutil.copytree(EXAMPLES / name, tmp_path / "bundles" / name))

    # Human approval: answered in the store where the step asked, as soon as it asks
    human_id = "demo-human-1"
    human = subprocess.Popen([MN, "blueprint", "run", "--folder", str(copied("demo_human_approval")), "--offline",
                              "--fake-llm", "--run-id", human_id, "--follow-seconds", "1"], env=env, cwd=home,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pending():
        for run_dir in run_stores(home, human_id):
            asked = (run_dir / "human.jsonl").exists() and [
                e for e in map(json.loads, (run_dir / "human.jsonl").read_text().splitlines())
                if e.get("type") == "human_input_requested"]
            if asked:
                return run_dir, asked[0]["payload"]["request_id"]
        return None
    run_dir, request = servers.wait_for(pending, timeout=240, interval=0.2, what="the human input request")
    mn("blueprint", "human", "respond", human_id, request, "--decision", "approve", "--reviewer", "demo-suite",
       "--runs-root", str(run_dir.parent))
    out, _ = human.communicate(timeout=240)
    assert human.returncode == 0, out[-3000:]
    final_dir = completed_run(home, human_id)
    assert "human_input_received" in (final_dir / "human.jsonl").read_text()
    flow_run = lab.http.post("/flow_runs/filter", json={"flow_runs": {"tags": {"all_": [f"mn-run:{human_id}"]}}}).json()
    assert [f["state"]["type"] for f in flow_run] == ["COMPLETED"], flow_run
    states = lab.http.get("/flow_run_states/", params={"flow_run_id": flow_run[0]["id"]}).json()
    assert "PAUSED" in {state["type"] for state in states}, states  # Prefect's form was there to answer too

    # Service health: resolvable while it runs, not after its job is cancelled
    port = servers.free_port()
    service = mn("blueprint", "run", "--folder", str(copied("demo_service_health")), "--offline", "--fake-llm",
                 "--run-id", "demo-service-1", "--follow-seconds", "1", "--detached", "--set", f"service.port={port}")
    service_job = re.search(r"Job ID:?\s+([A-Za-z0-9_-]+)", service.stdout).group(1)
    resolved = servers.wait_for(lambda: (r := mn("service", "resolve", "demo-health", check=False)).returncode == 0
                                and "demo-health" in r.stdout and r, timeout=180, interval=0.5,
                                what="a healthy demo-health")
    assert str(port) in resolved.stdout, resolved.stdout
    mn("job", "cancel", service_job)
    servers.wait_for(lambda: not ((r := mn("service", "resolve", "demo-health", check=False)).returncode == 0
                                  and "demo-health" in r.stdout), timeout=30, interval=0.5,
                     what="demo-health to be unresolvable once its job is cancelled")

    # Periodic schedule
    periodic = materialized(EXAMPLES / "demo_periodic_schedule", tmp_path / "periodic")
    mn("schedule", "create", str(periodic), "--cron", "0 0 * * *", "--name", "demo-periodic-suite")
    rows = printed_json(mn("schedule", "list").stdout)["data"]
    schedule = next(r for r in rows if r.get("name") == "demo-periodic-suite")["schedule_id"]
    dispatched = mn("schedule", "run-now", schedule, check=False)
    status = printed_json(mn("schedule", "status", schedule).stdout)
    assert any(d.get("job_id") and d.get("status") in {"submitted", "running", "completed"}
               for d in status.get("dispatches") or []) or (dispatched.returncode == 0 and "Job ID" in dispatched.stdout), \
        f"{dispatched.stdout}\n{json.dumps(status)}"
    mn("schedule", "delete", schedule, "--reason", "demo suite cleanup")
    assert all(r["schedule_id"] != schedule for r in printed_json(mn("schedule", "list").stdout)["data"])

    # Event trigger
    trigger_bundle = materialized(EXAMPLES / "demo_event_trigger", tmp_path / "trigger")
    mn("trigger", "create", str(trigger_bundle), "--event", "demo.match.suite", "--name", "demo-trigger-suite",
       "--filter-json", '{"region":"east"}')
    row = next(r for r in printed_json(mn("schedule", "list", "--kind", "event").stdout)["data"]
               if r.get("name") == "demo-trigger-suite")
    trigger, baseline = row["schedule_id"], int((row.get("counters") or {}).get("dispatched", 0))
    mn("event", "emit", "demo.match.suite", "--payload-json", '{"region":"west"}')
    time.sleep(0.5)
    counted = printed_json(mn("schedule", "status", trigger).stdout)
    assert int((counted.get("counters") or {}).get("dispatched", 0)) == baseline, counted  # no match, no job
    mn("event", "emit", "demo.match.suite", "--payload-json", '{"region":"east"}')
    after = servers.wait_for(lambda: int((s := printed_json(mn("schedule", "status", trigger).stdout)).get(
        "counters", {}).get("dispatched", 0)) == baseline + 1 and s, timeout=120, interval=0.5,
        what="the matching event's child job")
    assert (after.get("dispatches") or [{}])[-1].get("job_id"), after
    mn("trigger", "delete", trigger, "--reason", "demo suite cleanup")
    assert all(r["schedule_id"] != trigger for r in printed_json(mn("schedule", "list", "--kind", "event").stdout)["data"])


def test_the_sdk_pauses_resumes_and_cancels_a_run_and_bad_input_changes_nothing(lab, api, tmp_path):
    import mn_sdk

    idle_pool = lab.new_pool("mn-idle")  # no worker: its runs stay Scheduled until paused or cancelled
    idle = ApiServer(lab, tmp_path / "idle", pool=idle_pool)
    try:
        client = mn_sdk.Client(target=idle.target)
        bundle = EXAMPLES / "demo_dag_linear"
        payloads = payloads_of(bundle)
        created = json.loads(client.create_stable_job((bundle / "manifest.json").read_text(), payloads,
                                                      job_id="job-sdk-1"))
        # the bundle's one deployment on the pool, made in the background: the run starts once it is ready
        assert created["deployment"] == f"mn-bundle-run/api-{idle_pool}-demo-dag-linear", created
        assert created["pool"] == idle_pool and created["status"] in ("deploying", "active"), created
        started = json.loads(client.start_run("job-sdk-1", run_id="sdk-run-1"))
        assert started["run_id"] == "sdk-run-1" and started["status"] == "pending", started
        started["flow_run_id"] = started["flow_run_id"] or servers.wait_for(
            lambda: json.loads(client.get_run("sdk-run-1"))["flow_run_id"], timeout=120, interval=0.2,
            what="the run's flow run once its deployment is ready")
        assert lab.flow_run(started["flow_run_id"])["state"]["type"] == "SCHEDULED"
        assert json.loads(client.pause_run("sdk-run-1"))["status"] == "paused"
        assert lab.flow_run(started["flow_run_id"])["state"]["type"] == "PAUSED"
        assert client.resume_job("sdk-run-1") == "resumed"
        assert lab.flow_run(started["flow_run_id"])["state"]["type"] == "SCHEDULED"
        assert client.cancel_job("sdk-run-1") == "cancelled"
        assert json.loads(client.get_run("sdk-run-1"))["status"] == "cancelled"
        events = [json.loads(e) for e in client.stream_events("sdk-run-1", follow=True, timeout=30)]
        assert [e["type"] for e in events] == ["job_pending", "job_cancelled"], events
        with pytest.raises(grpc.RpcError) as over:
            client.cancel_job("sdk-run-1")
        assert over.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        second = json.loads(client.start_run("job-sdk-1", run_id="cli-run-2"))  # the same through the mn command
        home = tmp_path / "home"
        home.mkdir()

        def mn(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([MN, *args], env=mn_env(home, idle.target), cwd=home, capture_output=True,
                                  text=True, timeout=120)
        paused = mn("job", "pause", "cli-run-2")
        assert paused.returncode == 0 and "Status: paused" in paused.stdout, paused.stdout
        assert lab.flow_run(second["flow_run_id"])["state"]["type"] == "PAUSED"
        assert "Status: resumed" in mn("job", "resume", "cli-run-2").stdout
        cancelled = mn("job", "cancel", "cli-run-2")
        assert cancelled.returncode == 0 and "Status: cancelled" in cancelled.stdout, cancelled.stdout
        assert lab.flow_run(second["flow_run_id"])["state"]["type"] == "CANCELLED"
        again = mn("run", "cancel", "cli-run-2")
        assert again.returncode == 1 and "MN_FAILED_PRECONDITION" in again.stdout, again.stdout
        missing = mn("job", "status", "no-such-run")
        assert missing.returncode == 2 and "MN_NOT_FOUND" in missing.stdout, missing.stdout

        broken = json.loads((bundle / "manifest.json").read_text())
        broken["workflow"]["edges"][0]["to"] = "nowhere"
        with pytest.raises(grpc.RpcError) as refused:
            client.create_stable_job(json.dumps(broken), payloads, job_id="job-sdk-2")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "invalid manifest: workflow.edges[0].to: unknown step 'nowhere'" in refused.value.details()
        assert sorted(p.name for p in idle.bundles.iterdir()) == ["job-sdk-1"]  # nothing left of the refused job
        with pytest.raises(grpc.RpcError) as unknown:
            client.set_node_maintenance("mirror_neuron@nowhere", True, reason="x")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "gpu-1" in unknown.value.details()
        with pytest.raises(grpc.RpcError) as unsupported:
            client.clear_jobs()
        assert unsupported.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "Prefect" in unsupported.value.details()
        drain = json.loads(client.get_node_drain_status("gpu-1"))
        assert drain["status"] == "healthy" and drain["drain"] == {}
    finally:
        idle.stop()
        shutil.rmtree(tmp_path / "idle", ignore_errors=True)


def test_a_running_bundle_run_paused_through_mn_starts_no_step_until_resumed(lab, api, tmp_path):
    import mn_sdk
    from bundle_builders import step, write_bundle

    gate = tmp_path / "gate"
    folder = write_bundle(tmp_path, "held", [step("a", mode=f"wait_file:{gate}", timeout=120), step("b")],
                          [("a", "b")], sink_from="b")
    payloads = payloads_of(folder)
    client = mn_sdk.Client(target=api.target)
    client.create_stable_job((folder / "manifest.json").read_text(), payloads, job_id="job-held",
                             resolved_configuration=json.loads((folder / "config" / "default.json").read_text()))
    client.start_run("job-held", run_id="held-1")

    def run() -> dict:
        return json.loads(client.get_run("held-1"))

    try:
        servers.wait_for(lambda: run()["steps"].get("a", {}).get("state") == "running", timeout=120, interval=0.5,
                         what="step a to run")
    except TimeoutError:
        raise AssertionError(f"step a never ran: {json.dumps(run())}") from None
    home = tmp_path / "home"
    home.mkdir()

    def mn(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([MN, *args], env=mn_env(home, api.target), cwd=home, capture_output=True, text=True,
                              timeout=120)
    paused = mn("job", "pause", "held-1")
    assert paused.returncode == 0 and "Status: paused" in paused.stdout, paused.stdout
    assert run()["status"] == "paused"
    gate.touch()  # step a ends; b must not start while the run is paused (its runner said it holds)
    servers.wait_for(lambda: run()["steps"]["a"]["state"] == "completed", timeout=60, interval=0.5,
                     what="step a to complete")
    time.sleep(2)
    assert run()["steps"].get("b", {}).get("state") in (None, "pending", "queued"), (
        json.dumps(run()) + "\n".join(lab.logs(run()["flow_run_id"])))
    resumed = mn("job", "resume", "held-1")
    assert resumed.returncode == 0 and "Status: resumed" in resumed.stdout, resumed.stdout
    done = servers.wait_for(lambda: (r := run())["status"] in ("completed", "failed") and r, timeout=120,
                            interval=0.5, what="the run to end")
    assert done["status"] == "completed" and done["steps"]["b"]["state"] == "completed", done


def schedule_id(out: str) -> str:
    match = re.search(r"Schedule ID:?\s+(\S+)", out)
    assert match, out
    return match.group(1)


def runs_of(lab: Lab, deployment: str) -> list[dict]:
    body = {"deployments": {"name": {"any_": [deployment]}}}
    return lab.http.post("/flow_runs/filter", json=body).json()


def test_schedules_and_triggers_made_with_mn_are_prefect_deployments_schedules_and_automations(lab, mn):
    """`mn schedule create|delay|pause|resume|run-now|delete`, `mn trigger create` and `mn event emit`: a periodic
    schedule is its deployment's cron schedule, a delayed one a Scheduled run, an event trigger an automation that a
    matching `mn event emit` sets off; run-now and the event hand the run its payload."""
    bundle = str(EXAMPLES / "demo_dag_linear")
    bad = mn("--debug", "schedule", "create", bundle, "--cron", "61 * * * *", "--timezone", "UTC")
    assert bad.returncode == 2 and "schedule.crons[0]" in bad.stdout, bad.stdout
    assert mn("schedule", "status", "sch-nope").returncode == 2

    made = mn("schedule", "create", bundle, "--cron", "0 3 * * *", "--timezone", "UTC", "--name", "nightly")
    assert made.returncode == 0, made.stdout
    periodic = schedule_id(made.stdout)
    deployment = lab.http.get(f"/deployments/name/mn-bundle-run/{periodic}").json()
    assert [(s["schedule"]["cron"], s["active"]) for s in deployment["schedules"]] == [("0 3 * * *", True)]
    assert mn("schedule", "pause", periodic, "--reason", "holiday").returncode == 0
    status = printed_json(mn("schedule", "status", periodic).stdout)
    assert (status["status"], status["paused"], status["reason"]) == ("paused", True, "holiday")
    assert lab.http.get(f"/deployments/{deployment['id']}").json()["paused"] is True
    assert mn("schedule", "resume", periodic).returncode == 0
    assert lab.http.get(f"/deployments/{deployment['id']}").json()["paused"] is False

    now = mn("schedule", "run-now", periodic, "--payload-json", '{"batch": 7}')
    assert now.returncode == 0, now.stdout
    run = lab.wait(runs_of(lab, periodic)[0]["id"], timeout=240)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["parameters"]["trigger"]["payload"] == {"batch": 7}

    asked = datetime.now(UTC)
    delayed = schedule_id(mn("schedule", "delay", bundle, "--in", "2s").stdout)
    waiting = runs_of(lab, delayed)
    assert len(waiting) == 1  # made to start 2 s after it was asked for (a busy worker may have taken it since)
    expected = datetime.fromisoformat(waiting[0]["expected_start_time"])
    assert (expected - asked).total_seconds() >= 2, waiting[0]
    assert lab.wait(waiting[0]["id"], timeout=240)["state"]["type"] == "COMPLETED"

    made = mn("trigger", "create", bundle, "--event", "dataset_uploaded", "--filter-json",
              '{"path": {"prefix": "/demo/"}}')
    assert made.returncode == 0, made.stdout
    triggered = schedule_id(made.stdout)
    automations = printed_json(mn("schedule", "status", triggered).stdout)["automations"]
    assert len(automations) == 1 and automations[0]["enabled"]
    emitted = mn("event", "emit", "dataset_uploaded", "--payload-json", '{"path": "/demo/day-1.csv"}')
    assert emitted.returncode == 0, emitted.stdout
    started = servers.wait_for(lambda: runs_of(lab, triggered), timeout=90, interval=0.5, what="the triggered run")
    run = lab.wait(started[0]["id"], timeout=240)
    assert run["state"]["type"] == "COMPLETED" and run["parameters"]["trigger"]["payload"] == {"path": "/demo/day-1.csv"}
    listed = printed_json(mn("event", "list").stdout)["data"]
    assert listed[0]["event"] == "dataset_uploaded" and listed[0]["payload"] == {"path": "/demo/day-1.csv"}

    mine = {s["schedule_id"]: s["kind"] for s in printed_json(mn("schedule", "list").stdout)["data"]}
    assert mine == {periodic: "periodic", delayed: "delayed", triggered: "event"}
    for made_id in mine:
        assert mn("schedule", "delete", made_id).returncode == 0
        assert lab.http.get(f"/deployments/name/mn-bundle-run/{made_id}").status_code == 404
    assert printed_json(mn("schedule", "list").stdout)["data"] == []


def test_deployments_made_with_mn_roll_out_canaries_promote_roll_back_and_fail(lab, mn):
    """`mn deployment deploy|status|promote|rollback|pause|resume|fail|list` on demo_canary_deployment (its manifest:
    canary 1, auto_revert): one Prefect deployment whose version label follows the stable version, each version's
    runs flow runs of it tagged with their version, a canary tagged as one."""
    bundle = str(EXAMPLES / "demo_canary_deployment")
    key = "canary-svc"

    def status() -> dict:
        done = mn("deployment", "status", key)
        assert done.returncode == 0, done.stdout
        return printed_json(done.stdout)

    def flow_run(version: dict) -> dict:
        return lab.flow_run(version["runs"][0]["flow_run_id"])

    bad = mn("--debug", "deployment", "deploy", bundle, "--key", key, "--strategy", "canary")
    assert bad.returncode != 0 and "update_policy.canary" in bad.stdout, bad.stdout
    assert mn("deployment", "status", key).returncode != 0  # the refused deploy left nothing

    first = mn("deployment", "deploy", bundle, "--key", key, "--wait")
    assert first.returncode == 0, first.stdout
    doc = status()
    assert (doc["status"], doc["stable_version"]) == ("successful", 1), doc
    assert doc["policy"]["strategy"] == "canary" and doc["policy"]["auto_revert"]  # the manifest's own policy
    prefect_deployment = lab.http.get(f"/deployments/name/mn-bundle-run/{key}").json()
    assert prefect_deployment["version"] == "v1"

    second = mn("deployment", "deploy", bundle, "--key", key, "--wait")
    assert second.returncode == 0, second.stdout
    doc = status()
    assert doc["status"] == "awaiting_promotion", doc
    v1, v2 = doc["versions"]
    assert (v1["status"], v2["status"], v2["canary"]) == ("stable", "canary", True)
    assert {"mn-canary", "mn-version:v2", f"mn-deployment:{key}"} <= set(flow_run(v2)["tags"])
    assert flow_run(v2)["parameters"]["bundle_path"].endswith(f"{key}/v2")

    assert mn("deployment", "promote", key).returncode == 0
    doc = status()
    assert (doc["status"], doc["stable_version"]) == ("successful", 2)
    assert [v["status"] for v in doc["versions"]] == ["superseded", "stable"]
    assert lab.http.get(f"/deployments/name/mn-bundle-run/{key}").json()["version"] == "v2"
    again = mn("--debug", "deployment", "promote", key)
    assert again.returncode != 0 and "no canary to promote" in again.stdout, again.stdout

    assert mn("deployment", "rollback", key, "--version", "1", "--reason", "v2 is slower").returncode == 0
    doc = servers.wait_for(lambda: (d := status())["stable_version"] == 3 and d, timeout=180, interval=1,
                           what="the rollback to become stable")  # the API server advances it by itself
    v3 = doc["versions"][2]
    assert v3["source_version"] == 1 and v3["reason"] == "rollback to v1: v2 is slower" and not v3["canary"]
    prefect_deployment = lab.http.get(f"/deployments/name/mn-bundle-run/{key}").json()
    assert prefect_deployment["version"] == "v3" and prefect_deployment["parameters"]["bundle_path"].endswith("/v3")

    assert mn("deployment", "pause", key, "--reason", "freeze").returncode == 0
    assert status()["status"] == "paused"
    assert mn("deployment", "resume", key).returncode == 0
    assert status()["status"] == "successful"

    canary = mn("deployment", "deploy", bundle, "--key", key, "--strategy", "canary", "--canary", "1", "--auto-revert")
    assert canary.returncode == 0, canary.stdout
    assert mn("deployment", "fail", key, "--reason", "bad numbers").returncode == 0
    doc = status()
    assert doc["status"] == "failed" and doc["stable_version"] == 3, doc
    assert doc["versions"][3]["reason"] == "bad numbers"
    run = servers.wait_for(lambda: (r := flow_run(doc["versions"][3]))["state"]["type"] in ("CANCELLED", "CANCELLING")
                           and r, timeout=60, interval=0.5, what="the failed canary's run cancelled")
    # The rollout's own state says why: Cancelling when a worker had taken the run (its worker then makes it
    # Cancelled with a message of its own), Cancelled when none had.
    history = lab.http.get("/flow_run_states/", params={"flow_run_id": run["id"]}).json()
    asked = [s for s in sorted(history, key=lambda s: s["timestamp"]) if s["type"] in ("CANCELLING", "CANCELLED")]
    assert asked[0]["message"] == "v4 failed: bad numbers", history
    ended = servers.wait_for(lambda: (r := flow_run(doc["versions"][3]))["state"]["type"] in (
        "CANCELLED", "COMPLETED", "FAILED", "CRASHED") and r, timeout=90, interval=1, what="the canary's run to end")
    assert ended["state"]["type"] == "CANCELLED", ended["state"]  # stopped, not left to run its 20 s and complete

    listed = printed_json(mn("deployment", "list").stdout)["data"]
    assert [(d["deployment_key"], d["status"], d["stable_version"]) for d in listed] == [(key, "failed", 3)]
