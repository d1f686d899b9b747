"""docs/scheduling.md: feasibility, device fit, ports, volumes, constraints, ranking, gang and system placement."""

import json
from pathlib import Path

import pytest
from builders import agent, blueprint, gpu, node, one

from mn_prefect.model.blueprint import parse_blueprint
from mn_prefect.model.placement import Placement
from mn_prefect.scheduler import Limits, plan_job, reasons

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "blueprints"


def placed(plan):
    assert plan.status == "runnable_now", plan.reason
    return plan.placements


def refusal(plan, agent_id="w"):
    assert plan.status in ("runnable_later", "not_runnable"), plan
    assert plan.placements == ()
    return plan.agents[agent_id]


# -- feasibility chain and reasons ----------------------------------------------------------------------

@pytest.mark.parametrize("status", ["maintenance", "draining", "disconnected", "offline", "quarantined"])
def test_only_healthy_or_joining_nodes_take_work(status):
    plan = plan_job(one({"cpu": 1}), [node("a", status=status)])
    assert refusal(plan)["a"].startswith(reasons.NODE_NOT_READY)
    assert plan.status == "not_runnable"
    assert placed(plan_job(one({"cpu": 1}), [node("a", status="joining")]))[0].node == "a"


def test_ineligible_nodes_take_no_work():
    plan = plan_job(one({}), [node("a", scheduling_eligible=False)])
    assert refusal(plan)["a"].startswith(reasons.NODE_INELIGIBLE)


def test_reasons_follow_the_spec_order():
    # Each node fails exactly one check; together they cover the chain.
    nodes = [
        node("n1-status", status="maintenance", cpu=0),
        node("n2-profile", cpu=0),
        node("n3-constraint", profiles=["p"], cpu=0),
        node("n4-service", profiles=["p"], capabilities=["x"], cpu=0),
        node("n5-capacity", profiles=["p"], capabilities=["x"], services=[{"name": "db"}], cpu=0,
             runtime_drivers=["docker"]),
        node("n6-driver", profiles=["p"], capabilities=["x"], services=[{"name": "db"}], runtime_drivers=["docker"],
             devices=[gpu("d6", 0)]),
        node("n7-port", profiles=["p"], capabilities=["x"], services=[{"name": "db"}], devices=[gpu("d7", 0)]),
        node("n8-volume", profiles=["p"], capabilities=["x"], services=[{"name": "db"}], devices=[gpu("d8", 0)]),
        node("n9-device", profiles=["p"], capabilities=["x"], services=[{"name": "db"}], host_paths=["/data"],
             devices=[gpu("d9", 0, vendor="amd", driver="rocm")]),
    ]
    active = [Placement(agent_id="other", node="n7-port", allocation={"ports": [{"label": "x", "port": 8080}]})]
    raw = agent("w", {"cpu": 1, "runtime_driver": "host_local", "ports": [{"label": "api", "port": 8080}],
                      "volumes": [{"name": "data", "source": "/data/set"}], "devices": [{"kind": "gpu", "vendor": "nvidia"}]},
                requires_services=["db"], constraints=["x"])
    raw["config"]["execution_profile"] = "p"
    found = refusal(plan_job(blueprint(raw), nodes, active))
    expected = {
        "n1-status": reasons.NODE_NOT_READY, "n2-profile": reasons.MISSING_PROFILE,
        "n3-constraint": reasons.CONSTRAINT_NOT_MET, "n4-service": reasons.MISSING_SERVICE,
        "n5-capacity": "insufficient cpu", "n6-driver": reasons.MISSING_DRIVER, "n7-port": reasons.PORT_IN_USE,
        "n8-volume": reasons.MISSING_HOST_PATH, "n9-device": reasons.MISSING_DEVICES,
    }
    for name, prefix in expected.items():
        assert found[name].startswith(prefix), (name, found[name])


