"""Steps expanded from MirrorNeuron's source format (docs/bundles.md, "Steps expanded from the source format"): the
converter (mn_sdk) turns each step graph into ``<step>__start``, its agents (joins for parallel parts) and
``<step>__end``; the step is one attempt from its start node to its end node, completes only there, and its end
node's result is what the next step's start node reads. Fast: the engine driven with made-up agent results, no
server, no process."""

import json
import shutil
from pathlib import Path

import pytest

from mn_prefect.bundles.bundle import load_bundle
from mn_prefect.workflow.engine import Engine
from mn_prefect.workflow.protocol import ProcessResult

SOURCE = Path(__file__).parent / "bundles" / "source"
TWO_STEPS = SOURCE / "source_two_steps"
SHOWN = ("sandbox_job_started", "workflow_step_completed", "workflow_step_failed",
         "workflow_step_attempt_retry_scheduled")


@pytest.fixture(autouse=True)
def _catalog(monkeypatch):
    monkeypatch.setenv("MN_AGENTS_ROOT", str(SOURCE / "mn-agents"))


def drive(spec, result=None, limit=100):
    """Run the workflow to its end; ``result(launch, n)`` is what the n-th launch of an agent printed (default: its
    own name as its output). Returns the engine and the bodies each agent was sent."""
    engine = Engine(spec, job_id="job", run_id="run")
    bodies: dict[str, list] = {}
    seen: dict[str, int] = {}
    t = 0.0
    engine.start(t)
    while not engine.done and limit:
        limit -= 1
        launches = engine.take(t)
        if not launches:
            t += 60  # retries wait their backoff
            engine.tick(t)
            continue
        for launch in launches:
            t += 1
            n = seen[launch.agent_id] = seen.get(launch.agent_id, 0) + 1
            bodies.setdefault(launch.agent_id, []).append(launch.message.body)
            done = result(launch, n) if result else None
            engine.finish(launch, done or ProcessResult(0, json.dumps({"outputs": {"by": launch.agent_id}}), ""), t)
    return engine, bodies


def shown(engine):
    return [(e["type"], e.get("agent_id") if e["type"] == "sandbox_job_started" else e.get("step_id"))
            for e in engine.events if e["type"] in SHOWN]


def blueprint(tmp_path, first_flow: str, second_flow: str) -> Path:
    """The two-step blueprint with other step graphs (``mn_sdk.step_graph`` expressions over agents one..four)."""
    folder = tmp_path / "bp"
    shutil.copytree(TWO_STEPS, folder)
    for name, flow in (("first", first_flow), ("second", second_flow)):
        path = folder / "payloads" / "steps" / f"{name}.py"
        text = path.read_text()
        start = text.index("flow=")
        end = text.index("\n", start)
        path.write_text(text[:start] + f"flow={flow}," + text[end:])
    return folder


def test_two_steps_run_in_order_each_completing_at_its_end_node():
    engine, bodies = drive(load_bundle(TWO_STEPS).spec)
    assert engine.status == "completed", engine.error
    assert shown(engine) == [
        ("sandbox_job_started", "first__one"), ("sandbox_job_started", "first__two"),
        ("workflow_step_completed", "first"),
        ("sandbox_job_started", "second__three"), ("sandbox_job_started", "second__four"),
        ("workflow_step_completed", "second")]
    controls = [(e["type"], e["agent_id"]) for e in engine.events if e["type"].startswith("step_")]
    assert controls == [("step_source_dispatched", "first__start"), ("step_sink_completed", "first__end"),
                        ("step_source_dispatched", "second__start"), ("step_sink_completed", "second__end")]
    kinds = {e["type"] for e in engine.events}
    assert not {k for k in kinds if "duplicate" in k or "stale" in k or k == "workflow_step_triggered"}
    # The control nodes start no process; each step is one attempt.
    assert all(e["agent_id"] not in ("first__start", "first__end", "second__start", "second__end")
               for e in engine.events if e["type"] == "sandbox_job_started")
    assert [s["attempts"] for s in engine.steps_summary().values()] == [1, 1]


