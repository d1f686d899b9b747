"""SQLite, Redis and PostgreSQL decide exactly alike: a seeded random workload (commits that conflict on
capacity, devices, ports and queue quotas, full and partial releases, status, limit and queue changes) runs
against each real backend and against the admission rule over plain Python state; every outcome, every
refusal's node and reason, the final bookings and every queue's use must be identical."""

from __future__ import annotations

import copy
import json
import random
from contextlib import contextmanager

import pytest
from builders import gpu, node
from conftest import store_url

from mn_prefect.model.placement import Allocation, PlacedResources, Placement, PortAllocation
from mn_prefect.model.queues import QueueSpec
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.quotas import is_account, queue_account
from mn_prefect.store import open_store
from mn_prefect.store.accounts import account_of, queues_of, settle, split_release
from mn_prefect.store.admission import CommitRead, commit
from mn_prefect.store.audit import audit
from mn_prefect.store.booking import NodeState, added, demand_by_node, fingerprint
from mn_prefect.store.dimensions import CLAIM_KINDS

NODES = [
    node("a", cpu=12, memory=16384, devices=[gpu("a0", 0), gpu("a1", 1)]),
    node("b", cpu=6, memory=8192, devices=[gpu("b0", 0)]),
    node("c", cpu=8, memory=2048),
    node("d", cpu=3, memory=4096, devices=[gpu("d0", 0), gpu("d1", 1), gpu("d2", 2)]),
]
DEVICES = {n.name: [d.id for d in n.devices] for n in NODES}
QUEUES = [QueueSpec(name="qa", quota={"cpu": 2, "gpu": 1}, cohort="x"),
          QueueSpec(name="qb", quota={"gpu": 1}, borrow={"gpu": 1}, cohort="x"),
          QueueSpec(name="qc", quota={"cpu": 2, "memory": 2048})]


class PythonRule:
    """The admission rule over plain Python state: what every backend must agree with."""

    def __init__(self) -> None:
        self.states = {n.name: NodeState(record=n, used={}, held={k: set() for k in CLAIM_KINDS}) for n in NODES}
        self.limits = Limits()
        self.bookings: dict[str, list[Placement]] = {}
        # accounts: name -> [record text, used, version]; what each booking charged them
        self.accounts: dict[str, list] = {}
        self.charged: dict[str, dict] = {}

    @contextmanager
    def commit_session(self):
        yield self

    def read(self, job_id, nodes, lease):
        states = [copy.deepcopy(self.states[n]) for n in nodes if n in self.states]
        booked = fingerprint(self.bookings[job_id]) if job_id in self.bookings else None
        queues = queues_of(account_of(n, text, dict(used), version) for n, (text, used, version)
                           in self.accounts.items() if n in nodes) if any(map(is_account, nodes)) else None
        return CommitRead(states=states, limits=self.limits, booked=booked, queues=queues)

    def apply(self, ticket, lease):
        for name, demand in ticket.demands.items():
            if is_account(name):
                self.accounts[name][1] = added(self.accounts[name][1], demand.add)
                continue
            state = self.states[name]
            state.used = added(state.used, demand.add)
            for kind, keys in demand.claim.items():
                state.held[kind].update(keys)
        self.bookings[ticket.job_id] = self._pending
        self.charged[ticket.job_id] = {n: {"add": d.add} for n, d in ticket.demands.items() if is_account(n)}
        return "ok", None

    def set_queue(self, spec):
        specs = {n[len("@queue:"):]: QueueSpec.model_validate_json(a[0]) for n, a in self.accounts.items()
                 if n.startswith("@queue:")}
        text, cohorts = settle(specs, spec, spec.name)
        for name, body in [(queue_account(spec.name), text)] + [(f"@cohort:{c}", t) for c, t in cohorts.items()]:
            old = self.accounts.get(name, [None, {}, 0])
            self.accounts[name] = [body or json.dumps({"name": name[8:], "nominal": {}}), old[1], old[2] + 1]

    def commit_plan(self, job_id, placements):
        self._pending = list(placements)
        return commit(self, job_id, placements, None, 0.0)

    def release(self, job_id, node=None):
        placements = self.bookings.get(job_id, [])
        gone = [p for p in placements if node is None or p.node == node]
        kept = [p for p in placements if node is not None and p.node != node]
        for name, demand in demand_by_node(gone).items():
            state = self.states[name]
            state.used = added(state.used, demand.add, -1)
            for kind, keys in demand.claim.items():
                state.held[kind].difference_update(keys)
        refund, keep = split_release(self.charged.get(job_id, {}), gone)
        for name, demand in refund.items():
            self.accounts[name][1] = added(self.accounts[name][1], demand["add"], -1)
        if kept:
            self.bookings[job_id] = kept
            self.charged[job_id] = keep
        else:
            self.bookings.pop(job_id, None)
            self.charged.pop(job_id, None)
        return len(gone)

    def set_status(self, name, status, eligible):
        self.states[name].record = self.states[name].record.model_copy(
            update={"status": status, "scheduling_eligible": eligible})

    def set_limits(self, limits):
        self.limits = limits


def _placement(rng: random.Random, job: str, index: int) -> Placement:
    name = "ghost" if rng.random() < 0.03 else rng.choice(["a", "b", "c", "d"])
    devices = []
    pool = DEVICES.get(name, []) + ["x9"]
    for device_id in rng.sample(pool, min(len(pool), rng.choice([0, 0, 1, 1, 2]))):
        devices.append(gpu(device_id, 0))
    if devices and rng.random() < 0.05:
        devices.append(devices[0])  # the same device twice in one placement
    ports = tuple(PortAllocation(label=f"p{i}", port=rng.choice([8000, 8001, 8002, 9000]),
                                 protocol=rng.choice(["tcp", "tcp", "udp"])) for i in range(rng.choice([0, 0, 1, 2])))
    return Placement(agent_id=f"{job}-{index}", node=name,
                     resources=PlacedResources(cpu_cores=rng.choice([0.25, 0.5, 1, 1.5, 2]),
                                               memory_mb=rng.choice([128, 512, 1024, 2048]),
                                               disk_mb=rng.choice([0, 0, 100]), gpu_count=len(devices)),
                     allocation=Allocation(devices=tuple(devices), ports=ports))


