"""The worker's sweeps, given the store, the Prefect client and the node: they gather the facts of each booking
on this node, and of each run of the pool whose end never reached the server, and carry out what the rules of
``mn_prefect.worker.decisions`` say (release with why, keep, put back to Scheduled, mark Crashed or Cancelled).

- ``bookings``: this node's bookings whose run is over or gone (a flow run's, a system run's part, a bundle
  step's, a blueprint job's), and runs booked here left Pending or Cancelling by a worker that was killed
- ``crash_lost_running``: runs Running, placed here, unbooked, with no process left here
- ``every_few_seconds``: the two above, and the pool announcer's pass, on a timer of their own, not after polls
- ``crash_unreported_ends`` and ``silent_nodes``: the pool announcer's (runs Pending with no booking; nodes
  whose worker went silent)
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ParamSpec, Protocol, TypeVar

import anyio
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterIdempotencyKey,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Cancelling, Crashed, Scheduled

from mn_prefect.drivers.launchers import DOCKER_PID_PREFIX
from mn_prefect.lifecycle.states import advance_node_states
from mn_prefect.model.bookings import FlowRun, JobBooking, StepAttempt, SystemCopy, Why
from mn_prefect.model.scalars import is_uuid
from mn_prefect.model.states import TERMINAL_RUN_STATES
from mn_prefect.placement.bookings import classify
from mn_prefect.placement.fair_share import advance
from mn_prefect.placement.holding import end_hold, read_holds
from mn_prefect.placement.job_state import JobState, load_job, release_job
from mn_prefect.placement.placing import Placer
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import FlowRunRecord, WorkflowRecord, get_record, put_record
from mn_prefect.worker import decisions, system, visibility
from mn_prefect.worker.decisions import (
    ENDED_RUN_COPY_SECONDS,
    STRAY_KILL_SECONDS,
    Cancel,
    Crash,
    Keep,
    Release,
    ReleaseJob,
    ReleaseStep,
    StopProcess,
)

# How often a worker sweeps its node's bookings and its lost Running runs, and how often the pool's announcer
# makes its pass (silent nodes, unreported ends, fair share, preempted runs; the heartbeat timeout itself is
# MN_HEARTBEAT_TIMEOUT_SECONDS).
NODE_BOOKINGS_SWEEP_SECONDS = 5.0
POOL_SWEEP_SECONDS = 10.0

_P = ParamSpec("_P")
_T = TypeVar("_T")
_R = TypeVar("_R")


class InStore(Protocol):
    """Runs a blocking store call off the event loop, one at a time (the worker's ``_in_store``)."""

    def __call__(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> Awaitable[_T]: ...


class ReleaseRun(Protocol):
    """Releases a run's booking on this node, saying why (``Releaser.release``)."""

    def __call__(self, flow_run_id: Any, why: str, because: Why, *, run_name: str | None = None) -> Awaitable[None]: ...


class ReleasePart(Protocol):
    """Releases a system run's part on one node, saying why (``Releaser.release_part``)."""

    def __call__(self, job_id: str, node: str, why: str, because: Why, *, run_id: Any,
                 run_name: str | None = None) -> Awaitable[None]: ...


def _state_age(flow_run) -> float | None:
    """How long ``flow_run`` has been in its state, in seconds (None: no state, or no timestamp)."""
    state = flow_run.state
    if state is None or state.timestamp is None:
        return None
    return time.time() - state.timestamp.timestamp()


def _state_of(flow_run) -> tuple[str | None, str | None]:
    """``flow_run``'s state type and name (None, None: it has no state)."""
    state = flow_run.state
    return (state.type, state.name) if state is not None else (None, None)


def _over(flow_run) -> bool:
    """Whether ``flow_run`` is over (a run with no state is not)."""
    return flow_run.state is not None and flow_run.state.type in TERMINAL_RUN_STATES


def _flow_process_alive(infrastructure_pid: str | None, run_id: str) -> bool:
    """Whether the flow process a worker started for ``run_id`` still runs here (``host:pid``, the pid's
    environment naming the run, so that a reused pid is not taken for it). A container is left to its driver."""
    if not infrastructure_pid:
        return False
    if infrastructure_pid.startswith(DOCKER_PID_PREFIX):
        return True
    try:
        pid = int(infrastructure_pid.rsplit(":", 1)[-1])
        return run_id.encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except (ValueError, OSError):
        return False


def flow_processes(node: str, group: str | None, proc: Path = Path("/proc")) -> list[tuple[int, str, str]]:
    """The flow-run processes of this machine placed on ``node`` of ``group``: ``(pid, flow run id, booking id)``
    for each process whose environment names a flow run (``PREFECT__FLOW_RUN_ID``), this node (``MN_NODE``, an env
    hint) and an allocation in this group (``MN_ALLOCATION_JSON``: a machine may host the workers of several pools,
    each with its own store). The booking is the one the allocation names (a system copy's is its run's, a
    blueprint agent's its job's). Processes that cannot be read (another user's) are left out."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"PREFECT__FLOW_RUN_ID=" not in raw or b"MN_NODE=" not in raw:
            continue
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        if env.get(b"MN_NODE", b"").decode(errors="replace") != node:
            continue
        run_id = env[b"PREFECT__FLOW_RUN_ID"].decode(errors="replace")
        try:
            allocation = json.loads(env.get(b"MN_ALLOCATION_JSON", b"{}"))
        except ValueError:
            continue
        if not isinstance(allocation, dict) or allocation.get("group") != group:
            continue
        found.append((int(entry.name), run_id, str(allocation.get("job_id") or run_id)))
    return found


class Sweeps:
    """One node's sweeps. ``client`` and ``work_pool`` are read at each use (the worker's client is rewrapped
    when Prefect's changes; its pool is re-read from the server); ``busy``: the ids of the runs this worker is
    submitting or running now, which no sweep judges; ``release`` and ``release_part``: the worker's ``Releaser``'s,
    which also forget what it cached of the run; ``orphan_grace_s``: how long a run left Pending, Cancelling or
    Running unbooked here waits before it is judged lost with its worker."""

    def __init__(self, *, store: ClusterStore, placer: Placer, node: str, pool: str, client: Callable[[], Any],
                 work_pool: Callable[[], Any], in_store: InStore, logger: Any, run_logger: Callable[[Any], Any],
                 busy: Callable[[], set[str]], release: ReleaseRun, release_part: ReleasePart,
                 orphan_grace_s: float = decisions.ORPHAN_PENDING_GRACE_SECONDS):
        self._store, self._placer, self._node, self._pool = store, placer, node, pool
        self._orphan_grace_s = orphan_grace_s
        self._client, self._work_pool, self._in_store = client, work_pool, in_store
        self._logger, self._run_logger, self._busy = logger, run_logger, busy
        self._release, self._release_part = release, release_part
        # A system run's part here that no run holds, and since when (monotonic): released after the grace.
        self._orphan_parts: dict[tuple[str, str], float] = {}
        # Stray flow-run processes told to stop, and when (monotonic): killed after STRAY_KILL_SECONDS.
        self._stopped_strays: dict[int, float] = {}

    async def every_few_seconds(self, scheduled: Callable[[], set[str]], stopping: Callable[[], bool],
                                is_announcer: Callable[[], Awaitable[bool]], requeue: Callable[[], Awaitable[None]],
                                notices: Callable[[], Awaitable[None]], scope: anyio.CancelScope) -> None:
        """Until the worker stops: ``bookings`` and ``crash_lost_running`` every NODE_BOOKINGS_SWEEP_SECONDS, and
        while this worker is the pool's announcer (``is_announcer``) its pass every POOL_SWEEP_SECONDS (``requeue``:
        the preempted runs that stopped, scheduled again). A step that fails (the store or the API is away) is
        tried again at the next tick, and the others still run. On a timer of their own, not after polls: a poll
        that starts while the API is away sits through the client's retries, and a run a killed worker left
        Pending goes back to Scheduled whether or not this worker's polls get through. ``scheduled``: the runs
        Scheduled in the last poll (no need to judge those)."""
        pool_pass_at = 0.0
        with scope:
            while not stopping():
                await self._guarded("sweep of this node's bookings", self.bookings, scheduled())
                await self._guarded("sweep of this node's lost Running runs", self.crash_lost_running)
                await self._guarded("sweep of this node's stray flow-run processes", self.stray_processes)
                await self._guarded("preemption notices of this node's runs", notices)
                if time.monotonic() - pool_pass_at >= POOL_SWEEP_SECONDS and await is_announcer():
                    pool_pass_at = time.monotonic()
                    await self._guarded("judging of silent nodes", self.silent_nodes)
                    await self._guarded("sweep of the pool's unreported ends", self.crash_unreported_ends)
                    await self._guarded("fair-share step", self.fair_share)
                    await self._guarded("sweep of the pool's holds", self.holds)
                    await self._guarded("requeue of the preempted runs", requeue)
                await anyio.sleep(NODE_BOOKINGS_SWEEP_SECONDS)

    async def _guarded(self, what: str, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        try:
            await fn(*args)
        except Exception as error:  # a store or API outage; raised, it would end the worker
            self._logger.warning("%s skipped: %s: %s", what, type(error).__name__, error)

    async def bookings(self, scheduled: set[str]) -> None:
        """Release bookings on this node whose run is over or gone (cancelled while waiting, deleted, or
        left behind by a crashed worker). Runs still Scheduled in this poll or running here are skipped."""
        placements = await self._in_store(self._store.active_placements, node=self._node)
        skip = self._busy() | scheduled
        parts = {p.job_id for p in placements if p.job_id and p.locality == "system" and is_uuid(p.job_id)}
        self._orphan_parts = {key: since for key, since in self._orphan_parts.items() if key[0] in parts}
        for job_id in sorted(parts):  # a system run's part here: judged by the run that holds it, not by the id
            await self._part(job_id, skip)
        for job_id in {p.job_id for p in placements if p.job_id and p.job_id not in skip and p.job_id not in parts}:
            owner = await self._in_store(classify, self._store, job_id)  # the booking's owner, typed
            if isinstance(owner, (JobBooking, SystemCopy)):
                job = await self._in_store(load_job, self._store, owner.job_id)
                if job is not None:
                    await self._job(job)
                continue
            if isinstance(owner, StepAttempt):
                await self._step(owner)
                continue
            if not isinstance(owner, FlowRun):
                continue  # a reservation, a hold, or no owner known (yet): not the sweep's to judge
            try:
                flow_run = await self._client().read_flow_run(job_id)
            except ObjectNotFound:
                await self._release(job_id, decisions.GONE.why, decisions.GONE.because)
                continue
            except Exception:
                continue  # not a flow run id we can read now; leave it
            over = decisions.run_over(*_state_of(flow_run))
            if over is not None:
                await self._release(flow_run.id, over.why, over.because)
            else:
                await self._restart_if_orphaned(flow_run)

    async def _part(self, job_id: str, skip: set[str]) -> None:
        """System run ``job_id``'s part on this node, released once the run that holds it is over or gone: the
        copy made for this node (found by its idempotency key), or on the run's own node the run itself. A part
        that no run holds (its copy was never made, or was deleted) goes after ORPHAN_PART_GRACE_SECONDS."""
        node = self._node
        try:
            found = await self._client().read_flow_runs(flow_run_filter=FlowRunFilter(
                idempotency_key=FlowRunFilterIdempotencyKey(any_=[system.copy_key(job_id, node)])), limit=1)
        except Exception:
            return  # not readable now; the next sweep looks again
        holder = found[0] if found else None
        if holder is None:
            record = await self._in_store(get_record, self._store, job_id, FlowRunRecord)
            if record is not None and record.node != node:
                ended = await self._run_ended(job_id, ENDED_RUN_COPY_SECONDS)
                # The part has been unheld since this sweep first saw it so (an ended run's is released at once).
                since = self._orphan_parts.setdefault((job_id, node), time.monotonic()) if ended is None else 0.0
                decision = decisions.unheld_part(ended, time.monotonic() - since)
                if isinstance(decision, Release):
                    await self._release_part(job_id, node, decision.why, decision.because, run_id=job_id)
                return
            if job_id in skip:
                return
            try:
                holder = await self._client().read_flow_run(uuid.UUID(job_id))
            except ObjectNotFound:
                await self._release_part(job_id, node, decisions.GONE.why, decisions.GONE.because, run_id=job_id)
                return
            except Exception:
                return
        elif str(holder.id) in skip:
            return
        self._orphan_parts.pop((job_id, node), None)
        over = decisions.run_over(*_state_of(holder))
        if over is not None:
            await self._release_part(job_id, node, over.why, over.because, run_id=holder.id, run_name=holder.name)
        else:
            await self._restart_if_orphaned(holder)

    async def _run_ended(self, run_id: str, for_seconds: float) -> str | None:
        """The name of run ``run_id``'s final state when it has been over ``for_seconds`` ("deleted" when it no
        longer exists); None while it lives, ended only just now, or cannot be read now."""
        try:
            flow_run = await self._client().read_flow_run(uuid.UUID(run_id))
        except ObjectNotFound:
            return "deleted"
        except Exception:
            return None
        return decisions.ended_for(*_state_of(flow_run), _state_age(flow_run) or 0.0, for_seconds)

    async def _restart_if_orphaned(self, flow_run) -> None:
        """A run booked on this node, Pending for ORPHAN_PENDING_GRACE_SECONDS, that no launch of this worker
        holds and whose flow process (if one was started) is gone: the worker that was starting it was killed
        before the flow ran. No flow code ran (that starts with Running): back to Scheduled, its booking kept
        (it is this node's), and this worker starts it on its next poll.

        A run Cancelling as long with no process of it left here (its worker, which would have stopped it, was
        killed with it) is Cancelled: nothing is left to stop, and the next sweep releases its booking."""
        state, grace, age = flow_run.state, self._orphan_grace_s, _state_age(flow_run)
        state_type = state.type if state is not None else None
        # The /proc read only for a run the rule would judge by it.
        alive = (state_type in (StateType.PENDING, StateType.CANCELLING) and age is not None and age >= grace
                 and _flow_process_alive(flow_run.infrastructure_pid, str(flow_run.id)))
        decision = decisions.orphaned_run(state_type, state.message if state is not None else None, age,
                                          grace_s=grace, process_alive=alive, node=self._node)
        if isinstance(decision, Keep):
            return
        new_state: Any = (Cancelled(message=decision.message) if isinstance(decision, Cancel)
                          else Scheduled(message=decision.message))
        try:
            await self._client().set_flow_run_state(flow_run.id, new_state, force=True)
        except Exception as error:  # the next sweep looks again
            self._logger.warning("could not end the wait of orphaned run %s: %s", flow_run.id, error)
            return
        self._run_logger(flow_run).warning(decision.message)
        self._logger.warning("run %s %s", flow_run.id, decision.what)

    async def _step(self, owner: StepAttempt) -> None:
        """A bundle step's booking outlives its bundle run only when the run's flow was killed before its own
        cleanup (on another machine, so that machine's sweep cannot see its dead pid): release it once the
        bundle's flow run is over or gone, and say the workflow crashed."""
        booking, workflow = str(owner), owner.workflow_job
        record = await self._in_store(get_record, self._store, workflow, WorkflowRecord)
        if record is None or record.flow_run_id is None:
            return  # a local run (no flow run): its own machine sweeps it by pid
        flow_run_id = record.flow_run_id
        try:
            run = await self._client().read_flow_run(uuid.UUID(flow_run_id))
        except ObjectNotFound:
            run = None
        except Exception:
            return  # not readable now; the next sweep looks again
        run_over = run is not None and _over(run)
        if run is None or run_over:
            record = await self._read_again(record, get_record, self._store, workflow, WorkflowRecord)
        decision = decisions.step_booking(record.job_id, record.status, run_found=run is not None, run_over=run_over)
        if not isinstance(decision, ReleaseStep):
            return
        why = decision.why
        if await self._in_store(self._placer.release, owner, why="bundle_ended"):
            visibility.emit_placement(visibility.RELEASED, flow_run_id, self._node,
                                      {"reason": why, "booking": booking}, work_pool=self._work_pool())
            self._logger.info("released the step booking %s on %s (%s)", booking, self._node, why)
        if decision.crash_workflow:
            record.status = "crashed"
            await self._in_store(put_record, self._store, record)

    async def _read_again(self, stale: _R, read: Callable[..., _R | None], *args: Any) -> _R:
        """A record read again once its run is over (``stale`` if it is gone meanwhile): a coordinator or a bundle's
        run writes its end before its flow run ends, so a copy read while the run lived may miss that end."""
        fresh = await self._in_store(read, *args)
        return fresh if fresh is not None else stale

    async def _job(self, job: JobState) -> None:
        """A blueprint job's bookings outlive its coordinator only by accident (the coordinator was killed
        before its cleanup ran): stop its agents and release them once the coordinator run is over."""
        coordinator_over = True
        if not job.finished:
            try:
                coordinator = await self._client().read_flow_run(job.flow_run_id) if job.flow_run_id else None
            except ObjectNotFound:
                coordinator = None
            coordinator_over = coordinator is None or _over(coordinator)
            if coordinator_over:
                job = await self._read_again(job, load_job, self._store, job.job_id)
        decision = decisions.job_bookings(job.finished, job.status, coordinator_over=coordinator_over)
        if not isinstance(decision, ReleaseJob):
            return
        if decision.stop_agents:
            for track in job.agents.values():
                if track.current is not None:
                    await self._cancel_agent_run(track.current.run_id, f"mn: job {job.job_id} ended")
        released = await self._in_store(release_job, self._store, job, decision.status, decision.why)
        if released:
            self._logger.info("released the bookings of job %s (%s)", job.job_id, decision.why)

    async def _cancel_agent_run(self, run_id: str, message: str) -> None:
        """Cancel one agent run of a blueprint job (not Prefect's ``_cancel_run``, which its cancellation
        observer calls for runs of the pool cancelled while pending)."""
        try:
            run = await self._client().read_flow_run(run_id)
        except ObjectNotFound:
            return
        if run.state is not None and run.state.type not in TERMINAL_RUN_STATES:
            await self._client().set_flow_run_state(run.id, Cancelling(message=message), force=True)

    async def crash_lost_running(self) -> None:
        """Runs of the pool Running for the orphan grace that were placed on this node, whose booking is gone
        and whose flow process no longer runs here: the process ended (its booking released when it did) but its
        last state never reached the server (the API was away, or the process was killed with its worker).
        Prefect would show them Running for ever: Crashed, as Prefect's worker would have said. Runs Cancelling
        the same way (stopped, their booking released, their Cancelled lost) are Cancelled."""
        grace = self._orphan_grace_s
        runs = await self._client().read_flow_runs(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[self._pool])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.CANCELLING]))), limit=200)
        for run in runs:
            job_id, age, in_flight = str(run.id), _state_age(run), self._in_flight(run)
            owned_elsewhere = self._owned_elsewhere(run)
            if not decisions.overdue(age, grace, in_flight=in_flight) or owned_elsewhere:
                continue  # the rule keeps it: no store read for it
            record = await self._in_store(get_record, self._store, job_id, FlowRunRecord)
            placed_here = record is not None and record.node == self._node
            # Each fact read only while the ones before leave the run to be judged, as the rule reads them.
            booked = placed_here and bool(await self._in_store(self._store.active_placements, job_id=job_id))
            alive = placed_here and not booked and _flow_process_alive(run.infrastructure_pid, job_id)
            cancelling = run.state is not None and run.state.type == StateType.CANCELLING
            await self._end_run(run, decisions.lost_running(age, grace, in_flight=in_flight,
                                                          owned_elsewhere=owned_elsewhere, placed_here=placed_here,
                                                          booked=booked, process_alive=alive, node=self._node,
                                                          cancelling=cancelling))

    async def stray_processes(self) -> None:
        """Flow-run processes on this node that no launch of this worker holds: a worker killed outright leaves its
        runs' processes running, and the run may since have been placed again on another node (its node was lost),
        or ended there. Each is judged by ``decisions.stray_process`` (kept while its run lives booked here);
        one to stop gets SIGTERM, and SIGKILL once it has outlived STRAY_KILL_SECONDS."""
        found = await anyio.to_thread.run_sync(flow_processes, self._node, self._placer.group)
        busy, now = self._busy(), time.monotonic()
        self._stopped_strays = {pid: at for pid, at in self._stopped_strays.items()
                                if any(pid == p for p, _, _ in found)}
        for pid, run_id, booking in found:
            if run_id in busy or pid == os.getpid():
                continue
            if pid in self._stopped_strays:
                if now - self._stopped_strays[pid] >= STRAY_KILL_SECONDS:
                    _signal(pid, signal.SIGKILL)
                continue
            try:
                run = await self._client().read_flow_run(uuid.UUID(run_id))
                state = run.state.type if run.state is not None else None
            except ObjectNotFound:
                state = None
            except Exception:
                continue  # not readable now (or not a flow run id): the next sweep looks again
            booked = bool(await self._in_store(self._store.active_placements, job_id=booking, node=self._node))
            decision = decisions.stray_process(state, booked, self._node)
            if isinstance(decision, StopProcess):
                self._logger.warning("stopping flow-run process %d of run %s, which no launch of this worker "
                                     "holds: %s", pid, run_id, decision.why)
                _signal(pid, signal.SIGTERM)
                self._stopped_strays[pid] = now

    async def crash_unreported_ends(self) -> None:
        """Runs of the pool Pending for the orphan grace whose booking is gone: their flow process ended before
        it reached Running, and the worker that released the booking could not say so (its API calls failed, or
        it was killed just after), or a Redis failover dropped the booking before the run started. Nothing can
        start them any more: Crashed, as Prefect's worker would have said. A blueprint agent's run (its booking is
        its job's) and a system run's copy (its part is the run's) are left to those."""
        grace = self._orphan_grace_s
        try:
            runs = await self._client().read_flow_runs(
                work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[self._pool])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType.PENDING]))), limit=200)
        except Exception as error:  # the next sweep looks again
            self._logger.warning("could not list the pool's Pending runs: %s", error)
            return
        for run in runs:
            job_id, age, in_flight = str(run.id), _state_age(run), self._in_flight(run)
            owned_elsewhere = self._owned_elsewhere(run)
            if not decisions.overdue(age, grace, in_flight=in_flight) or owned_elsewhere:
                continue  # the rule keeps it: no store read for it
            booked = await self._in_store(self._own_part_booked, job_id)
            await self._end_run(run, decisions.unreported_pending_end(age, grace, in_flight=in_flight,
                                                                    owned_elsewhere=owned_elsewhere, booked=booked))

    def _own_part_booked(self, job_id: str) -> bool:
        """Whether the run itself still holds a booking. A system run's parts on other nodes are its copies'
        (a copy may run on after the run's own process ended): only its part on its own node says the run lives."""
        placements = self._store.active_placements(job_id=job_id)
        if not placements or not system.is_system(placements):
            return bool(placements)
        record = get_record(self._store, job_id, FlowRunRecord)
        own = record.node if record is not None and record.node else system.origin_node(placements)
        return any(p.node == own for p in placements)

    async def silent_nodes(self) -> None:
        """The pool's announcer judges silent nodes as the reconcile flow does (``advance_node_states``): a node
        whose worker died stops being offered at once, even when the reconcile flow's own run was placed there."""
        try:
            changes = await self._in_store(advance_node_states, self._store)
        except Exception as error:  # the reconcile flow's sweep, or the next pass, does it
            self._logger.warning("could not judge silent nodes: %s", error)
            return
        for change in changes:
            self._logger.warning("node %s is now %s: %s", change.node, change.to_status, change.reason)

    async def holds(self) -> None:
        """The pool's announcer ends the holds whose run no longer waits (``decisions.hold_over``): placed, running,
        over, paused, or deleted."""
        standing = await self._in_store(read_holds, self._store, self._placer.group)
        for run_id, hold in standing.items():
            if not is_uuid(run_id):  # a blueprint job's (jobs.gang_holds): judged by its job and coordinator run
                decision = await self._job_hold(run_id)
            else:
                try:
                    run = await self._client().read_flow_run(run_id)
                    state = run.state.type if run.state is not None else "SCHEDULED"
                except ObjectNotFound:
                    state = None
                decision = decisions.hold_over(state)
            if isinstance(decision, Release):
                await self._in_store(end_hold, self._placer, hold)
                self._logger.info("hold %s for run %s ended: %s", hold.hold_id, run_id, decision.why)
                visibility.emit_hold(visibility.HOLD_RELEASED, run_id, None, hold, self._work_pool(),
                                     why=decision.why)

    async def _job_hold(self, job_id: str) -> Release | Keep:
        job = await self._in_store(load_job, self._store, job_id)
        if job is None:
            return decisions.job_hold_over(None, False, None)
        coordinator: str | None = None
        if job.flow_run_id:
            try:
                run = await self._client().read_flow_run(uuid.UUID(job.flow_run_id))
                coordinator = run.state.type.value if run.state is not None else "SCHEDULED"
            except (ObjectNotFound, ValueError):
                coordinator = None
        else:
            coordinator = "RUNNING"  # a job run outside Prefect: its record alone says
        placed = bool(await self._in_store(self._store.active_placements, job_id=job_id))
        return decisions.job_hold_over(job.status, placed, coordinator)

    async def fair_share(self) -> None:
        """The pool's announcer moves the queues' decaying past use on (placement/fair_share.py)."""
        try:
            await self._in_store(advance, self._store)
        except Exception as error:  # the next pass does it; the order meanwhile uses the last one
            self._logger.warning("could not move the fair-share use on: %s", error)

    def _in_flight(self, run) -> bool:
        """Whether this worker is submitting or running ``run`` now."""
        return str(run.id) in self._busy()

    def _owned_elsewhere(self, run) -> bool:
        """A blueprint agent's run (its booking is its job's) or a system run's copy (its part is its run's)."""
        return bool((run.job_variables or {}).get("booking")) or system.copy_marker(None, run.job_variables) is not None

    async def _end_run(self, run, decision: Crash | Cancel | Keep) -> None:
        """Mark ``run`` Crashed (or Cancelled) when the rule says so (a failed write is tried again by the next
        sweep)."""
        if isinstance(decision, Keep):
            return
        state: Any = (Crashed if isinstance(decision, Crash) else Cancelled)(message=decision.message)
        try:
            await self._client().set_flow_run_state(run.id, state, force=True)
        except Exception as error:
            self._logger.warning("could not mark run %s %s: %s", run.id, state.name, error)
            return
        log = self._run_logger(run)
        (log.error if isinstance(decision, Crash) else log.warning)(decision.message)
        self._logger.warning("run %s %s", run.id, decision.what)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
