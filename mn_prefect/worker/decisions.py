"""The worker's decisions, as values: pure rules over plain facts (a run's state type and name, how long it has been
in it, whether its booking is held, whether its process is alive, the grace settings) that return what to do.

The worker's parts (``routing.py``, ``releasing.py``, ``sweeps.py``) gather the facts (store reads, Prefect API
reads, /proc), call a rule and carry out its answer, with the same log lines, events and state messages; the
rules are tested without either (``tests/test_worker_decisions.py``). No Prefect and no store here: run states are
their names (``"PENDING"``; Prefect's ``StateType`` is a ``str`` enum, so either works).

- a polled run that fits nowhere: ``wait_or_fail`` (``Wait`` or ``Fail``); one placed on a lost node before it
  started: ``movable`` then ``off_lost_node`` (``Release`` or ``Keep``); the node a booked run goes to, or
  ``Fail``: ``booked_node`` (a blueprint agent), ``copy_node`` (a system run's copy), ``system_run_node`` (the
  system run itself); ``inside_reservation`` (``Fail`` or None)
- a head-of-line hold: ``hold_over`` (``Release`` once its run no longer waits)
- a running run's health: ``deallocation`` (``Deallocate`` or ``Keep``)
- a booking the sweep looks at: ``run_over`` (``Release`` once the run is over), ``orphaned_run`` (``PutBack``,
  ``Cancel`` or ``Keep``), ``unheld_part`` and ``ended_for`` (a system run's part that no copy holds),
  ``step_booking`` (a bundle step's), ``job_bookings`` (a blueprint job's)
- runs of the pool whose end never reached the server: ``unreported_pending_end``, ``lost_running`` (``Crash``
  or ``Keep``), after the cheap filter ``overdue``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mn_prefect.lifecycle.settings import DEFAULT_ORPHAN_PENDING_S
from mn_prefect.model.bookings import Why
from mn_prefect.model.node_status import LOST
from mn_prefect.model.placement import Plan
from mn_prefect.model.states import TERMINAL_RUN_STATES
from mn_prefect.scheduler import reasons

# A system run's part on a node that no run holds (its copy was never created, or was deleted) is released by
# that node's sweep after this long: the worker that committed the booking creates the copies just after.
ORPHAN_PART_GRACE_SECONDS = 60.0
# A run Pending this long on this node with no launch holding it lost the worker that was starting it (the
# worker's setting MN_ORPHAN_PENDING_SECONDS, lifecycle/settings.py, passed to the sweeps).
ORPHAN_PENDING_GRACE_SECONDS = DEFAULT_ORPHAN_PENDING_S
# A system run's part that no copy holds goes this long after the run ended (its worker may still be making the
# copy as the run ends; once made, the copy holds the part); while the run lives, after ORPHAN_PART_GRACE_SECONDS.
ENDED_RUN_COPY_SECONDS = 10.0
# A run placed on a node in one of these states never starts there: any worker places it again.
LOST_NODE_STATES = frozenset(LOST)
# A stray flow-run process told to stop (SIGTERM) is killed if it still runs this long after.
STRAY_KILL_SECONDS = 10.0
# The most of a state message Prefect keeps.
STATE_MESSAGE_LIMIT = 5000


# -- the decisions -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Keep:
    """Nothing to do now: the booking stays, the run is left as it is (a later sweep looks again)."""


@dataclass(frozen=True)
class Release:
    """Release the booking (or the part of it on this node), saying ``why``; ``because``: the reason its owner's
    release rule is asked about (``mn_prefect.model.bookings``)."""

    why: str
    because: Why


@dataclass(frozen=True)
class PutBack:
    """Back to Scheduled with ``message`` (its booking kept); ``what`` completes the worker's log line."""

    message: str
    what: str


@dataclass(frozen=True)
class Cancel:
    """Cancelled with ``message``; ``what`` completes the worker's log line."""

    message: str
    what: str


@dataclass(frozen=True)
class Crash:
    """Crashed with ``message``; ``what`` completes the worker's log line."""

    message: str
    what: str