def workload(seed: int, count: int) -> list[tuple]:
    rng = random.Random(seed)
    ops: list[tuple] = [("queue", None, spec) for spec in QUEUES]
    jobs: list[str] = []
    commits: list[tuple] = []
    for i in range(count):
        roll = rng.random()
        if roll < 0.05 and commits:
            ops.append(rng.choice(commits))  # the same plan again: already committed, or refused the same way
        elif roll < 0.55 or not jobs:
            job = f"j{i}" if rng.random() < 0.9 or not jobs else rng.choice(jobs)  # some re-commit a known job
            placements = [_placement(rng, job, k) for k in range(rng.choice([1, 1, 1, 2, 3]))]
            queue = rng.choice(["qa", "qb", "qc", "unset", None, None])  # "unset": a queue with no settings
            placements = [p.model_copy(update={"queue": queue}) for p in placements]
            ops.append(("commit", job, placements))
            commits.append(ops[-1])
            jobs.append(job)
        elif roll < 0.85:
            ops.append(("release", rng.choice(jobs[-12:]), None))
        elif roll < 0.91:
            ops.append(("release", rng.choice(jobs[-12:]), rng.choice(["a", "b", "c", "d"])))
        elif roll < 0.94:  # settings change while runs hold: quota up or down, qb in or out of the cohort
            ops.append(("queue", None, rng.choice([
                QUEUES[0].model_copy(update={"quota": {"cpu": rng.choice([1, 2, 4]), "gpu": rng.choice([0, 1, 2])}}),
                QUEUES[1].model_copy(update={"cohort": rng.choice(["x", None])}), QUEUES[2]])))
        elif roll < 0.985:
            status, eligible = rng.choice([("draining", False), ("healthy", False)] + [("healthy", True)] * 4)
            ops.append(("status", rng.choice(["a", "b", "c", "d"]), (status, eligible)))
        else:
            ops.append(("limits", None, Limits(cpu=rng.choice([50, 100]), gpu=rng.choice([50, 100]))))
    return ops


def run(target, ops: list[tuple]) -> list:
    outcomes = []
    for op, subject, arg in ops:
        if op == "commit":
            result = target.commit_plan(subject, arg)
            conflict = result.conflict
            outcomes.append(("commit", subject, result.ok, result.already_committed,
                             conflict.node if conflict else None, conflict.reason if conflict else None))
        elif op == "release":
            outcomes.append(("release", subject, arg, target.release(subject, node=arg)))
        elif op == "queue":
            target.set_queue(arg)
        elif op == "status":
            if isinstance(target, PythonRule):
                target.set_status(subject, *arg)
            else:
                target.set_node_status(subject, arg[0], eligible=arg[1])
        else:
            target.set_limits(arg)
    return outcomes


SEEDS = [1, 2, 3]


def test_the_workloads_meet_every_kind_of_refusal():
    """Else the comparison below would prove little."""
    outcomes = [o for seed in SEEDS for o in run(PythonRule(), workload(seed, 300)) if o[0] == "commit"]
    reasons = " | ".join(o[5] for o in outcomes if o[5])
    for word in ("insufficient cpu", "insufficient memory", "insufficient gpu", "is held", "is not on", "port in use",
                 "not ready", "ineligible", "unknown node", "already holds a different booking",
                 "quota: queue qa", "quota: queue qc", "to lend"):
        assert word in reasons, word
    assert sum(1 for o in outcomes if o[2]) > 50 and any(o[3] for o in outcomes)  # accepted, and re-committed


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.lab
def test_every_backend_decides_like_the_python_rule(seed, request, tmp_path):
    ops = workload(seed, 300)
    reference = PythonRule()
    expected = run(reference, ops)
    for backend in ("sqlite", "redis", "postgresql"):
        store = open_store(store_url(backend, request, tmp_path / backend))
        for n in NODES:
            store.register_node(n)
        got = run(store, ops)
        for index, (want, have) in enumerate(zip(expected, got, strict=True)):
            assert have == want, f"{backend}: operation {index} {ops[index][:2]} differs"
        store.set_limits(Limits())  # the audit checks use against today's limits; lowered ones leave runs over them
        view = store.consistent_view()
        assert audit(view) == []
        assert sorted(view["bookings"]) == sorted(reference.bookings), backend
        held = sorted((kind, n, key) for kind, n, key, _job in view["held"])
        assert held == sorted((kind, name, key) for name, s in reference.states.items()
                              for kind, keys in s.held.items() for key in keys), backend
        for name, state in reference.states.items():
            for dim in ("cpu", "mem", "disk", "gpu"):
                assert view["nodes"][name][dim] == pytest.approx(state.amount(dim), abs=1e-6), (backend, name, dim)
        queues = store.queues()
        accounts = {**{f"@queue:{n}": q for n, q in queues.queues.items()},
                    **{f"@cohort:{n}": c for n, c in queues.cohorts.items()}}
        assert sorted(accounts) == sorted(reference.accounts), backend
        for name, (_text, used, _version) in reference.accounts.items():
            assert {d: v for d, v in accounts[name].used.items() if v} == pytest.approx(
                {d: v for d, v in used.items() if v}), (backend, name)
        store.close()
