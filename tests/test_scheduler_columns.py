"""The fleet as columns (scheduler/columns.py): a store snapshot's columns plan exactly as its records and holds do.

Equivalence: seeded mixed fleets (CPU, GPU, MIG and shared GPUs, profiles, services, statuses, port ranges) with
bookings written as the store writes them (``demand_by_node``, ``added``) are planned with many mixed requests
both ways, from the snapshot's records and holds and from its columns, and every plan must be the same JSON:
nodes, devices, shares, ports, scores, refusal reasons. Then table-driven checks of the columns themselves."""

from __future__ import annotations

import random

import numpy as np
import pytest
from builders import agent, blueprint, gpu, node

from mn_prefect.model.placement import Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.scheduler import ClusterView, plan_job
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.classes import fleet_for, forget
from mn_prefect.scheduler.columns import FleetColumns, NodeColumns, columns_of, row_of
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.plan import _placement
from mn_prefect.scheduler.quotas import Queues
from mn_prefect.store import open_store
from mn_prefect.store.booking import NodeState, added, demand_by_node, parse_record, snapshot_of
from mn_prefect.store.dimensions import CLAIM_KINDS

NO_QUEUES = Queues.of([], [])


def mig_gpu(id: str, index: int, slices: int = 3) -> list[dict]:
    parent = {**gpu(id, index, 81920), "mig_mode": True}
    return [parent] + [{**gpu(f"MIG-{id}-{k}", index, 9984), "parent": id, "mig_profile": "1g.10gb"}
                       for k in range(slices)]


def fleet(seed: int, count: int = 36) -> list:
    rng = random.Random(seed)
    nodes = []
    for i in range(count):
        name = f"n{rng.randrange(1000):03d}-{i}"
        kind = i % 6
        extra: dict = {"labels": {"rack": f"r{i % 3}"}, "host_paths": ["/data"] if i % 2 else []}
        if kind == 0:
            devices = []
        elif kind == 1:
            devices = [gpu(f"{name}-g{j}", j, 40960, caps=("fp16", "bf16")) for j in range(4)]
        elif kind == 2:
            devices = [gpu(f"{name}-g{j}", j, 16384) for j in range(2)]
        elif kind == 3:
            devices = [gpu(f"{name}-a{j}", j, 65536, vendor="amd", driver="rocm") for j in range(2)]
        elif kind == 4:
            devices = mig_gpu(f"{name}-m0", 0) + [gpu(f"{name}-g1", 1, 81920)]
        else:
            devices = [gpu(f"{name}-g0", 0, 24576)]
            extra["profiles"] = [{"name": "inference", "gpu": True}]
        if rng.random() < 0.15:
            extra["status"] = rng.choice(["draining", "joining", "offline", "maintenance"])
        if rng.random() < 0.1:
            extra["scheduling_eligible"] = False
        if rng.random() < 0.3:
            extra["services"] = [{"name": "db", "status": rng.choice(["passing", "critical"])}]
        if rng.random() < 0.3:
            extra["runtime_drivers"] = ["host_local", "podman"]
        if rng.random() < 0.3:
            extra["dynamic_port_range"] = [30000, 30000 + rng.randrange(1, 4)]
        nodes.append(node(name, cpu=rng.choice([4, 8, 32]), memory=rng.choice([8192, 32768, 131072]),
                          devices=devices, capabilities=rng.choice([[], ["cuda"], ["cuda", "avx2"]]), **extra))
    return nodes


REQUESTS: list[dict] = [
    {"cpu": 1, "memory_gb": 1},
    {"cpu": 6, "memory_gb": 24},
    {"cpu": 64},
    {"cpu": 1, "ports": [{"label": "api"}]},
    {"cpu": 1, "ports": [{"label": "api", "port": 8080}, {"label": "dyn"}]},
    {"cpu": 1, "gpu": 1},
    {"cpu": 2, "devices": [{"kind": "gpu", "min_memory_mb": 20000}]},
    {"cpu": 2, "devices": [{"kind": "gpu", "min_memory_mb": 60000}]},
    {"cpu": 2, "devices": [{"kind": "gpu", "driver": "cuda", "count": 2, "capabilities": ["bf16"]}]},
    {"cpu": 1, "devices": [{"kind": "gpu", "vendor": "amd"}]},
    {"cpu": 1, "devices": [{"kind": "gpu", "mig_profile": "1g.10gb", "count": 2}]},
    {"cpu": 1, "devices": [{"kind": "gpu", "shares": 0.25}]},
    {"cpu": 1, "devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": 30000}]},
    {"cpu": 1, "volumes": [{"name": "d", "source": "/data/x", "target": "/x"}]},
    {"cpu": 1, "runtime_driver": "podman"},
    {"cpu": 1, "devices": [{"kind": "gpu", "count": 5}]},
]


