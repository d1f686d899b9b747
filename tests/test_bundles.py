"""Bundles run end to end through the run engine with real worker processes and a real SQLite store: the
workflow's trigger rules, failure policies and retries decide, one booking per step attempt, none left after."""

from __future__ import annotations

import json
from pathlib import Path

import cli_runner
import pytest
from bundle_builders import run_bundle, step, write_bundle

from mn_prefect.bundles.bundle import load_bundle
from mn_prefect.inventory import local_node
from mn_prefect.model.issues import InvalidInput
from mn_prefect.store import open_store

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "bundles"


def states(outcome) -> dict[str, str]:
    return {sid: s["state"] for sid, s in outcome.steps.items()}


def test_linear_workflow_runs_each_step_once_in_order_with_the_allocation_map(tmp_path):
    folder = write_bundle(tmp_path, "linear", [step("a"), step("b"), step("c")], [("a", "b"), ("b", "c")],
                          sink_from="c", strategy="serial")
    outcome, launches = run_bundle(folder, tmp_path)
    assert outcome.state == "COMPLETED" and states(outcome) == {"a": "completed", "b": "completed", "c": "completed"}
    assert [l["step"] for l in launches] == ["a", "b", "c"]
    allocation = json.loads(launches[0]["allocation"])
    assert {"devices", "ports", "volumes", "runtime_driver"} <= set(allocation)  # MirrorNeuron's shape
    assert launches[0]["cwd"].endswith("/worker") and not launches[0]["cwd"].startswith("/sandbox")
    assert outcome.result["count"] == 1 and outcome.result["last_message"]["agent_id"] == "c"


def test_a_failed_attempt_is_retried_after_its_backoff_and_the_step_completes(tmp_path):
    folder = write_bundle(tmp_path, "retry", [step("flaky", mode="fail_first", attempts=2), step("after")],
                          [("flaky", "after")], sink_from="after")
    outcome, launches = run_bundle(folder, tmp_path)
    assert outcome.state == "COMPLETED"
    assert outcome.steps["flaky"]["attempts"] == 2 and outcome.steps["flaky"]["state"] == "completed"
    assert [(l["step"], l["attempt"]) for l in launches] == [("flaky", 1), ("flaky", 2), ("after", 1)]
    retry = [e for e in outcome.events if e["type"] == "workflow_step_attempt_retry_scheduled"]
    assert retry and retry[0]["delay_ms"] == pytest.approx(50)


def test_each_completed_step_attempt_teaches_its_step_how_long_it_held_its_booking(tmp_path):
    """A failed attempt is no sample: the flaky step learns from its second attempt only."""
    from mn_prefect.placement import estimates

    folder = write_bundle(tmp_path, "learns", [step("flaky", mode="fail_first", attempts=2), step("after")],
                          [("flaky", "after")], sink_from="after")
    outcome, _ = run_bundle(folder, tmp_path)
    assert outcome.state == "COMPLETED"
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        for step_id in ("flaky", "after"):
            (seconds,) = estimates.history(store, estimates.step_key("learns", step_id))
            assert seconds >= 0
        assert estimates.estimate_for(store, estimates.step_key("learns", "after")).source == "learned"
    finally:
        store.close()


def test_when_attempts_run_out_the_workflow_fails_naming_the_step_and_nothing_downstream_runs(tmp_path):
    folder = write_bundle(tmp_path, "exhausted", [step("broken", mode="fail", attempts=2), step("after")],
                          [("broken", "after")], sink_from="after")
    outcome, launches = run_bundle(folder, tmp_path)
    assert outcome.state == "FAILED"
    assert outcome.result["step_id"] == "broken" and "exited with code 4" in outcome.result["error"]
    assert [l["step"] for l in launches] == ["broken", "broken"]
    assert outcome.steps["after"]["state"] == "pending"