@dataclass(frozen=True)
class Wait:
    """The run stays Scheduled for ``reason``: ``announce`` says it (a log line on the run, a waiting event),
    ``show`` sets ``state_message`` on the run's state (it is not there yet)."""

    reason: str
    state_message: str
    announce: bool
    show: bool
    state_name: str | None = None  # the Scheduled state's name to show it under (None: the name it has)


@dataclass(frozen=True)
class Fail:
    """The run fails with ``message`` (cut to ``STATE_MESSAGE_LIMIT`` on the state, said whole in its logs)."""

    message: str


@dataclass(frozen=True)
class StoppedLaunch:
    """What becomes of a run whose worker stopped while launching it: ``schedule``, its state message when it goes
    back to Scheduled (None: its state is left as it is); ``release``, its own booking given back (with why), or
    ``release_part``, a system run's part on this node given back (the run being over); neither: kept."""

    schedule: str | None = None
    release: Release | None = None
    release_part: Release | None = None


@dataclass(frozen=True)
class StopProcess:
    """Stop a flow-run process on this node that no launch of this worker holds (SIGTERM, then SIGKILL after
    ``STRAY_KILL_SECONDS``), saying ``why``."""

    why: str


@dataclass(frozen=True)
class ReleaseStep:
    """Release a bundle step's booking, saying ``why``; ``crash_workflow``: its workflow record, still running,
    is marked crashed."""

    why: str
    crash_workflow: bool


@dataclass(frozen=True)
class ReleaseJob:
    """Release a blueprint job's bookings with the job ``status``, saying ``why``; ``stop_agents``: cancel its
    agents' runs first (the coordinator ended without doing it)."""

    why: str
    status: str
    stop_agents: bool


# -- a polled run ------------------------------------------------------------------------------------------


def never_placeable(plan: Plan, *, at_once: bool = False) -> str:
    """The failure message of a run no node can ever take, with each node's reason (said once); ``at_once``: it
    failed without waiting, and the message says how to make such runs wait for a node to join."""
    reasons: dict[str, str] = next(iter(plan.agents.values()), {}) if plan.agents else {}
    detail = "; ".join(f"{node}: {why}" for node, why in sorted(reasons.items())) or plan.reason or "no nodes"
    message = f"mn: no node can ever take this run ({detail})"
    return message + (f"; to wait for a node that can take it to join, set {WAIT_FOR_NEW_NODES} on the pool or the "
                      "deployment" if at_once else "")


# A run that no node could ever take (``not_runnable``) where some node refuses it only for its state (not ready:
# maintenance, a drain, disconnected; ineligible; a required service not passing), or with no node to judge by,
# may be placed once that node is back or one joins: it waits at least this long, whatever the pool's
# not_runnable_timeout_seconds. One that no registered node could take whatever their states fails at once, unless
# the pool (or the deployment) sets WAIT_FOR_NEW_NODES: then it waits not_runnable_timeout_seconds for one to join.
NODE_STATE_WAIT_S = 600.0
WAIT_FOR_NEW_NODES = "wait_for_new_nodes"  # the job variable
_NODE_STATE_REASONS = (reasons.NODE_NOT_READY, reasons.NODE_INELIGIBLE, reasons.MISSING_SERVICE)
NEVER_FITS = "Never fits"  # the name a never-fitting run that waits is shown under in the runs list


def missing_driver(plan: Plan) -> str | None:
    """The runtime driver a ``not_runnable`` plan asks for that no registered node offers: some agent's every node
    refuses it for that driver alone (a node's drivers are what it is set up with, say a Docker daemon, not a state
    it comes back from), or None."""
    prefix = f"{reasons.MISSING_DRIVER}: "
    for per_node in (plan.agents or {}).values():
        drivers = {why[len(prefix):] for why in per_node.values() if why.startswith(prefix)}
        if per_node and len(drivers) == 1 and all(why.startswith(prefix) for why in per_node.values()):
            return drivers.pop()
    return None