def random_agent(rng: random.Random, name: str, nodes: list) -> dict:
    raw = agent(name, dict(rng.choice(REQUESTS)))
    roll = rng.random()
    if roll < 0.1:
        raw["config"]["execution_profile"] = "inference"
    elif roll < 0.2:
        raw["constraints"] = [rng.choice(["cuda", {"attribute": "labels.rack", "operator": "!=", "value": "r1"},
                                          {"attribute": "node", "operator": "!=", "value": rng.choice(nodes).name}])]
    elif roll < 0.3:
        raw["requires_services"] = ["db"]
    elif roll < 0.5:
        raw["policies"] = {"scheduler": {"preferred_node": rng.choice(nodes).name}}
    return raw


def random_blueprint(rng: random.Random, nodes: list):
    agents = [random_agent(rng, f"a{k}", nodes) for k in range(rng.choice([1, 1, 1, 2, 3]))]
    return blueprint(*agents, policies={"job_type": rng.choice(["batch", "batch", "service", "system"])})


def booked_states(nodes: list, seed: int) -> list[NodeState]:
    """Bookings as a store holds them: random plans committed one by one (``demand_by_node``, rounded)."""
    rng = random.Random(seed)
    view = ClusterView(nodes)
    states = {n.name: NodeState(record=n, used={}, held={kind: set() for kind in CLAIM_KINDS}) for n in nodes}
    for k in range(60):
        ask = Ask(agent_id=f"b{k}", request=resource_request(rng.choice(REQUESTS)))
        choice, _ = view.place(ask, rng.choice(["binpack", "spread"]))
        if choice is None:
            continue
        placement = _placement(view, choice, "job_colocated", "batch", f"b{k}")
        for name, demand in demand_by_node([placement]).items():
            state = states[name]
            state.used = added(state.used, demand.add)
            for kind, keys in demand.claim.items():
                state.held.setdefault(kind, set()).update(keys)
    return list(states.values())


def limits_for(nodes: list, seed: int) -> Limits:
    if seed % 2 == 0:
        return Limits()
    return Limits(cpu=90, memory=80, gpu=75, per_node={nodes[0].name: {"cpu": 50}, nodes[3].name: {"gpu": 50}})


@pytest.mark.parametrize("seed", range(6))
def test_plans_from_columns_equal_plans_from_records_and_holds(seed):
    nodes = fleet(seed)
    states = booked_states(nodes, seed)
    rng = random.Random(seed)
    rng.shuffle(states)  # the store's row order is not the scheduler's
    limits = limits_for(nodes, seed)
    snap = snapshot_of(states, limits, NO_QUEUES, group=f"equivalence-{seed}")
    extra = [Placement(agent_id="cli", node=nodes[5].name, resources={"cpu_cores": 1},
                       allocation={"ports": [{"label": "x", "port": 30000}]})]
    statuses = set()
    for k in range(60):
        bp = random_blueprint(rng, nodes)
        strategy = rng.choice(["binpack", "spread"])
        explain = k % 3 == 0
        active = extra if k % 4 == 0 else []
        if k % 5 == 0:
            forget()
        by_records = plan_job(bp, snap.nodes, snap.holds + active, strategy=strategy, limits=limits, explain=explain)
        if k % 5 == 0:
            forget()
        by_columns = plan_job(bp, snap.columns, active, strategy=strategy, limits=limits, explain=explain)
        assert by_columns.model_dump_json() == by_records.model_dump_json()
        statuses.add(by_records.status)
    assert "runnable_now" in statuses and len(statuses) > 1


