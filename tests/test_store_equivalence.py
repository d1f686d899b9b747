"""SQLite, Redis and PostgreSQL decide exactly alike: a seeded random workload (commits that conflict on
capacity, devices, ports and queue quotas, holds booked past what is free and commits kept off their capacity,
backfills and held runs over a hold, full and partial releases, holds ending, status, limit and queue changes) runs
against each real backend and against the admission rule over plain Python state; every outcome, every
refusal's node and reason, the final bookings and every queue's use must be identical."""

from __future__ import annotations

import copy
import json
import random
from contextlib import contextmanager

import pytest
from builders import gpu, node
from stores import store_url

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

    def active_placements(self, *, node=None, job_id=None):
        return [p for job, placements in self.bookings.items() if job_id in (None, job)
                for p in placements if node in (None, p.node)]


def _placement(rng: random.Random, job: str, index: int, name: str | None = None) -> Placement:
    if name is None:
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


def _hold(rng: random.Random, index: int) -> Placement:
    """A hold's placement, as holding.hold_placements books one: a run's scalars and whole GPUs, no devices."""
    hold_id = f"hold-{index:08x}"
    name = rng.choice(["a", "a", "b", "c", "d", "d"])
    return Placement(agent_id=f"hold:run{index}", node=name, job_id=hold_id, hold=hold_id, hold_for=f"run{index}",
                     hold_start=1000.0 + index,
                     resources=PlacedResources(cpu_cores=rng.choice([0.5, 1, 2]), memory_mb=rng.choice([512, 1024]),
                                               gpu_count=rng.randint(0, len(DEVICES[name]))))


def _over_hold(rng: random.Random, job: str, hold: Placement) -> tuple[str, list[Placement]]:
    """A commit over ``hold``: the held run itself (its request, on the hold's node) or a backfill ending before the
    hold's expected start (mostly on its node; sometimes on another, where the hold holds nothing; sometimes beside
    a placement not over it)."""
    if rng.random() < 0.3:
        pool = DEVICES[hold.node]
        devices = tuple(gpu(d, 0) for d in rng.sample(pool, min(len(pool), hold.resources.gpu_count)))
        held_run = Placement(agent_id=hold.hold_for or "", node=hold.node, over_hold=hold.hold,
                             resources=hold.resources.model_copy(update={"gpu_count": len(devices)}),
                             allocation=Allocation(devices=devices))
        return hold.hold_for or "", [held_run]
    name = hold.node if rng.random() < 0.85 else rng.choice(["a", "b", "c", "d"])
    ends_by = (hold.hold_start or 0.0) - rng.choice([1, 60])
    placements = [_placement(rng, job, 0, name).model_copy(update={"over_hold": hold.hold, "ends_by": ends_by})]
    if rng.random() < 0.1:  # beside it on that node, a placement not over the hold: it would take held capacity
        placements.append(_placement(rng, job, 1, name))
    return job, placements


def workload(seed: int, count: int) -> list[tuple]:
    rng = random.Random(seed)
    ops: list[tuple] = [("queue", None, spec) for spec in QUEUES]
    jobs: list[str] = []
    commits: list[tuple] = []
    standing: list[Placement] = []  # the holds committed (admitted or refused) and not released since
    ended: list[Placement] = []  # the holds released
    for i in range(count):
        roll = rng.random()
        if roll < 0.2:  # holds: book one (past what is free), commit over one, end one
            kind = rng.random()
            if not standing or (kind < 0.3 and len(standing) < 3):
                standing.append(_hold(rng, i))
                ops.append(("commit", standing[-1].job_id, [standing[-1]]))
                commits.append(ops[-1])
            elif kind < 0.8:  # now and then over a hold already ended
                hold = rng.choice(ended if ended and rng.random() < 0.1 else standing)
                job, placements = _over_hold(rng, f"j{i}", hold)
                ops.append(("commit", job, placements))
                commits.append(ops[-1])
                jobs.append(job)
            else:
                ended.append(standing.pop(rng.randrange(len(standing))))
                ops.append(("release", ended[-1].job_id, None))
            continue
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


def commit_kind(placements: list[Placement]) -> str:
    if any(p.hold for p in placements):
        return "hold"
    if any(p.over_hold for p in placements):
        return "backfill" if any(p.ends_by is not None for p in placements) else "held run"
    return "plain"


def refused_for_holds(ops: list[tuple]) -> int:
    """How many plain commits of ``ops`` the rule refused that it would admit were the holds on the refusing node
    released: capacity a hold kept from them."""
    rule, count = PythonRule(), 0
    for op in ops:
        holding = op[0] == "commit" and commit_kind(op[2]) == "plain" and any(
            p.hold for placements in rule.bookings.values() for p in placements)
        before = copy.deepcopy(rule) if holding else None
        outcome = run(rule, [op])
        if before is None or outcome[0][2] or outcome[0][4] is None:
            continue
        for job, placements in list(before.bookings.items()):
            if any(p.hold and p.node == outcome[0][4] for p in placements):
                before.release(job)
        count += before.commit_plan(op[1], op[2]).ok
    return count


SEEDS = [1, 2, 3]


def test_the_workloads_meet_every_kind_of_refusal():
    """Else the comparison below would prove little."""
    workloads = [workload(seed, 300) for seed in SEEDS]
    commits = [(commit_kind(op[2]), o) for ops in workloads
               for op, o in zip([op for op in ops if op[0] == "commit"],
                                [o for o in run(PythonRule(), ops) if o[0] == "commit"], strict=True)]
    outcomes = [o for _kind, o in commits]
    reasons = " | ".join(o[5] for o in outcomes if o[5])
    for word in ("insufficient cpu", "insufficient memory", "insufficient gpu", "is held", "is not on", "port in use",
                 "not ready", "ineligible", "unknown node", "already holds a different booking",
                 "quota: queue qa", "quota: queue qc", "to lend", "hold ended", "where the commit places over it"):
        assert word in reasons, word
    assert sum(1 for o in outcomes if o[2]) > 50 and any(o[3] for o in outcomes)  # accepted, and re-committed
    assert {kind for kind, o in commits if o[2] and not o[3]} == {"plain", "hold", "backfill", "held run"}
    assert sum(refused_for_holds(ops) for ops in workloads) > 0, "held"  # plain commits a hold kept off its capacity


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
