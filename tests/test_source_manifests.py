"""Blueprints in MirrorNeuron's source format: recognised, expanded by MirrorNeuron's own converter (mn_sdk), and
what the expansion lacks named with the setting that points to it. The real ``mn-prefect`` command in a subprocess;
the catalog is the part of MirrorNeuron's mn-agents that the blueprint uses (tests/bundles/source/README.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import run

from mn_prefect.bundles.bundle import load_bundle
from mn_prefect.bundles.process import upload_source

SOURCE = Path(__file__).parent / "bundles" / "source"
BLUEPRINT = SOURCE / "source_hello"
CATALOG = {"MN_AGENTS_ROOT": str(SOURCE / "mn-agents")}
NODES = [{"name": "n1", "cpu_cores": 8, "memory_mb": 16384, "disk_mb": 100000,
          "runtime_drivers": ["host_local", "docker"]}]


def test_without_the_catalog_validate_names_what_is_missing_and_the_setting(tmp_path):
    done = run("blueprint", "validate", BLUEPRINT, "--json", env={"MN_AGENTS_ROOT": str(tmp_path)})
    assert done.returncode != 0
    [error] = json.loads(done.stdout)["errors"]
    assert error["path"] == "manifest" and "mn-agents index was not found" in error["message"]
    assert "set MN_AGENTS_ROOT to a folder holding its index.json" in error["message"]


def test_with_the_catalog_the_expanded_blueprint_validates_and_plans(tmp_path):
    done = run("blueprint", "validate", BLUEPRINT, env=CATALOG)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "valid:" in done.stdout and "1 agents; workflow source_hello, 1 steps" in done.stdout
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps(NODES))
    planned = run("plan", BLUEPRINT / "manifest.json", "--nodes", nodes, env=CATALOG)
    doc = json.loads(planned.stdout)
    assert planned.returncode == 0 and doc["status"] == "runnable_now", planned.stdout
    [placement] = doc["placements"]
    assert placement["agent_id"] == "greet" and placement["node"] == "n1"
    refused = run("plan", BLUEPRINT / "manifest.json", "--nodes", nodes, env={"MN_AGENTS_ROOT": str(tmp_path)})
    assert refused.returncode == 2 and "MN_AGENTS_ROOT" in json.loads(refused.stdout)["errors"][0]["message"]


def test_validate_takes_a_source_blueprints_manifest_file_as_its_folder():
    """``blueprint validate DIR/manifest.json`` is ``blueprint validate DIR``: the source manifest expanded, not
    read as a runtime manifest without nodes ("nodes: is required")."""
    by_file = run("blueprint", "validate", BLUEPRINT / "manifest.json", "--json", env=CATALOG)
    by_folder = run("blueprint", "validate", BLUEPRINT, "--json", env=CATALOG)
    assert by_file.returncode == by_folder.returncode == 0, by_file.stdout + by_file.stderr
    assert json.loads(by_file.stdout) == json.loads(by_folder.stdout) == {"valid": True, "errors": []}


def test_without_the_sdk_the_error_says_to_install_it():
    code = ("import sys; sys.modules['mn_sdk'] = None; sys.modules['mn_sdk.manifest_converter'] = None\n"
            "from mn_prefect.cli.app import main\n"
            f"sys.argv = ['mn-prefect', 'blueprint', 'validate', {str(BLUEPRINT)!r}, '--json']\n"
            "main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    [error] = json.loads(done.stdout)["errors"]
    assert error["path"] == "manifest.apiVersion" and "pip install mirrorneuron-python-sdk" in error["message"]


def test_a_source_blueprints_uploads_come_from_payloads_then_its_top_folder(monkeypatch):
    monkeypatch.setenv("MN_AGENTS_ROOT", CATALOG["MN_AGENTS_ROOT"])
    bundle = load_bundle(BLUEPRINT)
    assert bundle.source_format and bundle.upload_roots == (BLUEPRINT.resolve() / "payloads", BLUEPRINT.resolve())
    uploads = {u.source for agent in bundle.spec.agents.values() for u in agent.upload_paths}
    assert {"config", "examples/sample_inputs", "agents"} <= uploads  # as MirrorNeuron's profile lists them
    assert upload_source(bundle.upload_roots, "agents") == BLUEPRINT.resolve() / "payloads" / "agents"
    assert upload_source(bundle.upload_roots, "config") == BLUEPRINT.resolve() / "config"  # beside payloads/


def test_a_bundle_in_the_runtime_format_reads_uploads_from_payloads_only():
    bundle = load_bundle(Path(__file__).parents[1] / "examples" / "bundles" / "demo_dag_linear")
    assert not bundle.source_format and bundle.upload_roots == (bundle.payloads,)


def test_a_docker_workers_job_folder_maps_into_the_sandbox_never_onto_the_host(tmp_path):
    """MirrorNeuron's DockerWorker puts a step's uploads under /mn/job (its demos' workdir is /mn/job/worker): the
    sandbox stands in for it as for /sandbox/job, so nothing is made at a real /mn."""
    from types import SimpleNamespace

    from mn_prefect.bundles.process import stage

    bundle = load_bundle(Path(__file__).parents[1] / "examples" / "bundles" / "demo_docker_worker")
    agent = bundle.spec.agents["run"]
    assert agent.workdir == "/mn/job/worker"
    base, workdir = stage(SimpleNamespace(agent=agent), bundle.upload_roots, str(tmp_path))  # stage reads .agent
    assert workdir == base / "worker" and (workdir / "docker_worker.sh").is_file()
    assert not Path("/mn").exists()


@pytest.mark.lab  # `--local` starts a temporary Prefect server
def test_a_source_blueprint_on_a_host_worker_runs_through_mirrorneurons_step_runtime(tmp_path):
    env = {**CATALOG, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # the step's python3 has mn_sdk
    done = run("blueprint", "run", SOURCE / "source_host", "--local", "--wait", "--json", "--runs-root",
               tmp_path / "runs", env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["state"] == "COMPLETED" and doc["steps"]["greet"]["state"] == "completed", doc
    said = doc["result"]["sandbox"]["output"]  # what the step runtime printed of the handler's result, as JSON
    assert said["greeting"] == "hello" and said["workflow_step_id"] == "greet"
    assert said["runtime_step_mode"] == "manifest_handler"


@pytest.mark.lab  # `--local` starts a temporary Prefect server
def test_a_two_step_source_blueprint_runs_its_steps_in_order(tmp_path):
    """Each step of tests/bundles/source/source_two_steps is a sequence of two host agents; the second step starts
    only after the first one's end node (docs/bundles.md, "Steps expanded from the source format")."""
    env = {**CATALOG, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = run("blueprint", "run", SOURCE / "source_two_steps", "--local", "--wait", "--json", "--runs-root",
               tmp_path / "runs", env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["state"] == "COMPLETED", doc
    assert {s: doc["steps"][s]["state"] for s in ("first", "second")} == {"first": "completed", "second": "completed"}
    [events] = list((tmp_path / "runs").glob("*/events.jsonl"))
    seen = [json.loads(line) for line in events.read_text().splitlines()]
    order = [(e["type"], e.get("agent_id") if e["type"] == "sandbox_job_started" else e.get("step_id")) for e in seen
             if e["type"] in ("sandbox_job_started", "workflow_step_completed")]
    assert order == [("sandbox_job_started", "first__one"), ("sandbox_job_started", "first__two"),
                     ("workflow_step_completed", "first"), ("sandbox_job_started", "second__three"),
                     ("sandbox_job_started", "second__four"), ("workflow_step_completed", "second")], order
    assert not [e for e in seen if "duplicate" in e["type"]]