def test_quorum_success_runs_the_join_once_enough_parents_succeed(tmp_path):
    sensors = [step("start"), step("s1"), step("s2"), step("s3", mode="fail_event", policy="continue_partial")]
    approve = step("approve", rule={"rule": "quorum_success", "quorum": 2})
    edges = [("start", "s1"), ("start", "s2"), ("start", "s3"),
             ("s1", "approve", ["done", "failed"]), ("s2", "approve", ["done", "failed"]),
             ("s3", "approve", ["done", "failed"])]
    folder = write_bundle(tmp_path, "quorum", sensors + [approve], edges, sink_from="approve")
    outcome, _ = run_bundle(folder, tmp_path)
    assert outcome.state == "COMPLETED"
    assert states(outcome)["s3"] == "partial" and outcome.steps["s3"]["outcome"] == "failed"
    assert states(outcome)["approve"] == "completed"


def test_quorum_that_cannot_be_reached_skips_the_join(tmp_path):
    steps = [step("start"), step("s1", mode="fail_event", policy="continue_partial"),
             step("s2", mode="fail_event", policy="continue_partial"),
             step("approve", rule={"rule": "quorum_success", "quorum": 2})]
    edges = [("start", "s1"), ("start", "s2"), ("s1", "approve"), ("s2", "approve")]
    outcome, launches = run_bundle(write_bundle(tmp_path, "noquorum", steps, edges, sink_from="approve"), tmp_path)
    assert states(outcome)["approve"] == "skipped"
    assert "approve" not in [l["step"] for l in launches]


def test_a_branch_runs_the_selected_path_and_skips_the_other(tmp_path):
    steps = [step("route", mode="branch:high"), step("high"), step("low"),
             step("join", rule="none_failed_min_one_success")]
    edges = [("route", "high"), ("route", "low"), ("high", "join"), ("low", "join", ["done", "skipped"])]
    outcome, launches = run_bundle(write_bundle(tmp_path, "branch", steps, edges, sink_from="join"), tmp_path)
    assert outcome.state == "COMPLETED"
    assert states(outcome) == {"route": "completed", "high": "completed", "low": "skipped", "join": "completed"}
    assert "low" not in [l["step"] for l in launches]
    assert outcome.steps["low"]["reason"] == "not selected by branch route"


def test_a_failed_primary_falls_back_and_the_report_follows_the_fallback(tmp_path):
    steps = [step("primary", mode="fail_event", policy="continue_partial"),
             step("fallback", rule="one_failed"), step("report", rule="one_success")]
    edges = [("primary", "fallback", ["failed"]), ("primary", "report"), ("fallback", "report")]
    outcome, launches = run_bundle(write_bundle(tmp_path, "fallback", steps, edges, sink_from="report"), tmp_path)
    assert outcome.state == "COMPLETED"
    assert states(outcome) == {"primary": "partial", "fallback": "completed", "report": "completed"}
    assert [l["step"] for l in launches].count("fallback") == 1


def test_a_fallback_that_is_not_needed_is_skipped(tmp_path):
    steps = [step("primary"), step("fallback", rule="one_failed"), step("report", rule="one_success")]
    edges = [("primary", "fallback", ["failed"]), ("primary", "report"), ("fallback", "report")]
    outcome, launches = run_bundle(write_bundle(tmp_path, "nofallback", steps, edges, sink_from="report"), tmp_path)
    assert outcome.state == "COMPLETED" and states(outcome)["fallback"] == "skipped"
    assert "fallback" not in [l["step"] for l in launches]


def test_a_step_past_its_timeout_is_killed_and_fails_the_workflow(tmp_path):
    steps = [step("slow", mode="sleep:30", timeout=1)]
    outcome, _ = run_bundle(write_bundle(tmp_path, "timeout", steps, [], sink_from="slow"), tmp_path)
    assert outcome.state == "FAILED" and "timed out" in outcome.result["error"]


def test_output_that_is_not_json_is_read_as_unstructured_and_the_step_completes(tmp_path):
    outcome, _ = run_bundle(write_bundle(tmp_path, "plain", [step("talk", mode="nonjson")], [], sink_from="talk"),
                            tmp_path)
    assert outcome.state == "COMPLETED"
    notes = [e.get("note") for e in outcome.events if e["type"] == "sandbox_job_completed"]
    assert notes == ["stdout is not a JSON object: read as unstructured output"]


