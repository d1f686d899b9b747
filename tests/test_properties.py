"""Property tests: validation never raises, and no plan ever breaks the booking invariants."""

import copy
import json
from collections import Counter, defaultdict
from pathlib import Path

from builders import json_paths
from hypothesis import HealthCheck, given, settings, strategies as st

from mn_prefect.model.blueprint import parse_blueprint
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.node_status import SCHEDULABLE_STATES
from mn_prefect.scheduler import Limits, plan_job
from mn_prefect.scheduler.ports import family

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples" / "blueprints").glob("*.json"))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-10**20, max_value=10**20) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)

RESOURCE_KEYS = ["cpu", "cpu_cores", "cpu_millis", "memory_mb", "memory_gb", "disk_gb", "gpu_count", "gpus", "devices",
                 "ports", "volumes", "runtime_driver", "typo"]
resources = st.dictionaries(st.sampled_from(RESOURCE_KEYS), json_values, max_size=5)
agents = st.fixed_dictionaries({"node_id": st.text(max_size=4) | st.integers()},
                               optional={"resources": resources, "config": json_values, "constraints": json_values,
                                         "policies": json_values, "requires_services": json_values})
blueprints = st.fixed_dictionaries({"nodes": st.lists(agents, max_size=4)},
                                   optional={"policies": json_values, "edges": json_values, "type": json_values,
                                             "apiVersion": st.just("mn.workflow/v2")})


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_validation_never_raises_on_any_json(raw):
    blueprint, issues = parse_blueprint(raw)
    assert (blueprint is None) == bool(issues)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(blueprints)
def test_validation_never_raises_on_blueprint_shaped_input(raw):
    blueprint, issues = parse_blueprint(raw)
    assert (blueprint is None) == bool(issues)
    assert all(isinstance(i.path, str) and i.message for i in issues)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(EXAMPLES), st.data())
def test_mutated_examples_never_raise(path, data):
    raw = json.loads(path.read_text())
    mutated = copy.deepcopy(raw)
    locations = [p for p in json_paths(mutated) if p]
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        where = data.draw(st.sampled_from(locations))
        target = mutated
        try:
            for key in where[:-1]:
                target = target[key]
            target[where[-1]] = data.draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue
    blueprint, issues = parse_blueprint(mutated)
    assert (blueprint is None) == bool(issues)


# -- plan invariants ------------------------------------------------------------------------------------

STATUSES = ["healthy", "healthy", "joining", "maintenance", "offline"]


@st.composite
def clusters(draw):
    count = draw(st.integers(min_value=1, max_value=6))
    nodes = []
    for i in range(count):
        gpus = draw(st.integers(min_value=0, max_value=3))
        nodes.append(NodeRecord.model_validate({
            "name": f"n{i}", "status": draw(st.sampled_from(STATUSES)),
            "scheduling_eligible": draw(st.booleans() | st.just(True)),
            "cpu_cores": draw(st.sampled_from([1, 2, 4, 8])), "memory_mb": draw(st.sampled_from([1024, 4096, 16384])),
            "disk_mb": 10000, "dynamic_port_range": [30000, 30000 + draw(st.integers(min_value=0, max_value=3))],
            "host_paths": ["/data"],
            "devices": [{"id": f"n{i}-g{j}", "index": j, "vendor": draw(st.sampled_from(["nvidia", "amd"])),
                         "driver": "cuda", "memory_total_mb": draw(st.sampled_from([8000, 16000, 40000]))}
                        for j in range(gpus)],
        }))
    return nodes


requests = st.fixed_dictionaries({}, optional={
    "cpu_cores": st.sampled_from([0.5, 1, 2, 3]),
    "memory_mb": st.sampled_from([256, 1024, 4096]),
    "devices": st.lists(st.fixed_dictionaries({"count": st.integers(1, 2)},
                                              optional={"vendor": st.sampled_from(["nvidia", "amd"]),
                                                        "min_memory_mb": st.sampled_from([1000, 12000, 30000])}),
                        max_size=2),
    "ports": st.lists(st.sampled_from([{"label": "a", "port": 8080}, {"label": "b", "port": 8080, "protocol": "http"},
                                       {"label": "c", "protocol": "udp", "port": 8080}, {"label": "d"}, {"label": "e"}]),
                      max_size=3, unique_by=lambda p: p["label"]),
    "volumes": st.just([{"name": "v", "source": "/data/x"}]),
})
jobs = st.fixed_dictionaries({
    "nodes": st.lists(requests, min_size=1, max_size=3).map(
        lambda rs: [{"node_id": f"a{i}", "resources": r} for i, r in enumerate(rs)]),
    "policies": st.fixed_dictionaries({"job_type": st.sampled_from(["batch", "service", "system", "sysbatch"]),
                                       "scheduler_strategy": st.sampled_from(["binpack", "spread"])}),
})


def check_invariants(nodes, placements, limits):
    by_name = {n.name: n for n in nodes}
    used = defaultdict(Counter)
    devices, ports = Counter(), Counter()
    for p in placements:
        node = by_name[p.node]
        for key, value in p.resources.model_dump().items():
            used[p.node][key] += value
        node_ids = {d.id for d in node.devices}
        for d in p.allocation.devices:
            assert d.id in node_ids, "device from another node"
            devices[d.id] += 1
        for port in p.allocation.ports:
            ports[(p.node, family(port.protocol), port.port)] += 1
            if port.dynamic:
                low, high = node.dynamic_port_range
                assert low <= port.port <= high
    assert all(c == 1 for c in devices.values()), f"device booked twice: {devices}"
    assert all(c == 1 for c in ports.values()), f"port booked twice: {ports}"
    for name, amounts in used.items():
        node = by_name[name]
        pct = limits.for_node(name)
        assert amounts["cpu_cores"] <= node.cpu_cores * pct["cpu"] / 100 + 1e-6
        assert amounts["memory_mb"] <= node.memory_mb * pct["memory"] / 100 + 1e-6
        assert amounts["gpu_count"] <= Limits.scale_count(len(node.gpu_devices), pct["gpu"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.lists(jobs, min_size=1, max_size=8), st.sampled_from([100, 75, 50]))
def test_plans_never_double_book_or_overfill_or_use_unschedulable_nodes(nodes, job_docs, pct):
    limits = Limits(cpu=pct, memory=pct, gpu=pct)
    active = []
    for doc in job_docs:
        blueprint, issues = parse_blueprint(doc)
        assert not issues
        plan = plan_job(blueprint, nodes, active, limits=limits)
        if plan.status == "runnable_now":
            names = {p.node for p in plan.placements}
            for name in names:
                node = next(n for n in nodes if n.name == name)
                assert node.status in SCHEDULABLE_STATES and node.scheduling_eligible
            if blueprint.job_type in ("batch", "service"):
                assert {p.source_agent_id for p in plan.placements} == {a.agent_id for a in blueprint.agents}
            active.extend(plan.placements)
        else:
            assert plan.placements == ()
            refused = set().union(*(set(v) for v in plan.agents.values()))
            assert refused, "a refusal names the nodes and why"
        check_invariants(nodes, active, limits)