def no_driver_message(plan: Plan, driver: str) -> str:
    """The failure message of a run whose runtime driver no node offers: which nodes there are, and what to do."""
    nodes = sorted({node for per_node in plan.agents.values() for node in per_node})
    where = ("a worker on a machine whose Docker daemon answers (`mn-prefect up` offers it when one does)"
             if driver == "docker" else f"a node that advertises {driver} (MN_NODE_RUNTIME_DRIVERS)")
    return (f"mn: no node offers runtime driver {driver}, which this run asks for ({', '.join(nodes)} do not): "
            f"run it where {where}, or deploy it without runtime_driver {driver}")


def waits_for_nodes(plan: Plan) -> bool:
    """Whether a ``not_runnable`` plan might still be placed without any change of the request: every agent has
    a node that refuses it only for its state, or there is no node's reason to judge by (no nodes; a queue's
    quota). False: some agent's every node refuses it for what the node is (too few GPUs, no such driver)."""
    per_agent = [per_node for per_node in plan.agents.values()] if plan.agents else []
    if not per_agent or any(not per_node for per_node in per_agent):
        return True
    return all(any(why.startswith(_NODE_STATE_REASONS) for why in per_node.values()) for per_node in per_agent)


def wait_or_fail(plan: Plan, *, waited_s: float, timeout_s: float, last_reason: str | None,
                 shown_message: str | None, wait_for_new_nodes: bool = False) -> Wait | Fail:
    """A run that fits nowhere now. No node can ever take it (``not_runnable``): when no registered node could,
    whatever their states, it fails at once (its reason, each node's, as the message), unless
    ``wait_for_new_nodes`` (the pool's WAIT_FOR_NEW_NODES): then it fails once it has waited
    ``not_runnable_timeout_seconds`` for one to join (at once with 0); when a node refuses it only for its state
    (``waits_for_nodes``) it waits at least NODE_STATE_WAIT_S for that node to come back; when no node offers the
    runtime driver it asks for (``missing_driver``) it fails at once, whatever the setting. Else it waits, its
    reason said once (``last_reason``: the one said last) and kept on its state (``shown_message``: the state's
    message now; Prefect's Late transition drops it). A never-fitting run that waits is shown as NEVER_FITS, its
    message saying when it fails."""
    reason = f"{plan.status}: {plan.reason}"
    if plan.status == "not_runnable" and (driver := missing_driver(plan)) is not None:
        return Fail(no_driver_message(plan, driver))  # at once: no wait makes a node offer a driver
    if plan.status == "not_runnable":
        if not waits_for_nodes(plan) and not wait_for_new_nodes:
            return Fail(never_placeable(plan, at_once=True))  # what the nodes are: no state of theirs changes it
        limit = max(timeout_s, NODE_STATE_WAIT_S) if waits_for_nodes(plan) else timeout_s
        if waited_s >= limit:
            return Fail(never_placeable(plan))
        state_message = (f"mn not_runnable (fails after {limit:g} s of waiting unless a node that can take it "
                         f"joins or comes back): {plan.reason}")[:STATE_MESSAGE_LIMIT]
        shown = shown_message == state_message
        return Wait(reason=reason, state_message=state_message, announce=last_reason != reason and not shown,
                    show=not shown, state_name=NEVER_FITS)
    state_message = f"mn {reason}"[:STATE_MESSAGE_LIMIT]
    shown = shown_message == state_message
    # Already on the state: an earlier announcer (before a restart or a lease change) said exactly this.
    return Wait(reason=reason, state_message=state_message, announce=last_reason != reason and not shown,
                show=not shown)


def hold_over(state_type: str | None) -> Release | Keep:
    """A head-of-line hold stands while its run waits to be placed (Scheduled, Late included); once the run is placed,
    running, over, paused or gone (``state_type`` None), the hold is released."""
    if state_type == "SCHEDULED":
        return Keep()
    return Release("its run no longer waits" if state_type is not None else "its run is gone", "hold_ended")


# How long a crash report the API did not take is made again (``MNWorker._propose_crashed_state``).
CRASH_REPORT_SECONDS = 45.0