@pytest.mark.parametrize("name", ["demo_dag_linear", "demo_retry_recovery", "demo_dag_scatter_gather",
                                  "demo_resource_allocation"])
def test_each_example_bundle_completes_with_its_documented_steps(name, tmp_path):
    expected = json.loads((EXAMPLES / "EXPECTED.json").read_text())[name]
    outcome, _ = run_bundle(EXAMPLES / name, tmp_path)
    assert outcome.state == "COMPLETED"
    for sid, want in expected["steps"].items():
        assert outcome.steps[sid]["state"] == want.split()[0], sid
    result = json.loads((tmp_path / "runs" / "run-1" / "result.json").read_text())["result"]
    assert {k: v for k, v in expected["result"].items() if " " not in k} == \
        {k: result.get(k) for k in expected["result"] if " " not in k}
    if name == "demo_dag_scatter_gather":
        assert outcome.steps["collect"]["launches"] == 5
        assert outcome.steps["worker"]["outcome"] == "mapped"


def _manifest(tmp_path: Path, mutate) -> Path:
    folder = write_bundle(tmp_path, "bad", [step("a"), step("b")], [("a", "b")], sink_from="b")
    doc = json.loads((folder / "manifest.json").read_text())
    mutate(doc)
    (folder / "manifest.json").write_text(json.dumps(doc))
    return folder


@pytest.mark.parametrize("mutate, path, words", [
    (lambda d: d["workflow"]["steps"][0].update(run="ghost", id="ghost"), "workflow.steps[0].run", "names no agent"),
    (lambda d: d["workflow"]["edges"].append({"from": "a", "to": "nowhere"}), "workflow.edges[1].to", "unknown step"),
    (lambda d: d["workflow"]["edges"].append({"from": "b", "to": "a"}), "workflow.edges", "cycle"),
    (lambda d: d["workflow"]["steps"][1].update(trigger_rule="most_success"), "workflow.steps[1].trigger_rule",
     "unknown trigger rule"),
    (lambda d: d["workflow"]["steps"][1]["control"].update(failure_policy="shrug"),
     "workflow.steps[1].control.failure_policy", "unknown failure policy"),
    (lambda d: d["agents"]["nodes"][0]["config"].update(command=42), "agents.nodes[0].config.command", "list"),
    (lambda d: d["agents"]["nodes"][0]["config"].update(upload_path="../../etc"),
     "agents.nodes[0].config.upload_path", "inside the bundle"),
    (lambda d: d["agents"]["nodes"][0]["config"]["environment"].update({"A=B": "x"}),
     "agents.nodes[0].config.environment.A=B", "not a valid environment variable name"),
    (lambda d: d["agents"]["nodes"][0]["config"].update(runner_module="MirrorNeuron.Runner.DockerWorker"),
     "agents.nodes[0].config.image", "is required with runner_module MirrorNeuron.Runner.DockerWorker"),
    (lambda d: d["agents"]["nodes"][0]["config"].update(runner_module="DockerWorker", image="py thon; rm -rf /"),
     "agents.nodes[0].config.image", "is not an image reference"),
    (lambda d: d["agents"]["nodes"][0]["config"].update(runner_module="MirrorNeuron.Runner.OpenShell"),
     "agents.nodes[0].config.runner_module", "has no runner in mn-prefect"),
])
def test_bad_manifests_are_refused_naming_the_field(tmp_path, mutate, path, words):
    with pytest.raises(InvalidInput) as refused:
        load_bundle(_manifest(tmp_path, mutate))
    assert any(i.path == path and words in i.message for i in refused.value.issues), refused.value.issues


def test_a_folder_without_a_manifest_is_not_a_bundle(tmp_path):
    with pytest.raises(InvalidInput, match="without manifest.json"):
        load_bundle(tmp_path)