def test_capacity_counts_active_placements():
    active = [Placement(agent_id="x", node="a", resources={"cpu_cores": 6, "memory_mb": 1000})]
    plan = plan_job(one({"cpu": 4}), [node("a", cpu=8)], active)
    assert plan.status == "runnable_later"
    assert refusal(plan)["a"] == "insufficient cpu: asks 4 cores, 2 of 8 free"


def test_impossible_request_is_not_runnable():
    plan = plan_job(one({"memory_gb": 64}), [node("a", memory=16384)])
    assert plan.status == "not_runnable" and "insufficient memory" in plan.agents["w"]["a"]
    assert "insufficient memory" in plan.reason


# -- devices --------------------------------------------------------------------------------------------

GPU_NODE = node("g", devices=[gpu("g-16", 0, 16384), gpu("g-40", 1, 40960, caps=("fp16", "bf16")),
                              gpu("g-24", 2, 24576), gpu("g-80", 3, 81920, caps=("fp16", "bf16", "fp8"))])


def device_ids(plan):
    return [d.id for d in placed(plan)[0].allocation.devices]


def test_memory_minimum_picks_the_smallest_sufficient_device():
    assert device_ids(plan_job(one({"devices": [{"kind": "gpu", "min_memory_mb": 20000}]}), [GPU_NODE])) == ["g-24"]


def test_without_memory_minimum_the_smallest_device_first():
    assert device_ids(plan_job(one({"gpu": 2}), [GPU_NODE])) == ["g-16", "g-24"]


def test_ties_break_by_device_id():
    n = node("t", devices=[gpu("b", 0), gpu("a", 1), gpu("c", 2)])
    assert device_ids(plan_job(one({"gpu": 1}), [n])) == ["a"]


def test_capabilities_are_all_required():
    assert device_ids(plan_job(one({"devices": [{"capabilities": ["bf16", "fp8"]}]}), [GPU_NODE])) == ["g-80"]


def test_ids_restrict_the_choice():
    assert device_ids(plan_job(one({"devices": [{"ids": ["g-40"]}]}), [GPU_NODE])) == ["g-40"]


@pytest.mark.parametrize("op, want, expected", [(">", 24576, "g-40"), (">=", 24576, "g-24"), ("==", 40960, "g-40")])
def test_memory_operators(op, want, expected):
    request = {"devices": [{"min_memory_mb": want, "memory_operator": op}]}
    assert device_ids(plan_job(one(request), [GPU_NODE])) == [expected]


def test_free_memory_is_used_when_known():
    n = node("f", devices=[gpu("busy", 0, 81920, free=1000), gpu("idle", 1, 24576)])
    assert device_ids(plan_job(one({"devices": [{"min_memory_mb": 20000}]}), [n])) == ["idle"]


def test_api_version_comparison():
    n = node("v", devices=[gpu("old", 0, api="11.8"), gpu("new", 1, api="12.4")])
    assert device_ids(plan_job(one({"devices": [{"min_api_version": "12.0"}]}), [n])) == ["new"]
    assert device_ids(plan_job(one({"devices": [{"min_api_version": "12.0", "api_version_operator": "<"}]}), [n])) == ["old"]


def test_vendor_and_driver_match_case_insensitively():
    n = node("mixed", devices=[gpu("amd0", 0, vendor="AMD", driver="ROCm"), gpu("nv0", 1)])
    assert device_ids(plan_job(one({"devices": [{"type": "amd/gpu", "driver": "rocm"}]}), [n])) == ["amd0"]
    assert device_ids(plan_job(one({"devices": [{"vendor": "NVIDIA"}]}), [n])) == ["nv0"]


def test_held_devices_are_not_chosen_again():
    active = [Placement(agent_id="x", node="g", resources={"gpu_count": 1}, allocation={"devices": [GPU_NODE.devices[0]]})]
    assert device_ids(plan_job(one({"gpu": 1}), [GPU_NODE], active)) == ["g-24"]


