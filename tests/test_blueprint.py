"""docs/blueprints.md and docs/concepts.md: blueprint formats, validation with JSON paths, policies and job types."""

import copy
import json
from pathlib import Path

import pytest
from builders import agent

from mn_prefect.model.blueprint import parse_blueprint

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples" / "blueprints").glob("*.json"))


def paths(raw):
    blueprint, issues = parse_blueprint(raw)
    assert blueprint is None
    return {i.path: i.message for i in issues}


def flat(*nodes, **top):
    return {"job_name": "j", "nodes": list(nodes), "edges": [], **top}


def test_every_shared_example_exists():
    assert len(EXAMPLES) == 5


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_shared_examples_validate(path):
    blueprint, issues = parse_blueprint(json.loads(path.read_text()))
    assert issues == []
    assert blueprint.agents


def test_v2_layout_reads_agents_nodes():
    raw = {"apiVersion": "mn.workflow/v2", "agents": {"nodes": [agent("a"), agent("b")],
                                                      "edges": [{"from_node": "a", "to_node": "b"}], "entrypoints": ["a"]}}
    blueprint, issues = parse_blueprint(raw)
    assert issues == [] and blueprint.format == "v2" and [a.agent_id for a in blueprint.agents] == ["a", "b"]


def test_v2_errors_carry_the_agents_prefix():
    raw = {"apiVersion": "mn.workflow/v2", "agents": {"nodes": [agent("a", {"ports": [{"label": "x", "port": 70000}]})]}}
    assert "agents.nodes[0].resources.ports[0].port" in paths(raw)


def test_v2_without_agents_is_an_error():
    assert "agents" in paths({"apiVersion": "mn.workflow/v2"})


def test_example_error_path_from_the_spec():
    raw = flat(agent("a"), agent("b"), agent("c", {"ports": [{"label": "ok", "port": 80}, {"label": "bad", "port": 0.5}]}))
    raw["nodes"][2]["resources"]["ports"][1]["port"] = 70000
    assert paths(raw)["nodes[2].resources.ports[1].port"] == "must be between 1 and 65535 (0 or absent = dynamic), got 70000"


def test_all_errors_at_once_across_the_blueprint():
    raw = flat(agent("a", {"cpu": -1}), agent("a"), agent("c", {"volumes": [{"name": "v", "source": "x"}]}),
               policies={"job_type": "cron", "scheduler_strategy": "random"})
    raw["edges"] = [{"from_node": "a", "to_node": "ghost"}]
    found = paths(raw)
    assert {"nodes[0].resources.cpu", "nodes[1].node_id", "nodes[2].resources.volumes[0].source",
            "policies.job_type", "policies.scheduler_strategy", "edges[0].to_node"} <= set(found)


def test_unknown_keys_outside_resources_are_kept_not_rejected():
    raw = flat(agent("a", workflow={"x": 1}, display_name="A"), metadata={"anything": True}, contract={})
    blueprint, issues = parse_blueprint(raw)
    assert issues == []


def test_resources_fall_back_to_config_resources():
    node = {"node_id": "a", "config": {"command": ["x"], "resources": {"memory_gb": 1}}}
    blueprint, _ = parse_blueprint(flat(node))
    assert blueprint.agents[0].resources.memory_mb == 1024
    node["config"]["resources"] = {"memory_gb": -1}
    assert "nodes[0].config.resources.memory_gb" in paths(flat(node))


def test_catalog_form_uses_with():
    node = {"node_id": "a", "uses": "mn-agents.control_router@1.0.0", "with": {"environment": {"A": 1}, "runner_module": "X"}}
    blueprint, issues = parse_blueprint(flat(node))
    assert issues == [] and blueprint.agents[0].uses == "mn-agents.control_router@1.0.0"
    assert blueprint.agents[0].config.environment == {"A": "1"}


@pytest.mark.parametrize("source, expected", [
    ({"policies": {"job_type": "service"}}, "service"),
    ({"policies": {"scheduler": {"job_type": "system"}}}, "system"),
    ({"type": "sysbatch"}, "sysbatch"),
    ({}, "batch"),
])
def test_job_type_sources(source, expected):
    raw = {**flat(agent("a")), **source}
    blueprint, issues = parse_blueprint(raw)
    assert issues == [] and blueprint.job_type == expected


def test_policy_field_errors():
    bad = {"attempts": -1, "interval_ms": 1.5, "delay_ms": "5", "max_delay_ms": True, "mode": "retry",
           "delay_function": "linear", "unlimited": "yes"}
    found = paths(flat(agent("a", policies={"restart": bad})))
    for key in bad:
        assert f"nodes[0].policies.restart.{key}" in found
    assert "policies.reschedule.mode" in paths(flat(agent("a"), policies={"reschedule": {"mode": "x"}}))