def test_bookings_of_a_killed_run_are_released_by_the_next_local_run(tmp_path):
    import socket
    import subprocess as sp

    from mn_prefect.bundles.runner import sweep_dead_runs
    from mn_prefect.store.records import WorkflowRecord, get_record, put_record

    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    node = store.register_node(local_node())
    gone = sp.Popen(["true"])
    gone.wait()
    put_record(store, WorkflowRecord(job_id="dead-job", status="running", run_id="r", run_dir=str(tmp_path / "r"),
                                     bundle=str(tmp_path), pid=gone.pid, host=socket.gethostname()))
    from mn_prefect.model.resources import ResourceRequest
    from mn_prefect.placement.placing import place_and_commit
    from mn_prefect.scheduler.ask import Ask

    assert place_and_commit(store, "dead-job#1", [Ask(agent_id="s", request=ResourceRequest(cpu_cores=1))]).placed
    assert sweep_dead_runs(store) == 1
    assert store.active_placements() == [] and get_record(store, "dead-job", WorkflowRecord).status == "crashed"
    assert node.name


def test_json_refusals_are_json_on_stdout(tmp_path):
    for command in (["blueprint", "run", str(tmp_path), "--local", "--json"], ["blueprint", "deploy", str(tmp_path), "--json"]):
        done = cli_runner.run(command)
        assert done.returncode == 2
        doc = json.loads(done.stdout)
        assert doc["state"] == "INVALID" and "without manifest.json" in doc["errors"][0]["message"]


def test_a_failed_agent_with_failure_message_type_sends_the_fallback_message_instead_of_failing(tmp_path):
    """docs/bundles.md, "Exit codes, timeouts and retries": with config.failure_message_type the executor emits that
    type with the error (and fallback_used) instead of failing the agent; the next step gets it as its input."""
    folder = write_bundle(tmp_path, "fallback_message", [step("primary", mode="fail"), step("report")],
                          [("primary", "report")], sink_from="report")
    doc = json.loads((folder / "manifest.json").read_text())
    primary = next(n for n in doc["agents"]["nodes"] if n["node_id"] == "primary")
    primary["config"]["failure_message_type"] = "primary_fallback"
    doc["agents"]["edges"].append({"edge_id": "fallback", "from_node": "primary", "to_node": "report",
                                   "message_type": "primary_fallback"})
    (folder / "manifest.json").write_text(json.dumps(doc))

    outcome, launches = run_bundle(folder, tmp_path)

    assert outcome.state == "COMPLETED", outcome
    assert states(outcome) == {"primary": "completed", "report": "completed"}
    report = [launch for launch in launches if launch["step"] == "report"]
    assert len(report) == 1
    fallback = report[0]["body"]
    assert fallback["status"] == "failed" and fallback["agent_id"] == "primary"
    assert fallback["outputs"]["fallback_used"] is True and fallback["outputs"]["failed_agent_id"] == "primary"
    assert "this step always fails" in fallback["outputs"]["error"]


def _beacons(folder: Path, timeout_ms: int) -> None:
    doc = json.loads((folder / "manifest.json").read_text())
    for node in doc["agents"]["nodes"]:
        if node["node_id"] != "sink":
            node["config"].update(beacon_enabled=True, agent_beacon_required=True, beacon_timeout_ms=timeout_ms)
    (folder / "manifest.json").write_text(json.dumps(doc))


def test_a_step_that_misses_its_required_beacon_is_stopped_and_fails(tmp_path):
    folder = write_bundle(tmp_path, "silent", [step("silent", mode="sleep:60")], [], sink_from="silent")
    _beacons(folder, 600)

    outcome, _ = run_bundle(folder, tmp_path)

    assert outcome.state == "FAILED" and states(outcome) == {"silent": "failed"}
    assert "agent beacon deadline exceeded" in outcome.result["error"]
    kinds = [event["type"] for event in outcome.events]
    assert kinds.count("agent_beacon_missed") == 1 and "agent_failed" in kinds
    failed = next(e for e in outcome.events if e["type"] == "agent_failed")
    assert failed["step_id"] == "silent" and failed["reason"] == "agent beacon deadline exceeded"


def test_a_step_that_keeps_beaconing_outlives_the_beacon_timeout_and_completes(tmp_path):
    folder = write_bundle(tmp_path, "talkative", [step("talkative", mode="beacons:2")], [], sink_from="talkative")
    _beacons(folder, 600)

    outcome, _ = run_bundle(folder, tmp_path)

    assert outcome.state == "COMPLETED", outcome.result
    assert "agent_beacon_missed" not in [event["type"] for event in outcome.events]
    assert sum(event["type"] == "agent_beacon" for event in outcome.events) >= 10


