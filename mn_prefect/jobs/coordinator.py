"""The ``mn-blueprint-job`` flow: a blueprint compiled into one Prefect flow run that coordinates its agents.

Running it: validate and pre-check the blueprint once (refused whole, nothing booked), book the whole job
(gang: every agent or none; ``runnable_later`` waits with its reason), start each agent as a child ``mn-agent``
flow run on the ``mn`` pool pinned to its booking, then supervise by job type until the job completes, fails
or is cancelled; whatever ends it, its agents are cancelled and every booking is released. The job's machine
(``mn_prefect.jobs.machine``) decides each step; this module books, starts, reads and stops runs, and records.
"""

from __future__ import annotations

import time
import uuid
from contextlib import closing
from typing import Any

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run as current_run
from prefect.states import Cancelling, Crashed, Paused

from mn_prefect import events
from mn_prefect.events import HOLD_COVERED, HOLD_CREATED, HOLD_RELEASED
from mn_prefect.jobs import gang_holds
from mn_prefect.jobs.agent import AGENT_FLOW_NAME
from mn_prefect.jobs.gang_holds import end_job_hold, hold_step
from mn_prefect.jobs.machine import Book, Effects, JobFailed, JobMachine, JobNotRunnable, Stop, ending
from mn_prefect.jobs.preflight import BlueprintInvalid, load, runnable
from mn_prefect.lifecycle.drain import active_drain
from mn_prefect.model.blueprint import Blueprint
from mn_prefect.model.placement import Placement, Plan
from mn_prefect.model.recovery import SYSTEM_TYPES
from mn_prefect.model.states import TERMINAL_RUN_STATES
from mn_prefect.placement import bookings, estimates
from mn_prefect.placement.job_state import JobState, load_job, release_job
from mn_prefect.placement.placing import Placer, place_and_commit
from mn_prefect.placement.reservations import ReservationError, place_inside
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.store import ClusterStore, Event, open_store
from mn_prefect.store.base import placed_topic

__all__ = ["JOB_FLOW_NAME", "BlueprintInvalid", "JobFailed", "JobNotRunnable", "agent_deployment_name",
           "blueprint_job", "load", "new_job_id"]

JOB_FLOW_NAME = "mn-blueprint-job"
POLL_S = 1.0
NODE_CHECK_S = 2.0


def agent_deployment_name(pool: str) -> str:
    """Agents of jobs on pool ``pool`` run as flow runs of this deployment (one per pool)."""
    return f"{AGENT_FLOW_NAME}/agents-{pool}"  # not named like the pool: it is internal, not one of its examples


def new_job_id(blueprint: Blueprint, flow_run_id: str | None = None) -> str:
    """``<job_name>-<8 hex>``: from the coordinator run's id when there is one, so a coordinator run that is
    re-placed after its node was lost carries on the same job."""
    return f"{blueprint.job_name}-{(flow_run_id or uuid.uuid4().hex).replace('-', '')[:8]}"


@flow(name=JOB_FLOW_NAME, log_prints=True, retries=0)
def blueprint_job(blueprint: dict[str, Any], job_id: str | None = None, pool: str | None = None) -> dict:
    """Run a MirrorNeuron blueprint: place every agent, run each on its node, supervise by job type."""
    parsed = runnable(load(blueprint))  # the one parse: typed models from here on
    run_id = current_run.get_id()
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(uuid.UUID(run_id)) if run_id else None
        pool = pool or (run.work_pool_name if run is not None else None)
        if not pool:
            raise ValueError("pool: no work pool given and this run has none; pass pool=<an mn pool>")
        with closing(open_store()) as store:
            return Coordinator(parsed, store, client, job_id or new_job_id(parsed, run_id), pool,
                               reservation=_reservation_of(client, run)).run()


def _reservation_of(client, run) -> tuple[str, str | None] | None:
    """The reservation the coordinator's own run was given (job_variables.reservation and reservation_key, the
    run's over its deployment's): its agents are placed inside it too."""
    if run is None:
        return None
    variables = dict(client.read_deployment(run.deployment_id).job_variables or {}) if run.deployment_id else {}
    variables.update(run.job_variables or {})
    rid = variables.get("reservation")
    return (rid, variables.get("reservation_key")) if rid else None