def crash_report_next(state_type: str | None, *, deleted: bool, left_s: float,
                      pause_s: float) -> Literal["done", "again", "leave"]:
    """After a crash report, the run read back (``state_type`` None: the API is still away): ``done`` when the
    report took (or the run ended some other way), ``again`` after ``pause_s`` while it sits Pending or unreadable
    and time is ``left_s``; ``leave`` when it was deleted, put back (Scheduled: a sweep's or a recovery's), or the
    time is up (the pool's sweep of unreported ends takes it from there)."""
    if deleted or state_type == "SCHEDULED":
        return "leave"
    if state_type is None or state_type == "PENDING":
        return "again" if left_s >= pause_s else "leave"
    return "done"


def job_hold_over(job_status: str | None, placed: bool, coordinator_state: str | None) -> Release | Keep:
    """A blueprint job's hold (``jobs.gang_holds``) stands while the job waits to be placed and its coordinator run
    lives; once the job is placed, over (or gone: ``job_status`` None) or its coordinator run has ended (or is gone:
    ``coordinator_state`` None), the hold is released."""
    if job_status is None:
        return Release("its job is gone", "hold_ended")
    if placed or job_status != "waiting":
        return Release("its job no longer waits", "hold_ended")
    if coordinator_state is None or coordinator_state in TERMINAL_RUN_STATES:
        return Release("its job's coordinator run is over", "hold_ended")
    return Keep()


def movable(placements: int, node: str, own_node: str, *, in_reservation: bool, system_run: bool) -> bool:
    """Whether a still-Scheduled run's booking may be moved off its node: one placement, on another node, not
    inside a reservation, not a system run's parts (those belong where they are)."""
    return placements == 1 and node != own_node and not in_reservation and not system_run


def off_lost_node(status: str) -> Release | Keep:
    """A movable run's node is ``status``: released (and placed again) when the node is lost."""
    return Release(f"its node is {status}", "node_lost") if status in LOST_NODE_STATES else Keep()


def booked_node(node: str | None, job_id: str, agent_id: str) -> str | Fail:
    """A blueprint agent's run goes to the node its job booked for it (``node``); with no booking it fails."""
    if node is not None:
        return node
    return Fail(f"mn: job {job_id} holds no booking for agent {agent_id} (released?)")


def copy_node(node: str, run_id: str, *, part_held: bool) -> str | Fail:
    """A system run's copy runs on ``node`` while its run's booking holds its part there; then it fails, and is
    never placed anew."""
    if part_held:
        return node
    return Fail(f"mn: this copy of run {run_id} has no booking on {node} any more (its part was released: the node "
                "was lost, or the run's booking ended); it does not run")


def system_run_node(node: str, booked_nodes: list[str]) -> str | Fail:
    """A placed system run itself runs on ``node`` (its record's, else its booking's first) while its part there
    is booked; once that part was released it fails (its copies on ``booked_nodes`` keep theirs)."""
    if node in booked_nodes:
        return node
    return Fail(f"mn: this run's part of its booking on {node} was released before it started (its copies on "
                f"{', '.join(sorted(set(booked_nodes)))} keep theirs); it does not run")


def inside_reservation(reservation: str, job_type: str | None, *, system_run: bool, error: str | None = None,
                       plan: Plan | None = None) -> Fail | None:
    """A run placed inside reservation ``reservation`` fails when it is a system run (those book every node), when
    the reservation cannot be used (``error``: unknown, wrong key, ended) or when it could never fit in what the
    reservation holds (``plan``); None: ``plan`` stands (placed, or waiting like any run)."""
    if system_run:
        reason = (f"job_variables.reservation: a {job_type} run places a copy on every node of the group; it does "
                  "not run inside a reservation")
    elif error is not None:
        reason = error
    elif plan is not None and plan.status == "not_runnable":
        reason = f"does not fit inside reservation {reservation}: {plan.reason}"
    else:
        return None
    return Fail(f"mn: {reason}"[:STATE_MESSAGE_LIMIT])