FAN = """import json
print(json.dumps({"emit_messages": [{"type": "item", "to": "count", "body": {"i": i}} for i in range(6)]}))
"""
COUNT = """import json, os, pathlib, time
body = json.loads(pathlib.Path(os.environ["MN_INPUT_FILE"]).read_text())
time.sleep(0.1)
print(json.dumps({"emit_messages": [{"type": "counted", "to": "sink", "body": {"i": body["i"]}}]}))
"""


def test_a_full_mailbox_refuses_deliveries_which_are_retried_until_every_message_is_handled(tmp_path):
    """docs/bundles.md, "Routing over agent edges": config.backpressure.max_queue_depth caps an agent's mailbox; a
    delivery to a full one fails with backpressure_signal and is tried again after retry_after_ms: nothing is lost,
    nothing runs twice."""
    folder = tmp_path / "backpressure"
    (folder / "payloads" / "w").mkdir(parents=True)
    (folder / "payloads" / "w" / "fan.py").write_text(FAN)
    (folder / "payloads" / "w" / "count.py").write_text(COUNT)

    def executor(node_id: str, script: str, **config) -> dict:
        return {"node_id": node_id, "agent_type": "executor", "type": "generic",
                "resources": {"cpu_cores": 0.1, "memory_mb": 16},
                "config": {"command": ["python3.11", script], "upload_path": "w", "upload_as": "w",
                           "workdir": "/sandbox/job/w", "runner_module": "MirrorNeuron.Runner.HostLocal", **config}}

    manifest = {
        "apiVersion": "mn.workflow/v2", "kind": "Workflow", "id": "backpressure", "name": "backpressure",
        "job_name": "backpressure", "manifest_version": "1.0",
        "agents": {"entrypoints": ["fan"], "nodes": [
            executor("fan", "fan.py"),
            executor("count", "count.py", backpressure={"max_queue_depth": 2, "retry_after_ms": 50}),
            {"node_id": "sink", "agent_type": "aggregator", "type": "reduce",
             "config": {"complete_after": 6, "complete_run": True, "terminal_sink": True}}],
            "edges": [{"edge_id": "fan_count", "from_node": "fan", "to_node": "count", "message_type": "item"},
                      {"edge_id": "count_sink", "from_node": "count", "to_node": "sink", "message_type": "counted"}]},
        "runtime": {"initial_inputs": {"fan": [{"go": True}]}},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))

    outcome, _ = run_bundle(folder, tmp_path)

    assert outcome.state == "COMPLETED", outcome.result
    assert sorted(m["i"] for m in outcome.result["messages"]) == [0, 1, 2, 3, 4, 5]
    refused = [e for e in outcome.events if e["type"] == "backpressure_signal"]
    assert refused and {e["to"] for e in refused} == {"count"} and all(e["max_queue_depth"] == 2 for e in refused)
    handled = [e for e in outcome.events if e["type"] == "sandbox_job_completed" and e["agent_id"] == "count"]
    assert len(handled) == 6  # each item ran once, refused or not


def test_a_paused_run_starts_no_step_until_it_is_resumed(tmp_path):
    """``mn job pause`` on a running bundle run: its runner reads the pause from the store and places nothing
    until it is resumed; then the workflow runs to its end as if nothing happened."""
    import threading

    from mn_prefect.store.records import RunControlRecord, WorkflowRecord, get_record, put_record, run_control_id

    folder = write_bundle(tmp_path, "held", [step("a"), step("b")], [("a", "b")], sink_from="b", strategy="serial")
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    control = RunControlRecord(job_id=run_control_id("run-1"), run_id="run-1", status="paused", reason="test")
    put_record(store, control)
    seen_while_paused: list[bool] = []

    def resume_later() -> None:
        threading.Event().wait(2.5)  # more than two reads of the pause (PAUSE_READ_S)
        seen_while_paused.append((tmp_path / "runs" / "run-1" / "launches.jsonl").exists())
        seen_while_paused.append(get_record(store, "job-1", WorkflowRecord).held)  # the runner says it holds
        put_record(store, control.model_copy(update={"status": "running"}))

    resumer = threading.Thread(target=resume_later)
    resumer.start()
    outcome, launches = run_bundle(folder, tmp_path)
    resumer.join()
    store.close()
    assert seen_while_paused == [False, True]  # nothing launched while it was paused, and its record said so
    assert outcome.state == "COMPLETED" and [launch["step"] for launch in launches] == ["a", "b"]


