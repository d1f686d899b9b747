"""A step that waits for a person: its request in the run store, the flow run Paused in Prefect with a form.

MirrorNeuron's human-control gate is a file: a step appends ``human_input_requested`` (``payload.request_id``,
``prompt``, ``allowed_decisions``) to ``<run dir>/human.jsonl`` and waits until a ``human_input_received`` with the
same request id follows (``mn blueprint human respond RUN REQUEST --decision approve`` writes one), or writes
``human_input_timeout`` itself and goes on as its own policy says.

While a bundle run runs, ``HumanGate`` watches that file. For each request it pauses the run's flow run in Prefect
(the process keeps running) with a typed input, ``HumanDecision``: the Prefect UI shows the prompt and a Resume form
(decision approve or reject, notes, reviewer). Whoever answers first wins:

- Resume in the UI (or ``prefect``'s API with the input): the gate writes the answer to the file as
  ``human_input_received``, and the step reads it;
- ``mn-prefect blueprint human respond`` or ``mn blueprint human respond``: the answer is in the file; the gate
  resumes the flow run;
- the step gives up (``human_input_timeout``) or the run ends: the gate resumes the flow run without an answer.

One pause at a time (a flow run has one state): further requests wait their turn.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from prefect.input import RunInput

HUMAN_FILE = "human.jsonl"
REQUESTED, RECEIVED, TIMED_OUT = "human_input_requested", "human_input_received", "human_input_timeout"
POLL_S = 0.3
# Prefect fails a run whose pause times out: the gate ends every pause itself, so this is only a backstop for a
# runner that died while paused.
PAUSE_TIMEOUT_S = 7 * 24 * 3600


class HumanDecision(RunInput):
    """What a person answers to a step's request (the Prefect UI's Resume form)."""

    decision: Literal["approve", "reject"] = "approve"
    notes: str = ""
    reviewer: str = "prefect-ui"


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / HUMAN_FILE
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("payload"), dict):
            events.append(event)
    return events


def requests(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every request by id, with its ``status``: pending, answered (``answer``: the received payload) or timed_out."""
    found: dict[str, dict[str, Any]] = {}
    for event in events:
        payload = event["payload"]
        request_id = str(payload.get("request_id") or "")
        if not request_id:
            continue
        if event.get("type") == REQUESTED and request_id not in found:
            found[request_id] = {**event, "status": "pending"}
        elif event.get("type") == RECEIVED and request_id in found:
            found[request_id].update(status="answered", answer=payload)
        elif event.get("type") == TIMED_OUT and request_id in found and found[request_id]["status"] == "pending":
            found[request_id]["status"] = "timed_out"
    return found


def record_response(run_dir: Path, request_id: str, decision: str, *, notes: str = "", reviewer: str = "mn-prefect",
                    via: str = "mn-prefect") -> dict[str, Any]:
    """Append the answer to a pending request (ValueError naming the field when there is none to answer)."""
    found = requests(read_events(run_dir))
    request = found.get(request_id)
    if request is None:
        raise ValueError(f"REQUEST_ID: run {run_dir.name} has no human request {request_id!r}"
                         + (f" (requests: {', '.join(found)})" if found else ""))
    if request["status"] != "pending":
        raise ValueError(f"REQUEST_ID: request {request_id!r} is {request['status'].replace('_', ' ')} already")
    allowed = request["payload"].get("allowed_decisions") or ["approve", "reject"]
    if decision not in allowed:
        raise ValueError(f"--decision: {decision!r} is not one of {', '.join(allowed)}")
    event = {"ts": _now(), "run_id": request.get("run_id") or run_dir.name, "channel": "human", "type": RECEIVED,
             "trace_id": request.get("trace_id"), "span_id": "spn_" + uuid.uuid4().hex[:16],
             "payload": {"request_id": request_id, "decision": decision, "approved": decision == "approve",
                         "notes": notes, "reviewer": reviewer, "via": via, "status": "answered"}}
    encoded = json.dumps(event, sort_keys=True) + "\n"
    for name in (HUMAN_FILE, "events.jsonl"):
        with (run_dir / name).open("a", encoding="utf-8") as handle:
            handle.write(encoded)
    return event