# -- a running run's health ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deallocate:
    """Cancel a run that failed its health check with ``message``; ``release``: release its booking here (a
    blueprint agent's stays with its job)."""

    message: str
    release: bool


def deallocation(verdict: str | None, *, owned: bool) -> Deallocate | Keep:
    """What a health watch's ``verdict`` means (``health.watch``: None while the run ended healthy)."""
    if verdict is None:
        return Keep()
    return Deallocate(message=f"mn: {verdict}", release=owned)


# -- a booking the sweep looks at ----------------------------------------------------------------------------


GONE = Release("the run no longer exists", "run_ended")


def run_over(state_type: str | None, state_name: str | None) -> Release | None:
    """A booked run that is over gives its booking back; None while it is not (then ``orphaned_run`` judges)."""
    if state_type is not None and state_type in TERMINAL_RUN_STATES:
        return Release(f"the run is {state_name}", "run_ended")
    return None


def orphaned_run(state_type: str | None, state_message: str | None, state_age_s: float | None, *, grace_s: float,
                 process_alive: bool, node: str) -> PutBack | Cancel | Keep:
    """A run booked on ``node`` that no launch of its worker holds. Pending for ``grace_s`` with no process: the
    worker starting it was killed before the flow ran (no flow code ran: that starts with Running), so back to
    Scheduled, its booking kept. Cancelling as long with no process left to stop: Cancelled."""
    if state_type not in ("PENDING", "CANCELLING") or state_age_s is None or state_age_s < grace_s:
        return Keep()
    if process_alive:
        return Keep()
    if state_type == "CANCELLING":
        return Cancel(message=f"mn: no process of this run is left on {node} to stop "
                              f"({state_message or 'cancelling'})",
                      what="was Cancelling with no process left to stop: Cancelled")
    return PutBack(message=f"mn: the worker that was starting this run on {node} stopped before it started; it "
                           "starts again",
                   what="was Pending with no worker starting it: back to Scheduled")


def ended_for(state_type: str | None, state_name: str | None, state_age_s: float, for_seconds: float) -> str | None:
    """The name of a run's final state once it has been over ``for_seconds``; None while it lives or ended only
    just now."""
    if state_type is None or state_type not in TERMINAL_RUN_STATES:
        return None
    return state_name if state_age_s >= for_seconds else None


def unheld_part(ended: str | None, unheld_s: float) -> Release | Keep:
    """A system run's part on this node that no copy holds, the run's own node being another: released once the
    run has been over ``ENDED_RUN_COPY_SECONDS`` (``ended``, from ``ended_for``; "deleted" when it is gone), else
    once no run has held it for ``ORPHAN_PART_GRACE_SECONDS``."""
    if ended is not None:  # over for a while: the copy its worker did not make never will be
        return Release(f"the run is {ended} and made no copy for this node", "run_ended")
    if unheld_s >= ORPHAN_PART_GRACE_SECONDS:
        return Release("no run holds it: its copy was never made or was deleted", "orphaned")
    return Keep()


def step_booking(bundle_job_id: str, workflow_status: str, *, run_found: bool,
                 run_over: bool) -> ReleaseStep | Keep:
    """A bundle step's booking, kept while its bundle's flow run lives; released once it is over or gone."""
    if run_found and not run_over:
        return Keep()
    why = f"its bundle run {bundle_job_id} is over" if run_found else f"its bundle run {bundle_job_id} is gone"
    return ReleaseStep(why=why, crash_workflow=workflow_status == "running")


def job_bookings(finished: bool, status: str, *, coordinator_over: bool) -> ReleaseJob | Keep:
    """A blueprint job's bookings left on this node: kept while its coordinator run lives; released once the job
    is finished, or its coordinator is over or gone (the job then cancelled, its agents stopped)."""
    if finished:
        return ReleaseJob(why=f"the job is {status}", status=status, stop_agents=False)
    if not coordinator_over:
        return Keep()
    return ReleaseJob(why="its coordinator run is over", status="cancelled", stop_agents=True)


# -- runs of the pool whose end never reached the server -------------------------------------------------------