def test_the_next_step_receives_what_the_end_node_made_of_the_step():
    engine, bodies = drive(load_bundle(TWO_STEPS).spec)
    first = engine.ledger.steps["first"].output
    assert first == {"step_id": "first", "outputs": {"said": {"by": "first__two"}}, "artifacts": [], "_mn_step": {}}
    # second's start node resolves its input fields from first's outputs: upstream("first", "said")
    [into_second] = bodies["second__three"]
    assert into_second["outputs"] == {"from_first": {"by": "first__two"}}
    assert into_second["_mn_step"] == {"step_id": "second", "attempt_id": "second:attempt:1",
                                       "upstream_steps": ["first"]}
    [into_first] = bodies["first__one"]  # the run's inputs (none seeded here): the topic field resolves to null
    assert into_first["outputs"] == {"topic": None}
    assert bodies["first__two"] == [{"agent_id": "first__one", "outputs": {"by": "first__one"}}]
    assert engine.result["output"]["last_message"]["outputs"] == {"said": {"by": "second__four"}}


def test_agents_inside_a_step_carry_its_attempt():
    engine = Engine(load_bundle(TWO_STEPS).spec, job_id="job", run_id="run")
    engine.start(0)
    [one] = engine.take(0)
    assert one.agent_id == "first__one" and one.step_id == "first"
    assert one.context.attempt_id == "first:attempt:1" and one.workflow_env["MN_WORKFLOW_STEP_ID"] == "first"
    engine.finish(one, ProcessResult(0, "{}", ""), 1)
    [two] = engine.take(1)
    assert two.agent_id == "first__two" and two.context.attempt_id == "first:attempt:1"
    assert engine.ledger.steps["first"].status == "running"  # first__one's success did not complete the step


def test_a_failed_agent_inside_a_step_retries_the_step_from_its_start_node():
    def result(launch, n):
        if launch.agent_id == "first__two" and n == 1:
            return ProcessResult(3, "", "boom")
        return None

    engine, bodies = drive(load_bundle(TWO_STEPS).spec, result)  # the converter gives each step 2 attempts
    assert engine.status == "completed", engine.error
    assert shown(engine) == [
        ("sandbox_job_started", "first__one"), ("sandbox_job_started", "first__two"),
        ("workflow_step_attempt_retry_scheduled", "first"),
        ("sandbox_job_started", "first__one"), ("sandbox_job_started", "first__two"),
        ("workflow_step_completed", "first"),
        ("sandbox_job_started", "second__three"), ("sandbox_job_started", "second__four"),
        ("workflow_step_completed", "second")]
    assert [b["_mn_step"]["attempt_id"] for b in bodies["first__one"]] == ["first:attempt:1", "first:attempt:2"]
    assert engine.steps_summary()["first"]["attempts"] == 2


def test_a_step_that_fails_every_attempt_fails_the_run_and_the_next_step_never_starts():
    engine, _ = drive(load_bundle(TWO_STEPS).spec,
                      lambda launch, n: ProcessResult(1, "", "no") if launch.agent_id == "first__one" else None)
    assert engine.status == "failed" and engine.error["step_id"] == "first"
    assert not any(e.get("agent_id", "").startswith("second__") for e in engine.events
                   if e["type"] == "sandbox_job_started")


@pytest.mark.parametrize(("first_flow", "launched", "said"), [
    ("agent('one')", ["first__one"], {"by": "first__one"}),
    ("sequence(agent('one'), agent('two'))", ["first__one", "first__two"], {"by": "first__two"}),
    ("parallel(agent('one'), agent('two'))", ["first__one", "first__two"],
     {"one": {"by": "first__one"}, "two": {"by": "first__two"}}),  # the join names each branch by its alias
])
def test_step_graphs_complete_once_after_all_their_agents(tmp_path, first_flow, launched, said):
    folder = blueprint(tmp_path, first_flow, "sequence(agent('three'), agent('four'))")
    engine, bodies = drive(load_bundle(folder).spec)
    assert engine.status == "completed", engine.error
    order = shown(engine)
    done = order.index(("workflow_step_completed", "first"))
    assert sorted(agent for _, agent in order[:done]) == launched
    assert order[done + 1] == ("sandbox_job_started", "second__three")
    assert engine.ledger.steps["first"].output["outputs"] == {"said": said}
    assert [b["outputs"] for b in bodies["second__three"]] == [{"from_first": said}]
    assert not any("duplicate" in e["type"] or "stale" in e["type"] for e in engine.events)


def test_the_expanded_steps_name_their_graphs():
    spec = load_bundle(TWO_STEPS).spec
    first = spec.steps["first"]
    assert first.agent_id == "first__start" and first.end_agent_id == "first__end"
    assert first.members == ("first__start", "first__one", "first__two", "first__end")
    assert {a: spec.agents[a].is_step_control for a in first.members} == {
        "first__start": True, "first__one": False, "first__two": False, "first__end": True}
