"""What `blueprint run --json` prints for a bundle run (docs/bundles.md, "The run as JSON"): the same keys from the
flow's outcome and from the run's record in the store, `result` as JSON with each step's output once, one object
alone on stdout; and, with `--local --wait`, the run's log lines kept off the terminal but not off the API. The
runs here are real processes against a real SQLite store, without a Prefect server (the subprocess runs are in
test_bundle_runs.py)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import cli_runner
import pytest
import typer
from bundle_builders import json_in_strings, run_bundle, step, write_bundle

from mn_prefect.bundles.runner import RUN_KEYS
from mn_prefect.cli import bundles as cli
from mn_prefect.store import open_store
from mn_prefect.store.records import WorkflowRecord, get_record
from mn_prefect.workflow.readable import readable

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "bundles"
MN = str(Path(sys.executable).parent / "mn-prefect")
STEP_KEYS = {"state", "attempts", "node", "launches", "outcome", "reason"}


def from_the_store(tmp_path: Path, state: str) -> dict:
    """The run as the CLI prints it, read from its record (as `--local` and a pool both do)."""
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        record = get_record(store, "job-1", WorkflowRecord)
    finally:
        store.close()
    assert record is not None
    return cli._summary(record, job_id="job-1", flow_run_id="flow-1", run_id=None, state=state)


def test_a_completed_runs_json_has_the_documented_keys_and_each_steps_output_once_as_json(tmp_path):
    outcome, _ = run_bundle(EXAMPLES / "demo_dag_linear", tmp_path)
    assert outcome.state == "COMPLETED"
    whole = json.dumps(outcome.result)  # MirrorNeuron's record: each stdout a string holding the step before it
    doc = outcome.as_json("flow-1")  # what the flow run returns
    assert tuple(doc) == RUN_KEYS
    assert doc == from_the_store(tmp_path, "COMPLETED"), "the record gives the same object"
    assert json.loads(json.dumps(doc)) == doc
    assert len(json.dumps(doc)) < 3000 and len(whole) > 20 * len(json.dumps(doc))
    assert json_in_strings(doc["result"]) == []
    assert all(set(s) == STEP_KEYS for s in doc["steps"].values()) and doc["error"] is None
    assert set(doc["result"]) == {"messages", "count"}  # last_message was the last of messages
    report = doc["result"]["messages"][0]
    assert set(report["sandbox"]) == {"sandbox_name", "exit_code", "node_name", "attempts", "output", "stderr"}
    said = report["sandbox"]["output"]
    assert said["complete_step"]["step"] == "report" and said["complete_step"]["status"] == "ok"
    earlier = said["complete_step"]["input"]  # the score step's message, as report got it: named, not repeated
    assert earlier["agent_id"] == "score" and "output" not in earlier["sandbox"] and earlier["sandbox"]["exit_code"] == 0
    status = cli_runner.run(["job", "status", "job-1", "--store-url", f"sqlite:///{tmp_path / 'state.db'}", "--json"])
    assert status.returncode == 0, status.stderr[-2000:]
    assert json.loads(status.stdout)["result"] == doc["result"], "job status --json shows it the same way"


def test_a_failed_runs_json_has_no_result_and_says_why_in_error(tmp_path):
    folder = write_bundle(tmp_path, "failing", [step("a"), step("b", mode="fail")], [("a", "b")], sink_from="b")
    outcome, _ = run_bundle(folder, tmp_path)
    doc = outcome.as_json("flow-1")
    assert tuple(doc) == RUN_KEYS and doc["state"] == "FAILED" and doc["result"] is None
    assert doc["error"] == "step b: exited with code 4: this step always fails"
    assert doc["steps"]["b"]["reason"] == "exited with code 4: this step always fails"
    assert from_the_store(tmp_path, "FAILED") == doc


def test_a_run_only_submitted_has_the_same_keys():
    doc = cli._summary(None, job_id="j-1", flow_run_id="f-1", run_id="f-1", state="SCHEDULED")
    assert tuple(doc) == RUN_KEYS
    assert (doc["steps"], doc["result"], doc["error"], doc["run_dir"]) == ({}, None, None, None)


@pytest.mark.parametrize("state,exits", [("COMPLETED", None), ("SCHEDULED", None), ("FAILED", 1), ("TIMED_OUT", 1)])
def test_json_is_one_object_alone_on_stdout_and_the_exit_code_follows_the_state(capsys, state, exits):
    doc = cli._summary(None, job_id="j-1", flow_run_id="f-1", run_id="f-1", state=state)
    if exits is None:
        cli._finish(doc, as_json=True)
    else:
        with pytest.raises(typer.Exit) as ended:
            cli._finish(doc, as_json=True)
        assert ended.value.exit_code == exits
    out = capsys.readouterr().out
    assert out.endswith("}\n") and out.count("\n") == 1 and json.loads(out) == doc


def test_readable_keeps_what_is_not_repeated():
    sandbox = {"sandbox_name": "s-1", "exit_code": 0, "runner_exit_code": 0, "node_name": "n", "attempts": 1,
               "runner": "host_local", "stderr": "warn", "logs": "warn"}
    text = {"agent_id": "a", "sandbox": {**sandbox, "stdout": "plain text\n", "raw_output": "plain text\n"}}
    assert readable(text)["sandbox"] == {"sandbox_name": "s-1", "exit_code": 0, "node_name": "n", "attempts": 1,
                                         "output": "plain text\n", "stderr": "warn"}
    beacons = {"agent_id": "a", "sandbox": {**sandbox, "stdout": '__MN_AGENT_BEACON__ {}\n{"x": [1]}\n'}}
    assert readable(beacons)["sandbox"]["output"] == {"x": [1]}
    sdk = {"agent_id": "a", "outputs": {"y": 2}, "status": "ok"}
    assert readable(sdk) == sdk
    other = {"messages": [sdk], "count": 2, "last_message": {"agent_id": "b"}}  # not the last of messages: kept
    assert readable(other) == other
    assert readable(None) is None and readable({"error": "boom"}) == {"error": "boom"}


def test_the_runs_log_lines_stay_off_the_console_and_still_reach_the_api_handler():
    """`--local --wait`: the console handlers drop the flow and task runs' lines and Prefect's chatter below
    WARNING; the API handler on the run loggers takes every line, and other libraries' warnings still show."""
    import prefect  # noqa: F401  (configures Prefect's logging)
    from prefect.logging.handlers import APILogHandler, PrefectConsoleHandler

    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    api = [h for h in logging.getLogger("prefect.flow_runs").handlers if isinstance(h, APILogHandler)]
    assert consoles and api

    def record(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, "a line", None, None)

    undo = cli.keep_prefect_off_console()
    try:
        for console in consoles:
            assert not console.filter(record("prefect.flow_runs", logging.INFO))
            assert not console.filter(record("prefect.task_runs", logging.ERROR))
            assert not console.filter(record("prefect.flow_runs.child", logging.WARNING))
            assert not console.filter(record("prefect", logging.INFO))  # "Starting temporary server ..."
            assert console.filter(record("prefect.client", logging.WARNING))
            assert console.filter(record("urllib3", logging.WARNING))
        assert all(h.filter(record("prefect.flow_runs", logging.INFO)) for h in api)
    finally:
        undo()
    assert all(console.filter(record("prefect.flow_runs", logging.INFO)) for console in consoles)