class Coordinator:
    """Carries out one job's machine; the job's record is saved whenever it changed."""

    def __init__(self, blueprint: Blueprint, store: ClusterStore, client, job_id: str, pool: str, *,
                 reservation: tuple[str, str | None] | None = None):
        self.store, self.client, self.pool = store, client, pool
        self.reservation = reservation  # (id, key): every agent is placed inside it
        self.logger = get_run_logger()
        self.job = JobState(job_id=job_id, job_name=blueprint.job_name, job_type=blueprint.job_type,
                            flow_run_id=current_run.get_id(), pool=pool, strategy=blueprint.strategy,
                            recovery_mode=blueprint.recovery_mode)
        self.machine = JobMachine(blueprint, self.job)
        self._saved: dict[str, Any] | None = None

    def run(self) -> dict:
        job, machine = self.job, self.machine
        status, reason = "failed", "the coordinator stopped unexpectedly"
        try:
            self._do(machine.begin(load_job(self.store, job.job_id), self._node_statuses(), time.time()))
            self._publish()  # before any booking: the workers' sweep reads bookings through this record
            status, reason = self._supervise()
        except BaseException as error:  # cancellation arrives as a BaseException (TerminationSignal)
            status, reason = ending(error, cancelling=self._cancelling())
            raise
        finally:
            for stop in machine.stops(reason):
                if self._stop(stop):
                    stop.run.state = "CANCELLING"
            self._publish()
            released = release_job(self.store, job, status, reason)
            self._end_hold(f"the job {status}")
            events.job_status(status, job.job_id, reason=reason, run_id=job.flow_run_id, name=job.job_name,
                              data={"released": released})
            self.logger.info("job %s %s: %s (released %d booking(s))", job.job_id, status, reason, released)
        return job.summary()

    def _cancelling(self) -> bool:
        try:
            state = self.client.read_flow_run(self.job.flow_run_id).state if self.job.flow_run_id else None
        except Exception:
            return False
        return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)

    def _supervise(self) -> tuple[str, str]:
        """Book the job, start its agents and watch them until the job is done: (status, reason). Service and
        system jobs run until cancelled; a failed job raises JobFailed."""
        next_nodes = 0.0
        while True:
            if time.monotonic() >= next_nodes:
                next_nodes = time.monotonic() + NODE_CHECK_S
                self._watch_nodes()
            self._do(self.machine.placing(time.time()))
            for agent_id, run_id in self.machine.running().items():
                if (state := self.client.read_flow_run(run_id).state) is None:
                    continue
                ended = self.machine.observed(agent_id, state.type.value, state.name, state.message, time.time())
                if ended is not None:
                    self._learn_runtime(agent_id)
                if ended is not None and ended.action == "fail":
                    raise JobFailed(ended.reason)
            woken: set[str] = set()
            for launch in self.machine.due(time.time()):
                run = run_deployment(agent_deployment_name(self.pool), timeout=0, as_subflow=True,
                                     flow_run_name=launch.name, parameters=launch.parameters,
                                     job_variables=launch.job_variables)
                if not isinstance(run, FlowRun):  # a coroutine only when called from async code
                    raise TypeError(f"run_deployment returned a {type(run).__name__}, not a flow run")
                self.machine.launched(launch, str(run.id), time.time())
                if (node := self.job.agents[launch.agent_id].node) is not None:
                    woken.add(node)
            if woken:  # booked before they existed: wake their nodes' workers now, not at their next poll
                self.store.announce(sorted(placed_topic(node) for node in woken))
            self._publish()
            done = self.machine.done()
            if done is not None:
                return done.status, done.reason
            time.sleep(POLL_S)

    def _learn_runtime(self, agent_id: str) -> None:
        """An agent's run ended: a completed one teaches its agent's estimate; a store error loses the sample,
        never the job."""
        try:
            estimates.record_agent_run(self.store, self.job, agent_id)
        except Exception as error:
            self.logger.debug("did not record agent %s's runtime: %s", agent_id, error)

    def _node_statuses(self) -> dict[str, str]:
        return {n.record.name: n.record.status for n in self.store.list_nodes()}

    def _watch_nodes(self) -> None:
        status = self._node_statuses()
        drains = {node: drain.deadline for node in {t.node for t in self.job.agents.values()}
                  if node is not None and status.get(node) == "draining" and (drain := active_drain(self.store, node))}
        self._do(self.machine.node_actions(status, drains, time.time()))

    def _do(self, effects: Effects) -> None:
        """Carry out what the machine decided, in its order; each booking's result goes back to it."""
        for stop in effects.stops:
            self._stop(stop)
        for run_id, why in effects.pauses:
            self.client.set_flow_run_state(run_id, Paused(message=f"mn: {why}"), force=True)
        for booking, node in effects.releases:  # the job, or one agent, was booked again: its old booking goes
            owner = bookings.job_booking(self.job.job_id, booking, system=self.job.job_type in SYSTEM_TYPES)
            bookings.release(self.store, owner, "replaced", node=node)
        for book in effects.books:
            committed, plan = self._copies(book) if book.copies else self._book(book)
            self._do(self.machine.booked(book, committed, plan, time.time()))
        if effects.failure is not None:
            raise effects.failure

    def _book(self, book: Book) -> tuple[dict[str, list[Placement]], Plan]:
        """Plan and commit ``book``: what was committed (nothing when nothing fits now) and the plan. A booking
        made before, by the coordinator run this one replaces, stands."""
        if self.reservation is not None:
            rid, key = self.reservation
            try:
                result = place_inside(self.store, book.booking, book.asks, rid, key, job_type=self.job.job_type,
                                      strategy=self.job.strategy, group=self.pool)
            except ReservationError as error:
                raise ValueError(str(error)) from None  # the job fails with the field and the reason
        else:
            result = place_and_commit(self.store, book.booking, book.asks, job_type=self.job.job_type,
                                      strategy=self.job.strategy, explain=book.explain, group=self.pool)
        commit = result.commit
        if commit is not None and commit.ok:  # result.placed
            self._end_hold("the job was placed")
            return {book.booking: commit.placements or list(result.plan.placements)}, result.plan
        if commit is not None and commit.conflict is not None and commit.conflict.job_booked:
            return {book.booking: self.store.active_placements(job_id=book.booking)}, result.plan
        if self.reservation is None and book.move is None and book.booking == self.job.job_id:
            return self._hold(book, result.plan)
        return {}, result.plan

    def _hold(self, book: Book, plan: Plan) -> tuple[dict[str, list[Placement]], Plan]:
        """The job did not fit: placed over its head-of-line hold once that covers it, else held for
        (``gang_holds``); the plan's reason then says what is held where."""
        job = self.job
        step = hold_step(self.store, self.pool, job.job_id, book.asks, plan, strategy=job.strategy)
        if step.hold is None:
            return {}, plan
        if step.placed is not None:
            gang_holds.emit(HOLD_COVERED, job.job_id, job.flow_run_id, step.hold)
            self.logger.info("job %s placed on the capacity its hold kept on %s", job.job_id,
                             ", ".join(step.hold.nodes))
            return {book.booking: step.placed}, step.plan or plan
        if step.made:
            gang_holds.emit(HOLD_CREATED, job.job_id, job.flow_run_id, step.hold)
            self.logger.info("job %s: holding capacity on %s for its %d agent(s)", job.job_id,
                             ", ".join(step.hold.nodes), len(book.asks))
        held = f"holding capacity on {', '.join(step.hold.nodes)} for this job"
        return {}, plan.model_copy(update={"reason": f"{held} (now: {plan.reason})" if plan.reason else held})

    def _end_hold(self, why: str) -> None:
        try:
            hold = end_job_hold(self.store, self.pool, self.job.job_id)
        except Exception as error:  # the store is away: the announcer's sweep ends it once the job is over
            self.logger.warning("could not end job %s's hold: %s", self.job.job_id, error)
            return
        if hold is not None:
            gang_holds.emit(HOLD_RELEASED, self.job.job_id, self.job.flow_run_id, hold, why=why)

    def _copies(self, book: Book) -> tuple[dict[str, list[Placement]], Plan]:
        """Plan a system job's agent group once against the store (the nodes of the pool's resource group), then
        commit each new node's copy on its own."""
        if self.reservation is not None:
            raise ValueError(f"job_variables.reservation: a {self.job.job_type} job places a copy on every node of "
                             "the group; it does not run inside a reservation")
        snap = self.store.snapshot(group=self.pool)
        plan = plan_asks(book.asks, snap.columns, (), job_type=self.job.job_type, strategy=self.job.strategy,
                         limits=snap.limits, explain=book.explain, job_id=self.job.job_id)
        placer = Placer(self.store, group=self.pool)
        committed: dict[str, list[Placement]] = {}
        for booking, placements in self.machine.copies(plan).items():
            commit = placer.commit(booking, placements)
            if commit.ok:
                committed[booking] = commit.placements or placements
        return committed, plan

    def _stop(self, stop: Stop) -> bool:
        """Mark the run crashed or cancel it, as the machine said; False when it was over already."""
        try:
            run = self.client.read_flow_run(stop.run.run_id)
        except ObjectNotFound:
            return False
        if run.state is None or run.state.type in TERMINAL_RUN_STATES:
            return False
        message = f"mn: {stop.reason}"
        self.client.set_flow_run_state(run.id, Crashed(message=message) if stop.lost else Cancelling(message=message),
                                       force=True)
        return True

    def _publish(self) -> None:
        """Log and record what the machine noted (a change of the job's status is also the Prefect event
        ``mn.job.<status>``, with this run related), and save the job's record when it changed (``job status``
        and the workers' sweep read it)."""
        for note in self.machine.take_notes():
            if note.log is not None:
                self.logger.log(note.level, "%s", note.log)
            if note.kind is not None:
                self.store.record_event(Event(kind=note.kind, job_id=self.job.job_id, reason=note.reason,
                                              data=note.data))
            if note.kind is not None and note.kind.startswith("job."):
                events.job_status(note.kind.removeprefix("job."), self.job.job_id, reason=note.reason,
                                  run_id=self.job.flow_run_id, name=self.job.job_name, data=note.data)
        body = self.job.model_dump(mode="json")
        if body != self._saved:
            self.job.save(self.store)
            self._saved = body
