"""The store contract every backend implements, and the values it returns."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from mn_prefect.model.names import MAX_GROUP_NAME, MAX_NAME, name_issue
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Placement
from mn_prefect.model.queues import CohortRecord, QueueRecord, QueueSpec
from mn_prefect.scheduler.columns import FleetColumns
from mn_prefect.scheduler.limits import Limits
from mn_prefect.store.urls import StoreURL


class StoreError(RuntimeError):
    """A store operation failed; the message never contains a password."""


class StoreUnavailable(StoreError):
    """The backend could not be reached (within the retry budget)."""


class NodeNotRegistered(StoreError):
    pass


class StaleLease(StoreError):
    """A write fenced by a lease whose epoch is no longer current (another owner took over)."""


class UnknownGroup(StoreError):
    """A node reported, or a command named, a resource group the store does not have."""


class GroupInUse(StoreError):
    """A group cannot be deleted while nodes belong to it."""


class Conflict(BaseModel):
    """Why a commit was refused; the caller re-plans from the store's current view."""

    reason: str
    node: str | None = None
    job_booked: bool = Field(False, description="The job already holds a different booking (placed by someone else).")


class CommitResult(BaseModel):
    ok: bool
    job_id: str
    already_committed: bool = Field(False, description="The same plan was committed before: nothing changed.")
    conflict: Conflict | None = None
    placements: list[Placement] = Field(default_factory=list)
    ended: list[Any] = Field(default_factory=list, exclude=True, repr=False, description=(
        "The reservations (store.records.ReservationRecord) the commit ended on the way because their time was "
        "up (an expired reservation never blocks a commit), as written: the store publishes nothing, the caller "
        "announces them (placement.ending.announce_ended)."))
    rereads: int = Field(0, exclude=True, repr=False, description=(
        "How often the apply found the plan's nodes changed underneath and the commit read and decided again "
        "(optimistic concurrency: each is a conflict with another commit; the metrics count them)."))


class Lease(BaseModel):
    """A named lease; ``epoch`` grows with every new owner (fencing token)."""

    name: str
    owner: str
    epoch: int
    expires_at: float

    @property
    def expired(self) -> bool:
        return self.expires_at <= time.time()


class GroupInfo(BaseModel):
    """A resource group (docs/operating.md) and how many registered nodes belong to it."""

    name: str
    nodes: int = 0
    created_at: float | None = Field(None, description="None for the built-in group ``default``.")


class StoredNode(BaseModel):
    """A registered node with its liveness."""

    record: NodeRecord
    last_heartbeat: float | None = None


class JobRecord(BaseModel):
    """A row of the jobs table as every backend stores it. Callers read and write the typed records of
    ``mn_prefect.store.records`` (``job_type`` holds the record's kind, ``spec`` its body)."""

    job_id: str
    name: str | None = None
    job_type: str | None = None
    status: str = "pending"
    spec: dict[str, Any] = Field(default_factory=dict)
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)


class Event(BaseModel):
    kind: str
    at: float = Field(default_factory=time.time)
    node: str | None = None
    job_id: str | None = None
    reason: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class HistoryEntry(BaseModel):
    job_id: str
    placements: list[Placement]
    committed_at: float
    released_at: float | None = None


class Booking(BaseModel):
    """One held device or port, as the store keeps it (for independent checks)."""

    node: str
    kind: str  # device | port
    key: str  # device id, or protocol family:port
    job_id: str


class StoreInfo(BaseModel):
    backend: str
    url: str = Field(description="With any password replaced by ***.")
    reachable: bool
    version: str | None = None
    counts: dict[str, int] = Field(default_factory=dict)
    error: str | None = None


# What a change watcher reports (``ClusterStore.changes``).
DUE_AT_ONCE = 500  # reservations_due returns at most this many; the caller asks again for the rest
CAPACITY = "capacity"  # something may fit that did not: a release, a node registered or back, a status or limits change
PLACED = "placed"  # a booking was committed on the watched node: its worker can start the run now


def check_registrable(record: NodeRecord) -> None:
    """ValueError naming the field when ``record``'s node or group name breaks the name rule (model/names.py): a
    record built around validation (``model_copy``, ``model_construct``) is refused at registration, before
    anything is written."""
    for key, kind, limit in (("name", "node", MAX_NAME), ("group", "group", MAX_GROUP_NAME)):
        if why := name_issue(getattr(record, key), kind, limit):
            raise ValueError(f"{key}: {why}")


def placed_topic(node: str) -> str:
    """The topic a commit on ``node`` is announced under (a Redis channel's tail, a NOTIFY payload, a counter row)."""
    return f"{PLACED}:{node}"


