"""One blueprint job's supervision as a pure state machine (docs/blueprints.md, docs/operating.md): what to book and
when, which agents are due to start, what an agent's ended run means, what a lost or draining node does to each agent,
when the job is done, and how a job carries on after its coordinator was re-placed.

The coordinator flow (``mn_prefect.jobs.coordinator``) drives it and carries out its ``Effects``:

    machine = JobMachine(blueprint, job)                 # job: the job's record, updated in place
    do(machine.begin(previous record, node statuses, now))
    loop:
        do(machine.node_actions(node statuses, drain deadlines, now))   # every few seconds
        do(machine.placing(now))
        for launch in machine.due(now): start it; machine.launched(launch, run_id, now)
        for agent_id, run_id in machine.running().items(): machine.observed(agent_id, state, ...)
        machine.done()                                    # the job's end, or None
    where do(effects) stops, pauses and releases as told, books each ``Book`` and hands the result back
    (do(machine.booked(book, committed, plan, now))), then raises ``effects.failure`` when set.

Nothing here books, sleeps, reads the clock or talks to Prefect: times come in as ``now`` (seconds since the
epoch), so the same inputs give the same decisions. What happened is kept as ``Note``s to log and record.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from mn_prefect.jobs.supervision import RUN_TO_COMPLETION, after_exit
from mn_prefect.model.blueprint import Blueprint
from mn_prefect.model.blueprint_job import AgentRun, AgentTrack, BlueprintJob
from mn_prefect.model.bookings import SystemCopy
from mn_prefect.model.node_status import LOST
from mn_prefect.model.placement import Placement, Plan
from mn_prefect.model.recovery import drain_action, recovery_rule
from mn_prefect.model.states import FINISHED_AGENT_STATUSES, TERMINAL_RUN_STATES, RunState
from mn_prefect.scheduler.ask import Ask, asks_for_blueprint
from mn_prefect.scheduler.plan import SYSTEM_JOB_TYPES

WAIT_BACKOFF_S = (1.0, 5.0)
BLOCKED_BACKOFF_S = (5.0, 60.0)
SYSTEM_RECHECK_S = 5.0  # how often a system job looks for nodes that have no copy yet


class JobFailed(RuntimeError):
    """The job failed: an agent ran out of restarts or reschedules (the message says which, and why)."""


class JobNotRunnable(RuntimeError):
    """No node can ever take the job (the message carries the scheduler's reasons)."""


def backoff(previous_s: float, bounds: tuple[float, float]) -> float:
    """The next wait in seconds: double the previous one, within ``bounds`` (the first wait is the lower)."""
    low, high = bounds
    return min(max(previous_s * 2, low), high)


def ending(error: BaseException, *, cancelling: bool) -> tuple[str, str]:
    """How the job ends when ``error`` stopped its coordinator: (status, reason). ``cancelling``: the
    coordinator's own run is being cancelled."""
    if isinstance(error, (JobFailed, JobNotRunnable)):
        return "failed", str(error)
    if cancelling or not isinstance(error, Exception):
        return "cancelled", "the job was cancelled"
    return "failed", f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class Note:
    """Something to tell: ``log`` at ``level`` (None: nothing to log) and, with a ``kind``, an event."""

    log: str | None
    level: int = logging.WARNING
    kind: str | None = None
    reason: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Stop:
    """A run to stop. ``lost``: its node is gone and no worker is left to stop it, so it is marked crashed;
    otherwise it is cancelled and its worker stops the process."""

    run: AgentRun
    lost: bool
    reason: str


@dataclass(frozen=True)
class Move:
    """An agent to book elsewhere; ``lost``: its node was lost, which uses a reschedule attempt (a drain move
    does not)."""

    agent_id: str
    reason: str
    lost: bool


@dataclass(frozen=True)
class Book:
    """Asks to book in the store under ``booking``: the whole job, one agent that moves (``move``), or with
    ``copies`` a system job's group, planned once and committed per node (``JobMachine.copies``)."""

    booking: str
    asks: list[Ask]
    explain: bool = False
    copies: bool = False
    move: Move | None = None


@dataclass(frozen=True)
class Effects:
    """What the coordinator is to do, in this order: stop runs, pause runs (run id, reason), release bookings
    (on one node, or everywhere with None), make bookings (handing each result back to ``booked``), then raise
    ``failure`` when set."""

    stops: list[Stop] = field(default_factory=list)
    pauses: list[tuple[str, str]] = field(default_factory=list)
    releases: list[tuple[str, str | None]] = field(default_factory=list)
    books: list[Book] = field(default_factory=list)
    failure: JobFailed | JobNotRunnable | None = None


@dataclass(frozen=True)
class AgentLaunch:
    """A run to start for one agent: the ``mn-agent`` flow run's name, parameters and job variables (which pin
    it to the agent's booking)."""

    agent_id: str
    name: str
    parameters: dict[str, Any]
    job_variables: dict[str, Any]


@dataclass(frozen=True)
class Exit:
    """An agent's run ended: it is ``complete``, ``restart``s at ``start_at``, or ``fail``s the job."""

    agent_id: str
    action: Literal["complete", "restart", "fail"]
    reason: str
    start_at: float | None = None


@dataclass(frozen=True)
class History:
    """What an agent's earlier incarnation leaves to the next one: its attempts keep counting."""

    runs: list[AgentRun]
    restarts_ms: list[int]
    reschedules_ms: list[int]


@dataclass(frozen=True)
class Done:
    status: Literal["completed"]
    reason: str


class JobMachine:
    """The supervision of one job. ``job`` is its record: the machine updates it, the coordinator saves it."""

    def __init__(self, blueprint: Blueprint, job: BlueprintJob):
        self.job = job
        self.asks = asks_for_blueprint(blueprint)
        self._system = job.job_type in SYSTEM_JOB_TYPES
        self._agents = {a.agent_id: a for a in blueprint.agents}
        self._asks = {a.agent_id: a for a in self.asks}
        self._carried: dict[str, History] = {}
        self._notes: list[Note] = []
        self._next_placing = 0.0
        self._wait_s = 0.0
        self._moves = 0

    def take_notes(self) -> list[Note]:
        """What happened since the last call, oldest first."""
        notes, self._notes = self._notes, []
        return notes

    def _note(self, log: str | None, level: int = logging.WARNING, kind: str | None = None, reason: str | None = None,
              data: dict[str, Any] | None = None) -> None:
        self._notes.append(Note(log, level, kind, reason, data or {}))

    def _agent_note(self, track: AgentTrack, level: int = logging.WARNING, kind: str | None = None,
                    data: dict[str, Any] | None = None) -> None:
        self._note(f"agent {track.agent_id} {track.reason}", level, kind, f"{track.agent_id}: {track.reason}",
                   {"agent_id": track.agent_id, **(data or {})})

    # -- starting and placing -------------------------------------------------------------------------

    def begin(self, previous: BlueprintJob | None, node_status: Mapping[str, str], now: float) -> Effects:
        """Start the job. When ``previous`` (this job's record) is unfinished, its coordinator was lost with its
        node: every agent keeps its restart and reschedule history, each one that was on a lost node uses a
        reschedule attempt, every run left is stopped and every booking released, and the whole job is placed
        again."""
        job = self.job
        if previous is None or previous.finished or not previous.agents:
            self._note(None, kind="job.submitted", reason=self._submitted())
            return Effects()
        now_ms = int(now * 1000)
        stops, failure = [], None
        for track in previous.agents.values():
            reschedules = list(track.reschedules_ms)
            lost = track.node is not None and node_status.get(track.node) in LOST
            if lost:
                if not track.reschedule.allows(reschedules, now_ms) and failure is None:
                    failure = JobFailed(f"agent {track.agent_id}: node {track.node} was lost with the coordinator "
                                        "and its reschedule attempts are exhausted")
                reschedules.append(now_ms)
            self._carried[track.agent_id] = History(list(track.runs), list(track.restarts_ms), reschedules)
            if track.current is not None:
                stops.append(Stop(track.current, lost, "the job's coordinator was lost; the job is placed again"))
        releases: list[tuple[str, str | None]] = [(b, None) for b in dict.fromkeys([*previous.bookings, previous.job_id])]
        if failure is None:
            job.generation = previous.generation + 1
            self._note(f"job {job.job_id}: coordinator re-placed after node loss (generation {job.generation}); "
                       "placing the whole job again", kind="job.resumed",
                       reason=f"generation {job.generation}: the whole job is placed again")
            self._note(None, kind="job.submitted", reason=self._submitted())
        return Effects(stops=stops, releases=releases, failure=failure)

    def _submitted(self) -> str:
        return f"{len(self._agents)} agent(s), {self.job.job_type}, pool {self.job.pool}"

    def placing(self, now: float) -> Effects:
        """Book the whole job (gang: every agent or none) until it is placed, and a system job's copies on
        nodes that have none, every few seconds for as long as it runs."""
        if now < self._next_placing or (self.job.agents and self.job.job_type != "system"):
            return Effects()
        return Effects(books=[Book(self.job.job_id, self.asks, explain=True, copies=self._system)])

    def copies(self, plan: Plan) -> dict[str, list[Placement]]:
        """A system job's new copies of the agent group, by booking id (``<job>@<node>``): one per node of
        ``plan`` that has no copy yet, so a node that joins later gets its copy too."""
        covered = self.covered_nodes()
        out: dict[str, list[Placement]] = {}
        for placement in plan.placements:
            if placement.node not in covered:
                booking = str(SystemCopy(self.job.job_id, placement.node))
                out.setdefault(booking, []).append(placement.model_copy(update={"job_id": booking}))
        return dict(sorted(out.items()))

    def covered_nodes(self) -> set[str]:
        """Nodes that have their copy of a system job's group: a live one, or for sysbatch (one run per node)
        any, finished too."""
        return {t.node for t in self.job.agents.values()
                if t.node is not None and (t.status not in FINISHED_AGENT_STATUSES or self.job.job_type == "sysbatch")}

    def booked(self, book: Book, committed: Mapping[str, list[Placement]], plan: Plan, now: float) -> Effects:
        """``book`` was planned (``plan``) and ``committed`` (booking id -> placements; empty when nothing fits
        now). A job that could not be placed waits, 1 s doubling to 5 s between tries, and is refused when no
        node could ever take it."""
        if book.move is not None:
            placements = [p for placed in committed.values() for p in placed]
            if not placements:
                return self._blocked(book.move, str(plan.reason), now)
            return self._moved(book.move, placements[0].node, book.booking, now)
        for booking, placements in committed.items():
            self._track(booking, placements, plan)
        job = self.job
        if job.agents:
            self._next_placing = now + SYSTEM_RECHECK_S
            return Effects()
        job.plan = plan.as_json()
        if plan.status == "not_runnable":
            return Effects(failure=JobNotRunnable(f"no node can ever take this job: {plan.reason}"))
        if (job.status, job.reason) != ("waiting", plan.reason):
            job.status, job.reason = "waiting", plan.reason
            self._note(f"job {job.job_id} waiting to be placed: {plan.reason}", kind="job.waiting", reason=plan.reason)
        self._wait_s = backoff(self._wait_s, WAIT_BACKOFF_S)
        self._next_placing = now + self._wait_s
        return Effects()

    def _track(self, booking: str, placements: list[Placement], plan: Plan) -> None:
        """Each agent of ``placements`` is tracked under ``booking``, keeping the history a resumed job carried."""
        job = self.job
        job.plan = plan.as_json()
        job.bookings.append(booking)
        for placement in placements:
            agent = self._agents[placement.source_agent_id or placement.agent_id]
            track = AgentTrack(agent_id=placement.agent_id, source_agent_id=agent.agent_id, node=placement.node,
                               booking=booking, restart=agent.restart, reschedule=agent.reschedule)
            earlier = self._carried.get(placement.agent_id)
            if earlier is not None:
                track.runs, track.restarts_ms, track.reschedules_ms = (earlier.runs, earlier.restarts_ms,
                                                                       earlier.reschedules_ms)
            job.agents[placement.agent_id] = track
            ports = ",".join(f"{p.label}={p.port}" for p in placement.allocation.ports)
            self._note(f"agent {placement.agent_id} placed on {placement.node} (devices "
                       f"{','.join(placement.device_ids) or '-'}, ports {ports or '-'})", logging.INFO)
        self._note(None, kind="job.placed", reason=f"{len(placements)} agent(s) booked under {booking}",
                   data={"placements": [p.model_dump(mode="json", exclude={"env"}) for p in placements]})

    def due(self, now: float) -> list[AgentLaunch]:
        """Runs to start now: for agents placed and never started, and for agents restarting whose start time
        has come."""
        return [self._launch(t) for t in self.job.agents.values()
                if t.status == "pending" or (t.status == "restarting" and now >= (t.next_start_at or 0))]

    def _launch(self, track: AgentTrack) -> AgentLaunch:
        agent = self._agents[track.source_agent_id]
        config = agent.config
        attempt = track.next_attempt
        return AgentLaunch(
            track.agent_id, f"{self.job.job_id}.{track.agent_id}.{attempt}",
            {"job_id": self.job.job_id, "agent_id": track.agent_id, "command": list(config.command or ()),
             "environment": dict(config.environment), "pass_env": list(config.pass_env),
             "workdir": config.workdir, "timeout_seconds": config.timeout_seconds, "attempt": attempt},
            {"booking": {"job_id": track.booking, "agent_id": track.agent_id},
             **({"image": config.image} if config.image else {}),
             **({"health": agent.health.model_dump(exclude_none=True)} if agent.health else {})})

    def launched(self, launch: AgentLaunch, run_id: str, now: float) -> None:
        """``launch`` started as ``run_id``; with the job's first run, the job is running."""
        job = self.job
        track = job.agents[launch.agent_id]
        attempt = track.next_attempt
        track.runs.append(AgentRun(run_id=run_id, attempt=attempt, started_at=now))
        track.status, track.next_start_at = "running", None
        if job.status != "running":
            job.status, job.reason = "running", f"{len(job.agents)} agent(s) started"
        self._note(f"agent {track.agent_id} attempt {attempt} started as run {run_id} on {track.node}", logging.INFO)

    # -- runs ending ----------------------------------------------------------------------------------

    def running(self) -> dict[str, str]:
        """Agent id -> the run to watch, for every running agent."""
        return {t.agent_id: t.current.run_id for t in self.job.agents.values() if t.status == "running" and t.current}

    def observed(self, agent_id: str, state: RunState, name: str, message: str | None, now: float) -> Exit | None:
        """The agent's run is in ``state`` (``name`` and ``message`` as Prefect gives them): once it has ended,
        the agent completes, restarts within its restart policy, or fails the job."""
        track = self.job.agents[agent_id]
        current = track.current
        if current is None:
            raise ValueError(f"agent {agent_id} has no run to observe")
        current.state = state
        if state not in TERMINAL_RUN_STATES:
            return None
        current.ended_at, current.message = now, message
        now_ms = int(now * 1000)
        decision = after_exit(self.job.job_type, track.restart, track.restarts_ms, now_ms,
                              succeeded=state == "COMPLETED", how=f"{name}: {message}" if message else name)
        track.reason = decision.reason
        if decision.action == "complete":
            track.status = "completed"
            self._agent_note(track, logging.INFO)
            return Exit(agent_id, "complete", decision.reason)
        if decision.action == "restart":
            track.status, track.next_start_at = "restarting", now + decision.delay_ms / 1000
            track.restarts_ms.append(now_ms)
            self._agent_note(track, kind="agent.restarting")
            return Exit(agent_id, "restart", decision.reason, track.next_start_at)
        track.status = "failed"
        self._agent_note(track, logging.ERROR)
        return Exit(agent_id, "fail", f"agent {agent_id} {decision.reason}; history: {_history(track)}")

    def done(self) -> Done | None:
        """Batch and sysbatch jobs complete when every agent has; service and system jobs run until cancelled."""
        agents = self.job.agents
        if self.job.job_type in RUN_TO_COMPLETION and agents and all(t.status == "completed" for t in agents.values()):
            return Done("completed", f"all {len(agents)} agent(s) completed")
        return None

    def stops(self, reason: str) -> list[Stop]:
        """The runs to cancel when the job ends: every agent's latest, unless it completed."""
        return [Stop(t.current, False, reason) for t in self.job.agents.values()
                if t.current is not None and t.status != "completed"]

    # -- node loss and drain --------------------------------------------------------------------------

    def node_actions(self, node_status: Mapping[str, str], drain_deadlines: Mapping[str, float],
                     now: float) -> Effects:
        """Agents on a lost node move (within their reschedule policy) or pause for review; agents on a
        draining node (``drain_deadlines``: node -> deadline, epoch seconds) migrate or wait by the drain rules.
        A blocked agent is looked at again once its backoff is over."""
        moves: list[Move] = []
        pauses: list[tuple[str, str]] = []
        for track in self.job.agents.values():
            if track.status in FINISHED_AGENT_STATUSES or track.status == "paused" or track.node is None:
                continue
            if track.status == "blocked" and now < (track.next_start_at or 0):
                continue
            node, status = track.node, node_status.get(track.node)
            if status in LOST:
                rule = recovery_rule(self.job.recovery_mode, self.job.job_type, node, status)
                if rule is None:
                    why = f"node {node} is {status}"
                    if not track.reschedule.allows(track.reschedules_ms, int(now * 1000)):
                        return Effects(failure=JobFailed(f"agent {track.agent_id}: {why}; reschedule attempts "
                                                         f"exhausted ({len(track.reschedules_ms)} used)"))
                    moves.append(Move(track.agent_id, why, lost=True))
                elif rule[0] == "paused":
                    track.status, track.reason = "paused", rule[1]
                    self._agent_note(track, kind="job.paused")
                    if track.current is not None:
                        pauses.append((track.current.run_id, rule[1]))
            elif status == "draining" and node in drain_deadlines:
                config = self._agents[track.source_agent_id].config
                action, why = drain_action(self.job.job_type, self.job.recovery_mode,
                                           safe_to_retry=config.idempotent or config.safe_to_retry,
                                           deadline_passed=now >= drain_deadlines[node])
                if action == "migrate":
                    moves.append(Move(track.agent_id, f"drain of {node}: {why}", lost=False))
                elif action == "pause" and track.reason != why:
                    track.reason = why  # left running, never killed: the operator decides
                    self._agent_note(track, kind="agent.paused")
            elif track.status == "blocked":
                self._unblocked(track, node, status)
        return Effects(pauses=pauses, books=[self._book_move(move) for move in moves])

    def _book_move(self, move: Move) -> Book:
        track = self.job.agents[move.agent_id]
        self._moves += 1  # every try its own booking id, so moves decided together never share one
        ask = replace(self._asks[track.source_agent_id], agent_id=track.agent_id)
        return Book(f"{self.job.job_id}@m{self._moves}", [ask], move=move)

    def _moved(self, move: Move, node: str, booking: str, now: float) -> Effects:
        """The agent was booked on ``node``: its old run is stopped and its old booking released there, and it
        starts on ``node`` (after the reschedule policy's delay when its node was lost)."""
        track = self.job.agents[move.agent_id]
        old_node, old_booking = track.node, track.booking
        stops = [Stop(track.current, move.lost, move.reason)] if track.current is not None else []
        delay = 0.0
        if move.lost:
            track.reschedules_ms.append(int(now * 1000))
            delay = track.reschedule.delay_for(len(track.reschedules_ms)) / 1000
        track.node, track.booking, track.blocked_backoff_s = node, booking, 0.0
        track.status, track.next_start_at = "restarting", now + delay
        track.reason = f"{move.reason}: moved to {node}" + (f", starting in {delay:g} s" if delay else "")
        self.job.bookings.append(booking)
        shared = any(t.booking == old_booking and t.node == old_node for t in self.job.agents.values())
        self._agent_note(track, kind="job.rescheduled" if move.lost else "job.migrated",
                         data={"from": old_node, "to": node})
        return Effects(stops=stops, releases=[] if shared or old_booking is None else [(old_booking, old_node)])

    def _unblocked(self, track: AgentTrack, node: str, status: str | None) -> None:
        """The node of a blocked agent is neither lost nor draining any more: its run was never stopped (a move
        stops it only once it is booked elsewhere), so the agent stays there and is watched again; one whose
        run had ended waits for its restart."""
        ended = track.current is None or track.current.state in TERMINAL_RUN_STATES
        track.status = "restarting" if ended else "running"
        track.blocked_backoff_s = 0.0
        track.reason = f"node {node} is {status or 'gone from the store'} again: {track.agent_id} stays there"
        self._agent_note(track, kind="agent.unblocked")

    def _blocked(self, move: Move, why_not: str, now: float) -> Effects:
        """Nothing can take the agent now (``why_not``, the scheduler's reason): it is looked at again after a
        backoff of 5 s doubling to 60 s."""
        track = self.job.agents[move.agent_id]
        track.blocked_backoff_s = backoff(track.blocked_backoff_s, BLOCKED_BACKOFF_S)
        track.status, track.next_start_at = "blocked", now + track.blocked_backoff_s
        track.reason = (f"{move.reason}; blocked, nothing fits now (retry in {track.blocked_backoff_s:g} s): "
                        f"{why_not}")
        self._agent_note(track, kind="agent.blocked")
        return Effects()


def _history(track: AgentTrack) -> str:
    return ", ".join(f"#{r.attempt} {r.state}" + (f" ({r.message})" if r.message else "") for r in track.runs)