def overdue(state_age_s: float | None, grace_s: float, *, in_flight: bool) -> bool:
    """Whether a run is judged at all: not being submitted or run by this worker, and in its state for
    ``grace_s``."""
    return not in_flight and state_age_s is not None and state_age_s >= grace_s


def unreported_pending_end(state_age_s: float | None, grace_s: float, *, in_flight: bool, owned_elsewhere: bool,
                           booked: bool) -> Crash | Keep:
    """A run of the pool Pending for ``grace_s`` whose booking is gone: its flow process ended before it reached
    Running and its end was never reported. ``owned_elsewhere``: a blueprint agent's run (its booking is its
    job's) or a system run's copy (its part is the run's); ``booked``: its node's worker judges it."""
    if not overdue(state_age_s, grace_s, in_flight=in_flight) or owned_elsewhere or booked:
        return Keep()
    return Crash(message="mn: the run's flow process ended before the run started, and its worker could not report "
                         "it (its booking is already released)",
                 what="was Pending with no booking: marked Crashed")


def lost_running(state_age_s: float | None, grace_s: float, *, in_flight: bool, owned_elsewhere: bool,
                 placed_here: bool, booked: bool, process_alive: bool, node: str,
                 cancelling: bool = False) -> Crash | Cancel | Keep:
    """A run of the pool Running (or, with ``cancelling``, Cancelling) for ``grace_s``, placed on ``node``, unbooked
    and with no process left there: it ended (or was stopped, and its booking released), but its last state never
    reached the server. A Running one is Crashed; a Cancelling one Cancelled, as its worker would have said."""
    if (not overdue(state_age_s, grace_s, in_flight=in_flight) or owned_elsewhere or not placed_here or booked
            or process_alive):
        return Keep()
    if cancelling:
        return Cancel(message=f"mn: the run's flow process on {node} was stopped, and its end never reached the "
                              "server (its booking is already released)",
                      what="was Cancelling with no booking and no process: Cancelled")
    return Crash(message=f"mn: the run's flow process on {node} ended, and its end never reached the server (its "
                         "booking is already released)",
                 what="was Running with no booking and no process: marked Crashed")


def stray_process(run_state: str | None, booked_here: bool, node: str) -> StopProcess | Keep:
    """A flow-run process on ``node`` that no launch of this worker holds: its worker was killed, and this one
    started since. It runs on while its run lives and is still booked here (its end releases the booking, through
    the sweep); once the run is over or gone, or no longer booked here (placed again on another node while this
    one was lost), it is stopped: it would run beside its copy, or hold what is no longer booked to it."""
    if run_state is None:
        return StopProcess(f"its run no longer exists; stopped by the worker of {node}")
    if run_state in TERMINAL_RUN_STATES:
        return StopProcess(f"its run is over ({run_state.lower()}); stopped by the worker of {node}")
    if not booked_here:
        return StopProcess(f"its run is no longer booked on {node} (placed again elsewhere, or released)")
    return Keep()


def stopped_launch(state_type: str | None, *, node: str, agent: bool, system_part: bool) -> StoppedLaunch:
    """The worker on ``node`` stopped while launching a run now in ``state_type``. Never Running (no flow code ran):
    back to Scheduled for any worker, its booking released; a blueprint agent's booking (``agent``) belongs to its
    job, which keeps it; a system run's part, or its copy's (``system_part``), waits for its node and goes only
    with a run that is over. Already over: only released. Running (or Cancelling, Paused): left alone, the worker's
    teardown says why."""
    waiting = state_type in ("PENDING", "SCHEDULED")
    over = state_type in TERMINAL_RUN_STATES
    if not waiting and not over:
        return StoppedLaunch()
    schedule = (f"mn: the worker on {node} stopped before starting this run; it waits to be placed again"
                if waiting else None)
    if agent:
        return StoppedLaunch(schedule)
    if system_part:
        return StoppedLaunch(schedule, release_part=Release("the run is over", "run_ended") if over else None)
    return StoppedLaunch(schedule, release=Release("its worker stopped before starting it", "not_started"))