@runtime_checkable
class ChangeWatcher(Protocol):
    """Wakes a waiter when the store changed in a way that can let a waiting run start (``store.changes()``).

    Every backend announces from the step that makes the change or just after it (Redis: PUBLISH inside the Lua
    script; PostgreSQL: ``pg_notify`` in the same transaction, or for commits and releases right after it commits;
    SQLite: a counter row in the same transaction, read every 100 ms), so a change is never announced before it is
    there for the next read. Changes between two ``wait`` calls are kept, not lost; what has arrived by the time a
    wait returns is reported once. A lost connection reports both kinds (a change may have been missed), so a
    waiter re-reads rather than sleeps on. Heartbeats that change nothing are not reported. Polling stays the
    safety net: a watcher only shortens the wait (a change announced just after its commit is lost with a client
    that dies in between)."""

    def wait(self, timeout: float) -> frozenset[str]:
        """Block up to ``timeout`` seconds for a change; the kinds seen (CAPACITY, PLACED) since the last call,
        empty when none. One thread waits at a time; close the watcher once its wait has returned."""
        ...

    def close(self) -> None: ...


@dataclass(eq=False)
class ClusterSnapshot:
    """What planning needs: nodes, what is held on them, and the limits. ``columns`` are the nodes with what is
    held on them as arrays (scheduler/columns.py): what a planner builds its view from (``ClusterView(columns,
    (), limits)``). ``holds``, the same as one aggregate placement per busy node, is built on first use."""

    nodes: list[NodeRecord]
    limits: Limits
    columns: FleetColumns
    make_holds: Callable[[], list[Placement]] = field(repr=False)
    queues: list[QueueRecord] = field(default_factory=list)  # queues with settings, and their use
    cohorts: list[CohortRecord] = field(default_factory=list)

    @cached_property
    def holds(self) -> list[Placement]:
        return self.make_holds()


