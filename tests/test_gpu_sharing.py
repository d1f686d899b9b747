"""docs/resources.md, "Sharing GPUs": MIG slices, fractional GPUs and memory best fit, through the scheduler and its
admission rule."""

import pytest
from builders import agent, blueprint, gpu, node, one

from mn_prefect.model.hints import env_hints
from mn_prefect.model.issues import InvalidInput
from mn_prefect.model.resources import resource_request
from mn_prefect.scheduler import plan_job, reasons
from mn_prefect.scheduler.ask import asks_for_blueprint
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.scheduler.view import ClusterView


def mig_gpu(id: str, index: int, slices: int = 7, profile: str = "1g.10gb", memory: float = 81920) -> list[dict]:
    """An A100-like GPU in MIG mode and its slices."""
    parent = {**gpu(id, index, memory), "mig_mode": True}
    cut = [{**gpu(f"MIG-{id}-{n}", index, 9984), "parent": id, "mig_profile": profile} for n in range(slices)]
    return [parent, *cut]


def plan_in(view, bp):
    """Plan against a long-lived view, which keeps what it books (as a worker's placer does)."""
    return plan_asks(asks_for_blueprint(bp), [], job_type=bp.job_type, strategy=bp.strategy, view=view)


def placed(plan):
    assert plan.status == "runnable_now", plan.reason
    return plan.placements


def refused(plan, agent_id="w"):
    assert plan.status in ("runnable_later", "not_runnable"), plan
    return plan.agents[agent_id]


def slices(n=2, profile="1g.10gb"):
    return {"devices": [{"kind": "gpu", "mig_profile": profile, "count": n}]}


def fraction(shares, memory_mb=None, **more):
    request = {"kind": "gpu", "shares": shares, **more}
    if memory_mb is not None:
        request["memory_mb"] = memory_mb
    return {"devices": [request]}


# -- MIG slices -----------------------------------------------------------------------------------------------

def test_a_slice_request_gets_slices_named_by_their_uuid():
    plan = plan_job(one(slices(2)), [node("a", devices=mig_gpu("GPU-A", 0))])
    p = placed(plan)[0]
    assert [d.parent for d in p.allocation.devices] == ["GPU-A", "GPU-A"]
    assert p.resources.gpu_count == 0  # a slice is never counted as a GPU
    assert p.env["CUDA_VISIBLE_DEVICES"] == ",".join(d.id for d in p.allocation.devices)
    assert all(x.startswith("MIG-") for x in p.env["CUDA_VISIBLE_DEVICES"].split(","))


def test_a_request_without_mig_profile_gets_neither_a_slice_nor_a_gpu_in_mig_mode():
    """CUDA cannot give a process a GPU in MIG mode whole (named in CUDA_VISIBLE_DEVICES, it yields at most one of
    its slices): such a GPU is booked only slice by slice."""
    nodes = [node("a", devices=mig_gpu("GPU-A", 0) + [gpu("GPU-B", 1)])]
    p = placed(plan_job(one({"gpu": 1}), nodes))[0]
    assert [d.id for d in p.allocation.devices] == ["GPU-B"]
    why = refused(plan_job(one({"gpu": 2}), nodes))["a"]
    assert why.startswith(reasons.MISSING_DEVICES) and "GPU-A in MIG mode: ask for its slices by mig_profile" in why
    assert refused(plan_job(one({"devices": [{"kind": "gpu", "ids": ["GPU-A"]}]}), nodes))["a"].startswith(
        reasons.MISSING_DEVICES)
    assert refused(plan_job(one(fraction(0.5)), [node("a", devices=mig_gpu("GPU-A", 0))]))["a"]


def held_whole_before(nodes, gpu_id: str):
    """A placement that holds the GPU in MIG mode ``gpu_id`` whole, as one booked before such GPUs were
    refused to whole requests would (the admission rule still honours it)."""
    plain = [node(n.name, devices=[gpu(gpu_id, 0)]) for n in nodes]
    placement = placed(plan_job(one({"gpu": 1}), plain))[0]
    mig_mode_gpu = next(d for n in nodes for d in n.devices if d.id == gpu_id)
    allocation = placement.allocation.model_copy(update={"devices": (mig_mode_gpu,)})
    return placement.model_copy(update={"allocation": allocation})


def test_the_admission_rule_refuses_a_slice_of_a_gpu_held_whole_and_the_reverse():
    nodes = [node("a", devices=mig_gpu("GPU-A", 0, slices=2))]
    whole = held_whole_before(nodes, "GPU-A")
    a_slice = placed(plan_job(one(slices(1)), nodes))[0]  # planned against the same empty cluster
    view = ClusterView(nodes, [whole])
    assert "never both" in view.admit(a_slice)
    view = ClusterView(nodes, [a_slice])
    why = view.admit(whole)
    assert why is not None and "never both" in why
    assert ClusterView(nodes, [a_slice]).admit(a_slice).endswith("is held")


