"""Who owns a booking, and which reasons may release it: the owner kinds and their release rules.

A booking's id is a bare string in the store; this gives it a type. Each owner kind is a frozen dataclass whose
``str()`` is the booking id, and whose ``released_by`` is its release rule: the reasons (``Why``) for which a
booking of that kind may be released. Nothing releases a booking without its owner's rule saying so
(``mn_prefect.store.releasing.release`` checks it before it touches the store), so a node going down, a drain
or a stopped lab can never free a reservation.

``parse`` tells what the id alone tells: a reservation (``rsv-<hex>``), a hold (``hold-<hex>``), a bundle step attempt
(``<workflow job>#<launch>``), a flow run (a UUID), else an unknown owner. A blueprint job's bookings (its id,
``<job>@<node>`` for a system job's copy, ``<job>@m<n>`` for an agent moved) and a flow run with a non-UUID id
need the store to be told apart: ``mn_prefect.placement.bookings.classify`` refines what ``parse`` says; the
coordinator builds its own with ``job_booking``. Pure: no store, no Prefect.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

from mn_prefect.model.scalars import is_uuid

# Why a booking is released. Every release says one; each owner kind's rule lists the ones it accepts.
Why = Literal[
    "run_ended",                # the flow run is over (or gone): its worker's sweep, its copy that ran already
    "preempted",                # a run of higher priority (or a queue taking back what it lent) evicted it
    "not_started",              # the run never started: its worker stopped first, or its copy could not be made
    "health_check",             # the run failed its health check and is deallocated
    "orphaned",                 # a system run's part on a node that no run holds, past the grace
    "node_lost",                # the node is lost (offline): the run is gone with it, or re-placed elsewhere
    "drain",                    # a drain stopped the run on its node and migrates it
    "job_finished",             # the blueprint job finished (completed, failed, cancelled, stopped)
    "replaced",                 # the blueprint job or its agent was booked again (moved, coordinator re-placed)
    "step_ended",               # the bundle step attempt ended (or could not start)
    "bundle_ended",             # the bundle run is over: stopped, crashed, or its flow run ended
    "reservation_ended",        # the reservation itself ended: released, extended to 0, or expired
    "reservation_deallocated",  # the reservation this booking was placed inside has ended
    "hold_ended",               # a hold's run started, ended, was deleted or lost the head of the line
    "audit_owner_ended",        # ``store audit --repair`` found its owner ended
    "lab_stopped",              # ``mn up --down`` (or a lab's restart): the lab's work was interrupted
    "node_down",                # a node went down or disconnected: never a reason to release (its work waits)
]
WHYS: tuple[Why, ...] = get_args(Why)

Kind = Literal["flow_run", "blueprint_job", "system_copy", "reservation", "hold", "step_attempt", "unknown"]

RESERVATION_ID = re.compile(r"^rsv-[0-9a-f]{8,32}$")
HOLD_ID = re.compile(r"^hold-[0-9a-f]{8,32}$")


@dataclass(frozen=True)
class FlowRun:
    """A flow run's booking (a system run's parts, one per node, included): released when the run ends."""

    run_id: str
    kind: ClassVar[Kind] = "flow_run"
    words: ClassVar[str] = "flow run"  # what people are told it is
    released_by: ClassVar[frozenset[Why]] = frozenset({
        "run_ended", "preempted", "not_started", "health_check", "orphaned", "node_lost", "drain",
        "reservation_deallocated",
        "audit_owner_ended", "lab_stopped"})

    @property
    def owner_id(self) -> str:
        """The owner's own id (a copy's or a moved agent's is its job's, a step attempt's its bundle run's)."""
        return self.run_id

    def __str__(self) -> str:
        return self.run_id


@dataclass(frozen=True)
class JobBooking:
    """A blueprint job's booking: the job's own (``part`` None) or a moved agent's (``<job>@<part>``)."""

    job_id: str
    part: str | None = None
    kind: ClassVar[Kind] = "blueprint_job"
    words: ClassVar[str] = "blueprint job"  # what people are told it is
    released_by: ClassVar[frozenset[Why]] = frozenset({
        "job_finished", "replaced", "reservation_deallocated", "audit_owner_ended", "lab_stopped"})

    @property
    def owner_id(self) -> str:
        """The owner's own id (a copy's or a moved agent's is its job's, a step attempt's its bundle run's)."""
        return self.job_id

    def __str__(self) -> str:
        return self.job_id if self.part is None else f"{self.job_id}@{self.part}"


@dataclass(frozen=True)
class SystemCopy:
    """A system blueprint job's copy on one node (``<job>@<node>``): it waits for its node, never moves."""

    job_id: str
    node: str
    kind: ClassVar[Kind] = "system_copy"
    words: ClassVar[str] = "blueprint job"  # what people are told it is
    released_by: ClassVar[frozenset[Why]] = frozenset({
        "job_finished", "replaced", "audit_owner_ended", "lab_stopped"})

    @property
    def owner_id(self) -> str:
        """The owner's own id (a copy's or a moved agent's is its job's, a step attempt's its bundle run's)."""
        return self.job_id

    def __str__(self) -> str:
        return f"{self.job_id}@{self.node}"


