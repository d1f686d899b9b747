"""What the control nodes of a step expanded from MirrorNeuron's source format do (docs/bundles.md, "Steps expanded
from the source format"). Pure: each takes a node's state and one message body and returns the new state and what
happens; the engine delivers, completes and fails.

MirrorNeuron's converter turns a step whose ``run.definition`` is a step graph into ``<step>__start`` (agent type
``step_source``), the graph's agents, joins (``step_join``) for its parallel parts, and ``<step>__end``
(``step_sink``):

- the start node collects the outputs of the steps it ``required_upstreams`` (a message from such a step names it in
  ``step_id``; its output is the message's ``outputs``), waits until it has all of them, resolves its input
  ``fields`` (``{"$ref": "run_input" | "upstream", "path": [...]}``) and sends ``{outputs, artifacts, _mn_step}`` into
  the graph, once per attempt;
- a fork (agent type ``router``) passes the message on as it came, as its ``emit_type`` (else the message's type);
- a join waits for one message from each of its ``expected_sources`` (or the first, ``completion_mode: first``) and
  sends ``{agent_id, outputs: {source: its outputs}, artifacts, _mn_step}`` on (or the one message, ``passthrough``);
- the end node resolves the output ``fields`` from what the graph's last agent sent (``flow_output``), checks the
  output ``schema``, completes the step with ``{step_id, outputs, artifacts, _mn_step}``, and sends that result, as
  the step's emitted message type, to the steps that need it; a second message in the same attempt is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

INITIAL_KEYS = ("kwargs", "body", "payload", "data", "content", "input")


@dataclass
class ControlState:
    """One control node's state within one attempt of its step."""

    attempt_id: str | None = None
    upstream_outputs: dict[str, Any] = field(default_factory=dict)
    run_inputs: Any = None
    artifacts: list[Any] = field(default_factory=list)
    received: dict[str, Any] = field(default_factory=dict)  # a join's messages, by sender
    done: bool = False  # the start node dispatched, the join emitted, the end node completed


@dataclass
class Outcome:
    """What one message to a control node leads to: ``emit`` (a message type and body to route), ``complete`` (the
    step's output, end node), ``error`` (the attempt fails), ``event`` (what to record: type and payload)."""

    event: tuple[str, dict[str, Any]]
    emit: tuple[str, Any] | None = None
    complete: Any = None
    error: str | None = None


def metadata(body: Any) -> dict[str, Any]:
    value = body.get("_mn_step") if isinstance(body, dict) else None
    return value if isinstance(value, dict) else {}


def output_payload(body: Any) -> Any:
    """A step's or agent's output as the next one reads it: its ``outputs`` when it has them, else the whole body."""
    if isinstance(body, dict):
        outputs = body.get("outputs")
        return outputs if isinstance(outputs, dict) else body
    return {}


def initial_input(body: Any) -> Any:
    """The run's inputs as a seed message carries them: the first object under one of MirrorNeuron's envelope keys."""
    if not isinstance(body, dict):
        return {}
    for key in INITIAL_KEYS:
        nested = body.get(key)
        if isinstance(nested, dict):
            return initial_input(nested)
    return body


def artifacts(body: Any) -> list[Any]:
    listed = body.get("artifacts") if isinstance(body, dict) else None
    out: list[Any] = []
    for item in listed if isinstance(listed, list) else []:
        if isinstance(item, dict) and item not in out:
            out.append(item)
    return out


def resolve(value: Any, context: dict[str, Any]) -> Any:
    """A contract's ``fields`` with every reference replaced by what it names (None when the path is missing)."""
    if isinstance(value, dict):
        ref = value.get("$ref")
        if ref == "run_input":
            return _at(context.get("run_inputs"), value.get("path"))
        if ref == "upstream":
            return _at((context.get("upstream_outputs") or {}).get(str(value.get("step_id"))), value.get("path"))
        if ref == "flow_output":
            return _at(context.get("flow_output"), value.get("path"))
        return {str(k): resolve(v, context) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, context) for v in value]
    return value


def _at(value: Any, path: Any) -> Any:
    for part in path if isinstance(path, list) else []:
        value = value.get(str(part)) if isinstance(value, dict) else None
    return value


def schema_problem(value: Any, schema: Any) -> str | None:
    """The one check MirrorNeuron makes of a step contract's ``schema``: an object, with its ``required`` fields."""
    if not isinstance(schema, dict) or not schema:
        return None
    if schema.get("type") == "object" and not isinstance(value, dict):
        return "step contract requires an object"
    required = schema.get("required")
    if isinstance(required, list) and isinstance(value, dict):
        missing = [str(r) for r in required if str(r) not in value]
        if missing:
            return f"step contract is missing required fields: {', '.join(missing)}"
    return None