def test_too_few_matching_devices_is_a_device_reason():
    plan = plan_job(one({"devices": [{"capabilities": ["fp8"], "count": 2}]}), [GPU_NODE])
    assert plan.status == "not_runnable"
    assert plan.agents["w"]["g"].startswith(reasons.MISSING_DEVICES)


def test_several_device_requests_never_share_a_device():
    ids = device_ids(plan_job(one({"devices": [{"count": 2}, {"min_memory_mb": 10000, "count": 2}]}), [GPU_NODE]))
    assert len(ids) == len(set(ids)) == 4


def test_cuda_visible_devices_lists_indices_of_cuda_devices_only():
    n = node("m", devices=[gpu("nv0", 0), gpu("amd0", 1, vendor="amd", driver="rocm"), gpu("nv1", 2, memory=20000)])
    env = placed(plan_job(one({"gpu": 3}), [n]))[0].env
    assert env["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert env["ROCR_VISIBLE_DEVICES"] == env["HIP_VISIBLE_DEVICES"] == "1"
    assert set(env["MN_GPU_DRIVER"].split(",")) == {"cuda", "rocm"}


# -- ports ----------------------------------------------------------------------------------------------

def hold_ports(*ports, node_name="a"):
    return [Placement(agent_id="x", node=node_name, allocation={"ports": [{"label": f"p{i}", "port": p, "protocol": proto}
                                                                          for i, (proto, p) in enumerate(ports)]})]


@pytest.mark.parametrize("held, asked, free", [
    ("tcp", "http", False), ("http", "grpc", False), ("grpc", "tcp", False), ("udp", "tcp", True), ("udp", "udp", False),
])
def test_port_conflicts_by_transport(held, asked, free):
    plan = plan_job(one({"ports": [{"label": "x", "port": 9000, "protocol": asked}]}), [node("a")], hold_ports((held, 9000)))
    assert (plan.status == "runnable_now") is free


def test_dynamic_ports_come_from_the_range_and_skip_held_ones():
    n = node("a", dynamic_port_range=[30000, 30005])
    plan = plan_job(one({"ports": [{"label": "a"}, {"label": "b"}, {"label": "c", "port": 30002}]}), [n],
                    hold_ports(("tcp", 30000)))
    ports = {p.label: (p.port, p.dynamic) for p in placed(plan)[0].allocation.ports}
    assert ports == {"a": (30001, True), "b": (30003, True), "c": (30002, False)}
    assert placed(plan)[0].env["MN_PORT_A"] == "30001"


def test_an_exhausted_dynamic_range_is_a_reason():
    n = node("a", dynamic_port_range="30000-30001")
    plan = plan_job(one({"ports": [{"label": "a"}, {"label": "b"}, {"label": "c"}]}), [n])
    assert plan.agents["w"]["a"].startswith(reasons.NO_DYNAMIC_PORT)


# -- volumes, drivers, constraints, profiles, services ----------------------------------------------------

@pytest.mark.parametrize("source, ok", [("/mnt/models", True), ("/mnt/models/llama", True), ("/mnt/models2", False),
                                        ("/mnt", False), ("/srv/x", False)])
def test_volume_sources_must_lie_under_an_advertised_path(source, ok):
    plan = plan_job(one({"volumes": [{"name": "m", "source": source, "target": "/models"}]}),
                    [node("a", host_paths=["/mnt/models"])])
    assert (plan.status == "runnable_now") is ok
    if ok:
        volume = plan.placements[0].allocation.volumes[0]
        assert (volume.source, volume.target) == (source, "/models")
        assert plan.placements[0].env["MN_VOLUME_M"] == source and plan.placements[0].env["MN_VOLUME_M_TARGET"] == "/models"


def test_runtime_driver_must_be_advertised():
    nodes = [node("a"), node("b", runtime_drivers=["host_local", "podman"])]
    assert placed(plan_job(one({"runtime_driver": "podman"}), nodes))[0].node == "b"
    assert placed(plan_job(one({}), nodes))[0].allocation.runtime_driver == "host_local"


NODES_FOR_CONSTRAINTS = [
    node("a", os="linux", arch="x86_64", labels={"zone": "east", "tier": 2}, capabilities=["cuda", "avx512"], role="runtime"),
    node("b", os="darwin", arch="arm64", labels={"zone": "west"}, capabilities=["metal"], role="edge"),
]


@pytest.mark.parametrize("constraint, expected", [
    ("cuda", {"a"}), ("metal", {"b"}),
    ({"attribute": "os", "operator": "==", "value": "linux"}, {"a"}),
    ({"attribute": "os", "operator": "=", "value": "darwin"}, {"b"}),
    ({"attribute": "node", "operator": "!=", "value": "a"}, {"b"}),
    ({"attribute": "node.name", "operator": "==", "value": "b"}, {"b"}),
    ({"attribute": "node_role", "operator": "==", "value": "runtime"}, {"a"}),
    ({"attribute": "role", "operator": "in", "value": ["edge", "x"]}, {"b"}),
    ({"attribute": "capabilities", "operator": "contains_all", "value": ["cuda", "avx512"]}, {"a"}),
    ({"attribute": "capabilities", "operator": "contains_any", "value": ["metal", "cuda"]}, {"a", "b"}),
    ({"attribute": "labels.tier", "operator": "exists"}, {"a"}),
    ({"attribute": "labels.tier", "operator": "not_exists"}, {"b"}),
    ({"attribute": "labels.tier", "operator": ">=", "value": 2}, {"a"}),
    ({"attribute": "labels.tier", "operator": "<", "value": 2}, set()),
    ({"attribute": "cpu_cores", "operator": ">", "value": 4}, {"a", "b"}),
    ({"attribute": "labels.zone", "operator": "in", "value": "west,north"}, {"b"}),
    ({"attribute": "dynamic_port_range.0", "operator": "==", "value": 20000}, {"a", "b"}),
    ({"attribute": "arch", "operator": "contains", "value": "86"}, {"a"}),
])
def test_constraint_operators(constraint, expected):
    ok = set()
    for n in NODES_FOR_CONSTRAINTS:
        plan = plan_job(blueprint(agent("w", {}, constraints=[constraint])), [n])
        if plan.status == "runnable_now":
            ok.add(n.name)
        else:
            assert plan.agents["w"][n.name].startswith(reasons.CONSTRAINT_NOT_MET)
    assert ok == expected


def test_version_constraints_compare_as_versions():
    n = node("a", labels={"driver": "535.104.05"})
    c = {"attribute": "labels.driver", "operator": ">=", "value": "535.99"}
    assert plan_job(blueprint(agent("w", {}, constraints=[c])), [n]).status == "runnable_now"


@pytest.mark.parametrize(("have", "op", "value", "ok"), [
    ("550.120", ">=", "550.90", True),   # as floats 550.12 < 550.9
    ("550.120", ">=", 550.90, True),     # a JSON number keeps no trailing zero: 550.9
    ("12.10", ">", "12.9", True),
    ("12.10", "<=", 12.9, False),
    ("12.9", "<", "12.10", True),
    ("12.10", "==", "12.1", False),
    ("16", ">", "8", True),              # plain numbers stay numbers
    ("2.5", ">", 2, True),
])
def test_ordered_constraints_compare_dotted_text_as_versions(have, op, value, ok):
    n = node("a", labels={"driver": have})
    c = {"attribute": "labels.driver", "operator": op, "value": value}
    assert (plan_job(blueprint(agent("w", {}, constraints=[c])), [n]).status == "runnable_now") is ok


def test_min_api_version_compares_versions():
    n = node("a", devices=[gpu("g0", 0, api="12.10")])
    assert placed(plan_job(one({"devices": [{"min_api_version": "12.9"}]}), [n]))
    assert placed(plan_job(one({"devices": [{"min_api_version": 12.9, "api_version_operator": ">"}]}), [n]))


def test_global_constraints_apply_to_every_agent():
    bp = blueprint(agent("a"), agent("b"), policies={"constraints": ["cuda"]})
    plan = plan_job(bp, [node("cpu"), node("gpu", capabilities=["cuda"])])
    assert {p.node for p in placed(plan)} == {"gpu"}


def test_gpu_profile_implies_one_gpu():
    raw = agent("w", {})
    raw["config"]["execution_profile"] = "inference"
    nodes = [node("gpu", profiles=[{"name": "inference", "gpu": True}], devices=[gpu("g0", 0)]),
             node("bare", profiles=[{"name": "inference", "gpu": True}])]
    p = placed(plan_job(blueprint(raw), nodes))[0]
    assert p.node == "gpu" and p.resources.gpu_count == 1 and [d.id for d in p.allocation.devices] == ["g0"]
    assert plan_job(blueprint(raw), [nodes[1]]).agents["w"]["bare"].startswith("insufficient gpu")


def test_required_services_need_a_passing_instance():
    bp = blueprint(agent("w", {}, requires_services=[{"name": "redis", "tags": ["primary"]}]))
    nodes = [node("a", services=[{"name": "redis", "tags": ["primary"], "status": "critical"}]),
             node("b", services=[{"name": "redis", "tags": ["replica"]}]),
             node("c", services=[{"name": "redis", "tags": ["primary", "x"], "status": "passing"}])]
    plan = plan_job(bp, nodes)
    assert placed(plan)[0].node == "c"
    assert plan.agents["w"]["a"].startswith(reasons.MISSING_SERVICE) and plan.agents["w"]["b"].startswith(reasons.MISSING_SERVICE)


# -- limits ---------------------------------------------------------------------------------------------

def test_limits_scale_capacity_and_round_gpus_down():
    n = node("a", cpu=8, devices=[gpu("g0", 0), gpu("g1", 1), gpu("g2", 2)])
    limits = Limits(cpu=50, gpu=50)
    assert plan_job(one({"cpu": 4}), [n], limits=limits).status == "runnable_now"
    assert plan_job(one({"cpu": 4.5}), [n], limits=limits).status == "not_runnable"
    assert plan_job(one({"gpu": 1}), [n], limits=limits).status == "runnable_now"
    assert plan_job(one({"gpu": 2}), [n], limits=limits).agents["w"]["a"] == "insufficient gpu: asks 2, 1 of 1 free"


def test_per_node_limit_overrides():
    limits = Limits(cpu=100, per_node={"a": {"cpu": 25}})
    plan = plan_job(one({"cpu": 4}), [node("a", cpu=8), node("b", cpu=8)], limits=limits)
    assert placed(plan)[0].node == "b"


# -- ranking --------------------------------------------------------------------------------------------

def test_binpack_prefers_the_fullest_node_and_spread_the_emptiest():
    nodes = [node("empty"), node("busy")]
    active = [Placement(agent_id="x", node="busy", resources={"cpu_cores": 6, "memory_mb": 12000})]
    assert placed(plan_job(one({"cpu": 1}), nodes, active, strategy="binpack"))[0].node == "busy"
    assert placed(plan_job(one({"cpu": 1}), nodes, active, strategy="spread"))[0].node == "empty"


def test_strategy_is_a_ranking_not_a_tie_breaker():
    # Different node sizes: binpack fills the small node, spread picks the large one.
    nodes = [node("small", cpu=4, memory=8192), node("large", cpu=64, memory=262144)]
    assert placed(plan_job(one({"cpu": 2, "memory_gb": 2}), nodes, strategy="binpack"))[0].node == "small"
    assert placed(plan_job(one({"cpu": 2, "memory_gb": 2}), nodes, strategy="spread"))[0].node == "large"


def test_spread_distributes_successive_placements():
    nodes = [node(f"n{i}") for i in range(3)]
    active, seen = [], []
    for _ in range(6):
        p = placed(plan_job(one({"cpu": 1}), nodes, active, strategy="spread"))[0]
        active.append(p)
        seen.append(p.node)
    assert sorted(seen) == ["n0", "n0", "n1", "n1", "n2", "n2"]


def test_binpack_fills_one_node_before_the_next():
    nodes = [node(f"n{i}", cpu=4) for i in range(3)]
    active = []
    for _ in range(4):
        active.append(placed(plan_job(one({"cpu": 1}), nodes, active, strategy="binpack"))[0])
    assert {p.node for p in active} == {"n0"}


def test_ties_break_by_node_name():
    nodes = [node("c"), node("a"), node("b")]
    assert placed(plan_job(one({"cpu": 1}), nodes))[0].node == "a"


def test_work_without_devices_keeps_off_gpu_nodes():
    nodes = [node("gpu-box", devices=[gpu("g0", 0)]), node("zz-cpu")]
    assert placed(plan_job(one({"cpu": 1}), nodes, strategy="binpack"))[0].node == "zz-cpu"
    # ...but uses them when nothing else fits.
    assert placed(plan_job(one({"cpu": 1}), [nodes[0], node("full", cpu=0.5)]))[0].node == "gpu-box"


@pytest.mark.parametrize("strategy", ["binpack", "spread"])
def test_cpu_only_work_prefers_a_fitting_cpu_node_even_while_the_gpus_are_busy(strategy):
    # The demo lab's shape: a big GPU node whose only GPU is held looks fuller (binpack) or emptier (spread)
    # than the small CPU node; its CPU and memory still belong to the GPU work that comes back.
    big = node("gpu-big", cpu=32, memory=131072, devices=[gpu("G0", 0)])
    small = node("cpu-small", cpu=8, memory=32768)
    gpu_run = Placement(agent_id="x", node="gpu-big", resources={"gpu_count": 1, "cpu_cores": 2, "memory_mb": 8192},
                        allocation={"devices": [big.devices[0]]})
    for active in ([], [gpu_run]):
        assert placed(plan_job(one({"cpu": 1, "memory_mb": 512}), [big, small], active, strategy=strategy))[0].node \
            == "cpu-small"


@pytest.mark.parametrize("strategy", ["binpack", "spread"])
def test_among_gpu_nodes_cpu_only_work_takes_the_one_whose_gpus_are_held(strategy):
    busy = node("a-busy", devices=[gpu("A0", 0)])
    idle = node("b-idle", devices=[gpu("B0", 0)])
    held = Placement(agent_id="x", node="a-busy", resources={"gpu_count": 1}, allocation={"devices": [busy.devices[0]]})
    assert placed(plan_job(one({"cpu": 1}), [idle, busy], [held], strategy=strategy))[0].node == "a-busy"


def test_preferred_node_is_honored_when_feasible_else_fallback():
    def pref(name):
        return blueprint(agent("w", {"cpu": 1}, policies={"scheduler": {"preferred_node": name}}))
    nodes = [node("a"), node("b"), node("tiny", cpu=0.5)]
    p = placed(plan_job(pref("b"), nodes))[0]
    assert (p.node, p.preferred) == ("b", "honored")
    p = placed(plan_job(pref("tiny"), nodes))[0]
    assert p.node != "tiny" and p.preferred == "fallback"


# -- gang and system ------------------------------------------------------------------------------------

def test_gang_colocates_when_one_node_fits_all():
    bp = blueprint(agent("a", {"cpu": 2}), agent("b", {"cpu": 2}), policies={"scheduler_strategy": "spread"})
    placements = placed(plan_job(bp, [node("x"), node("y")]))
    assert {p.node for p in placements} == {"x"} and {p.locality for p in placements} == {"job_colocated"}


def test_gang_spills_over_when_no_single_node_fits():
    bp = blueprint(agent("a", {"cpu": 6}), agent("b", {"cpu": 6}))
    placements = placed(plan_job(bp, [node("x"), node("y")]))
    assert {p.node for p in placements} == {"x", "y"} and {p.locality for p in placements} == {"agent_spillover"}


def test_gang_is_all_or_nothing():
    bp = blueprint(agent("a", {"cpu": 1}), agent("b", {"cpu": 1}), agent("huge", {"cpu_cores": 100}))
    plan = plan_job(bp, [node("x"), node("y")])
    assert plan.status == "not_runnable" and plan.placements == ()
    assert plan.agents["huge"]["x"].startswith("insufficient cpu")


def test_gang_two_agents_wanting_the_same_port_split_across_nodes():
    bp = blueprint(agent("a", {"ports": [{"label": "p", "port": 80}]}), agent("b", {"ports": [{"label": "p", "port": 80}]}))
    placements = placed(plan_job(bp, [node("x"), node("y")]))
    assert sorted(p.node for p in placements) == ["x", "y"]
    plan = plan_job(bp, [node("x")])
    assert plan.status == "not_runnable" and plan.agents["b"]["x"].startswith(reasons.PORT_IN_USE)


def test_gang_waits_while_capacity_is_held():
    bp = blueprint(agent("a", {"gpu": 1}), agent("b", {"gpu": 1}))
    n = node("g", devices=[gpu("g0", 0), gpu("g1", 1)])
    first = plan_job(bp, [n])
    assert len(placed(first)) == 2
    second = plan_job(bp, [n], first.placements)
    assert second.status == "runnable_later" and second.placements == ()
    assert "waiting for capacity" in second.reason


@pytest.mark.parametrize("job_type", ["system", "sysbatch"])
def test_system_jobs_place_the_group_on_every_eligible_node(job_type):
    bp = blueprint(agent("mon", {"cpu": 1}), agent("log", {"cpu": 1}), policies={"job_type": job_type})
    nodes = [node("a"), node("b"), node("c", status="maintenance"), node("d", cpu=1)]
    plan = plan_job(bp, nodes)
    ids = sorted(p.agent_id for p in placed(plan))
    assert ids == ["log@a", "log@b", "mon@a", "mon@b"]
    assert {p.source_agent_id for p in plan.placements} == {"mon", "log"}
    assert {p.locality for p in plan.placements} == {"system"}
    assert plan.agents["mon"]["c"].startswith(reasons.NODE_NOT_READY)
    assert "d" in plan.agents["log"] or "d" in plan.agents["mon"]


def test_system_job_with_no_eligible_node_is_refused():
    bp = blueprint(agent("mon", {"cpu": 1}), policies={"job_type": "system"})
    assert plan_job(bp, [node("a", status="offline")], []).status == "not_runnable"


def test_no_nodes_at_all_is_not_runnable():
    plan = plan_job(one({}), [])
    assert plan.status == "not_runnable" and plan.placements == ()


# -- the shared examples --------------------------------------------------------------------------------

def test_the_reliability_example_plans_on_a_two_node_lab():
    raw = json.loads((EXAMPLES / "cluster_reliability_simulation.manifest.json").read_text())
    bp, issues = parse_blueprint(raw)
    assert not issues
    caps = ["cluster-reliability-demo", "replayable-work"]
    nodes = [node("mn1", capabilities=caps), node("mn2", capabilities=caps)]
    plan = plan_job(bp, nodes)
    placements = placed(plan)
    assert len(placements) == 6 and plan.strategy == "spread"
    planner = next(p for p in placements if p.agent_id == "placement_planner")
    assert planner.env["MN_PORT_PROBE_HTTP"] == "18080"
    # Without the capability the global constraint refuses every node.
    refused = plan_job(bp, [node("plain")])
    assert refused.status == "not_runnable" and "capabilities contains" in refused.agents["placement_planner"]["plain"]
