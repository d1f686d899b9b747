"""One admission rule for every backend: decide in Python, apply conditionally (optimistic concurrency).

A commit reads the plan's nodes (records, usage, held keys, versions), the limits, the job's booking and the
lease, decides with ``ClusterView.admit`` (the rule the planner uses), and hands the backend a ``Ticket``:
per node the amounts to add, the ceilings the rule admitted them under, the keys to claim, and the node
version it read. The backend applies a ticket atomically only if, at that moment, every node still has the
version read, every dimension stays under its ceiling and no key is held; otherwise it writes nothing and
the commit reads again. So the Redis script, the PostgreSQL function and the SQLite transaction know no
rule, only "compare and apply", as Nomad's plan applier re-checks a plan against the latest state.

Because usage only ever makes a node fuller, "usage + amount <= ceiling" at apply time implies the rule
still admits the plan: releases in between never cause a retry, and two commits on one node conflict only
when together they would not fit.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Literal, Protocol

from mn_prefect.model.placement import Placement
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.view import ClusterView
from mn_prefect.store.base import CommitResult, Conflict, Lease, StaleLease, StoreError
from mn_prefect.store.booking import NodeDemand, NodeState, demand_by_node, fingerprint
from mn_prefect.store.dimensions import DIMENSIONS
from mn_prefect.store.failpoints import failpoint

Applied = Literal["ok", "changed", "stale_lease"]
ATTEMPTS = 200  # a commit re-reads at most this often before giving up (each retry means others committed)


@dataclass
class CommitRead:
    """What a commit decides on, read in one consistent step."""

    states: list[NodeState]  # the plan's nodes that exist
    limits: Limits
    booked: str | None = None  # the fingerprint of the job's booking, if it has one
    lease_ok: bool = True


@dataclass
class Ticket:
    """A decided commit, for the backend to apply if nothing it relied on has changed."""

    job_id: str
    fingerprint: str
    placements: str  # JSON of the placements
    demands: dict[str, NodeDemand]
    versions: dict[str, int]
    ceilings: dict[str, dict[str, float]]
    now: float
    seq: int | None = field(default=None, compare=False)  # set by backends that number commits

    def demands_json(self) -> str:
        return json.dumps({n: d.as_json() for n, d in self.demands.items()})

    def plan_json(self) -> str:
        """The generic form the server-side apply takes: per node its version, amounts, ceilings and claims."""
        return json.dumps({n: {"version": self.versions[n], "add": d.add, "ceiling": self.ceilings[n], "claim": d.claim}
                           for n, d in self.demands.items()})


class CommitSession(Protocol):
    def read(self, job_id: str, nodes: list[str], lease: Lease | None) -> CommitRead: ...
    def apply(self, ticket: Ticket, lease: Lease | None) -> Applied: ...


class Committer(Protocol):
    def commit_session(self) -> AbstractContextManager[CommitSession]: ...


def decide(read: CommitRead, job_id: str, placements: list[Placement], fp: str, demands: dict[str, NodeDemand],
           now: float) -> CommitResult | Ticket:
    """The result when the commit is settled by what was read (already booked, refused), else the ticket."""
    if read.booked is not None:
        if read.booked == fp:
            return CommitResult(ok=True, job_id=job_id, already_committed=True, placements=placements)
        return CommitResult(ok=False, job_id=job_id, conflict=Conflict(
            reason=f"job {job_id} already holds a different booking", job_booked=True))
    view = ClusterView([s.record for s in read.states], [s.hold() for s in read.states], read.limits)
    for placement in placements:
        why = view.admit(placement)
        if why is not None:
            return CommitResult(ok=False, job_id=job_id, conflict=Conflict(node=placement.node, reason=why))
    versions = {s.record.name: s.version for s in read.states}
    ceilings = {name: {dim: ceiling(view, view.index[name]) for dim, (_amount, ceiling) in DIMENSIONS.items()}
                for name in demands}
    body = json.dumps([p.model_dump(mode="json") for p in placements])
    return Ticket(job_id=job_id, fingerprint=fp, placements=body, demands=demands, versions=versions,
                  ceilings=ceilings, now=now)


def commit(store: Committer, job_id: str, placements: list[Placement], lease: Lease | None, now: float) -> CommitResult:
    """Read, decide, apply; read again when the apply found the state changed underneath."""
    placements = list(placements)
    fp = fingerprint(placements)
    demands = demand_by_node(placements)
    for _ in range(ATTEMPTS):
        with store.commit_session() as session:
            read = session.read(job_id, list(demands), lease)
            if not read.lease_ok:
                assert lease is not None
                raise StaleLease(f"lease {lease.name!r} epoch {lease.epoch} held by {lease.owner!r} is no longer current")
            decided = decide(read, job_id, placements, fp, demands, now)
            if isinstance(decided, CommitResult):
                return decided
            failpoint("commit.after_reads")
            applied = session.apply(decided, lease)
        if applied == "ok":
            return CommitResult(ok=True, job_id=job_id, placements=placements)
        if applied == "stale_lease":
            assert lease is not None
            raise StaleLease(f"lease {lease.name!r} epoch {lease.epoch} held by {lease.owner!r} is no longer current")
    raise StoreError(f"commit of job {job_id} kept finding its nodes changed ({ATTEMPTS} reads); try again")