@pytest.mark.parametrize(("raw", "want", "fields"), [
    ({"kind": "periodic", "crons": ["@hourly", "0 9 * * 1-5"], "timezone": "Europe/Paris", "enabled": True,
      "prohibit_overlap": True, "missed_policy": "skip", "catchup_limit": 1},
     (("@hourly", "0 9 * * 1-5"), "Europe/Paris", True, True), []),
    ({"crons": ["*/5 * * * *"], "enabled": False}, (("*/5 * * * *",), "UTC", False, False), []),
    ({"crons": ["nope", "@daily"]}, None, ["schedule.crons[0]"]),
    ({"crons": ["@daily"], "timezone": "Mars/Olympus"}, None, ["schedule.timezone"]),
    ({"kind": "event", "crons": ["@daily"]}, None, ["schedule.kind"]),
    ({"kind": "periodic"}, None, ["schedule.crons"]),
    ({"crons": ["@daily"], "missed_policy": "catch_up"}, None, ["schedule.missed_policy"]),
    ("hourly", None, ["schedule"]),
])
def test_a_bundle_schedule_becomes_cron_schedules_or_names_each_bad_field(raw, want, fields):
    from mn_prefect.bundles.schedule import parse_schedule
    from mn_prefect.model.issues import Issues

    issues = Issues()
    parsed = parse_schedule({"schedule": raw}, issues)
    assert [i.path for i in issues.items] == fields
    if want is not None:
        assert (parsed.crons, parsed.timezone, parsed.active, parsed.no_overlap) == want


def test_blueprint_validate_names_a_bad_schedule(tmp_path):

    folder = write_bundle(tmp_path, "timed", [step("a")], [], sink_from="a")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["schedule"] = {"kind": "periodic", "crons": ["61 * * * *"]}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    done = cli_runner.run(["blueprint", "validate", folder, "--json"])
    assert done.returncode == 1, done.stdout + done.stderr
    assert [e["path"] for e in json.loads(done.stdout)["errors"]] == ["schedule.crons[0]"]


@pytest.mark.parametrize(("raw", "want", "fields"), [
    ([{"name": "dataset-uploaded", "event_type": "dataset_uploaded", "filters": {"path": {"prefix": "/demo/"}},
       "enabled": True}], [("dataset-uploaded", "dataset_uploaded", {"mn.payload.path": "/demo/*"}, True)], []),
    ({"event_type": "mn.bucket.put", "filters": {"bucket": "raw", "size": 3, "ok": True, "tier": {"equals": "a"}},
      "enabled": False},
     [("mn.bucket.put", "mn.bucket.put", {"mn.payload.bucket": "raw", "mn.payload.size": "3",
                                          "mn.payload.ok": "true", "mn.payload.tier": "a"}, False)], []),
    ([{"event_type": "a"}, {"event_type": "a"}], None, ["triggers[1].name"]),
    ([{"name": "x"}], None, ["triggers[0].event_type"]),
    ([{"event_type": "has space"}], None, ["triggers[0].event_type"]),
    ([{"event_type": "a", "filters": {"path": {"regex": ".*"}}}], None, ["triggers[0].filters.path"]),
    ([{"event_type": "a", "filters": {"a.b": 1}}], None, ["triggers[0].filters.a.b"]),
    ([{"event_type": "a", "filters": "path"}], None, ["triggers[0].filters"]),
    ([{"event_type": "a", "enabled": "yes"}], None, ["triggers[0].enabled"]),
    ("dataset_uploaded", None, ["triggers"]),
])
def test_a_bundles_triggers_become_event_matches_or_name_each_bad_field(raw, want, fields):
    from mn_prefect.bundles.triggers import parse_triggers
    from mn_prefect.model.issues import Issues

    issues = Issues()
    parsed = parse_triggers({"triggers": raw}, issues)
    assert [i.path for i in issues.items] == fields
    if want is not None:
        assert [(t.name, t.event_type, t.match, t.enabled) for t in parsed] == want


