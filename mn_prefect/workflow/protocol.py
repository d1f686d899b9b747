"""The worker-process protocol (docs/bundles.md, "Standard output" to "The default output"): what a step's process
printed, read as actions.

Pure: the text of stdout/stderr and the exit code in, a ``StepOutput`` out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

STRUCTURED_KEYS = ("emit_messages", "events", "next_state", "complete_step", "complete_run")
LEGACY_KEYS = ("complete_job", "complete_job?")
SDK_KEYS = ("outputs", "artifacts", "metrics", "status")
TRANSIENT_MARKERS = (
    "h2 protocol error", "peer closed connection", "status: unknown", "error reading a body from connection",
    "tls close_notify", "transport error", "connection reset", "connection refused", "timed out",
    "agent beacon deadline exceeded", "deadline exceeded", "artifact_not_ready", "unavailable",
)
BEACON_PREFIX = "__MN_AGENT_BEACON__"
BEACON_MISSED = "agent beacon deadline exceeded"  # MirrorNeuron's words, one of its transient markers
_SECRET_NAME = re.compile(r"TOKEN|SECRET|KEY|COOKIE|PASSWORD", re.IGNORECASE)
MAX_OUTPUT_BYTES = 1024 * 1024


@dataclass
class ProcessResult:
    """What one run of a step's command left behind."""

    exit_code: int
    stdout: str
    stderr: str
    seconds: float = 0.0
    timed_out: bool = False
    refused: str | None = None  # the command could not start (reason); nothing ran
    node: str | None = None
    runs: int = 1  # executor-level tries (transient failures retried in place)
    stopped: str | None = None  # why the runner stopped it early (a required beacon missed)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.refused is None and self.stopped is None

    def error_text(self) -> str:
        if self.refused:
            return self.refused
        if self.stopped:
            return self.stopped
        if self.timed_out:
            return f"host local command timed out after {self.seconds:.1f} s"
        said = [line.strip() for line in (self.stderr or "").splitlines() if line.strip()]
        return f"exited with code {self.exit_code}" + (f": {said[-1][:300]}" if said else "")  # the last word on stderr

    def as_json(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "stdout": self.stdout, "stderr": self.stderr,
                "seconds": self.seconds, "timed_out": self.timed_out, "refused": self.refused,
                "node": self.node, "runs": self.runs, "stopped": self.stopped}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ProcessResult:
        fields: dict[str, Any] = {k: raw[k] for k in ("exit_code", "stdout", "stderr", "seconds", "timed_out",
                                                      "refused", "node", "runs", "stopped") if k in raw}
        return cls(**fields)


@dataclass
class StepOutput:
    """The structured actions of one successful run (all optional)."""

    structured: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)
    next_state: Any = None
    has_next_state: bool = False
    complete_step: Any = None
    complete_run: Any = None
    emit_messages: list[dict[str, Any]] = field(default_factory=list)
    sdk_result: dict[str, Any] | None = None
    error: str | None = None  # the output itself fails the attempt
    beacons: list[dict[str, Any]] = field(default_factory=list)
    note: str | None = None  # why the output was read as unstructured


def split_beacons(stdout: str, prefix: str = BEACON_PREFIX) -> tuple[str, list[dict[str, Any]]]:
    """Beacon lines are taken out of stdout and become ``agent_beacon`` events."""
    kept, beacons = [], []
    for line in stdout.splitlines():
        if line.startswith(prefix):
            rest = line[len(prefix):].strip()
            try:
                payload = json.loads(rest) if rest else {}
            except ValueError:
                payload = {"message": rest}
            beacons.append(payload if isinstance(payload, dict) else {"message": payload})
        else:
            kept.append(line)
    return "\n".join(kept), beacons


def decode(stdout: str) -> StepOutput:
    """Read the whole trimmed stdout as one JSON object (MirrorNeuron's rule); anything else is unstructured."""
    text, beacons = split_beacons(stdout)
    text = text.strip()
    out = StepOutput(beacons=beacons)
    if not text:
        out.note = "no output"
        return out
    try:
        doc = json.loads(text)
    except ValueError:
        doc = _last_json_line(text)
        if doc is None:
            out.note = "stdout is not a JSON object: read as unstructured output"
            return out
    if not isinstance(doc, dict):
        out.note = "stdout is JSON but not an object: read as unstructured output"
        return out
    legacy = [k for k in LEGACY_KEYS if k in doc]
    if legacy:
        out.error = f"unsupported structured output key {legacy[0]!r} (use complete_run from a terminal sink)"
        return out
    if all(k in doc for k in ("outputs",)) and isinstance(doc.get("outputs"), dict):
        out.sdk_result = {k: doc.get(k) for k in SDK_KEYS if k in doc}
    if not any(k in doc for k in STRUCTURED_KEYS):
        out.note = None if out.sdk_result else "no structured keys: read as unstructured output"
        return out
    out.structured = True
    raw_events = doc.get("events")
    if isinstance(raw_events, list):
        out.events = [e for e in raw_events if isinstance(e, dict) and isinstance(e.get("type"), str)
                      and isinstance(e.get("payload", {}), dict)]
    if "next_state" in doc:
        out.has_next_state, out.next_state = True, doc["next_state"]
    out.complete_step = doc.get("complete_step") or None
    out.complete_run = doc.get("complete_run") or None
    emits = doc.get("emit_messages")
    if isinstance(emits, list):
        out.emit_messages = [m for m in emits if isinstance(m, dict)]
    return out


def _last_json_line(text: str) -> dict | None:
    """Tolerate log lines before the result: the last line that is a JSON object."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                return None
            return doc if isinstance(doc, dict) else None
    return None


def is_transient(result: ProcessResult) -> bool:
    """A failure worth retrying in place: its text carries one of MirrorNeuron's transient markers."""
    haystack = f"{result.error_text()}\n{result.stdout}\n{result.stderr}".lower()
    return any(marker in haystack for marker in TRANSIENT_MARKERS)


def redact(text: str, env: dict[str, str]) -> str:
    """Values of secret-looking variables never reach logs or messages."""
    for name, value in env.items():
        if value and len(value) >= 4 and _SECRET_NAME.search(name):
            text = text.replace(value, "[REDACTED]")
    return text


def capped(text: str, limit: int = MAX_OUTPUT_BYTES) -> str:
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[:limit].decode(errors="ignore") + f"\n[truncated: {len(data) - limit} bytes over the cap]"


def default_payload(agent_id: str, result: ProcessResult, output: StepOutput, *, sandbox_name: str,
                    attempts: int) -> dict[str, Any]:
    """The routed output of a run (docs/bundles.md, "The default output"): SDK results as they are, else the sandbox
    record."""
    if output.sdk_result is not None:
        return {**output.sdk_result, "agent_id": agent_id}
    return {"agent_id": agent_id, "sandbox": {
        "sandbox_name": sandbox_name, "exit_code": result.exit_code, "runner_exit_code": result.exit_code,
        "stdout": result.stdout, "stderr": result.stderr, "logs": result.stderr, "raw_output": result.stdout,
        "runner": "host_local", "node_name": result.node, "attempts": attempts}}