def test_node_policy_overrides_job_policy_field_by_field():
    raw = flat(agent("a", policies={"restart": {"attempts": 7}}), agent("b"),
               policies={"job_type": "batch", "restart": {"delay_ms": 50, "delay_function": "constant"}})
    blueprint, _ = parse_blueprint(raw)
    a, b = blueprint.agents
    assert (a.restart.attempts, a.restart.delay_ms, a.restart.delay_function) == (7, 50, "constant")
    assert (b.restart.attempts, b.restart.delay_ms) == (3, 50)


def test_default_policies_per_job_type_and_recovery_mode():
    service, _ = parse_blueprint(flat(agent("a"), policies={"job_type": "service", "recovery_mode": "cluster_recover"}))
    batch, _ = parse_blueprint(flat(agent("a")))
    s, b = service.agents[0], batch.agents[0]
    assert (s.restart.attempts, s.restart.interval_ms, s.restart.max_delay_ms) == (3, 600_000, 30_000)
    assert (b.restart.attempts, b.restart.interval_ms) == (3, 86_400_000)
    assert s.reschedule.unlimited and s.reschedule.delay_function == "exponential" and s.reschedule.max_delay_ms == 300_000
    assert not b.reschedule.unlimited and b.reschedule.attempts == 0  # reschedule disabled without cluster_recover


@pytest.mark.parametrize("constraint, path", [
    (5, "nodes[0].constraints[0]"), ({"operator": "=="}, "nodes[0].constraints[0].attribute"),
    ({"attribute": "os", "operator": "like", "value": "x"}, "nodes[0].constraints[0].operator"),
    ({"attribute": "os", "operator": "=="}, "nodes[0].constraints[0].value"),
    ({"attribute": "labels.zone", "operator": "in", "value": []}, "nodes[0].constraints[0].value"),
    ({"attribute": "cpu_cores", "operator": ">", "value": [1]}, "nodes[0].constraints[0].value"),
    ("", "nodes[0].constraints[0]"),
])
def test_malformed_constraints(constraint, path):
    assert path in paths(flat(agent("a", constraints=[constraint])))


def test_structural_errors():
    assert "nodes" in paths({"job_name": "x"})
    assert "nodes" in paths({"nodes": {}})
    assert "nodes" in paths({"nodes": []})
    assert "nodes[0]" in paths({"nodes": ["a"]})
    assert "nodes[0].node_id" in paths({"nodes": [{"resources": {}}]})
    assert "" in paths([1, 2])
    assert "entrypoints[0]" in paths(flat(agent("a"), entrypoints=["nope"]))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_mutating_an_example_port_is_caught_with_its_path(path):
    raw = json.loads(path.read_text())
    graph = raw["agents"] if "agents" in raw else raw
    prefix = "agents.nodes" if "agents" in raw else "nodes"
    mutated = copy.deepcopy(raw)
    target = mutated["agents"] if "agents" in raw else mutated
    target["nodes"][0].setdefault("resources", {})["ports"] = [{"label": "p", "port": 0}, {"label": "p", "port": 65536}]
    found = paths(mutated)
    assert f"{prefix}[0].resources.ports[1].label" in found and f"{prefix}[0].resources.ports[1].port" in found
    assert graph  # the original is untouched


HTTP_PORT = {"ports": [{"label": "http"}]}


def test_an_agent_health_check_is_read_from_the_agent_or_its_config():
    check = {"http": "/healthz", "port_label": "http", "interval_s": 5, "failures_to_deallocate": 3}
    on_agent, issues = parse_blueprint(flat(agent("a", resources=HTTP_PORT, health=check)))
    assert issues == [] and on_agent.agents[0].health.http == "/healthz"
    node = agent("a", resources=HTTP_PORT)
    node["config"]["health"] = {"tcp": True, "port_label": "http"}
    in_config, issues = parse_blueprint(flat(node))
    assert issues == [] and in_config.agents[0].health.tcp and in_config.agents[0].health.interval_s == 180


@pytest.mark.parametrize(("health", "named"), [
    ({"tcp": True, "port_label": "http", "interval_s": 0}, "nodes[0].health.interval_s"),
    ({"tcp": True, "port_label": "api"}, "nodes[0].health.port_label"),
    ({"http": "healthz", "port_label": "http"}, "nodes[0].health.http"),
    ({"port_label": "http"}, "nodes[0].health"),
    ("tcp", "nodes[0].health"),
])
def test_a_bad_agent_health_check_is_refused_naming_the_field(health, named):
    found = paths(flat(agent("a", resources=HTTP_PORT, health=health)))
    assert named in found, found
