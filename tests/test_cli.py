"""The command-line contract: the commands through the console script's entry point (tests/cli_runner.py), and the
installed ``mn-prefect`` executable itself in a real subprocess, driven by the plan contract's smoke check."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import cli_runner
import pytest
from builders import gpu

MN = shutil.which("mn-prefect", path=str(Path(sys.executable).parent)) or "mn-prefect"
EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples" / "blueprints").glob("*.json"))
# The smoke check of the command-line contract (docs/cli.md), kept in the repository.
CONTRACT = Path(__file__).parent / "contract" / "plan_contract.py"

NODES = [
    {"name": "cpu-a", "cpu_cores": 8, "memory_mb": 16384, "disk_mb": 100000},
    {"name": "gpu-a", "cpu_cores": 16, "memory_mb": 65536, "disk_mb": 100000,
     "devices": [gpu("GPU-a0", 0, 16384), gpu("GPU-a1", 1, 40960)], "host_paths": ["/mnt/models"]},
]


def run(*args, env=None):
    return cli_runner.run(args, env=env)


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def bp(resources, **policies):
    return {"job_name": "c", "nodes": [{"node_id": "w", "config": {"command": ["true"]}, "resources": resources}],
            "policies": policies}


@pytest.fixture
def nodes(tmp_path):
    return write(tmp_path, "nodes.json", NODES)


def test_plan_contract_smoke_check_passes():
    result = subprocess.run([sys.executable, str(CONTRACT), MN], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout
    assert "plan contract: 5/5 passed" in result.stdout


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_through_the_cli(path):
    result = run("blueprint", "validate", path, "--json")
    assert result.returncode == 0 and json.loads(result.stdout) == {"valid": True, "errors": []}


def test_validate_lists_every_error_with_paths(tmp_path):
    path = write(tmp_path, "b.json", bp({"cpu": -1, "ports": [{"label": "a", "port": 0}, {"label": "a", "port": 70000}]}))
    result = run("blueprint", "validate", path, "--json")
    doc = json.loads(result.stdout)
    assert result.returncode == 1 and doc["valid"] is False
    assert {e["path"] for e in doc["errors"]} == {"nodes[0].resources.cpu", "nodes[0].resources.ports[1].label",
                                                  "nodes[0].resources.ports[1].port"}
    readable = run("blueprint", "validate", path)
    assert readable.returncode == 1 and "nodes[0].resources.cpu" in readable.stdout and "Traceback" not in readable.stderr


@pytest.mark.parametrize("content, fragment", [
    ("", "is empty"), ("{not json", "malformed JSON at line 1"), ("[1, 2]", "must be a JSON object"),
    ('{"nodes": 5}', "must be a list"), ('{"nodes": [{"node_id": "w", "resources": {"cpu": 1e999}}]}', "too large"),
    ("[" * 100000, "nested too deeply"),
])
def test_bad_blueprint_files_exit_2_from_plan_with_a_clear_error(tmp_path, nodes, content, fragment):
    path = write(tmp_path, "bad.json", content)
    result = run("plan", path, "--nodes", nodes)
    doc = json.loads(result.stdout)
    assert result.returncode == 2 and doc["status"] == "invalid"
    assert any(fragment in e["message"] for e in doc["errors"]), doc["errors"]
    assert "Traceback" not in result.stderr


def test_missing_file_is_an_input_error(tmp_path, nodes):
    result = run("plan", tmp_path / "nope.json", "--nodes", nodes)
    assert result.returncode == 2 and json.loads(result.stdout)["errors"][0]["message"] == "no such file"


@pytest.mark.parametrize("node_doc, path", [
    ([{"name": "a", "cpu_cores": "lots"}], "nodes.json[0].cpu_cores"),
    ([{"name": "a", "devices": [{"index": 0}]}], "nodes.json[0].devices[0].id"),
    ([{"name": "a", "status": "sleeping"}], "nodes.json[0].status"),
    ([{"name": "a"}, {"name": "a"}], "nodes.json[1].name"),
    ({"name": "a"}, "nodes.json"),
    ([{"name": "a", "memory_mb": 1e300}], "nodes.json[0].memory_mb"),
])
def test_bad_node_files_name_the_path(tmp_path, node_doc, path):
    result = run("plan", write(tmp_path, "b.json", bp({})), "--nodes", write(tmp_path, "nodes.json", node_doc))
    doc = json.loads(result.stdout)
    assert result.returncode == 2 and path in {e["path"] for e in doc["errors"]}


def test_bad_limits_and_strategy(tmp_path, nodes):
    b = write(tmp_path, "b.json", bp({}))
    result = run("plan", b, "--nodes", nodes, "--limits", "cpu=0,gpu=x,ram=5", "--strategy", "random")
    paths = {e["path"] for e in json.loads(result.stdout)["errors"]}
    assert result.returncode == 2 and {"--limits.cpu", "--limits.gpu", "--limits", "--strategy"} <= paths


def test_plan_statuses_and_exit_codes(tmp_path, nodes):
    now = run("plan", write(tmp_path, "a.json", bp({"gpu": 2})), "--nodes", nodes)
    assert now.returncode == 0 and json.loads(now.stdout)["status"] == "runnable_now"
    active = write(tmp_path, "active.json", now.stdout)
    later = run("plan", write(tmp_path, "b.json", bp({"gpu": 1})), "--nodes", nodes, "--active", active)
    doc = json.loads(later.stdout)
    assert later.returncode == 1 and doc["status"] == "runnable_later"
    assert doc["agents"]["w"]["gpu-a"] == "insufficient gpu: asks 1, 0 of 2 free"
    never = run("plan", write(tmp_path, "c.json", bp({"gpu": 3})), "--nodes", nodes)
    assert never.returncode == 1 and json.loads(never.stdout)["status"] == "not_runnable"


def test_active_accepts_a_list_of_placements(tmp_path, nodes):
    first = json.loads(run("plan", write(tmp_path, "a.json", bp({"ports": [{"label": "p", "port": 80}]})), "--nodes",
                           nodes).stdout)
    active = write(tmp_path, "active.json", first["placements"] * 1)
    again = json.loads(run("plan", write(tmp_path, "b.json", bp({"ports": [{"label": "p", "port": 80}]})), "--nodes",
                           nodes, "--active", active).stdout)
    assert again["placements"][0]["node"] != first["placements"][0]["node"]


def test_plan_output_has_the_contract_fields(tmp_path, nodes):
    doc = json.loads(run("plan", write(tmp_path, "a.json", bp({"gpu": 1, "ports": [{"label": "api"}]})), "--nodes",
                         nodes).stdout)
    assert set(doc) >= {"status", "job_type", "strategy", "placements", "reason", "agents"}
    p = doc["placements"][0]
    assert set(p) >= {"agent_id", "source_agent_id", "node", "resources", "allocation", "env", "locality", "score"}
    assert set(p["allocation"]) >= {"devices", "ports", "volumes", "runtime_driver"}
    assert doc["agents"]["w"]["cpu-a"].startswith("insufficient gpu")


def test_strategy_flag_overrides_the_blueprint(tmp_path, nodes):
    b = write(tmp_path, "a.json", bp({"cpu": 1}, scheduler_strategy="binpack"))
    doc = json.loads(run("plan", b, "--nodes", nodes, "--strategy", "spread").stdout)
    assert doc["strategy"] == "spread"


def test_limits_flag_shrinks_capacity(tmp_path, nodes):
    b = write(tmp_path, "a.json", bp({"cpu_cores": 9}))
    assert run("plan", b, "--nodes", nodes).returncode == 0
    assert json.loads(run("plan", b, "--nodes", nodes, "--limits", "cpu=50").stdout)["status"] == "not_runnable"


def test_table_output_for_people(tmp_path, nodes):
    result = run("plan", write(tmp_path, "a.json", bp({"gpu": 1})), "--nodes", nodes, "--table")
    assert result.returncode == 0 and "placements" in result.stdout and "GPU-a0" in result.stdout


def test_resource_list_reports_usage(tmp_path, nodes):
    plan = run("plan", write(tmp_path, "a.json", bp({"gpu": 1, "cpu": 2})), "--nodes", nodes)
    active = write(tmp_path, "active.json", plan.stdout)
    doc = json.loads(run("resource", "list", "--nodes", nodes, "--active", active, "--json").stdout)
    gpu_node = next(n for n in doc["nodes"] if n["name"] == "gpu-a")
    assert gpu_node["used"]["cpu_cores"] == 2 and gpu_node["free"]["gpu_count"] == 1
    assert [d["held"] for d in gpu_node["devices"]] == [True, False]
    assert gpu_node["gpu_memory_total_mb"] == 16384 + 40960 and gpu_node["host_paths"] == ["/mnt/models"]
    assert doc["total"]["cpu_cores"] == 24 and doc["used"]["gpu_count"] == 1
    table = run("resource", "list", "--nodes", nodes)
    assert table.returncode == 0 and "gpu-a" in table.stdout and "GPU-a1" in table.stdout


def test_resource_list_of_this_machine():
    result = run("resource", "list", "--json", env={"MN_INVENTORY_FILE": "", "LD_LIBRARY_PATH": ""})
    doc = json.loads(result.stdout)
    assert result.returncode == 0 and len(doc["nodes"]) == 1 and doc["nodes"][0]["total"]["cpu_cores"] >= 1


def test_version():
    assert run("--version").stdout.strip() == "0.1.0"