def fields(config: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    raw = config.get("fields")
    return {str(k): resolve(v, context) for k, v in raw.items()} if isinstance(raw, dict) else {}


def required_upstreams(config: dict[str, Any]) -> list[str]:
    raw = config.get("required_upstreams")
    return [str(s) for s in (raw if isinstance(raw, list) else [raw] if raw is not None else [])]


def expected_sources(config: dict[str, Any]) -> list[str]:
    raw = config.get("expected_sources")
    return [str(s) for s in (raw if isinstance(raw, list) else [raw] if raw is not None else [])]


def source(config: dict[str, Any], state: ControlState, upstream_outputs: dict[str, Any], body: Any,
           run_inputs: Any) -> Outcome:
    """The start node takes a message. ``upstream_outputs``: what the step's required upstream steps sent so far
    (the engine keeps them across attempts); ``run_inputs``: the run's inputs once a start node read them."""
    step_id = config.get("step_id")
    required = required_upstreams(config)
    if state.done:
        return Outcome(("step_source_already_dispatched", {"step_id": step_id}))
    if state.run_inputs is None:
        state.run_inputs = run_inputs if run_inputs is not None else metadata(body).get("run_inputs")
        if state.run_inputs is None:
            state.run_inputs = initial_input(body) if not required else {}
    for item in artifacts(body):
        if item not in state.artifacts:
            state.artifacts.append(item)
    state.upstream_outputs = {s: upstream_outputs[s] for s in required if s in upstream_outputs}
    waiting = [s for s in required if s not in state.upstream_outputs]
    if waiting:
        return Outcome(("step_source_waiting", {"step_id": step_id, "waiting_for": waiting,
                                                "received_upstream_count": len(state.upstream_outputs)}))
    outputs = fields(config, {"run_inputs": state.run_inputs or {}, "upstream_outputs": state.upstream_outputs})
    problem = schema_problem(outputs, config.get("schema"))
    if problem:
        return Outcome(("step_source_rejected", {"step_id": step_id, "reason": problem}), error=problem)
    state.done = True
    result = {"outputs": outputs, "artifacts": list(state.artifacts),
              "_mn_step": {"step_id": step_id, "attempt_id": state.attempt_id, "upstream_steps": required}}
    return Outcome(("step_source_dispatched", {"step_id": step_id, "received_upstream_count": len(required)}),
                   emit=(str(config.get("output_message_type")), result))


def join(config: dict[str, Any], state: ControlState, node_id: str, sender: str, body: Any) -> Outcome:
    """A join inside an expanded step takes a message from ``sender``."""
    expected = expected_sources(config)
    if config.get("fail_on_message") is True:
        reason = str(config.get("failure_reason") or "step guard failed")
        return Outcome(("step_join_failed", {"reason": reason}), error=reason)
    if state.done or sender in state.received:
        return Outcome(("step_join_duplicate_ignored", {"sender": sender}))
    state.received[sender] = body
    first = config.get("completion_mode") == "first"
    if not (state.received if first else all(s in state.received for s in expected)):
        return Outcome(("step_join_waiting", {"expected_count": 1 if first else len(expected),
                                              "received_count": len(state.received)}))
    state.done = True
    if config.get("passthrough") is True:
        result = next(iter(state.received.values()))
    else:
        raw_keys = config.get("output_keys")
        keys: dict[str, Any] = raw_keys if isinstance(raw_keys, dict) else {}
        named = [s for s in expected if s in state.received] or list(state.received)
        found = [artifacts(state.received[s]) for s in named]
        result = {"agent_id": node_id,
                  "outputs": {str(keys.get(s, s)): output_payload(state.received[s]) for s in named},
                  "artifacts": [a for i, group in enumerate(found) for a in group
                                if a not in [b for g in found[:i] for b in g]],
                  "_mn_step": next((m for s in named if (m := _reference(state.received[s]))), {})}
    return Outcome(("step_join_completed", {"received_count": len(state.received)}),
                   emit=(str(config.get("output_message_type")), result))


def router(config: dict[str, Any], message_type: str, body: Any) -> Outcome:
    emit_type = config.get("emit_type")
    return Outcome(("router_forwarded", {"message_type": emit_type or message_type}),
                   emit=(str(emit_type) if isinstance(emit_type, str) else message_type, body))


def sink(config: dict[str, Any], state: ControlState, body: Any) -> Outcome:
    """The end node takes what the step's graph produced."""
    step_id = config.get("step_id")
    if state.done:
        return Outcome(("step_sink_duplicate_ignored", {"step_id": step_id, "completed": True}))
    outputs = fields(config, {"flow_output": output_payload(body)})
    problem = schema_problem(outputs, config.get("schema"))
    if problem:
        return Outcome(("step_sink_rejected", {"step_id": step_id, "reason": problem}), error=problem)
    state.done = True
    result = {"step_id": step_id, "outputs": outputs, "artifacts": artifacts(body), "_mn_step": _reference(body)}
    return Outcome(("step_sink_completed", {"step_id": step_id, "completed": True}),
                   emit=(str(config.get("output_message_type")), result), complete=result)


def _reference(body: Any) -> dict[str, Any]:
    return {k: v for k, v in metadata(body).items() if k not in ("run_inputs", "step_input")}