@pytest.mark.parametrize("seed", range(3))
def test_a_long_lived_view_from_columns_decides_as_one_from_holds(seed):
    """A placer's view: many decisions in a row, releases among them, and admission of planned placements."""
    nodes = fleet(seed + 10)
    states = booked_states(nodes, seed)
    snap = snapshot_of(states, Limits(), NO_QUEUES, group=f"warm-{seed}")
    by_records, by_columns = ClusterView(snap.nodes, snap.holds), ClusterView(snap.columns)
    rng = random.Random(seed)
    tokens = []
    for k in range(150):
        ask = Ask(agent_id=f"w{k}", request=resource_request(rng.choice(REQUESTS)))
        strategy = rng.choice(["binpack", "spread"])
        (a, why_a), (b, why_b) = by_records.place(ask, strategy), by_columns.place(ask, strategy)
        assert why_a == why_b
        assert (a is None) == (b is None)
        if a is None or b is None:
            continue
        assert (a.node, a.score, a.devices, a.shares, a.ports, a.gpu) == (b.node, b.score, b.devices, b.shares,
                                                                          b.ports, b.gpu)
        tokens.append((a.token, b.token))
        if rng.random() < 0.3:
            ta, tb = tokens.pop(rng.randrange(len(tokens)))
            by_records.unbook(ta)
            by_columns.unbook(tb)
    for i, name in enumerate(by_records.nodes):
        assert by_columns.nodes[i].name == name.name
        assert by_records.ports_used[i] == by_columns.ports_used[i]
        assert by_records.devices_held[i] == by_columns.devices_held[i]
        assert by_records.devices_used[i] == by_columns.devices_used[i]
    assert np.array_equal(by_records._free_rows, by_columns._free_rows)


@pytest.mark.parametrize("size,seed", [(3, 0), (4, 1), (6, 2), (12, 3), (36, 4)])
def test_a_long_lived_view_decides_as_a_fresh_view_of_the_same_bookings(size, seed):
    """A placer's view catches its rankings up on the nodes booked or released since (in plain floats for a few
    nodes, in arrays for many): every decision must be the one a view read afresh from the same bookings makes."""
    nodes = fleet(seed + 20, count=size)
    view = ClusterView(nodes)
    rng = random.Random(seed)
    live: dict[str, tuple] = {}
    for k in range(200):
        ask = Ask(agent_id=f"w{k}", request=resource_request(rng.choice(REQUESTS[:6] + REQUESTS[10:13])))
        strategy = rng.choice(["binpack", "spread"])
        # The choices, not the nodes tried on the way: a warm ranking knows some refuse without trying them.
        fresh_choice, _ = ClusterView(nodes, [p for p, _ in live.values()]).place(ask, strategy)
        choice, _ = view.place(ask, strategy)
        assert (choice is None) == (fresh_choice is None)
        if choice is None or fresh_choice is None:
            continue
        assert (choice.node, choice.score, choice.devices, choice.shares, choice.ports, choice.gpu) == (
            fresh_choice.node, fresh_choice.score, fresh_choice.devices, fresh_choice.shares, fresh_choice.ports,
            fresh_choice.gpu)
        live[f"w{k}"] = (_placement(view, choice, "job_colocated", "batch", f"w{k}"), choice.token)
        if live and rng.random() < 0.35:
            _, token = live.pop(rng.choice(sorted(live)))
            view.unbook(token)


def test_holds_are_the_columns_holdings():
    nodes = fleet(3)
    states = booked_states(nodes, 3)
    snap = snapshot_of(states, Limits(), NO_QUEUES)
    columns = snap.columns
    assert [h.node for h in snap.holds] == [s.record.name for s in states if s.busy]
    holds = {h.node: h for h in snap.holds}
    for i, name in enumerate(columns.nodes.names):
        hold = holds.get(name)
        held = columns.holding(i)
        if hold is None:
            assert held is None and not columns.used[:, i].any()
            continue
        r = hold.resources
        assert tuple(columns.used[:, i]) == (r.cpu_cores, r.memory_mb, r.gpu_count, r.disk_mb)
        devices, shares, ports = held
        assert (tuple(devices), tuple(shares)) == (hold.allocation.devices, hold.allocation.shares)
        assert list(ports) == [(p.protocol, p.port) for p in hold.allocation.ports]


# -- the columns themselves -------------------------------------------------------------------------------------

A, B, C = node("a", cpu=4), node("b", cpu=8, devices=[gpu("b0", 0)]), node("c", cpu=2)