def test_an_events_payload_scalars_become_the_labels_trigger_filters_match():
    from mn_prefect.bundles.triggers import event_resource, parse_trigger_parameter

    resource = event_resource({"path": "/demo/a.csv", "rows": 3, "ok": False, "nested": {"x": 1}, "bad key": 1},
                              "cli")
    assert resource["prefect.resource.id"].startswith("mn.event.") and resource["mn.source"] == "cli"
    assert {k: v for k, v in resource.items() if k.startswith("mn.payload.")} == {
        "mn.payload.path": "/demo/a.csv", "mn.payload.rows": "3", "mn.payload.ok": "false"}
    assert parse_trigger_parameter('{"event": "e", "payload": {"a": 1}}') == {"event": "e", "payload": {"a": 1}}
    assert parse_trigger_parameter(None) is None and parse_trigger_parameter("") is None


def test_a_bad_trigger_refuses_the_bundle_naming_the_field(tmp_path):
    from mn_prefect.bundles.bundle import load_bundle
    from mn_prefect.model.issues import InvalidInput

    folder = write_bundle(tmp_path, "triggered", [step("a")], [], sink_from="a")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["triggers"] = [{"name": "t", "event_type": "dataset_uploaded", "filters": {"path": {"glob": "*"}}}]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidInput) as refused:
        load_bundle(folder)
    assert [i.path for i in refused.value.issues] == ["triggers[0].filters.path"]


@pytest.mark.parametrize(("raw", "fields"), [
    ([{"id": "web", "name": "web", "port": 8080, "tags": ["a"], "checks": [{"type": "http", "path": "/health"}]}],
     []),
    ([{"name": "db", "port": "5432", "checks": [{"type": "tcp", "interval_ms": 200}]}], []),
    ([{"name": "web", "port": "${config.service.port}"}], ["services[0].port"]),
    ([{"name": "web", "port": 70000}], ["services[0].port"]),
    ([{"name": "web", "checks": [{"type": "http"}]}], ["services[0].checks[0].port"]),
    ([{"name": "web", "port": 1, "checks": [{"type": "grpc"}]}], ["services[0].checks[0]"]),
    ([{"name": "web", "port": 1, "checks": [{"path": "health"}]}], ["services[0].checks[0].path"]),
    ([{"name": "web", "port": 1, "checks": [{"timeout_ms": 0}]}], ["services[0].checks[0].timeout_ms"]),
    ([{"port": 1}], ["services[0]"]),
    ({"name": "web"}, ["services"]),
])
def test_a_bundles_services_are_read_or_each_bad_field_named(raw, fields):
    from mn_prefect.bundles.services import parse_services
    from mn_prefect.model.issues import Issues

    issues = Issues()
    parsed = parse_services({"services": raw}, issues)
    assert [i.path for i in issues.items] == fields
    if not fields:
        assert parsed[0].checks and parsed[0].checks[0].port == int(raw[0]["port"])


def test_config_references_in_a_bundles_services_take_the_configs_values_or_name_the_field(tmp_path):
    """MirrorNeuron's service bundle writes ``"port": "${config.service.port}"``: the value itself (a number stays
    a number); inside other text, as text; a reference to nothing refuses the bundle naming where it is."""
    from mn_prefect.bundles.bundle import load_bundle
    from mn_prefect.bundles.services import parse_services
    from mn_prefect.model.issues import InvalidInput, Issues

    folder = write_bundle(tmp_path, "served", [step("a")], [], sink_from="a")
    (folder / "config" / "default.json").write_text(json.dumps({"service": {"port": 18081, "host": "10.0.0.5"}}))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["services"] = [{"name": "web", "port": "${config.service.port}", "address": "${config.service.host}",
                             "tags": ["on-${config.service.host}"], "checks": [{"type": "http", "path": "/health",
                                                                              "port": "${config.service.port}"}]}]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    services = parse_services(load_bundle(folder).document, Issues())
    assert (services[0].port, services[0].address, services[0].tags) == (18081, "10.0.0.5", ("on-10.0.0.5",))
    assert services[0].checks[0].port == 18081
    manifest["services"][0]["port"] = "${config.service.nope}"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidInput) as refused:
        load_bundle(folder)
    assert [i.path for i in refused.value.issues][0] == "services[0].port"


