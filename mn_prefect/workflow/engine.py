"""One workflow run as a pure state machine: agents with FIFO mailboxes, message routing, the step ledger,
executor pools, the aggregator sink and the completion rule (docs/bundles.md, "Workflow semantics").

The adapter that places and launches (``mn_prefect.bundles.runner``) drives it:

    engine.start(now)
    while not engine.done:
        for launch in engine.take(now): start it somewhere
        ... when one ends: engine.finish(launch, result, now)
        engine.tick(now)            # retries, synthetic triggers, deadlines, completion

Nothing here sleeps, spawns, books or talks to Prefect: the same inputs give the same decisions.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from mn_prefect.model.scalars import as_string
from mn_prefect.model.states import FINISHED_JOB_STATUSES
from mn_prefect.workflow import routing, step_graph
from mn_prefect.workflow.ledger import AttemptContext, Ledger
from mn_prefect.workflow.manifest import AgentSpec, WorkflowSpec
from mn_prefect.workflow.protocol import BEACON_MISSED, ProcessResult, StepOutput, decode, default_payload

MAX_LAUNCHES = 10_000  # a message loop between agents must end somewhere
RESERVED_ENVELOPE = ("body", "payload", "headers", "type", "class", "envelope", "artifacts", "stream")


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


@dataclass
class Message:
    message_id: str
    source: str
    target: str
    type: str
    body: Any
    cls: str = "event"
    headers: dict[str, Any] = field(default_factory=dict)
    correlation_id: str | None = None
    causation_id: str | None = None
    seq: int = 0
    timestamp: float = 0.0

    def as_json(self, job_id: str) -> dict[str, Any]:
        """The normalised message a worker reads from ``mirror_neuron_message.json`` (docs/bundles.md, "Files")."""
        return {"envelope": {"spec_version": "mn-msg/1", "message_id": self.message_id, "job_id": job_id,
                             "from": self.source, "to": self.target, "type": self.type, "class": self.cls,
                             "timestamp": iso(self.timestamp), "correlation_id": self.correlation_id,
                             "causation_id": self.causation_id, "attempt": 1, "priority": 0,
                             "content_type": "application/json", "content_encoding": "identity"},
                "headers": dict(self.headers), "body": self.body, "artifacts": [], "stream": None}


@dataclass
class StepLaunch:
    """One run of one agent's command on one message: what the adapter places and starts."""

    id: int
    agent: AgentSpec
    message: Message
    step_id: str | None
    context: AttemptContext | None
    timeout_s: float | None
    message_doc: dict[str, Any]
    context_doc: dict[str, Any]
    workflow_env: dict[str, str]
    started_at: float

    @property
    def agent_id(self) -> str:
        return self.agent.node_id

    @property
    def label(self) -> str:
        return self.step_id or self.agent_id


