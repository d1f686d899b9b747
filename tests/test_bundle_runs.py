"""Bundles through Prefect: `blueprint run --local` against a real Prefect server (the bundle contract check),
and through the `mn` pool with three real workers, each step booked and released in the lab's store."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import cli_runner
import pytest
import servers
from bundle_builders import json_in_strings
from lab import Lab

from mn_prefect.bundles.runner import RUN_KEYS

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "bundles"
MN = str(Path(sys.executable).parent / "mn-prefect")
# A line of Prefect's console handler: "15:31:13.712 | INFO    | Flow run 'piquant-hippo' - ..."
PREFECT_LINE = re.compile(r"^\S+ \| (?:DEBUG|INFO|WARNING|ERROR|CRITICAL) +\| .*$", re.MULTILINE)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("bundle-lab"))
    yield lab
    lab.stop()


def _env(lab: Lab, home: Path) -> dict[str, str]:
    env = {**os.environ, "PREFECT_API_URL": lab.server.api_url, "HOME": str(home), "MN_PREFECT_HOME": str(home / ".mn-prefect"),
           "MN_STORE_URL": lab.store_url}
    env.pop("MN_INVENTORY_FILE", None)
    return env


def test_every_example_bundle_passes_the_bundle_contract_locally(lab, tmp_path):
    """`blueprint run DIR --local --wait --json --runs-root R`, compared with EXPECTED.json by the contract check."""
    env = _env(lab, tmp_path)
    env.pop("MN_STORE_URL")
    check = subprocess.run([sys.executable, str(ROOT / "tests" / "contract" / "bundle_contract.py"), MN, str(EXAMPLES)],
                           env=env, capture_output=True, text=True, timeout=600)
    assert check.returncode == 0 and "bundles: 4/4 passed" in check.stdout, check.stdout + check.stderr[-3000:]


# Through the pool, the two shapes whose steps meet there: a fan-out and fan-in (steps at once on several nodes)
# and a step that fails and is tried again. Every example bundle's steps and result are checked locally by the
# bundle contract above (and each one's documented steps in tests/test_bundles.py); a step booked on a GPU node
# below.
THROUGH_THE_POOL = ["demo_retry_recovery", "demo_dag_scatter_gather"]


@pytest.mark.parametrize("name", THROUGH_THE_POOL)
def test_example_bundle_completes_through_the_mn_pool(lab, tmp_path, name):
    expected = json.loads((EXAMPLES / "EXPECTED.json").read_text())[name]
    runs = tmp_path / "runs"
    done = subprocess.run([MN, "blueprint", "run", str(EXAMPLES / name), "--pool", lab.pool, "--wait", "--json",
                           "--runs-root", str(runs), "--timeout", "240"],
                          env=_env(lab, tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert tuple(doc) == RUN_KEYS, "the same keys as --local (docs/bundles.md, The run as JSON)"
    assert doc["state"] == "COMPLETED" and doc["flow_run_id"]
    for sid, want in expected["steps"].items():
        assert doc["steps"][sid]["state"] == want.split()[0], sid
        if want.startswith("completed"):
            assert doc["steps"][sid]["node"] in {n["name"] for n in lab.nodes}
    result = json.loads((Path(doc["run_dir"]) / "result.json").read_text())["result"]
    assert result["step"] == expected["result"]["step"]
    assert not [p for p in lab.store.active_placements() if p.job_id.startswith(doc["job_id"])]
    run = lab.flow_run(doc["flow_run_id"])
    assert run["state"]["type"] == "COMPLETED"
    status = subprocess.run([MN, "job", "status", doc["job_id"], "--json"], env=_env(lab, tmp_path),
                            capture_output=True, text=True, timeout=60)
    record = json.loads(status.stdout)
    assert record["status"] == "completed" and set(record["steps"]) == set(doc["steps"])


def test_a_workflow_step_that_needs_a_gpu_runs_on_a_gpu_node_as_a_child_flow_run(lab, tmp_path):
    from bundle_builders import step, write_bundle

    folder = write_bundle(tmp_path, "gpu_step", [step("prep"), step("train")], [("prep", "train")],
                          sink_from="train")
    doc = json.loads((folder / "manifest.json").read_text())
    doc["agents"]["nodes"][1]["resources"] = {"cpu_cores": 1, "memory_mb": 256,
                                              "devices": [{"kind": "gpu", "min_memory_mb": 30000}]}
    (folder / "manifest.json").write_text(json.dumps(doc))
    done = subprocess.run([MN, "blueprint", "run", str(folder), "--pool", lab.pool, "--wait", "--json",
                           "--runs-root", str(tmp_path / "runs"), "--timeout", "240"],
                          env=_env(lab, tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["steps"]["train"]["node"] == "gpu-2"  # the only GPU with 30 GB or more
    launches = [json.loads(l) for l in (Path(out["run_dir"]) / "launches.jsonl").read_text().splitlines()]
    train = json.loads(next(l for l in launches if l["step"] == "train")["allocation"])
    assert [d["id"] for d in train["devices"]] == ["GPU-2a"]
    children = lab.http.post("/flow_runs/filter", json={"flow_runs": {"name": {"like_": f"{out['job_id']}-train"}}}).json()
    assert [c["state"]["type"] for c in children] == ["COMPLETED"], children  # train ran on gpu-2's worker
    assert not [p for p in lab.store.active_placements() if p.job_id.startswith(out["job_id"])]


def test_a_bundle_runs_with_local_on_a_machine_with_no_prefect_server_configured(tmp_path):
    """A newcomer's first try: no PREFECT_API_URL, no profile, no store configured. `--local` starts a temporary
    Prefect server itself, books each step in its own SQLite store and completes the run."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MN_"))}
    env.update(HOME=str(home), PREFECT_HOME=str(home / ".prefect"))
    runs = tmp_path / "runs"
    done = subprocess.run([MN, "blueprint", "run", str(EXAMPLES / "demo_dag_linear"), "--local", "--wait", "--json",
                           "--runs-root", str(runs)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "no Prefect server configured: starting a temporary one" in done.stderr
    assert not PREFECT_LINE.findall(done.stderr), done.stderr[-3000:]  # nor the temporary server's
    doc = json.loads(done.stdout)  # stdout holds the one object and nothing else
    assert tuple(doc) == RUN_KEYS and len(done.stdout) < 20_000, len(done.stdout)
    assert json_in_strings(doc["result"]) == []  # JSON, not JSON escaped inside strings
    expected = json.loads((EXAMPLES / "EXPECTED.json").read_text())["demo_dag_linear"]
    assert doc["state"] == "COMPLETED"
    assert {sid: s["state"] for sid, s in doc["steps"].items()} == {sid: w.split()[0] for sid, w in expected["steps"].items()}
    assert Path(doc["run_dir"]).parent == runs
    assert json.loads((Path(doc["run_dir"]) / "result.json").read_text())["result"]["step"] == expected["result"]["step"]
    # Its own store, under this HOME, holds no booking once the run is over.
    from mn_prefect.store import open_store

    store = open_store(f"sqlite:///{home / '.mn-prefect' / 'local' / 'state.db'}")
    try:
        assert [p for p in store.active_placements() if p.job_id.startswith(doc["job_id"])] == []
        assert store.history(f"{doc['job_id']}#1"), "the first step's booking is in the local store's history"
    finally:
        store.close()


def test_local_wait_shows_the_steps_alone_and_the_runs_log_lines_go_to_its_flow_run(lab, tmp_path):
    """`--local --wait` without --json: the steps table, none of Prefect's log lines (each step's output among
    them) in the terminal; the flow run's logs in Prefect still hold them."""
    env = _env(lab, tmp_path)
    env.pop("MN_STORE_URL")
    done = subprocess.run([MN, "blueprint", "run", str(EXAMPLES / "demo_dag_linear"), "--local", "--wait",
                           "--runs-root", str(tmp_path / "runs")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert not PREFECT_LINE.findall(said) and "[parse]" not in said, said[-3000:]
    assert "COMPLETED" in done.stdout and "report" in done.stdout
    flow_run_id = re.search(r"flow run ([0-9a-f-]{36})", done.stdout)[1]
    logs = servers.wait_for(lambda: [m for m in lab.logs(flow_run_id) if m.startswith("[report]")], timeout=30,
                            interval=0.5, what="the report step's output in the flow run's logs")
    assert logs[0].startswith('[report] {"complete_step": {"attempt": 1, "demo": "demo_dag_linear"')
    lab.wait_for_log(flow_run_id, "Finished in state Completed")


def test_a_bundles_schedule_is_its_deployments_schedule_and_prefect_schedules_its_runs(lab, tmp_path):
    """``blueprint deploy`` of a bundle with a periodic schedule: the deployment has one active cron schedule per
    cron and a concurrency limit of 1 (prohibit_overlap); Prefect's scheduler makes Scheduled runs at those times."""
    from bundle_builders import step, write_bundle

    folder = write_bundle(tmp_path, "timed", [step("a")], [], sink_from="a")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["schedule"] = {"kind": "periodic", "crons": ["0 3 * * *"], "timezone": "UTC", "enabled": True,
                            "prohibit_overlap": True, "missed_policy": "skip"}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    done = subprocess.run([MN, "blueprint", "deploy", str(folder), "--pool", lab.pool, "--json"],
                          env=_env(lab, tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    deployment = lab.http.get("/deployments/name/mn-bundle-run/timed").json()
    assert [(s["schedule"]["cron"], s["schedule"]["timezone"], s["active"]) for s in deployment["schedules"]] == [
        ("0 3 * * *", "UTC", True)]
    assert deployment["global_concurrency_limit"]["limit"] == 1  # Prefect keeps a deployment's limit there
    lab.http.post(f"/deployments/{deployment['id']}/schedule", json={}).raise_for_status()  # as the scheduler does
    runs = lab.http.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [deployment["id"]]}}}).json()
    assert runs and {r["state"]["type"] for r in runs} == {"SCHEDULED"}
    assert {r["expected_start_time"][11:19] for r in runs} == {"03:00:00"}
    lab.http.delete(f"/deployments/{deployment['id']}")  # its runs must not start later in this lab


def test_a_bundles_trigger_runs_it_on_each_matching_event_with_the_event_as_its_input(lab, tmp_path):
    """A bundle's ``triggers`` become Prefect automations on its deployment: `mn-prefect event emit` of a matching
    event starts a run whose steps read the event (MN_TRIGGER_EVENT_JSON); one the filters refuse starts none."""
    from bundle_builders import step, write_bundle

    folder = write_bundle(tmp_path, "triggered", [step("a")], [], sink_from="a")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["triggers"] = [{"name": "dataset-uploaded", "event_type": "dataset_uploaded", "enabled": True,
                             "filters": {"path": {"prefix": "/demo/"}}}]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    env, runs_root = _env(lab, tmp_path), tmp_path / "runs"
    for _ in range(2):  # deployed again, it replaces its automations
        done = subprocess.run([MN, "blueprint", "deploy", str(folder), "--pool", lab.pool, "--runs-root",
                               str(runs_root), "--json"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    deployment = lab.http.get("/deployments/name/mn-bundle-run/triggered").json()
    assert "runs on each dataset_uploaded event" in deployment["description"]
    automations = [a for a in lab.http.post("/automations/filter", json={}).json()
                   if a["name"].startswith("mn-bundle-run/triggered ")]
    assert len(automations) == 1 and automations[0]["trigger"]["expect"] == ["dataset_uploaded"]
    assert automations[0]["trigger"]["match"] == {"mn.payload.path": "/demo/*"}
    try:
        sent = {}
        for path in ("/elsewhere/b.csv", "/demo/a.csv"):
            emitted = subprocess.run([MN, "event", "emit", "dataset_uploaded", "--payload-json",
                                      json.dumps({"path": path, "rows": 3}), "--json"],
                                     env=env, capture_output=True, text=True, timeout=60)
            assert emitted.returncode == 0, emitted.stderr[-2000:]
            sent[path] = json.loads(emitted.stdout)["event_id"]
        body = {"deployments": {"id": {"any_": [deployment["id"]]}}}
        runs = servers.wait_for(lambda: lab.http.post("/flow_runs/filter", json=body).json(), timeout=90,
                                interval=0.5, what="a run started by the event")
        run = lab.wait(runs[0]["id"], timeout=180)
        assert run["state"]["type"] == "COMPLETED", run["state"]
        launches = [json.loads(line) for line in next(runs_root.glob("*/launches.jsonl")).read_text().splitlines()]
        event = json.loads(launches[0]["trigger_event"])
        assert (event["event"], event["id"], event["payload"]) == ("dataset_uploaded", sent["/demo/a.csv"],
                                                                   {"path": "/demo/a.csv", "rows": 3})
        assert len(lab.http.post("/flow_runs/filter", json=body).json()) == 1  # the /elsewhere/ event started none
        listed = subprocess.run([MN, "event", "list", "--json"], env=env, capture_output=True, text=True, timeout=60)
        assert set(sent.values()) <= {e["id"] for e in json.loads(listed.stdout)}
    finally:
        lab.http.delete(f"/deployments/{deployment['id']}")


def test_a_step_that_asks_a_person_pauses_its_flow_run_with_a_form_answered_from_prefect_or_mn_prefect(lab, tmp_path):
    """A step's request (human.jsonl, as MirrorNeuron's human-control demo writes it) pauses the bundle's flow run in
    Prefect with a typed input; Resume with that input (what the UI's form sends) approves, and the step goes on;
    `mn-prefect blueprint human respond ... --decision reject` answers the next run's request, its flow run resumes
    and the workflow fails as the step's policy says."""
    from bundle_builders import step, write_bundle

    folder = write_bundle(tmp_path, "gated", [step("ask", mode="human:120"), step("publish")], [("ask", "publish")],
                          sink_from="publish")
    env, runs_root = _env(lab, tmp_path), tmp_path / "runs"

    def start(run_id: str) -> str:
        done = subprocess.run([MN, "blueprint", "run", str(folder), "--pool", lab.pool, "--runs-root", str(runs_root),
                               "--run-id", run_id, "--json"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])["flow_run_id"]

    approved = start("gated-approve")
    paused = lab.wait(approved, states={"PAUSED"}, timeout=180)
    keyset = paused["state"]["state_details"]["run_input_keyset"]
    schema = lab.http.get(f"/flow_runs/{approved}/input/{keyset['schema']}").json()
    assert set(schema["properties"]) >= {"decision", "notes", "reviewer"}
    assert "May ask publish?" in lab.http.get(f"/flow_runs/{approved}/input/{keyset['description']}").text
    lab.http.post(f"/flow_runs/{approved}/resume", json={"run_input": {"decision": "approve", "notes": "fine",
                                                                        "reviewer": "ana"}}).raise_for_status()
    assert lab.wait(approved, timeout=180)["state"]["type"] == "COMPLETED"
    answers = [json.loads(line) for line in (runs_root / "gated-approve" / "human.jsonl").read_text().splitlines()]
    assert [a["type"] for a in answers] == ["human_input_requested", "human_input_received"]
    assert {k: answers[1]["payload"][k] for k in ("decision", "approved", "reviewer", "via")} == {
        "decision": "approve", "approved": True, "reviewer": "ana", "via": "prefect"}

    rejected = start("gated-reject")
    lab.wait(rejected, states={"PAUSED"}, timeout=180)
    listed = subprocess.run([MN, "blueprint", "human", "list", "gated-reject", "--runs-root", str(runs_root), "--json"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert [(r["request_id"], r["status"]) for r in json.loads(listed.stdout)] == [("ask-approval", "pending")]
    wrong = subprocess.run([MN, "blueprint", "human", "respond", "gated-reject", "ask-approval", "--decision", "maybe",
                            "--runs-root", str(runs_root)], env=env, capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "--decision" in wrong.stderr, wrong.stderr
    answered = subprocess.run([MN, "blueprint", "human", "respond", "gated-reject", "ask-approval", "--decision",
                               "reject", "--notes", "not today", "--runs-root", str(runs_root), "--json"],
                              env=env, capture_output=True, text=True, timeout=60)
    assert answered.returncode == 0, answered.stderr
    run = lab.wait(rejected, timeout=180)
    assert run["state"]["type"] == "FAILED" and "not approved" in run["state"]["message"], run["state"]
    again = subprocess.run([MN, "blueprint", "human", "respond", "gated-reject", "ask-approval", "--decision",
                            "approve", "--runs-root", str(runs_root)], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "answered already" in again.stderr, again.stderr

    by_mn = start("gated-mn")  # MirrorNeuron's own command answers in the run store; the flow run resumes
    lab.wait(by_mn, states={"PAUSED"}, timeout=180)
    answered = subprocess.run([str(Path(sys.executable).parent / "mn"), "blueprint", "human", "respond", "gated-mn",
                               "ask-approval", "--decision", "approve", "--reviewer", "mn-user", "--runs-root",
                               str(runs_root)], env={**env, "MN_DISABLE_UPDATE_CHECK": "1", "NO_COLOR": "1"},
                              capture_output=True, text=True, timeout=60)
    assert answered.returncode == 0, answered.stdout + answered.stderr
    assert lab.wait(by_mn, timeout=180)["state"]["type"] == "COMPLETED"


def test_mirror_neurons_operator_lifecycle_demos_run_unchanged_through_the_mn_pool(lab, tmp_path):
    """The four lifecycle demos of examples/bundles, unmodified: a periodic schedule, an event trigger, a human
    approval and a service with its health check, each through Prefect's own feature."""
    env, runs_root = _env(lab, tmp_path), tmp_path / "runs"

    def mn(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([MN, *args], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done

    def deployed(name: str) -> dict:
        out = mn("blueprint", "deploy", str(EXAMPLES / name), "--pool", lab.pool, "--runs-root", str(runs_root), "--json")
        return lab.http.get(f"/deployments/name/{json.loads(out.stdout)['deployment']}").json()

    def started(name: str, run_id: str) -> str:
        out = mn("blueprint", "run", str(EXAMPLES / name), "--pool", lab.pool, "--runs-root", str(runs_root),
                 "--run-id", run_id, "--json")
        return json.loads(out.stdout.strip().splitlines()[-1])["flow_run_id"]

    periodic = deployed("demo_periodic_schedule")
    assert [(s["schedule"]["cron"], s["active"]) for s in periodic["schedules"]] == [("@hourly", True)]
    lab.http.delete(f"/deployments/{periodic['id']}")  # its hourly runs must not start in this lab

    triggered = deployed("demo_event_trigger")
    mn("event", "emit", "dataset_uploaded", "--payload-json", '{"path": "/demo/day-1.csv"}')
    body = {"deployments": {"id": {"any_": [triggered["id"]]}}}
    runs = servers.wait_for(lambda: lab.http.post("/flow_runs/filter", json=body).json(), timeout=90, interval=0.5,
                            what="the triggered run")
    assert lab.wait(runs[0]["id"], timeout=180)["state"]["type"] == "COMPLETED"
    lab.http.delete(f"/deployments/{triggered['id']}")

    approval = started("demo_human_approval", "demo-approval-1")
    lab.wait(approval, states={"PAUSED"}, timeout=120)  # the worker waits 15 s for the answer
    mn("blueprint", "human", "respond", "demo-approval-1", "demo-approval", "--decision", "approve",
       "--runs-root", str(runs_root))
    assert lab.wait(approval, timeout=180)["state"]["type"] == "COMPLETED"

    # The manifest's services: registered for the run's life on its node, probed by their checks (passing once the
    # step answers /health), resolvable, and gone from the catalog when the run ends.
    service = started("demo_service_health", "demo-service-1")

    # The catalog is read in this process (a store command needs no server): the service lives for the step's 15 s,
    # and two new interpreters between its first passing check and the resolve could outlast it on a busy machine.
    def store_command(*args: str) -> dict | list:
        done = cli_runner.run([*args, "--json", "--store-url", lab.store_url])
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return json.loads(done.stdout)

    def offered() -> list[dict]:
        return [s for s in store_command("service", "list", "--all") if s["origin"] == "bundle"]
    seen = servers.wait_for(lambda: [s for s in offered() if s["status"] == "passing"], timeout=90, interval=0.5,
                            what="demo-health to pass its check")
    assert [(s["name"], s["job_id"], s["port"], s["node"] in {n["name"] for n in lab.nodes}) for s in seen] == [
        ("demo-health", "demo-service-1", 18081, True)]
    resolved = store_command("service", "resolve", "demo-health", "--tag", "blueprint")
    assert resolved["services"][0]["port"] == 18081
    assert lab.wait(service, timeout=180)["state"]["type"] == "COMPLETED"
    assert offered() == []  # deregistered with the run