@pytest.mark.parametrize(("before", "after", "same", "shapes"), [
    ([A, B, C], [A, B, C], True, 2),  # nothing changed: the same columns
    ([A, B, C], [C, B, A], True, 2),  # order given does not matter: rows are sorted by name
    ([A, B, C], [A, node("b", cpu=16, devices=[gpu("b0", 0)]), C], False, 2),  # capacity patched
    ([A, B, C], [A, node("b", cpu=8), C], False, 1),  # b's shape now a's: its old shape dropped
    ([A, B, C], [A, B, node("c", cpu=2, labels={"x": "y"})], False, 3),  # a new shape
    ([A, B, C], [A, B], False, 2),  # another set of names: built anew
])
def test_columns_are_patched_where_rows_changed(before, after, same, shapes):
    previous = columns_of(before)
    columns = NodeColumns.of(map(row_of, after), previous)
    assert (columns is previous) is same
    fresh = columns_of(after)
    assert columns.names == fresh.names == sorted(n.name for n in after)
    assert np.array_equal(columns.capacity, fresh.capacity)
    assert [set(d) for d in columns.devices] == [set(d) for d in fresh.devices]
    assert len(columns.shapes) == shapes
    # nodes share a code exactly where their shapes are equal, and ``first`` names each shape's first node
    keys = [columns.shapes[k].key for k in columns.shape_of.tolist()]
    assert keys == [fresh.shapes[k].key for k in fresh.shape_of.tolist()]
    assert [columns.shape_of[i] for i in columns.first] == list(range(len(columns.shapes)))
    assert all(min(np.flatnonzero(columns.shape_of == k)) == i for k, i in enumerate(columns.first))
    # each shape's representative has that shape, and a fresh build takes the first record given with it
    assert [row_of(r).shape for r in columns.representatives] == columns.shapes
    assert fresh.representatives == [next(n for n in after if row_of(n).shape is shape) for shape in fresh.shapes]


@pytest.mark.parametrize(("status", "eligible", "class_status"), [
    ("healthy", True, "healthy"), ("draining", True, "draining"), ("healthy", False, "healthy")])
def test_a_stored_text_is_one_record_and_one_row_per_live_status(status, eligible, class_status):
    text = node("t", cpu=3).model_dump_json()
    record = parse_record(text, status, eligible)
    assert parse_record(text, status, eligible) is record  # the same object: its row is derived once
    assert (record.status, record.scheduling_eligible) == (status, eligible)
    row = row_of(record)
    assert row_of(record) is row and row.shape.key[0] == class_status and row.shape.key[1] is eligible


def test_a_fleet_is_kept_on_its_columns_until_forgotten():
    columns = columns_of([A, B, C])
    fleet = fleet_for(columns)
    assert fleet_for(columns) is fleet and len(fleet.classes) == 2
    forget()
    assert fleet_for(columns) is not fleet


def test_columns_without_holds_and_extra_active_placements():
    """``NodeColumns`` hold nothing; ``active`` is held on top of what ``FleetColumns`` hold."""
    nodes = [A, B, C]
    active = [Placement(agent_id="x", node="b", resources={"cpu_cores": 3, "gpu_count": 1},
                        allocation={"devices": [B.devices[0]], "ports": [{"label": "p", "port": 9000}]})]
    plain, columns = ClusterView(nodes, active), ClusterView(columns_of(nodes), active)
    assert np.array_equal(plain._free_rows, columns._free_rows)
    assert plain.devices_held[1] == columns.devices_held[1] == {"b0"} and columns.ports_used[1] == {("tcp", 9000)}
    held = FleetColumns.of(columns_of(nodes), np.zeros((4, 3)), lambda i: None, Limits())
    twice = ClusterView(held, active)
    assert np.array_equal(twice._free_rows, plain._free_rows) and twice.devices_held[1] == {"b0"}


def test_a_sqlite_snapshot_plans_alike_from_columns_and_from_holds(tmp_path):
    """The store's own snapshot, after commits and a status change (the columns patched where a row changed)."""
    nodes = fleet(7, count=12)
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        for n in nodes:
            store.register_node(n)
        rng = random.Random(7)
        for k in range(25):
            plan = plan_job(random_blueprint(rng, nodes), store.snapshot().columns, strategy="binpack")
            if plan.status == "runnable_now":
                store.commit_plan(f"j{k}", list(plan.placements))
        first = store.snapshot()
        store.set_node_status(nodes[2].name, "draining")
        second = store.snapshot()
        assert second.columns.nodes.names == first.columns.nodes.names
        assert second.columns.nodes.index is first.columns.nodes.index  # patched, not rebuilt
        for snap in (first, second):
            for _ in range(30):
                bp = random_blueprint(rng, nodes)
                by_columns = plan_job(bp, snap.columns, explain=True)
                assert by_columns.model_dump_json() == plan_job(bp, snap.nodes, snap.holds).model_dump_json()
    finally:
        store.close()