def test_slices_fill_a_gpu_that_already_has_slices_booked_first():
    nodes = [node("a", devices=mig_gpu("GPU-A", 0, slices=3) + mig_gpu("GPU-B", 1, slices=3))]
    view = ClusterView(nodes)
    first = placed(plan_in(view, one(slices(1))))[0].allocation.devices[0].parent
    second = placed(plan_in(view, one(slices(1))))[0].allocation.devices[0].parent
    assert first == second  # the other GPU keeps its slices free
    assert placed(plan_in(view, one(slices(1))))[0].allocation.devices[0].parent == first  # its last slice
    assert placed(plan_in(view, one(slices(1))))[0].allocation.devices[0].parent != first


def test_an_unknown_profile_on_every_node_is_not_runnable():
    plan = plan_job(one(slices(1, "3g.40gb")), [node("a", devices=mig_gpu("GPU-A", 0))])
    assert plan.status == "not_runnable"
    assert "mig_profile=3g.40gb" in plan.agents["w"]["a"]


# -- fractional GPUs -------------------------------------------------------------------------------------------

def test_fractions_share_a_gpu_until_shares_or_memory_run_out():
    nodes = [node("a", devices=[gpu("GPU-A", 0, 16384)])]
    view = ClusterView(nodes)
    for _ in range(4):
        p = placed(plan_in(view, one(fraction(0.25))))[0]
        assert p.allocation.shares[0].memory_mb == 4096  # default: shares x the GPU's memory
    assert "shares=0.25: 0 of 1 free" in refused(plan_in(view, one(fraction(0.25))))["a"]
    view = ClusterView(nodes)
    placed(plan_in(view, one(fraction(0.1, 12000))))
    why = refused(plan_in(view, one(fraction(0.1, 8000))))["a"]
    assert why.startswith(reasons.MISSING_DEVICES), why


def test_a_fraction_goes_where_it_leaves_the_least_memory_unbooked():
    nodes = [node("a", devices=[gpu("GPU-big", 0, 24576), gpu("GPU-small", 1, 16384)]),
             node("b", devices=[gpu("GPU-b", 0, 40960)])]
    p = placed(plan_job(one(fraction(0.5, 8192)), nodes))[0]
    assert (p.node, p.allocation.shares[0].id) == ("a", "GPU-small")
    view = ClusterView(nodes)
    placed(plan_in(view, one(fraction(0.5, 14000))))  # GPU-small: 2384 MB left
    p = placed(plan_in(view, one(fraction(0.25, 2000))))[0]
    assert p.allocation.shares[0].id == "GPU-small"


def test_a_shared_gpu_is_not_booked_whole_and_a_whole_gpu_is_not_shared():
    nodes = [node("a", devices=[gpu("GPU-A", 0)])]
    view = ClusterView(nodes)
    share = placed(plan_in(view, one(fraction(0.5))))[0]
    assert refused(plan_in(view, one({"gpu": 1})))["a"].startswith(reasons.MISSING_DEVICES)
    whole = placed(plan_job(one({"gpu": 1}), nodes))[0]
    assert "held whole" in ClusterView(nodes, [whole]).admit(share)
    assert "not booked whole" in ClusterView(nodes, [share]).admit(whole)


def test_a_gpu_in_mig_mode_is_not_shared_in_fractions():
    plan = plan_job(one(fraction(0.5)), [node("a", devices=mig_gpu("GPU-A", 0))])
    assert plan.status == "not_runnable"


def test_fraction_hints_state_the_shares_memory_and_mps_limits():
    p = placed(plan_job(one(fraction(0.3, 5000)), [node("a", devices=[gpu("GPU-x", 0), gpu("GPU-A", 3, 24576)])]))[0]
    assert p.allocation.shares[0].id == "GPU-x"
    assert p.env["MN_GPU_SHARES"] == "0.3"
    assert p.env["MN_GPU_MEMORY_MB"] == "5000"
    assert p.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert p.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=5000M"
    assert p.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env_hints(p, in_container=True)["CUDA_VISIBLE_DEVICES"] == "GPU-x"
    tiny = placed(plan_job(one(fraction(0.01)), [node("a", devices=[gpu("GPU-x", 0)])]))[0]  # the least: 0.01
    assert tiny.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"


