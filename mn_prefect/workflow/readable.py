"""A workflow's result as people and programs read it (docs/bundles.md, "What `--json` prints").

MirrorNeuron's default output message carries a step's stdout as text twice (``stdout``, ``raw_output``), and a
step that echoes its input carries the message before it, text inside text: three steps make 90 KB of escaped
JSON. ``readable`` keeps what the result says and drops the repeats: each default output's stdout once, as JSON
when it is a JSON document, and an earlier step's message inside it as its name and exit code only. The record
itself is left as it is (the store, ``mn_job.json`` and MirrorNeuron's clients keep the full text).

Pure: a result in, a new value out.
"""

from __future__ import annotations

import json
from typing import Any

from mn_prefect.workflow.protocol import split_beacons

# A default output's sandbox fields that say something once: stdout and stderr are kept (as ``output`` and
# ``stderr``); raw_output, logs and runner_exit_code repeat them, runner is always host_local.
SANDBOX_FIELDS = ("sandbox_name", "exit_code", "node_name", "attempts")


def readable(result: Any) -> Any:
    """The sink's output (``{messages, count, last_message}`` of an aggregator, or one step's output message)
    with every default output message made readable; ``last_message`` is left out when it is the last of
    ``messages``."""
    if isinstance(result, dict) and isinstance(result.get("messages"), list):
        messages = result["messages"]
        out = {k: v for k, v in result.items() if k != "messages" and not (
            k == "last_message" and messages and v == messages[-1])}
        return {"messages": [_message(m) for m in messages], **{k: _nested(v) for k, v in out.items()}}
    return _message(result)


def is_default_output(value: Any) -> bool:
    """A default output message: ``{agent_id, sandbox: {stdout, exit_code, ...}}`` (docs/bundles.md, "The default
    output")."""
    sandbox = value.get("sandbox") if isinstance(value, dict) else None
    return isinstance(sandbox, dict) and "agent_id" in value and isinstance(sandbox.get("stdout"), str) \
        and "exit_code" in sandbox


def decoded(stdout: str) -> Any:
    """A step's stdout as JSON when the whole of it (beacon lines aside) is one JSON document, else the text."""
    text = split_beacons(stdout)[0].strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return stdout


def _message(value: Any) -> Any:
    """One message of the result: a default output with its stdout decoded once (earlier steps' messages inside
    it shortened); anything else with the earlier messages inside it shortened."""
    if not is_default_output(value):
        return _nested(value)
    sandbox = value["sandbox"]
    kept = {k: sandbox[k] for k in SANDBOX_FIELDS if k in sandbox}
    kept["output"] = _nested(decoded(sandbox["stdout"]))
    kept["stderr"] = sandbox.get("stderr") or ""
    return {**{k: _nested(v) for k, v in value.items() if k != "sandbox"}, "sandbox": kept}


def _nested(value: Any) -> Any:
    """Inside a step's output: an earlier step's default output (a step that echoes its input) keeps its name,
    sandbox and exit code, not its output again."""
    if is_default_output(value):
        sandbox = value["sandbox"]
        return {"agent_id": value["agent_id"], "sandbox": {k: sandbox[k] for k in SANDBOX_FIELDS if k in sandbox}}
    if isinstance(value, dict):
        return {k: _nested(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nested(v) for v in value]
    return value
