"""The ``mn-blueprint-job`` flow: a blueprint compiled into one Prefect flow run that coordinates its agents.

Running it: validate and pre-check the blueprint (refused whole, nothing booked), plan the whole job
against the store and commit it atomically (gang: every agent or none; ``runnable_later`` waits with its
reason), start each agent as a child ``mn-agent`` flow run on the ``mn`` pool pinned to its booking, then
supervise by job type (SPEC section 3) until the job completes, fails or is cancelled. Whatever ends the
coordinator, its agents are cancelled and every booking is released.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, State, StateType
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run as current_run
from prefect.states import Cancelling, Crashed, Paused

from mn_prefect.jobs.agent import AGENT_FLOW_NAME
from mn_prefect.jobs.preflight import JobRefused, refusals
from mn_prefect.jobs.supervision import after_exit
from mn_prefect.lifecycle.drain import active_drain, drain_action
from mn_prefect.lifecycle.reconcile import recovery_rule
from mn_prefect.model.blueprint import Blueprint, parse_blueprint
from mn_prefect.model.placement import Placement, Plan
from mn_prefect.model.states import TERMINAL_RUN_STATES
from mn_prefect.scheduler.ask import ask_for_agent, asks_for_blueprint
from mn_prefect.scheduler.plan import SYSTEM_JOB_TYPES, plan_asks
from mn_prefect.store import ClusterStore, Event, open_store
from mn_prefect.store.job_state import AGENT_FINISHED, AgentRun, AgentTrack, JobState, load_job, release_job
from mn_prefect.store.placing import Placer, place_and_commit

JOB_FLOW_NAME = "mn-blueprint-job"
POLL_S = 1.0
WAIT_BACKOFF_S = (1.0, 5.0)
SYSTEM_RECHECK_S = 5.0
NODE_CHECK_S = 2.0
BLOCKED_BACKOFF_S = (5.0, 60.0)
LOST = ("disconnected", "offline")


class BlueprintInvalid(ValueError):
    pass


class JobFailed(RuntimeError):
    pass


class JobNotRunnable(RuntimeError):
    pass


def agent_deployment_name(pool: str) -> str:
    """Agents of jobs on pool ``pool`` run as flow runs of this deployment (one per pool)."""
    return f"{AGENT_FLOW_NAME}/agents-{pool}"  # not named like the pool: it is internal, not one of its examples


def new_job_id(blueprint: Blueprint, flow_run_id: str | None = None) -> str:
    """``<job_name>-<8 hex>``: from the coordinator run's id when there is one, so a coordinator run that is
    re-placed after its node was lost carries on the same job."""
    return f"{blueprint.job_name}-{(flow_run_id or uuid.uuid4().hex).replace('-', '')[:8]}"


def load(raw: dict[str, Any]) -> Blueprint:
    """The blueprint, or BlueprintInvalid listing every problem with its path."""
    blueprint, issues = parse_blueprint(raw)
    if blueprint is None or issues:
        raise BlueprintInvalid("invalid blueprint: " + "; ".join(str(i) for i in issues))
    return blueprint


@flow(name=JOB_FLOW_NAME, log_prints=True, retries=0)
def blueprint_job(blueprint: dict[str, Any], job_id: str | None = None, pool: str | None = None) -> dict:
    """Run a MirrorNeuron blueprint: place every agent, run each on its node, supervise by job type."""
    parsed = load(blueprint)
    reasons = refusals(parsed)
    if reasons:
        raise JobRefused(parsed.job_name, reasons)
    pool = pool or _own_pool()
    if not pool:
        raise ValueError("pool: no work pool given and this run has none; pass pool=<an mn pool>")
    store = open_store()
    try:
        with get_client(sync_client=True) as client:
            coordinator = Coordinator(parsed, store, client, job_id or new_job_id(parsed, current_run.get_id()), pool)
            return coordinator.run()
    finally:
        store.close()


def _own_pool() -> str | None:
    run_id = current_run.get_id()
    if not run_id:
        return None
    with get_client(sync_client=True) as client:
        return client.read_flow_run(uuid.UUID(run_id)).work_pool_name


class Coordinator:
    """Places, starts and supervises the agents of one job; its state is saved to the store on every change."""

    def __init__(self, blueprint: Blueprint, store: ClusterStore, client, job_id: str, pool: str):
        self.blueprint = blueprint
        self.store = store
        self.client = client
        self.logger = get_run_logger()
        self.agents = {a.agent_id: a for a in blueprint.agents}
        self.asks = asks_for_blueprint(blueprint)
        self._job_services = tuple(s for s in blueprint.required_services if s.required)
        self.system = blueprint.job_type in SYSTEM_JOB_TYPES
        self.job = JobState(job_id=job_id, job_name=blueprint.job_name, job_type=blueprint.job_type,
                            flow_run_id=current_run.get_id(), pool=pool, strategy=blueprint.strategy,
                            recovery_mode=blueprint.recovery_mode)
        self._next_system_check = 0.0
        self._next_node_check = 0.0
        self._last_plan: Plan | None = None
        self._carried: dict[str, tuple[list[AgentRun], list[int], list[int]]] = {}

    # -- the whole life -------------------------------------------------------------------------------

    def run(self) -> dict:
        job = self.job
        status, reason = "failed", "the coordinator stopped unexpectedly"
        try:
            self._resume()
            job.save(self.store)  # before any booking: the workers' sweep reads bookings through this record
            self._event("job.submitted", f"{len(self.agents)} agent(s), {job.job_type}, pool {job.pool}")
            self._place()
            for track in job.agents.values():
                self._launch(track)
            job.status, job.reason = "running", f"{len(job.agents)} agent(s) started"
            job.save(self.store)
            status, reason = self._supervise()
            return self.summary()
        except BaseException as error:  # cancellation arrives as a BaseException (TerminationSignal)
            status, reason = self._ended_by(error)
            raise
        finally:
            self._stop_agents(reason)
            released = release_job(self.store, job, status, reason)
            self.logger.info("job %s %s: %s (released %d booking(s))", job.job_id, status, reason, released)

    def _ended_by(self, error: BaseException) -> tuple[str, str]:
        if isinstance(error, (JobFailed, JobNotRunnable)):
            return "failed", str(error)
        if self._cancelling() or not isinstance(error, Exception):
            return "cancelled", "the job was cancelled"
        return "failed", f"{type(error).__name__}: {error}"

    def _cancelling(self) -> bool:
        try:
            state = self.client.read_flow_run(self.job.flow_run_id).state if self.job.flow_run_id else None
        except Exception:
            return False
        return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)

    def summary(self) -> dict:
        return {"job_id": self.job.job_id, "status": self.job.status, "reason": self.job.reason,
                "agents": {a: {"node": t.node, "status": t.status, "attempts": len(t.runs)}
                           for a, t in self.job.agents.items()}}

    # -- placement ------------------------------------------------------------------------------------

    def _place(self) -> None:
        """Book every agent (gang) or one copy of the group per node (system), waiting while it only lacks
        capacity; a job no node could ever take fails with the scheduler's reasons."""
        job = self.job
        delay, last_reason = WAIT_BACKOFF_S[0], None
        while True:
            placed = self._place_system_copies() if self.system else self._place_gang()
            if placed:
                return
            plan = self._last_plan
            if plan is None:  # both placers record their plan before saying they placed nothing
                raise RuntimeError("no placement plan to report")
            job.plan = plan.as_json()
            if plan.status == "not_runnable":
                raise JobNotRunnable(f"no node can ever take this job: {plan.reason}")
            if plan.reason != last_reason:
                last_reason = plan.reason
                job.status, job.reason = "waiting", plan.reason
                job.save(self.store)
                self.logger.warning("job %s waiting to be placed: %s", job.job_id, plan.reason)
                self._event("job.waiting", plan.reason)
            time.sleep(delay)
            delay = min(delay * 2, WAIT_BACKOFF_S[1])

    def _place_gang(self) -> bool:
        job = self.job
        result = place_and_commit(self.store, job.job_id, self.asks, job_type=job.job_type, strategy=job.strategy,
                                  explain=True)
        self._last_plan = result.plan
        commit = result.commit
        if commit is not None and commit.ok:  # result.placed
            placements = commit.placements or list(result.plan.placements)
        elif commit is not None and commit.conflict is not None and commit.conflict.job_booked:
            placements = self.store.active_placements(job_id=job.job_id)  # this job was booked before: resume
        else:
            return False
        job.plan = result.plan.as_json()
        job.bookings = [job.job_id]
        self._track(placements, job.job_id)
        return True

    def _place_system_copies(self) -> bool:
        """One copy of the agent group on every node where it fits and that has none yet, each node's copy
        committed on its own (``<job>@<node>``) so a node that joins later gets its copy too."""
        job = self.job
        covered = {t.node for t in job.agents.values() if t.status not in AGENT_FINISHED or job.job_type == "sysbatch"}
        snap = self.store.snapshot()
        plan = plan_asks(self.asks, snap.nodes, snap.holds, job_type=job.job_type, strategy=job.strategy,
                         limits=snap.limits, explain=True, job_id=job.job_id)
        self._last_plan = plan
        by_node: dict[str, list[Placement]] = {}
        for placement in plan.placements:
            if placement.node not in covered:
                by_node.setdefault(placement.node, []).append(placement)
        added = 0
        placer = Placer(self.store)
        for node, placements in sorted(by_node.items()):
            booking = f"{job.job_id}@{node}"
            commit = placer.commit(booking, [p.model_copy(update={"job_id": booking}) for p in placements])
            if commit.ok:
                job.bookings.append(booking)
                self._track(commit.placements or placements, booking)
                added += 1
        if added:
            job.plan = plan.as_json()
        return added > 0 or bool(covered - {None})

    def _track(self, placements: list[Placement], booking: str) -> None:
        for placement in placements:
            agent = self.agents[placement.source_agent_id or placement.agent_id]
            earlier = self._carried.get(placement.agent_id)
            track = AgentTrack(agent_id=placement.agent_id, source_agent_id=agent.agent_id, node=placement.node,
                               booking=booking, restart=agent.restart, reschedule=agent.reschedule)
            if earlier is not None:  # a resumed job: attempts keep counting, history is kept
                track.runs, track.restarts_ms, track.reschedules_ms = earlier
            self.job.agents[placement.agent_id] = track
            self.logger.info("agent %s placed on %s (devices %s, ports %s)", placement.agent_id, placement.node,
                             ",".join(placement.device_ids) or "-",
                             ",".join(f"{p.label}={p.port}" for p in placement.allocation.ports) or "-")
        self._event("job.placed", f"{len(placements)} agent(s) booked under {booking}",
                    {"placements": [p.model_dump(mode="json", exclude={"env"}) for p in placements]})

    # -- agents ---------------------------------------------------------------------------------------

    def _launch(self, track: AgentTrack) -> None:
        agent = self.agents[track.source_agent_id]
        config = agent.config
        attempt = len(track.runs) + 1
        if self.job.pool is None:  # the coordinator is always given its pool
            raise RuntimeError(f"job {self.job.job_id} has no pool to start its agents on")
        run = run_deployment(
            agent_deployment_name(self.job.pool), timeout=0, as_subflow=True,
            flow_run_name=f"{self.job.job_id}.{track.agent_id}.{attempt}",
            parameters={"job_id": self.job.job_id, "agent_id": track.agent_id, "command": list(config.command or ()),
                        "environment": dict(config.environment), "pass_env": list(config.pass_env),
                        "workdir": config.workdir, "timeout_seconds": config.timeout_seconds, "attempt": attempt},
            job_variables={"booking": {"job_id": track.booking, "agent_id": track.agent_id}},
        )
        if not isinstance(run, FlowRun):  # run_deployment returns a coroutine only when called from async code
            raise TypeError(f"run_deployment returned a {type(run).__name__}, not a flow run")
        track.runs.append(AgentRun(run_id=str(run.id), attempt=attempt))
        track.status, track.next_start_at = "running", None
        self.logger.info("agent %s attempt %d started as run %s on %s", track.agent_id, attempt, run.id, track.node)

    def _supervise(self) -> tuple[str, str]:
        """Poll the agents until the job is done: (status, reason). Service and system jobs run until
        cancelled; a failed job raises JobFailed."""
        job = self.job
        while True:
            changed = False
            if time.monotonic() >= self._next_node_check:
                self._next_node_check = time.monotonic() + NODE_CHECK_S
                changed |= self._watch_nodes()
            for track in list(job.agents.values()):
                if track.status == "restarting" and time.time() >= (track.next_start_at or 0):
                    self._launch(track)
                    changed = True
                elif track.status == "running":
                    changed |= self._observe(track)
            if job.job_type == "system" and time.monotonic() >= self._next_system_check:
                self._next_system_check = time.monotonic() + SYSTEM_RECHECK_S
                before = set(job.agents)
                self._place_system_copies()
                for agent_id in set(job.agents) - before:
                    self._launch(job.agents[agent_id])
                    changed = True
            if changed:
                job.save(self.store)
            if job.job_type in ("batch", "sysbatch") and all(t.status == "completed" for t in job.agents.values()):
                return "completed", f"all {len(job.agents)} agent(s) completed"
            time.sleep(POLL_S)

    def _observe(self, track: AgentTrack) -> bool:
        current = track.current
        if current is None:  # a running agent has been launched: it has a run
            raise RuntimeError(f"agent {track.agent_id} is running but has no run")
        run = self.client.read_flow_run(current.run_id)
        state = run.state
        if state is None or state.type.value == current.state:
            return False
        current.state = state.type.value
        if state.type not in TERMINAL_RUN_STATES:
            return True
        current.ended_at, current.message = time.time(), state.message
        now_ms = int(time.time() * 1000)
        how = f"{state.name}: {state.message}" if state.message else state.name
        decision = after_exit(self.job.job_type, track.restart, track.restarts_ms, now_ms,
                              succeeded=state.type == StateType.COMPLETED, how=how)
        track.reason = decision.reason
        if decision.action == "complete":
            track.status = "completed"
            self.logger.info("agent %s %s", track.agent_id, decision.reason)
        elif decision.action == "restart":
            track.status, track.next_start_at = "restarting", time.time() + decision.delay_ms / 1000
            track.restarts_ms.append(now_ms)
            self.logger.warning("agent %s %s", track.agent_id, decision.reason)
            self._event("agent.restarting", f"{track.agent_id}: {decision.reason}", {"agent_id": track.agent_id})
        else:
            track.status = "failed"
            self.logger.error("agent %s %s", track.agent_id, decision.reason)
            raise JobFailed(f"agent {track.agent_id} {decision.reason}; history: {_history(track)}")
        return True

    def _stop_agents(self, reason: str) -> None:
        for track in self.job.agents.values():
            current = track.current
            if current is None or track.status in ("completed",):
                continue
            try:
                run = self.client.read_flow_run(current.run_id)
            except ObjectNotFound:
                continue
            if run.state is not None and run.state.type not in TERMINAL_RUN_STATES:
                self.client.set_flow_run_state(run.id, Cancelling(message=f"mn: {reason}"), force=True)
                current.state = "CANCELLING"

    # -- node loss and drain -------------------------------------------------------------------------------

    def _resume(self) -> None:
        """A coordinator run re-placed after its node was lost finds its job's record: it keeps the agents'
        restart and reschedule history, stops the runs the lost incarnation left, releases its bookings and
        then places the whole job again (each agent that was on a lost node uses one reschedule attempt)."""
        previous = load_job(self.store, self.job.job_id)
        if previous is None or previous.finished or not previous.agents:
            return
        status = self._node_statuses()
        now_ms = int(time.time() * 1000)
        for track in previous.agents.values():
            reschedules = list(track.reschedules_ms)
            lost = track.node is not None and status.get(track.node) in LOST
            if lost:
                if not track.reschedule.allows(reschedules, now_ms):
                    raise JobFailed(f"agent {track.agent_id}: node {track.node} was lost with the coordinator and "
                                    f"its reschedule attempts are exhausted")
                reschedules.append(now_ms)
            self._carried[track.agent_id] = (list(track.runs), list(track.restarts_ms), reschedules)
            if track.current is not None:
                self._stop_run(track.current.run_id, lost=lost,
                               reason="the job's coordinator was lost; the job is placed again")
        for booking in dict.fromkeys([*previous.bookings, previous.job_id]):
            self.store.release(booking)
        self.job.generation = previous.generation + 1
        self.logger.warning("job %s: coordinator re-placed after node loss (generation %d); placing the whole job "
                            "again", self.job.job_id, self.job.generation)
        self._event("job.resumed", f"generation {self.job.generation}: the whole job is placed again")

    def _node_statuses(self) -> dict[str, str]:
        return {n.record.name: n.record.status for n in self.store.list_nodes()}

    def _watch_nodes(self) -> bool:
        """Agents on a lost node are re-placed (cluster_recover, within the reschedule policy) or paused for
        review; agents on a draining node migrate or wait by the drain rules. True when anything changed."""
        status = self._node_statuses()
        changed = False
        now = time.time()
        for track in list(self.job.agents.values()):
            if track.status in AGENT_FINISHED or track.status == "paused" or track.node is None:
                continue
            if track.status == "blocked" and now < (track.next_start_at or 0):
                continue
            node_status = status.get(track.node)
            if node_status in LOST:
                rule = recovery_rule(self.job.recovery_mode, self.job.job_type, track.node, node_status)
                if rule is None:
                    changed |= self._move(track, f"node {track.node} is {node_status}", lost=True)
                elif rule[0] == "paused":
                    track.status, track.reason = "paused", rule[1]
                    self._pause_run(track, rule[1])
                    changed = True
            elif node_status == "draining":
                changed |= self._drain(track, now)
        return changed

    def _drain(self, track: AgentTrack, now: float) -> bool:
        if track.node is None:
            return False
        drain = active_drain(self.store, track.node)
        if drain is None:
            return False
        config = self.agents[track.source_agent_id].config
        action, why = drain_action(self.job.job_type, self.job.recovery_mode,
                                   safe_to_retry=config.idempotent or config.safe_to_retry,
                                   deadline_passed=now >= drain.deadline)
        if action == "migrate":
            return self._move(track, f"drain of {track.node}: {why}", lost=False)
        if action == "pause" and track.reason != why:
            track.reason = why  # left running, never killed: the operator decides
            self._event("agent.paused", f"{track.agent_id}: {why}", {"agent_id": track.agent_id})
            return True
        return False

    def _move(self, track: AgentTrack, why: str, *, lost: bool) -> bool:
        """Re-place one agent elsewhere. A move off a lost node uses a reschedule attempt; a drain move does
        not. Nothing fits: the agent is blocked and retried with backoff (5 s doubling to 60 s)."""
        now = time.time()
        now_ms = int(now * 1000)
        if lost and not track.reschedule.allows(track.reschedules_ms, now_ms):
            raise JobFailed(f"agent {track.agent_id}: {why}; reschedule attempts exhausted "
                            f"({len(track.reschedules_ms)} used)")
        agent = self.agents[track.source_agent_id]
        ask = replace(ask_for_agent(agent, self.blueprint.constraints, self._job_services), agent_id=track.agent_id)
        booking = f"{self.job.job_id}@m{len(self.job.bookings) + 1}"
        result = place_and_commit(self.store, booking, [ask], job_type=self.job.job_type, strategy=self.job.strategy)
        commit = result.commit
        if commit is None or not commit.ok:  # not result.placed
            track.blocked_backoff_s = min(max(track.blocked_backoff_s * 2, BLOCKED_BACKOFF_S[0]), BLOCKED_BACKOFF_S[1])
            track.status, track.next_start_at = "blocked", now + track.blocked_backoff_s
            track.reason = f"{why}; blocked, nothing fits now (retry in {track.blocked_backoff_s:g} s): {result.plan.reason}"
            self.logger.warning("agent %s %s", track.agent_id, track.reason)
            self._event("agent.blocked", f"{track.agent_id}: {track.reason}", {"agent_id": track.agent_id})
            return True
        placement = commit.placements[0] if commit.placements else result.plan.placements[0]
        old_node, old_booking = track.node, track.booking
        if track.current is not None:
            self._stop_run(track.current.run_id, lost=lost, reason=why)
        delay = 0.0
        if lost:
            track.reschedules_ms.append(now_ms)
            delay = track.reschedule.delay_for(len(track.reschedules_ms)) / 1000
        track.node, track.booking, track.blocked_backoff_s = placement.node, booking, 0.0
        track.status, track.next_start_at = "restarting", now + delay
        track.reason = f"{why}: moved to {placement.node}" + (f", starting in {delay:g} s" if delay else "")
        self.job.bookings.append(booking)
        if old_booking and not any(t.booking == old_booking and t.node == old_node for t in self.job.agents.values()):
            self.store.release(old_booking, node=old_node)
        self.logger.warning("agent %s %s", track.agent_id, track.reason)
        self._event("job.rescheduled" if lost else "job.migrated", f"{track.agent_id}: {track.reason}",
                    {"agent_id": track.agent_id, "from": old_node, "to": placement.node})
        return True

    def _stop_run(self, run_id: str, *, lost: bool, reason: str) -> None:
        """A run on a lost node has no worker left to stop it: mark it crashed. Elsewhere, cancel it (its
        worker stops the process)."""
        try:
            run = self.client.read_flow_run(run_id)
        except ObjectNotFound:
            return
        if run.state is None or run.state.type in TERMINAL_RUN_STATES:
            return
        state: State[Any] = Crashed(message=f"mn: {reason}") if lost else Cancelling(message=f"mn: {reason}")
        self.client.set_flow_run_state(run.id, state, force=True)

    def _pause_run(self, track: AgentTrack, reason: str) -> None:
        if track.current is not None:
            self.client.set_flow_run_state(track.current.run_id, Paused(message=f"mn: {reason}"), force=True)
        self.logger.warning("agent %s %s", track.agent_id, reason)
        self._event("job.paused", f"{track.agent_id}: {reason}", {"agent_id": track.agent_id})

    def _event(self, kind: str, reason: str | None, data: dict | None = None) -> None:
        self.store.record_event(Event(kind=kind, job_id=self.job.job_id, reason=reason, data=data or {}))


def _history(track: AgentTrack) -> str:
    return ", ".join(f"#{r.attempt} {r.state}" + (f" ({r.message})" if r.message else "") for r in track.runs)
