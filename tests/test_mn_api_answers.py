"""Compact, true answers of the MirrorNeuron API (docs/mirrorneuron-api.md): ``mn job status`` of a 5-step run is
a few KB (a step table; a large result as a summary saying how to read it whole), and ``mn resource list``'s cluster totals
are summed from the nodes, as MirrorNeuron's own client library reads them. Fast: the views built from records
and a real SQLite store, no server."""

from __future__ import annotations

import json

from builders import node
from mn_sdk import ensure_combined_resource_totals

from mn_prefect.mn_api.cluster import resources
from mn_prefect.mn_api.runs import RESULT_SHOWN_BYTES, Run, changes
from mn_prefect.store import open_store
from mn_prefect.store.records import StepSummary, WorkflowRecord

STEPS = ("ingest", "clean", "train", "evaluate", "publish")


def nested(depth: int) -> dict:
    """A result like a demo's sink output: each level the JSON text of the one below (escapes on escapes)."""
    doc: dict = {"rows": [{"i": i, "text": "x" * 200} for i in range(1000)]}
    for level in range(depth):
        doc = {"level": level, "payload": json.dumps(doc), "summary": {"ok": True}}
    return doc


def run_of(result) -> Run:
    record = WorkflowRecord(job_id="demo-5-abc12345", run_id="demo-5-run", run_dir="/srv/runs/demo-5-run",
                            bundle="/srv/bundles/demo-5", status="completed", state="COMPLETED", result=result,
                            steps={s: StepSummary(state="completed", attempts=1, node="n1", launches=1,
                                                  outcome="success") for s in STEPS})
    return Run(run_id="demo-5-run", workflow=record)


def test_a_five_step_runs_status_is_a_few_kb_with_a_step_table_and_a_large_result_summarised():
    result = nested(4)
    assert len(json.dumps(result)) > 100_000
    run = run_of(result)
    view = run.view()
    events = changes(run.snapshot().__class__(), run.snapshot(), run.run_id)
    for event in events:
        if "result" in event:
            event["result"] = view["result"]
    answer = json.dumps({"job": view, "recent_events": events})
    assert len(answer) < 4096, len(answer)
    assert {s: (row["state"], row["attempts"], row["node"]) for s, row in view["steps"].items()} == {
        s: ("completed", 1, "n1") for s in STEPS}
    shown = view["result"]
    assert shown["truncated"] is True and shown["size_bytes"] == len(json.dumps(result, separators=(",", ":")))
    assert shown["keys"] == ["level", "payload", "summary"]
    assert shown["details"] == "mn-prefect job status demo-5-abc12345 --json"


def test_a_small_result_is_shown_whole():
    result = {"summary": {"ok": True}, "value": 42}
    assert len(json.dumps(result)) < RESULT_SHOWN_BYTES
    assert run_of(result).view()["result"] == result


def test_cluster_totals_are_summed_from_the_nodes_as_mn_reads_them(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store.register_node(node("small", cpu=4, memory=24 * 1024, disk=50 * 1024))
    store.register_node(node("big", cpu=32, memory=128 * 1024, disk=500 * 1024))
    view = ensure_combined_resource_totals(resources(store))
    store.close()
    for totals in (view["totals"], view["combined"]):
        assert totals["memory_total_gb"] == 152.0
        assert totals["memory_available_gb"] == sum(n["memory_available_gb"] for n in view["nodes"]) == 152.0
        assert totals["disk_available_gb"] == 550.0
        assert totals["cpu_cores"] == 36