class Engine:
    """The state of one run. ``events`` is the run's event stream, in order."""

    def __init__(self, spec: WorkflowSpec, *, job_id: str, run_id: str, pools: dict[str, int] | None = None,
                 max_launches: int = MAX_LAUNCHES):
        self.spec = spec
        self.job_id = job_id
        self.run_id = run_id
        self.ledger = Ledger(spec, run_id=f"wf-{run_id}")
        self.mailboxes: dict[str, deque[Message]] = {a: deque() for a in spec.agents}
        self.busy: dict[str, StepLaunch] = {}
        self.agent_state: dict[str, Any] = {}
        self.pools = dict(pools or {"default": 50})
        self.pool_use: Counter[str] = Counter()
        self.sinks: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.status = "pending"
        self.result: Any = None
        self.error: dict[str, Any] | None = None
        self.launches_per_step: Counter[str] = Counter()
        # Process runs beyond the first of each launch: the executor's retries in place (docs/bundles.md). Each is a
        # launch of the step's worker, though the ledger sees one attempt; reported in ``launches``.
        self.reruns_per_step: Counter[str] = Counter()
        self.nodes: dict[str, str] = {}
        self._completion: Any = None
        self._seq = itertools.count(1)
        self._launch_ids = itertools.count(1)
        self._ledger_seen = 0
        self._max_launches = max_launches
        self.concurrency = 1 if spec.strategy == "serial" else spec.max_parallel_steps
        self.deferred: list[tuple[float, Message]] = []  # refused by a full mailbox: (when to try again, message)
        # Expanded steps (docs/bundles.md, "Steps expanded from the source format"): each control node's state in
        # its step's current attempt, what each step's upstream steps sent it (kept across attempts), and the run's
        # inputs as the first start node read them.
        self.controls: dict[str, step_graph.ControlState] = {}
        self.upstream_outputs: dict[str, dict[str, Any]] = {}
        self.run_inputs: Any = None

    # -- events -----------------------------------------------------------------------------------------

    def _event(self, kind: str, now: float, **payload: Any) -> None:
        self.events.append({"type": kind, "timestamp": iso(now), "job_id": self.job_id, **payload})

    def _drain_ledger_events(self) -> None:
        for event in self.ledger.events[self._ledger_seen:]:
            self.events.append({**event, "timestamp": iso(event["timestamp"]), "job_id": self.job_id})
        self._ledger_seen = len(self.ledger.events)

    @property
    def done(self) -> bool:
        return self.status in FINISHED_JOB_STATUSES

    # -- start --------------------------------------------------------------------------------------------

    def pool_problems(self) -> list[str]:
        """Executor pools every agent can lease from (an unknown pool or too many slots is an error)."""
        out = []
        for agent in self.spec.agents.values():
            if agent.is_sink or agent.is_step_control:
                continue
            capacity = self.pools.get(agent.pool)
            if capacity is None:
                out.append(f"agent {agent.node_id}: unknown executor pool {agent.pool!r} "
                           f"(pools: {', '.join(f'{k}={v}' for k, v in sorted(self.pools.items()))})")
            elif agent.pool_slots > capacity:
                out.append(f"agent {agent.node_id}: requested {agent.pool_slots} executor slots but pool "
                           f"{agent.pool!r} capacity is {capacity}")
        return out

    def start(self, now: float) -> None:
        """Seed every entrypoint with its initial inputs (docs/bundles.md, "Start")."""
        self.status = "running"
        self._event("job_running", now, blueprint_id=self.spec.blueprint_id, run_id=self.run_id)
        seeds = self.spec.initial_inputs
        for agent_id in self.spec.entrypoints:
            payloads = seeds.get(agent_id) or seeds.get("__entrypoints__") or [{}]
            correlation = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{self.run_id}:{agent_id}:seed"))
            for i, payload in enumerate(payloads):
                body = payload
                if isinstance(payload, dict):
                    body = payload.get("body", payload.get("payload", {k: v for k, v in payload.items()
                                                                          if k not in RESERVED_ENVELOPE}))
                self._deliver(Message(message_id=_digest(self.run_id, "seed", agent_id, str(i)), source="runtime",
                                      target=agent_id, type="init", cls="command", body=body,
                                      correlation_id=correlation), now)
        self.tick(now)

    # -- taking messages --------------------------------------------------------------------------------

    def _deliver(self, message: Message, now: float) -> None:
        if message.target not in self.spec.agents:
            self._event("delivery_dropped", now, to=message.target, message_type=message.type,
                        reason="no such agent")
            return
        step_id = self.ledger.step_for(message.target, message.headers)
        if step_id is not None:
            # A message to an agent that owns a step carries that step and no attempt of the sender (only, inside an
            # expanded step, which attempt sent it).
            message.headers = {k: v for k, v in message.headers.items()
                               if not k.startswith("mn.workflow.") or k == SOURCE_ATTEMPT}
            message.headers["mn.workflow.step_id"] = step_id
            message.headers["mn.workflow.run_id"] = self.ledger.run_id
        depth, retry_ms = backpressure(self.spec.agents[message.target].config)
        if len(self.mailboxes[message.target]) >= depth:
            # Backpressure (docs/bundles.md): a saturated mailbox refuses the delivery; the sender is told and it is
            # tried again.
            self._event("backpressure_signal", now, to=message.target, message_type=message.type,
                        queue_depth=len(self.mailboxes[message.target]), max_queue_depth=depth,
                        retry_after_ms=retry_ms)
            self.deferred.append((now + retry_ms / 1000, message))
            return
        message.seq, message.timestamp = next(self._seq), now
        self.mailboxes[message.target].append(message)

    def _redeliver_deferred(self, now: float) -> None:
        due = [message for at, message in self.deferred if at <= now]
        self.deferred = [(at, message) for at, message in self.deferred if at > now]
        for message in due:
            self._deliver(message, now)

    def take(self, now: float) -> list[StepLaunch]:
        """Messages that can run now, oldest first, within the run's concurrency and the executor pools; sink
        messages are handled here and start nothing."""
        out: list[StepLaunch] = []
        while not self.done and len(self.busy) < self.concurrency:
            candidates = [(box[0].seq, agent_id) for agent_id, box in self.mailboxes.items()
                          if box and agent_id not in self.busy and self._pool_free(self.spec.agents[agent_id])]
            if not candidates:
                break
            _, agent_id = min(candidates)
            message = self.mailboxes[agent_id].popleft()
            agent = self.spec.agents[agent_id]
            if agent.is_sink:
                self._aggregate(agent, message, now)
                continue
            if agent.is_step_control:
                self._control(agent, message, now)
                continue
            launch = self._launch(agent, message, now)
            if launch is not None:
                out.append(launch)
        self._drain_ledger_events()
        return out

    def _pool_free(self, agent: AgentSpec) -> bool:
        if agent.is_sink or agent.is_step_control:
            return True
        return self.pool_use[agent.pool] + agent.pool_slots <= self.pools.get(agent.pool, 0)

    def _launch(self, agent: AgentSpec, message: Message, now: float) -> StepLaunch | None:
        step_id = self.ledger.step_for(agent.node_id, message.headers) if self.ledger.enabled else None
        context = None
        if step_id is not None:
            context = self.ledger.receive(step_id, message.message_id, message, now, agent_id=agent.node_id,
                                          attempt_id=message.headers.get(SOURCE_ATTEMPT))
            if context is None:
                self._drain_ledger_events()
                self.tick(now)
                return None
        if sum(self.launches_per_step.values()) >= self._max_launches:
            self._fail({"agent_id": agent.node_id, "error": f"more than {self._max_launches} launches: "
                                                             f"a message loop?"}, now)
            return None
        headers = dict(message.headers)
        if context is not None and context.attempt is not None:
            headers.update({"mn.workflow.attempt_id": context.attempt_id, "mn.workflow.attempt": context.attempt,
                            "mn.workflow.deadline_at": iso(context.deadline_at),
                            "mn.workflow.heartbeat_deadline_at": iso(context.deadline_at),
                            "mn.workflow.idempotency_key": context.idempotency_key,
                            "mn.workflow.timeout_seconds": context.timeout_seconds})
        if self.ledger.graph_revision:
            headers["mn.workflow.graph_revision"] = self.ledger.graph_revision
        if context is not None and context.template_id:
            headers.update({"mn.workflow.template_id": context.template_id,
                            "mn.workflow.region_id": context.region_id})
        message.headers = headers
        workflow = {k.removeprefix("mn.workflow."): v for k, v in headers.items()
                    if k.startswith("mn.workflow.") and v is not None}
        timeout = agent.timeout_seconds
        if context is not None and context.deadline_at is not None:
            left = max(context.deadline_at - now, 0.001)
            timeout = left if timeout is None else min(timeout, left)
        launch = StepLaunch(
            id=next(self._launch_ids), agent=agent, message=message, step_id=step_id, context=context,
            timeout_s=timeout, message_doc=message.as_json(self.job_id),
            context_doc={"job_id": self.job_id, "agent_id": agent.node_id, "agent_type": agent.agent_type,
                         "template_type": agent.template, "agent_state": copy.deepcopy(self.agent_state.get(
                             agent.node_id, {})), "workflow": workflow, "timestamp": iso(now)},
            workflow_env=_workflow_env(workflow), started_at=now)
        self.busy[agent.node_id] = launch
        self.pool_use[agent.pool] += agent.pool_slots
        self.launches_per_step[launch.label] += 1
        self._event("sandbox_job_started", now, agent_id=agent.node_id, step_id=step_id, launch=launch.id,
                    attempt=context.attempt if context else None, message_id=message.message_id)
        return launch

    # -- results ------------------------------------------------------------------------------------------

    def finish(self, launch: StepLaunch, result: ProcessResult, now: float) -> None:
        """A launch ended: read its output and carry out its actions in MirrorNeuron's order (docs/bundles.md, "One
        launch, in order")."""
        agent = launch.agent
        self.busy.pop(agent.node_id, None)
        self.pool_use[agent.pool] -= agent.pool_slots
        if result.node:
            self.nodes[launch.label] = result.node
        if result.runs > 1:
            self.reruns_per_step[launch.label] += result.runs - 1
        if self.done:
            return
        output = decode(result.stdout) if result.ok else StepOutput()
        if result.ok and output.error is None:
            self._event("sandbox_job_completed", now, agent_id=agent.node_id, step_id=launch.step_id,
                        exit_code=result.exit_code, seconds=round(result.seconds, 3), runs=result.runs,
                        **({"note": output.note} if output.note else {}))
            self._succeeded(launch, result, output, now)
        else:
            reason = output.error or result.error_text()
            if result.stopped == BEACON_MISSED:
                self._event("agent_beacon_missed", now, agent_id=agent.node_id, step_id=launch.step_id)
            self._event("agent_failed", now, agent_id=agent.node_id, step_id=launch.step_id, reason=reason,
                        exit_code=result.exit_code, runs=result.runs)
            if agent.failure_message_type:
                payload = {"agent_id": agent.node_id, "outputs": {"error": reason, "fallback_used": True,
                                                                  "failed_agent_id": agent.node_id},
                           "status": "failed", "artifacts": []}
                self._complete_implicitly(launch, payload, now)
                self._emit(launch, agent.failure_message_type, payload, now)
            else:
                self._attempt_failed(launch, reason, now)
        self._drain_ledger_events()
        self.tick(now)

    def _attempt_failed(self, launch: StepLaunch, reason: str, now: float) -> None:
        if launch.step_id is not None and self.ledger.is_current(launch.step_id, launch.context):
            if self.ledger.fail_attempt(launch.step_id, launch.context, reason, now):
                self._fail(dict(self.ledger.failure or {}), now)
        elif launch.step_id is None:
            self._fail({"agent_id": launch.agent_id, "error": reason}, now)
        # else: a run outside the step's attempt failed; the step is judged by its own attempt

    def _succeeded(self, launch: StepLaunch, result: ProcessResult, output: StepOutput, now: float) -> None:
        agent, step_id, ctx = launch.agent, launch.step_id, launch.context
        if output.has_next_state:
            self.agent_state[agent.node_id] = output.next_state
        routed = default_payload(agent.node_id, result, output, sandbox_name=f"{self.job_id}-{launch.id}",
                                 attempts=result.runs)
        workflow_ctx = ({"step": step_id, "step_id": step_id, "attempt_id": ctx.attempt_id if ctx else None,
                         "attempt": ctx.attempt if ctx else None, "workflow_run_id": self.ledger.run_id}
                        if step_id else {})
        for beacon in output.beacons:
            self._event("agent_beacon", now, agent_id=agent.node_id, payload={**beacon, **workflow_ctx})
        for event in output.events:
            payload = {**event.get("payload", {}), **workflow_ctx}
            self._event(event["type"], now, agent_id=agent.node_id, source="worker", payload=payload)
            self._ledger_event(launch, event["type"], event.get("payload", {}), now)
            if self.done:
                return
        if output.complete_run and step_id is not None:
            self._event("workflow_run_completion_rejected", now, agent_id=agent.node_id, step_id=step_id)
            self._attempt_failed(launch, "complete_run is only valid from a declared terminal sink", now)
            return
        if output.complete_step and step_id is not None:
            value = routed if output.complete_step is True else output.complete_step
            self.ledger.complete(step_id, ctx, value, now)
        self._complete_implicitly(launch, routed, now)
        emit_type = agent.default_emit_type
        if emit_type is not None:
            self._emit(launch, emit_type, routed, now)
        if agent.config.get("terminal_sink") and agent.config.get("complete_run") or (
                output.complete_run and step_id is None):
            self._request_completion({"agent_id": agent.node_id, "output": routed}, now)
        for item in output.emit_messages:
            self._emit_structured(launch, item, now)

    def _complete_implicitly(self, launch: StepLaunch, payload: Any, now: float) -> None:
        """A successful run completes its attempt unless the agent completes steps itself."""
        if (launch.step_id is not None and launch.agent.workflow_complete_step
                and self.ledger.completes(launch.step_id, launch.agent_id)
                and self.ledger.is_current(launch.step_id, launch.context)):
            self.ledger.complete(launch.step_id, launch.context, payload, now)

    def _ledger_event(self, launch: StepLaunch, kind: str, payload: dict[str, Any], now: float) -> None:
        step_id, ctx = launch.step_id, launch.context
        if step_id is None:
            return
        if kind == "workflow_step_failed":
            if self.ledger.is_current(step_id, ctx):
                reason = str(payload.get("reason") or payload.get("error") or "the step reported failure")
                if self.ledger.fail_attempt(step_id, ctx, reason, now):
                    self._fail(dict(self.ledger.failure or {}), now)
        elif kind == "workflow_step_partial":
            self.ledger.partial(step_id, ctx, payload.get("reason"), now)
        elif kind == "workflow_step_completed":
            self.ledger.complete(step_id, ctx, payload, now)
        elif kind == "workflow_step_skipped":
            self.ledger.skip(step_id, str(payload.get("reason") or "skipped by its worker"), now,
                             downstream=bool(payload.get("skip_downstream")))
        elif kind == "workflow_step_branch":
            self.ledger.branch(step_id, payload, now)
        elif kind == "workflow_step_scatter":
            for inst_id, body in self.ledger.scatter(step_id, payload, now):
                inst = self.ledger.steps[inst_id]
                self._deliver(Message(message_id=_digest(launch.message.message_id, inst_id), source=launch.agent_id,
                                      target=inst.spec.agent_id, type="workflow_scatter_item", cls="command",
                                      body=body, headers={"mn.workflow.step_id": inst_id},
                                      correlation_id=launch.message.correlation_id,
                                      causation_id=launch.message.message_id), now)
        elif kind == "workflow_graph_patch":
            self.ledger.patch(step_id, payload, now)

    # -- routing ------------------------------------------------------------------------------------------

    def _scope(self, launch: StepLaunch, payload: Any) -> dict[str, Any]:
        m = launch.message
        state = self.agent_state.get(launch.agent_id, {})
        return {"payload": payload, "message": {"body": m.body, "headers": m.headers, "type": m.type,
                                                "class": m.cls, "from": m.source, "to": m.target},
                "state": state, "agent_state": state}

    def _emit(self, launch: StepLaunch, message_type: str, payload: Any, now: float, *, headers: dict | None = None,
              cls: str = "event") -> None:
        edges = routing.route(self.spec.agent_edges, launch.agent_id, message_type, self._scope(launch, payload))
        self._event("route_evaluated", now, agent_id=launch.agent_id, message_type=message_type,
                    selected=[e.edge_id for e in edges])
        for edge in edges:
            self._send(launch, edge.to_node, message_type, payload, now, headers=headers, cls=cls, key=edge.edge_id)

    def _send(self, launch: StepLaunch, target: str, message_type: str, body: Any, now: float, *,
              headers: dict | None = None, cls: str = "event", key: str = "", correlation: str | None = None) -> None:
        incoming = launch.message
        headers = dict(headers or {})
        ctx = launch.context
        if (launch.step_id is not None and ctx is not None and ctx.attempt_id
                and self.ledger.step_for(target, {}) == launch.step_id):
            headers[SOURCE_ATTEMPT] = ctx.attempt_id  # a message inside an expanded step names its attempt
        self._deliver(Message(message_id=_digest(incoming.message_id, launch.agent_id, target, key, message_type),
                              source=launch.agent_id, target=target, type=message_type, cls=cls, body=body,
                              headers=headers, correlation_id=correlation or incoming.correlation_id,
                              causation_id=incoming.message_id), now)

    def _emit_structured(self, launch: StepLaunch, item: dict[str, Any], now: float) -> None:
        message_type = as_string(item.get("type"), "message")
        body = item.get("body", item.get("payload", {}))
        headers = item.get("headers") if isinstance(item.get("headers"), dict) else None
        cls = as_string(item.get("class"), "event")
        target = item.get("to")
        if isinstance(target, str):
            self._send(launch, target, message_type, body, now, headers=headers, cls=cls,
                       key=f"to:{target}:{len(self.events)}", correlation=item.get("correlation_id"))
        else:
            self._emit(launch, message_type, body, now, headers=headers, cls=cls)

    # -- the control nodes of expanded steps -------------------------------------------------------------

    def _control(self, agent: AgentSpec, message: Message, now: float) -> None:
        """A start, fork, join or end node of an expanded step takes a message (``step_graph``); nothing is
        launched."""
        config, body = agent.config, message.body
        step_id = self.ledger.step_for(agent.node_id, message.headers) if self.ledger.enabled else None
        if agent.agent_type == "step_source" and step_id is not None:
            self._collect_upstreams(step_id, config, message)
        ctx = None
        if step_id is not None:
            ctx = self.ledger.receive(step_id, message.message_id, message, now, agent_id=agent.node_id,
                                      attempt_id=message.headers.get(SOURCE_ATTEMPT))
            self._drain_ledger_events()
            if ctx is None or ctx.attempt is None:  # over, stale, or waiting for its dependencies (kept, redelivered)
                return
        state = self.controls.get(agent.node_id)
        attempt_id = ctx.attempt_id if ctx else None
        if state is None or state.attempt_id != attempt_id:  # each attempt of the step starts afresh
            state = self.controls[agent.node_id] = step_graph.ControlState(attempt_id=attempt_id)
        if agent.agent_type == "step_source":
            outcome = step_graph.source(config, state, self.upstream_outputs.get(step_id or "", {}), body,
                                        self.run_inputs)
            if self.run_inputs is None and state.run_inputs:
                self.run_inputs = state.run_inputs
        elif agent.agent_type == "step_join":
            outcome = step_graph.join(config, state, agent.node_id, message.source, body)
        elif agent.agent_type == "router":
            outcome = step_graph.router(config, message.type, body)
        else:
            outcome = step_graph.sink(config, state, body)
        kind, payload = outcome.event
        self._event(kind, now, **{**payload, "agent_id": agent.node_id, "step_id": step_id,
                                  "attempt": ctx.attempt if ctx else None})
        pseudo = StepLaunch(id=0, agent=agent, message=message, step_id=step_id, context=ctx, timeout_s=None,
                            message_doc={}, context_doc={}, workflow_env={}, started_at=now)
        if outcome.error is not None:
            self._event("agent_failed", now, agent_id=agent.node_id, step_id=step_id, reason=outcome.error)
            self._attempt_failed(pseudo, outcome.error, now)
            self._drain_ledger_events()
            return
        if outcome.complete is not None and step_id is not None and self.ledger.is_current(step_id, ctx):
            self.ledger.complete(step_id, ctx, outcome.complete, now)
        if outcome.emit is not None:
            self._emit(pseudo, outcome.emit[0], outcome.emit[1], now)
        self._drain_ledger_events()

    def _collect_upstreams(self, step_id: str, config: dict[str, Any], message: Message) -> None:
        """What a required upstream step sent this step's start node: its end node's result (``step_id`` and
        ``outputs``), or, for the ledger's synthetic trigger, each parent's output."""
        required = step_graph.required_upstreams(config)
        kept = self.upstream_outputs.setdefault(step_id, {})
        body = message.body
        if message.type == "workflow_trigger" and isinstance(body, dict):
            for parent in body.get("parents") or []:
                if isinstance(parent, dict) and parent.get("step_id") in required:
                    kept.setdefault(str(parent["step_id"]), step_graph.output_payload(parent.get("output") or {}))
        elif isinstance(body, dict) and body.get("step_id") in required:
            kept[str(body["step_id"])] = step_graph.output_payload(body)

    # -- the sink -----------------------------------------------------------------------------------------

    def _aggregate(self, agent: AgentSpec, message: Message, now: float) -> None:
        """The aggregator (docs/bundles.md, "Sink, completion and the result"): collect payloads, de-duplicated by their
        agent_id, then complete."""
        state = self.sinks.setdefault(agent.node_id, {"messages": [], "senders": set()})
        payload = message.body
        sender = payload.get("agent_id") if isinstance(payload, dict) else None
        if sender is not None and sender in state["senders"]:
            self._event("aggregator_duplicate_ignored", now, agent_id=agent.node_id, sender=sender)
            return
        if sender is not None:
            state["senders"].add(sender)
        state["messages"].append(payload)
        count = len(state["messages"])
        self._event("aggregator_received", now, agent_id=agent.node_id, count=count)
        config = agent.config
        after = config.get("complete_after")
        if not (config.get("complete_on_message") or isinstance(after, int) and count >= after):
            return
        result = {"messages": list(state["messages"]), "count": count, "last_message": payload}
        step_id = self.ledger.step_for(agent.node_id, message.headers) if self.ledger.enabled else None
        if step_id is not None and self.ledger.steps[step_id].status == "running":
            self.ledger.complete(step_id, self.ledger.steps[step_id].current, result, now)
        if isinstance(config.get("output_message_type"), str):
            pseudo = StepLaunch(id=0, agent=agent, message=message, step_id=None, context=None, timeout_s=None,
                                message_doc={}, context_doc={}, workflow_env={}, started_at=now)
            self._emit(pseudo, config["output_message_type"], result, now)
        if config.get("terminal_sink") and config.get("complete_run"):
            self._request_completion({"agent_id": agent.node_id, "output": result}, now)

    # -- completion ---------------------------------------------------------------------------------------

    def _request_completion(self, result: Any, now: float) -> None:
        if not self.ledger.enabled or self.ledger.all_succeeded():
            self._complete(result, now)
            return
        if self._completion is None:
            self._event("workflow_completion_deferred", now, open_steps=self.ledger.open_steps())
        self._completion = result

    def _complete(self, result: Any, now: float) -> None:
        self.status = "completed"
        self.result = {**result, "workflow_state": self.ledger.as_json()} if self.ledger.enabled else result
        self._drain_ledger_events()
        self._event("job_completed", now, result_agent=result.get("agent_id") if isinstance(result, dict) else None)

    def _fail(self, error: dict[str, Any], now: float) -> None:
        if self.done:
            return
        self.status = "failed"
        self.error = error
        self.result = error
        self._drain_ledger_events()
        self._event("job_failed", now, **error)

    def cancel(self, now: float, reason: str = "cancelled") -> None:
        if not self.done:
            self.status = "cancelled"
            self.result = {"error": reason}
            self._event("job_cancelled", now, reason=reason)

    def tick(self, now: float) -> None:
        """Everything that happens by itself: due retries, steps that became ready, expired deadlines,
        deferred completion, and what to do when nothing is left to run."""
        if self.done:
            return
        self._redeliver_deferred(now)
        for step_id in self.ledger.expired(now):
            if not any(l.step_id == step_id for l in self.busy.values()):
                step = self.ledger.steps[step_id]
                reason = f"step deadline of {step.spec.timeout_seconds:g} s exceeded"
                self._event("workflow_step_attempt_timed_out", now, step_id=step_id)
                if self.ledger.fail_attempt(step_id, step.current, reason, now):
                    self._fail(dict(self.ledger.failure or {}), now)
                    return
        self._run_due(now, quiescent=False)
        self._drain_ledger_events()
        if self._completion is not None and self.ledger.all_succeeded():
            self._event("workflow_completion_resumed", now)
            self._complete(self._completion, now)
            return
        if self._quiet() and self.ledger.next_timer() is None:
            self._run_due(now, quiescent=True)
            self._drain_ledger_events()
            if self._quiet():
                self._settle(now)

    def _run_due(self, now: float, *, quiescent: bool) -> None:
        for step_id, why in self.ledger.due(now):
            step = self.ledger.steps[step_id]
            if why == "redeliver":
                m = step.last_message
                self._deliver(Message(message_id=_digest(m.message_id, "redeliver", str(step.attempt_count)),
                                      source=m.source, target=step.spec.agent_id, type=m.type, cls=m.cls,
                                      body=m.body, headers={"mn.workflow.step_id": step_id},
                                      correlation_id=m.correlation_id, causation_id=m.causation_id), now)
            elif quiescent or not self._feeders_active(step.spec.agent_id):
                # Nothing will ever message this step: the ledger starts it itself (docs/bundles.md, "The step ledger").
                self.ledger.queue(step_id)
                self._event("workflow_step_triggered", now, step_id=step_id)
                self._deliver(Message(message_id=_digest(self.run_id, "trigger", step_id), source="workflow_ledger",
                                      target=step.spec.agent_id, type="workflow_trigger", cls="command",
                                      body=self.ledger.trigger_body(step), headers={"mn.workflow.step_id": step_id},
                                      correlation_id=f"{self.run_id}:{step_id}"), now)

    def _feeders_active(self, agent_id: str) -> bool:
        """Whether a message can still reach ``agent_id``: it is queued or running, or an agent with an edge to
        it still has work or an unfinished step."""
        if self.mailboxes[agent_id] or agent_id in self.busy or any(m.target == agent_id for _, m in self.deferred):
            return True
        for edge in self.spec.agent_edges:
            if edge.to_node != agent_id:
                continue
            src = edge.from_node
            if self.mailboxes[src] or src in self.busy:
                return True
            step_id = self.ledger.agent_to_step.get(src)
            if step_id is not None and not self.ledger.steps[step_id].terminal:
                return True
        return False

    def _quiet(self) -> bool:
        return not self.busy and not any(self.mailboxes.values()) and not self.deferred

    def _settle(self, now: float) -> None:
        """Nothing runs, nothing is queued, no timer is pending: the run ends here one way or the other."""
        if self.done:
            return
        if not self.ledger.enabled:
            self._complete({"agent_id": None, "output": None, "note": "no agent asked to complete the run"}, now)
            return
        if self.ledger.all_succeeded():
            sink = self.spec.sink
            output = self.ledger.steps[sink].output if sink in self.ledger.steps else None
            self._event("workflow_completed_without_sink", now, sink=sink,
                        reason="every step succeeded but no terminal sink asked to complete the run")
            self._complete({"agent_id": None, "step_id": sink, "output": output}, now)
            return
        stuck = self.ledger.open_steps()
        self._fail({"step_id": stuck[0] if stuck else None,
                    "error": f"the workflow stalled: step(s) {', '.join(stuck)} can never run"}, now)

    def next_timer(self) -> float | None:
        if self.done:
            return None
        timers = [t for t in (self.ledger.next_timer(), *(at for at, _ in self.deferred)) if t is not None]
        return min(timers, default=None)

    # -- reporting ----------------------------------------------------------------------------------------

    def steps_summary(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for step_id, step in self.ledger.steps.items():
            out[step_id] = {"state": step.status, "attempts": step.attempt_count, "node": self.nodes.get(step_id),
                            "launches": self.launches(step_id), "outcome": step.terminal_outcome,
                            **({"reason": step.terminal_reason} if step.terminal_reason else {})}
        if not self.ledger.enabled:
            for agent_id, agent in self.spec.agents.items():
                if not agent.is_sink:
                    out[agent_id] = {"state": "completed" if self.status == "completed" else self.status,
                                     "attempts": self.launches_per_step.get(agent_id, 0),
                                     "node": self.nodes.get(agent_id),
                                     "launches": self.launches(agent_id)}
        return out

    def launches(self, label: str) -> int:
        """How many times the step's (or agent's) worker process was started: one per launch, and one more for
        each retry in place of a launch that ended."""
        return self.launches_per_step.get(label, 0) + self.reruns_per_step.get(label, 0)


SOURCE_ATTEMPT = "mn.workflow.source_attempt_id"
BACKPRESSURE_DEPTH = 100  # MirrorNeuron's default max_queue_depth
BACKPRESSURE_RETRY_MS = 500  # and its first delivery retry delay


def backpressure(config: dict[str, Any]) -> tuple[int, float]:
    """An agent's mailbox limit and how long a refused delivery waits (``config.backpressure``)."""
    raw = config.get("backpressure")
    raw = raw if isinstance(raw, dict) else {}
    depth, retry = raw.get("max_queue_depth"), raw.get("retry_after_ms")
    return (depth if isinstance(depth, int) and depth > 0 else BACKPRESSURE_DEPTH,
            float(retry) if isinstance(retry, int | float) and retry >= 0 else BACKPRESSURE_RETRY_MS)


def _digest(*parts: str) -> str:
    return "msg_" + hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:24]


def _workflow_env(workflow: dict[str, Any]) -> dict[str, str]:
    names = {"run_id": "MN_WORKFLOW_RUN_ID", "step_id": "MN_WORKFLOW_STEP_ID", "attempt_id": "MN_WORKFLOW_ATTEMPT_ID",
             "attempt": "MN_WORKFLOW_ATTEMPT", "deadline_at": "MN_WORKFLOW_DEADLINE_AT",
             "heartbeat_deadline_at": "MN_WORKFLOW_HEARTBEAT_DEADLINE_AT",
             "idempotency_key": "MN_WORKFLOW_IDEMPOTENCY_KEY", "graph_revision": "MN_WORKFLOW_GRAPH_REVISION",
             "template_id": "MN_WORKFLOW_TEMPLATE_ID", "region_id": "MN_WORKFLOW_REGION_ID"}
    return {env: str(workflow[key]) for key, env in names.items() if workflow.get(key) is not None}