@runtime_checkable
class ClusterStore(Protocol):
    """Durable cluster state. Every backend passes the same contract tests (tests/test_store_contract.py)."""

    backend: str
    url: StoreURL  # what it was opened with (``url.safe`` for people, ``url.raw`` to open it again)

    def check(self) -> StoreInfo: ...
    def close(self) -> None: ...

    # nodes
    def register_node(self, record: NodeRecord, *, now: float | None = None) -> NodeRecord:
        """Register (or re-register) a node in its ``record.group``; UnknownGroup, with nothing written, when
        that group does not exist (checked in the same atomic step, so a concurrent delete cannot slip in)."""
        ...
    def heartbeat(self, name: str, *, now: float | None = None) -> NodeRecord: ...
    def set_node_status(self, name: str, status: str, *, eligible: bool | None = None) -> NodeRecord: ...
    def transition_node(self, name: str, to_status: str, *, from_statuses: tuple[str, ...], now: float | None = None,
                        reason: str | None = None, eligible: bool | None = None,
                        heartbeat_before: float | None = None) -> NodeRecord | None:
        """Atomically move ``name`` to ``to_status`` only if its status is in ``from_statuses`` and, with
        ``heartbeat_before`` (seconds since the epoch), its last heartbeat is older than that; ``eligible`` also
        sets scheduling eligibility. When it applies, the event ``node.<to_status>`` (``at`` = ``now``, the
        reason, ``data`` = from/to) is written in the same step and the new record returned; otherwise None and
        nothing is written. NodeNotRegistered for an unknown node, ValueError for an unknown status."""
    def get_node(self, name: str) -> StoredNode | None: ...
    def list_nodes(self) -> list[StoredNode]: ...

    # resource groups (``default`` always exists and is never deleted)
    def create_group(self, name: str, *, now: float | None = None) -> bool:
        """Create group ``name`` (checked by ``groups.check_group_name``); True when created, False when it
        already existed (creating is idempotent: workers and ``up`` create their pool's group every start)."""
        ...
    def list_groups(self) -> list[GroupInfo]:
        """Every group by name, ``default`` included, with its node count."""
        ...
    def delete_group(self, name: str) -> None:
        """Delete group ``name``: UnknownGroup when there is none, GroupInUse (naming its nodes) while any node
        belongs to it, ValueError for ``default``. Atomic with registration."""
        ...

    # limits
    def get_limits(self) -> Limits: ...
    def set_limits(self, limits: Limits) -> None: ...

    # placements
    def commit_plan(self, job_id: str, placements: list[Placement], *, lease: Lease | None = None,
                    event: Event | None = None) -> CommitResult:
        """Book ``placements`` for ``job_id`` if they still fit (atomic; see store/admission.py). ``event`` is
        recorded when this call makes the booking, never when it is refused or was already made: Redis writes it
        from the commit's own script, the SQL backends just after the commit."""
        ...
    def release(self, job_id: str, *, lease: Lease | None = None, node: str | None = None) -> int:
        """Release the job's booking, or with ``node`` only its placements on that node: their capacity, devices
        and ports there; its placements on other nodes stay booked as they were. When nothing of the job is left,
        the booking is gone as after a full release (not in ``active_jobs``, history entry ``released_at``).
        Returns how many placements were released (0 when the job holds nothing there). Atomic; StaleLease,
        with nothing changed, when ``lease`` is no longer current."""
        ...
    def active_placements(self, *, node: str | None = None, job_id: str | None = None) -> list[Placement]: ...
    def active_jobs(self) -> list[str]: ...
    def bookings(self) -> list[Booking]: ...
    def snapshot(self, *, group: str | None = None) -> ClusterSnapshot:
        """What planning needs; with ``group``, only that group's nodes (and what is held on them)."""
        ...
    def history(self, job_id: str) -> list[HistoryEntry]: ...
    def history_since(self, since: float | None = None) -> list[HistoryEntry]:
        """Every booking's history entry (of every job) still live (``released_at`` None) or released at or after
        ``since`` (seconds since the epoch; None: every entry ever): what usage accounting (ops/accounting.py)
        reads. Each entry is one booking from its commit to its release, both written in the store's atomic
        commit and release steps, so each is there once. Reads every job's history on Redis."""
        ...

    # queues (model/queues.py; scheduler/quotas.py): their accounts are applied to by every commit of their runs
    def queues(self) -> Any:
        """Every queue with settings and every cohort, with what their runs hold now (``scheduler.quotas.Queues``)."""
        ...
    def set_queue(self, spec: QueueSpec) -> QueueRecord:
        """Set a queue's settings (its use is kept) and its cohorts' quotas, atomically; its version grows, so a
        commit decided under the old settings is decided again."""
        ...
    def delete_queue(self, name: str) -> None:
        """Delete a queue's settings: StoreError when it has none, QueueInUse while its runs hold something."""
        ...

    def repair_derived(self, *, dry_run: bool = False) -> list[str]:
        """Make the state derived from the bookings agree with the live bookings, in one atomic step: drop
        held claims (devices, ports, reservations) whose holder has no live booking or whose booking does not
        claim them, restore the claims a live booking makes that nothing holds, and set every node's usage
        counters (``cpu``... ``share:``, ``gmem:``, ``rsv:<id>:``) to what its live bookings hold, summed as the
        commits sum them. Bookings are never changed; a key claimed by two live bookings (a real double
        booking) is left as it is. Returns one line per fix made (with ``dry_run``: that would be made, and
        nothing is written), and one per problem left for an operator; [] with nothing written when the
        derived state already agrees."""
        ...

    # changes
    def changes(self, *, node: str | None = None) -> ChangeWatcher:
        """A watcher of this store on its own connection (close it): CAPACITY after every release, registration,
        node status or eligibility change and limits change; PLACED after a commit on ``node`` (on any node when
        None)."""
        ...

    def replicate(self, timeout_ms: int = 2000) -> int | None:
        """Wait until every write made so far (by any connection) has reached the store's replicas, for what must
        survive a failover (a reservation); how many replicas acknowledged, or None for a store without
        asynchronous replicas (SQLite, PostgreSQL: a commit is durable once it returns)."""
        ...

    def pipelined(self) -> AbstractContextManager[None]:
        """A block whose records and events may be sent with the next call that waits for an answer (in the order
        written), or at its end: a Redis store's line sends a write and the commit after it in one round trip.
        Other stores write each at once."""
        ...

    def announce(self, topics: list[str]) -> None:
        """Announce ``topics`` (CAPACITY, ``placed_topic(node)``) to the watchers, for a change the store did not
        see: a run created in Prefect after its booking was committed (a system run's copy, a blueprint agent),
        which the node's worker could not have found when the commit woke it. Never raises: a missed
        announcement only waits for the next poll."""
        ...

    # jobs and events
    def put_job(self, job: JobRecord) -> None: ...
    def get_job(self, job_id: str) -> JobRecord | None: ...
    def delete_job(self, job_id: str) -> bool:
        """Remove record ``job_id`` (a reservation's from the expiry index too); whether there was one."""
        ...
    def list_jobs(self, *, status: str | None = None) -> list[JobRecord]: ...

    def reservations_due(self, now: float) -> tuple[list[JobRecord], float]:
        """The rows of the active reservations whose expiry is at or before ``now`` (DUE_AT_ONCE at most), and
        the earliest expiry after ``now`` (inf when none; ``now`` when DUE_AT_ONCE were returned). Read from an
        index of the expiries, not from every record: a process making reservations asks every second."""
        ...
    def record_event(self, event: Event) -> None: ...
    def events(self, *, node: str | None = None, job_id: str | None = None, limit: int = 100) -> list[Event]: ...

    # leases
    def acquire_lease(self, name: str, owner: str, ttl_s: float, *, now: float | None = None) -> Lease | None: ...
    def renew_lease(self, lease: Lease, ttl_s: float, *, now: float | None = None) -> Lease | None: ...
    def release_lease(self, lease: Lease) -> bool: ...
