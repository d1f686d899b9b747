"""Poison inputs: every field is bounded where it is parsed, and a bad one is a named validation error."""

from __future__ import annotations

import pytest

from mn_prefect.model.issues import InvalidInput
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.reservations import ReservationError, parse_duration


def _device(**fields: object) -> dict[str, object]:
    return {"devices": [{"kind": "gpu", **fields}]}


@pytest.mark.parametrize("version", ["1" + "0" * 5000, "abc", "12.x", "1..2", "1234567890.1", "١٢.٢", "9." * 40 + "9"])
def test_min_api_version_out_of_grammar_is_refused_naming_the_field(version: str) -> None:
    with pytest.raises(InvalidInput) as error:
        resource_request(_device(min_api_version=version))
    assert "min_api_version" in str(error.value)


@pytest.mark.parametrize("version", ["12.2", " 550.120 ", 12.9, 12])
def test_min_api_version_in_grammar_is_kept(version: object) -> None:
    request = resource_request(_device(min_api_version=version))
    assert request.devices[0].min_api_version == str(version).strip()


@pytest.mark.parametrize(
    "memory", ["1_0_0", "1" * 5000, "١٠٠", "inf", "nan", -1, 10**5000],
    ids=["underscores", "5000-digit-string", "arabic-digits", "inf", "nan", "negative", "5000-digit-int"],
)
def test_a_number_out_of_grammar_is_refused_naming_the_field(memory: object) -> None:
    with pytest.raises(InvalidInput) as error:
        resource_request({"memory": memory})
    assert "memory" in str(error.value)


def test_an_integer_of_5000_digits_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidInput) as error:
        resource_request({"gpus": 10**5000})
    assert "gpus" in str(error.value)


@pytest.mark.parametrize("shares", [1e-320, 0.001])
def test_shares_below_one_hundredth_are_refused(shares: float) -> None:
    with pytest.raises(InvalidInput) as error:
        resource_request(_device(shares=shares, memory_mb=100))
    assert "shares" in str(error.value)


def test_shares_of_one_hundredth_are_kept() -> None:
    assert resource_request(_device(shares=0.01, memory_mb=100)).devices[0].shares == 0.01


@pytest.mark.parametrize("text", ["9223372036854775807s", "999999999d", "3651d", "1" * 5000])
def test_a_duration_past_ten_years_is_refused_naming_the_field(text: str) -> None:
    with pytest.raises(ReservationError) as error:
        parse_duration(text)
    assert error.value.field == "--for"


def test_a_duration_of_ten_years_is_kept() -> None:
    assert parse_duration("3650d") == 3650 * 86400


@pytest.mark.parametrize("weight", ["nan", "inf"])
def test_a_queue_weight_that_is_not_finite_is_refused_naming_the_option(tmp_path, weight: str) -> None:
    from test_cli import run

    bad = run("queue", "set", "x", "--weight", weight, "--store-url", f"sqlite:///{tmp_path}/s.db")
    assert bad.returncode == 2 and "--weight" in bad.stdout + bad.stderr


@pytest.mark.parametrize("doc", [{}, {"job_name": "x"}, {"nodes": []}, {"apiVersion": "mn.workflow/v2"},
                                 {"apiVersion": "mn.workflow/v2", "agents": {"nodes": []}}],
                         ids=["empty", "name-only", "no-nodes", "v2-no-agents", "v2-no-nodes"])
def test_a_blueprint_without_agents_is_refused_naming_the_field(doc: dict) -> None:
    from mn_prefect.model.blueprint import parse_blueprint

    blueprint, issues = parse_blueprint(doc)
    assert blueprint is None and {i.path for i in issues} & {"nodes", "agents", "agents.nodes"}


def test_blueprint_validate_refuses_an_empty_manifest_naming_nodes(tmp_path) -> None:
    import cli_runner

    (tmp_path / "empty.json").write_text("{}")
    bad = cli_runner.run(["blueprint", "validate", tmp_path / "empty.json"])
    assert bad.returncode != 0 and "nodes" in bad.stdout + bad.stderr and "valid (" not in bad.stdout


@pytest.mark.parametrize("workflow", [{}, {"steps": []}], ids=["no-steps", "empty-steps"])
def test_a_workflow_section_without_steps_is_refused_naming_the_field(workflow: dict) -> None:
    from mn_prefect.workflow.manifest import parse_workflow

    spec, issues = parse_workflow({"nodes": [{"node_id": "a"}], "workflow": workflow})
    assert spec is None and [i.path for i in issues] == ["workflow.steps"]