class HumanGate:
    """Watches ``run_dir``'s requests for the life of a bundle run and mirrors them onto its flow run (see the
    module's note). ``client``: a factory of Prefect sync clients."""

    def __init__(self, run_dir: Path, flow_run_id: str, client: Callable[[], Any], logger: logging.Logger | Any):
        self.run_dir, self.flow_run_id, self._client, self.log = run_dir, flow_run_id, client, logger
        self._stop = threading.Event()
        self._paused_for: str | None = None  # the request the flow run is paused for now
        self._keyset: Any = None  # prefect's Keyset of the pause's input
        self._thread = threading.Thread(target=self._loop, name="mn-human-gate", daemon=True)

    def start(self) -> HumanGate:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if self._paused_for is not None:  # the run is ending: it must not stay Paused
            self._resume(f"the run ended before request {self._paused_for} was answered")

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.step()
            except Exception as error:  # the gate must never take the run down
                self.log.warning("human gate: %s: %s", type(error).__name__, error)

    def step(self) -> None:
        found = requests(read_events(self.run_dir))
        if self._paused_for is not None:
            request = found.get(self._paused_for)
            if request is None or request["status"] != "pending":
                self._resume(f"request {self._paused_for} was {request['status'] if request else 'withdrawn'}")
            else:
                self._collect(request)
            return
        pending = [r for r in found.values() if r["status"] == "pending"]
        if pending:
            self._pause(pending[0])

    def _pause(self, request: dict[str, Any]) -> None:
        from prefect.input.run_input import keyset_from_paused_state
        from prefect.states import Paused

        request_id = request["payload"]["request_id"]
        prompt = str(request["payload"].get("prompt") or f"human request {request_id}")
        state: Any = Paused(timeout_seconds=PAUSE_TIMEOUT_S, reschedule=False, pause_key=f"mn-human-{request_id}")
        keyset = keyset_from_paused_state(state)
        state.state_details.run_input_keyset = keyset
        # The form first: whoever sees the run Paused finds the form that answers it.
        HumanDecision.with_initial_data(description=f"**{prompt}** (request `{request_id}`)").save(
            keyset, flow_run_id=uuid.UUID(self.flow_run_id))
        with self._client() as client:
            answer = client.set_flow_run_state(self.flow_run_id, state, force=True)
        if answer.state is None or not answer.state.is_paused():
            self.log.warning("human gate: Prefect did not pause the run for request %s", request_id)
            return
        self._paused_for, self._keyset = request_id, keyset
        self.log.info("waiting for a person: %s (request %s): answer with Resume in the Prefect UI, or "
                      "`mn-prefect blueprint human respond %s %s --decision approve|reject`", prompt, request_id,
                      self.run_dir.name, request_id)

    def _collect(self, request: dict[str, Any]) -> None:
        """The flow run resumed from Prefect (the UI's form): its input is the answer."""
        with self._client() as client:
            run = client.read_flow_run(self.flow_run_id)
        if run.state is None or run.state.is_paused():
            return
        assert self._keyset is not None
        answer: Any = HumanDecision.load(self._keyset, flow_run_id=uuid.UUID(self.flow_run_id))
        request_id = request["payload"]["request_id"]
        record_response(self.run_dir, request_id, answer.decision, notes=answer.notes, reviewer=answer.reviewer,
                        via="prefect")
        self.log.info("request %s answered in Prefect: %s", request_id, answer.decision)
        self._paused_for = self._keyset = None

    def _resume(self, why: str) -> None:
        from prefect.states import Running

        with self._client() as client:
            run = client.read_flow_run(self.flow_run_id)
            if run.state is not None and run.state.is_paused():
                client.set_flow_run_state(self.flow_run_id, Running(message=f"mn: {why}"), force=True)
        self.log.info("flow run goes on: %s", why)
        self._paused_for = self._keyset = None

