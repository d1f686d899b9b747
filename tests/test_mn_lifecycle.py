"""A bundle's lifecycle only when asked, and source-format steps in order, through MirrorNeuron's own ``mn`` command
against ``mn-prefect mn-api serve`` in front of a lab (a real Prefect server, three real mn workers, a store file).

A plain run (``mn blueprint run --folder``, ``mn-prefect blueprint run``) registers neither the bundle's schedule
nor its triggers; ``mn-prefect blueprint deploy`` does, and ``mn schedule list`` / ``mn trigger list`` show those
too; a bundle deployment deleted in Prefect takes its trigger automations with it."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import servers
from lab import Lab
from test_mn_clients import EXAMPLES, MN, MN_PREFECT, ApiServer, mn_env, printed_json, run_stores

pytestmark = pytest.mark.lab  # a Prefect server and three workers

SOURCE = Path(__file__).parent / "bundles" / "source"
CATALOG = str(SOURCE / "mn-agents")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    home = tmp_path_factory.mktemp("mn-lifecycle")
    runs_root = home / "runs"
    # the source blueprint's python_host agents run python3 with mn_sdk: this virtual environment's
    path = f"{Path(MN).parent}:{os.environ['PATH']}"
    lab = Lab(home, worker_env={"MN_RUNS_ROOT": str(runs_root), "MN_AGENTS_ROOT": CATALOG, "PATH": path})
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

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        env = {**mn_env(home, api.target), "MN_AGENTS_ROOT": CATALOG}
        return subprocess.run([MN, *args], env=env, cwd=home, capture_output=True, text=True, timeout=timeout)
    run.home = home
    return run


def mn_prefect(lab: Lab, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MN_PREFECT, *args], capture_output=True, text=True, timeout=300,
                          env={**lab.server.env, "MN_STORE_URL": lab.store_url, "MN_AGENTS_ROOT": CATALOG})


def deployment(lab: Lab, name: str) -> dict | None:
    found = lab.http.get(f"/deployments/name/mn-bundle-run/{name}")
    return found.json() if found.status_code == 200 else None


def automations_of(lab: Lab, deployment_id: str) -> list[dict]:
    every = lab.http.post("/automations/filter", json={}).json()
    return [a for a in every if any(x.get("deployment_id") == deployment_id for x in a["actions"])]


def scheduled_runs(lab: Lab, deployment_id: str) -> list[dict]:
    body = {"deployments": {"id": {"any_": [deployment_id]}}, "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}}}
    return lab.http.post("/flow_runs/filter", json=body).json()


def test_a_plain_mn_run_registers_neither_the_bundles_schedule_nor_its_triggers(lab, api, mn):
    for bundle in ("demo_periodic_schedule", "demo_event_trigger"):
        done = mn("blueprint", "run", "--folder", str(EXAMPLES / bundle))
        out = done.stdout + done.stderr
        assert done.returncode == 0 and re.search(r"Status: +Completed", out), out[-3000:]
        made = deployment(lab, f"api-{lab.pool}-{bundle.replace('_', '-')}")
        assert made is not None
        assert made["schedules"] == [] and scheduled_runs(lab, made["id"]) == [], made["schedules"]
        assert automations_of(lab, made["id"]) == []
    listed = printed_json(mn("schedule", "list").stdout)["data"]
    assert listed == [], listed


def test_blueprint_run_registers_nothing_and_blueprint_deploy_registers_what_mn_lists(lab, api, mn):
    periodic, triggered = EXAMPLES / "demo_periodic_schedule", EXAMPLES / "demo_event_trigger"
    done = mn_prefect(lab, "blueprint", "run", str(periodic), "--pool", lab.pool, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert deployment(lab, "demo-periodic-schedule")["schedules"] == []

    for bundle in (periodic, triggered):
        done = mn_prefect(lab, "blueprint", "deploy", str(bundle), "--pool", lab.pool, "--json")
        assert done.returncode == 0, done.stdout + done.stderr
    made = deployment(lab, "demo-periodic-schedule")
    assert [(s["schedule"]["cron"], s["active"]) for s in made["schedules"]] == [("@hourly", True)]
    # a plain run of a deployed bundle keeps what the deploy registered, and adds nothing
    done = mn_prefect(lab, "blueprint", "run", str(periodic), "--pool", lab.pool, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert [s["schedule"]["cron"] for s in deployment(lab, "demo-periodic-schedule")["schedules"]] == ["@hourly"]

    schedules = {s["schedule_id"]: s for s in printed_json(mn("schedule", "list").stdout)["data"]}
    assert schedules["demo-periodic-schedule"]["kind"] == "periodic"
    assert schedules["demo-periodic-schedule"]["schedule"]["crons"] == ["@hourly"]
    assert schedules["demo-periodic-schedule"]["managed_by"] == "prefect"
    events = printed_json(mn("trigger", "list").stdout)["data"]
    assert [(e["kind"], e["deployment"], e["schedule"]["trigger"]["event_type"]) for e in events] == [
        ("event", "mn-bundle-run/demo-event-trigger", "dataset_uploaded")], events

    # the trigger's deployment deleted in Prefect: its automation goes with it
    gone = deployment(lab, "demo-event-trigger")
    assert len(automations_of(lab, gone["id"])) == 1
    assert lab.http.delete(f"/deployments/{gone['id']}").status_code == 204
    assert printed_json(mn("trigger", "list").stdout)["data"] == []
    assert automations_of(lab, gone["id"]) == []


def test_a_two_step_source_blueprint_runs_its_steps_in_order_through_mn(lab, api, mn):
    """tests/bundles/source/source_two_steps (step ``second`` needs ``first``, each a sequence of two python_host
    agents), converted by ``mn`` itself and run through the API: the second step starts only after the first one's
    end node, and nothing is ignored as a duplicate."""
    done = mn("blueprint", "run", "--folder", str(SOURCE / "source_two_steps"))
    out = done.stdout + done.stderr
    assert done.returncode == 0 and re.search(r"Status: +Completed", out), out[-3000:]
    run_id = re.search(r"(source_two_steps-[0-9a-f]+)", out).group(1)

    def store() -> Path | None:
        return next((d for d in run_stores(mn.home, run_id) if (d / "events.jsonl").is_file()), None)
    events_file = servers.wait_for(store, timeout=60, interval=0.5, what=f"the run store of {run_id}") / "events.jsonl"
    seen = [json.loads(line) for line in events_file.read_text().splitlines()]
    order = [(e["type"], e.get("agent_id") if e["type"] == "sandbox_job_started" else e.get("step_id")) for e in seen
             if e["type"] in ("sandbox_job_started", "workflow_step_completed")]
    assert order == [("sandbox_job_started", "first__one"), ("sandbox_job_started", "first__two"),
                     ("workflow_step_completed", "first"), ("sandbox_job_started", "second__three"),
                     ("sandbox_job_started", "second__four"), ("workflow_step_completed", "second")], order
    assert not [e for e in seen if "duplicate" in e["type"]]