def _chain(length: int, *back: tuple[int, int]) -> dict:
    """A workflow of ``length`` steps on one agent, each after the one before, plus the ``back`` edges."""
    steps = [{"id": f"s{i}", "agent_id": "a"} for i in range(length)]
    edges = [{"from": f"s{i}", "to": f"s{i + 1}"} for i in range(length - 1)]
    edges += [{"from": f"s{src}", "to": f"s{dst}"} for src, dst in back]
    return {"apiVersion": "mn.workflow/v2", "kind": "Workflow", "id": "chain",
            "agents": {"nodes": [{"node_id": "a"}], "entrypoints": ["a"]},
            "workflow": {"steps": steps, "edges": edges, "source": "s0"}}


def test_a_linear_workflow_of_5000_steps_validates() -> None:
    from mn_prefect.workflow.manifest import parse_workflow

    spec, issues = parse_workflow(_chain(5000))
    assert issues == [] and spec is not None and len(spec.steps) == 5000


def test_a_cycle_at_the_end_of_a_long_chain_is_reported_as_a_cycle() -> None:
    from mn_prefect.workflow.manifest import parse_workflow

    spec, issues = parse_workflow(_chain(5000, (4999, 4990)))
    cycle = " -> ".join(f"s{i}" for i in [*range(4990, 5000), 4990])
    assert spec is None and [(i.path, i.message) for i in issues] == [
        ("workflow.edges", f"the step graph has a cycle: {cycle}")]


HUGE = "1" + "0" * 5000  # past Python's digit limit for int(): json.loads alone raises a bare ValueError


@pytest.mark.parametrize("where", ["inline", "file"])
def test_plan_refuses_a_request_number_of_5000_digits_naming_the_field_in_json(tmp_path, where: str) -> None:
    import json

    import cli_runner

    (tmp_path / "nodes.json").write_text(json.dumps([{"name": "n1", "cpu_cores": 8, "memory_mb": 16384}]))
    text = '{"cpu": ' + HUGE + ', "memory_mb": 100}'
    (tmp_path / "req.json").write_text(text)
    request = text if where == "inline" else f"@{tmp_path / 'req.json'}"
    done = cli_runner.run(["plan", "--request", request, "--nodes", tmp_path / "nodes.json"])
    doc = json.loads(done.stdout)
    field = "--request.cpu" if where == "inline" else "req.json.cpu"
    assert done.returncode == 2 and doc["status"] == "invalid"
    assert doc["errors"] == [{"path": field, "message": "is too large (at most 1e+12)"}]


def test_a_nodes_file_with_a_number_of_5000_digits_is_refused_naming_the_field(tmp_path) -> None:
    import json

    import cli_runner

    (tmp_path / "nodes.json").write_text('[{"name": "n1", "cpu_cores": ' + HUGE + "}]")
    done = cli_runner.run(["plan", "--request", '{"cpu": 1}', "--nodes", tmp_path / "nodes.json"])
    doc = json.loads(done.stdout)
    assert done.returncode == 2 and [e["path"] for e in doc["errors"]] == ["nodes.json[0].cpu_cores"]


def test_json_text_reads_an_integer_past_the_digit_limit_as_infinity() -> None:
    from mn_prefect.model.json_text import parse_json

    assert parse_json('[' + HUGE + ', -' + HUGE + ', 12]') == [float("inf"), float("-inf"), 12]


@pytest.mark.parametrize("api_version", [HUGE, "12." + HUGE, "12.4"])
def test_a_node_whose_gpu_reports_a_version_past_the_digit_limit_plans_without_raising(tmp_path, api_version) -> None:
    """The node's side of ``min_api_version``: a device reporting a version with a part of 5,000 digits (a broken
    driver, or a hand-written nodes file) compares as newer than any real version, and every plan on it goes on
    (before: ``int()`` raised in the comparison, and every run's plan on that node with it)."""
    import json

    import cli_runner

    device = {"id": "G0", "index": 0, "kind": "gpu", "vendor": "nvidia", "driver": "cuda", "memory_total_mb": 16384,
              "api_version": api_version}
    (tmp_path / "nodes.json").write_text(json.dumps([{"name": "n1", "cpu_cores": 8, "memory_mb": 16384,
                                                      "devices": [device]}]))
    request = '{"devices": [{"kind": "gpu", "min_api_version": "12.2"}]}'
    done = cli_runner.run(["plan", "--request", request, "--nodes", tmp_path / "nodes.json"])
    doc = json.loads(done.stdout)
    assert done.returncode == 0 and doc["status"] == "runnable_now", doc