@dataclass(frozen=True)
class Reservation:
    """A reservation's own booking: released only by its end (released, expired) or the audit finding it ended."""

    reservation_id: str
    kind: ClassVar[Kind] = "reservation"
    words: ClassVar[str] = "reservation"  # what people are told it is
    released_by: ClassVar[frozenset[Why]] = frozenset({"reservation_ended", "audit_owner_ended"})

    @property
    def owner_id(self) -> str:
        """The owner's own id (a copy's or a moved agent's is its job's, a step attempt's its bundle run's)."""
        return self.reservation_id

    def __str__(self) -> str:
        return self.reservation_id


@dataclass(frozen=True)
class Hold:
    """A head-of-line hold's booking (``hold-<hex>``): capacity booked to the waiting run at the head of the line.
    Released when that run starts, ends, is deleted or loses the head of the line, by the audit finding its run
    gone, or when the lab stops."""

    hold_id: str
    kind: ClassVar[Kind] = "hold"
    words: ClassVar[str] = "hold"  # what people are told it is
    released_by: ClassVar[frozenset[Why]] = frozenset({"hold_ended", "audit_owner_ended", "lab_stopped"})

    @property
    def owner_id(self) -> str:
        """The owner's own id (a copy's or a moved agent's is its job's, a step attempt's its bundle run's)."""
        return self.hold_id

    def __str__(self) -> str:
        return self.hold_id


@dataclass(frozen=True)
class StepAttempt:
    """A bundle step attempt's booking (``<workflow job>#<launch>``): released by its step's or its bundle's end."""

    workflow_job: str
    launch: str
    kind: ClassVar[Kind] = "step_attempt"
    words: ClassVar[str] = "bundle step"  # what people are told it is
    released_by: ClassVar[frozenset[Why]] = frozenset({
        "step_ended", "bundle_ended", "audit_owner_ended", "lab_stopped"})

    @property
    def owner_id(self) -> str:
        """The owner's own id (a copy's or a moved agent's is its job's, a step attempt's its bundle run's)."""
        return self.workflow_job

    def __str__(self) -> str:
        return f"{self.workflow_job}#{self.launch}"


@dataclass(frozen=True)
class Unknown:
    """A booking no owner is known of: kept, but where the reservation it was placed inside has ended."""

    booking: str
    kind: ClassVar[Kind] = "unknown"
    words: ClassVar[str] = "unknown owner"  # what people are told it is
    released_by: ClassVar[frozenset[Why]] = frozenset({"reservation_deallocated"})

    @property
    def owner_id(self) -> str:
        """The owner's own id (a copy's or a moved agent's is its job's, a step attempt's its bundle run's)."""
        return self.booking

    def __str__(self) -> str:
        return self.booking


Owner = FlowRun | JobBooking | SystemCopy | Reservation | Hold | StepAttempt | Unknown
OWNER_KINDS: tuple[type[Owner], ...] = (FlowRun, JobBooking, SystemCopy, Reservation, Hold, StepAttempt, Unknown)


class ReleaseRefused(ValueError):
    """A release its owner's rule does not allow; nothing was released."""

    def __init__(self, owner: Owner, why: str):
        self.owner, self.why = owner, why
        allowed = ", ".join(sorted(type(owner).released_by))
        super().__init__(f"booking {owner} ({owner.kind.replace('_', ' ')}) is not released for {why!r}: a "
                         f"{owner.kind.replace('_', ' ')}'s booking is released only for {allowed}")


def parse(booking: str) -> Owner:
    """The owner the id alone tells: a reservation, a bundle step attempt, a flow run (a UUID), else unknown (a
    blueprint job's bookings are told by its record: ``mn_prefect.placement.bookings.classify``)."""
    if RESERVATION_ID.match(booking):
        return Reservation(booking)
    if HOLD_ID.match(booking):
        return Hold(booking)
    if "#" in booking:
        workflow_job, launch = booking.split("#", 1)
        return StepAttempt(workflow_job, launch)
    if is_uuid(booking):
        return FlowRun(booking)
    return Unknown(booking)


def owning_job(booking: str) -> str:
    """The blueprint job one of its booking ids belongs to (``job_booking``'s inverse): ``J`` for the job's own
    and a moved agent's, ``J@node`` / ``J@m<n>`` for a copy or a moved agent."""
    return booking.rsplit("@", 1)[0] if "@" in booking else booking


def owning_run(booking: str) -> str:
    """The flow run a run's booking id names: its own id, or a system run's copy ``<run id>@<node>``'s run."""
    return booking.split("@", 1)[0]


def copy_agent(agent_id: str, node: str) -> str:
    """A system job's agent's copy on ``node`` (``<agent>@<node>``), as its placement names it."""
    return f"{agent_id}@{node}"


def job_booking(job_id: str, booking: str, *, system: bool) -> JobBooking | SystemCopy:
    """One of blueprint job ``job_id``'s bookings: its own id, a system job's copy ``<job>@<node>``, or an agent
    moved ``<job>@m<n>`` (a system job's copies never move, so every ``@`` part of one is a node)."""
    if booking == job_id:
        return JobBooking(job_id)
    prefix = f"{job_id}@"
    if not booking.startswith(prefix):
        raise ValueError(f"booking {booking!r} is not one of job {job_id}'s")
    part = booking[len(prefix):]
    return SystemCopy(job_id, part) if system else JobBooking(job_id, part)


def may_release(owner: Owner, why: str) -> bool:
    """Whether ``owner``'s rule lets ``why`` release its booking."""
    return why in type(owner).released_by


def check(owner: Owner, why: str) -> None:
    """Raise ReleaseRefused unless ``owner``'s rule lets ``why`` release its booking (an unknown reason too)."""
    if not may_release(owner, why):
        raise ReleaseRefused(owner, why)