def _with_environment(tmp_path: Path, values: dict[str, dict[str, str]]) -> Path:
    """demo_dag_linear with ``values[node_id]`` added to each named agent's ``config.environment``."""
    import shutil

    folder = tmp_path / "demo_dag_linear"
    shutil.copytree(EXAMPLES / "demo_dag_linear", folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    for node in manifest["agents"]["nodes"]:
        node.setdefault("config", {}).setdefault("environment", {}).update(values.get(node["node_id"], {}))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_the_run_store_a_submitted_manifest_names_for_every_agent_is_the_runs_root(tmp_path):
    """MirrorNeuron's CLI writes its shared storage into each agent's environment as MN_RUNS_ROOT: the steps write
    there, so the runner keeps the run store (and watches human requests) there; where the agents disagree, or some
    name none, the runner's own root stands."""
    from mn_prefect.bundles.bundle import declared_runs_root

    nodes = [n["node_id"] for n in json.loads((EXAMPLES / "demo_dag_linear" / "manifest.json").read_text())
             ["agents"]["nodes"]]
    shared = str(tmp_path / "shared" / "runs")
    assert declared_runs_root(load_bundle(_with_environment(tmp_path / "all", {
        n: {"MN_RUNS_ROOT": shared} for n in nodes}))) == shared
    assert declared_runs_root(load_bundle(_with_environment(tmp_path / "some", {nodes[0]: {"MN_RUNS_ROOT": shared}}))) \
        is None
    assert declared_runs_root(load_bundle(_with_environment(tmp_path / "two", {
        n: {"MN_RUNS_ROOT": f"{shared}-{i}"} for i, n in enumerate(nodes)}))) is None
    assert declared_runs_root(load_bundle(EXAMPLES / "demo_dag_linear")) is None


def test_a_run_killed_before_it_deregistered_its_services_stops_offering_them_once_their_lease_lapses(tmp_path,
                                                                                                     monkeypatch):
    """A bundle run renews its services' lease while it lives; a run that was killed (cancelled, its node lost)
    cannot say it ended, and its services are no longer offered once the lease lapses."""
    import logging
    import time

    from mn_prefect.bundles import services as offered
    from mn_prefect.ops.services import instances
    from mn_prefect.store.records import ServiceRecord, get_record, put_record, service_record_id

    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    monkeypatch.setattr(offered, "RENEW_S", 0.2)
    service = offered.BundleService(id="web", name="web", address="127.0.0.1", port=8080, tags=("blueprint",),
                                    checks=())
    watch = offered.ServiceWatch(store, [service], run_id="run-1", job_id="job-1", node=None,
                                 logger=logging.getLogger("test")).start()
    try:
        first = get_record(store, service_record_id("run-1", "web"), ServiceRecord).expires_at
        assert first is not None and first > time.time() + offered.LEASE_S - 5
        time.sleep(0.6)
        assert get_record(store, service_record_id("run-1", "web"), ServiceRecord).expires_at > first  # renewed
        assert [s["name"] for s in instances(store, passing_only=True)] == ["web"]
    finally:
        watch.stop()
    assert instances(store) == []  # deregistered when the run ended

    killed = ServiceRecord(job_id=service_record_id("run-2", "web"), name="web", service_id="web", run_id="run-2",
                           status="passing", port=8081, expires_at=time.time() - 1)
    put_record(store, killed)
    assert instances(store) == [] and instances(store, name="web", passing_only=True) == []
    put_record(store, killed.model_copy(update={"expires_at": time.time() + 30}))
    assert [s["port"] for s in instances(store, passing_only=True)] == [8081]
