"""Bundles through Prefect: `blueprint run --local` against a real Prefect server (the bundle contract check),
and through the `mn` pool with three real workers, each step booked and released in the lab's store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lab import Lab

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "bundles"
MN = str(Path(sys.executable).parent / "mn-prefect")
NAMES = ["demo_dag_linear", "demo_retry_recovery", "demo_dag_scatter_gather", "demo_resource_allocation"]


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


@pytest.mark.parametrize("name", NAMES)
def test_example_bundle_completes_through_the_mn_pool(lab, tmp_path, name):
    expected = json.loads((EXAMPLES / "EXPECTED.json").read_text())[name]
    runs = tmp_path / "runs"
    done = subprocess.run([MN, "blueprint", "run", str(EXAMPLES / name), "--pool", lab.pool, "--wait", "--json",
                           "--runs-root", str(runs), "--timeout", "240"],
                          env=_env(lab, tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    doc = json.loads(done.stdout.strip().splitlines()[-1])
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
    doc = json.loads(done.stdout.strip().splitlines()[-1])
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