def test_memory_above_every_gpu_is_not_runnable_with_the_field_named():
    plan = plan_job(one(fraction(0.5, 99999)), [node("a", devices=[gpu("GPU-A", 0)])])
    assert plan.status == "not_runnable"
    assert "memory_mb=99999" in plan.agents["w"]["a"]


@pytest.mark.parametrize(("request_", "field", "words"), [
    ({"kind": "gpu", "shares": 1.5}, "shares", "at least 0.01 and below 1"),
    ({"kind": "gpu", "shares": 0}, "shares", "at least 0.01 and below 1"),
    ({"kind": "gpu", "shares": 0.5, "count": 2}, "count", "must be 1 with shares"),
    ({"kind": "gpu", "memory_mb": 4096}, "memory_mb", "needs shares"),
    ({"kind": "gpu", "mig_profile": "tiny"}, "mig_profile", "unknown MIG profile"),
    ({"kind": "gpu", "mig_profile": "1g.10gb", "shares": 0.5}, "shares", "cannot be combined"),
    ({"kind": "gpu", "shares": "half"}, "shares", "must be a number"),
])
def test_bad_sharing_requests_name_the_field(request_, field, words):
    with pytest.raises(InvalidInput) as error:
        resource_request({"devices": [request_]})
    text = str(error.value)
    assert f"resources.devices[0].{field}" in text and words in text, text


def test_slices_and_fractions_do_not_count_as_gpus():
    request = resource_request({"devices": [{"kind": "gpu", "shares": 0.5}, {"kind": "gpu", "mig_profile": "1g.10gb"},
                                            {"kind": "gpu", "count": 2}]})
    assert request.gpu_count == 2
    with pytest.raises(InvalidInput, match="gpu_count: is 3 but the GPU device requests total 2"):
        resource_request({"gpu_count": 3, "devices": [{"kind": "gpu", "count": 2}, {"kind": "gpu", "shares": 0.5}]})


# -- memory best fit for whole GPUs ----------------------------------------------------------------------------

def test_a_memory_sized_request_takes_the_smallest_sufficient_gpu_across_nodes():
    # Binpack alone would pick the fuller node "a" and its 64 GB GPU.
    nodes = [node("a", cpu=4, devices=[gpu("GPU-64", 0, 65536)]), node("b", cpu=64, devices=[gpu("GPU-16", 0, 16384)])]
    p = placed(plan_job(one({"cpu": 2, "devices": [{"kind": "gpu", "min_memory_mb": 16000}]}), nodes))[0]
    assert (p.node, p.allocation.devices[0].id) == ("b", "GPU-16")
    p = placed(plan_job(one({"cpu": 2, "devices": [{"kind": "gpu", "min_memory_mb": 20000}]}), nodes))[0]
    assert p.node == "a"
    p = placed(plan_job(one({"cpu": 2, "gpu": 1}), nodes))[0]
    assert p.node == "a"  # no memory minimum: the strategy decides


def test_best_fit_is_recomputed_when_a_node_changes():
    nodes = [node("a", devices=[gpu("GPU-a", 0, 16384)]), node("b", devices=[gpu("GPU-b", 0, 24576)])]
    view = ClusterView(nodes)
    ask = one({"devices": [{"kind": "gpu", "min_memory_mb": 16000}]})
    first = placed(plan_in(view, ask))[0]
    assert first.node == "a"
    assert placed(plan_in(view, ask))[0].node == "b"
    view.unhold(first)
    assert placed(plan_in(view, ask))[0].node == "a"


def test_a_gang_may_mix_whole_gpus_slices_and_fractions_on_one_node():
    devices = [gpu("GPU-w", 0), *mig_gpu("GPU-m", 1, slices=2)]
    bp = blueprint(agent("x", {"gpu": 1}), agent("y", slices(2)), agent("z", fraction(0.5, memory_mb=None)))
    plan = plan_job(bp, [node("a", devices=devices), node("b", devices=[gpu("GPU-b", 0)])])
    by_agent = {p.agent_id: p for p in placed(plan)}
    assert by_agent["y"].node == "a" and {d.parent for d in by_agent["y"].allocation.devices} == {"GPU-m"}
    assert by_agent["x"].allocation.devices[0].id != by_agent["z"].allocation.shares[0].id


def test_an_ask_whose_every_candidate_is_known_not_to_fit_is_refused_cleanly():
    # The first refusal records that the node's devices cannot take the ask; the second finds no candidate left.
    nodes = [node("a", devices=mig_gpu("GPU-A", 0, slices=1))]
    view = ClusterView(nodes)
    placed(plan_in(view, one(slices(1))))
    for _ in range(2):
        assert view.place(asks_for_blueprint(one(slices(1)))[0])[0] is None
