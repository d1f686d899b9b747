"""``mn-prefect job status``: tables for people and the same data as JSON, from a job record in a real
SQLite store (written through JobState.save, as the coordinator writes it)."""

import json
import time

import pytest
from builders import agent, blueprint, gpu, node
from test_cli import run

from mn_prefect.placement.job_state import AgentRun, AgentTrack, JobState
from mn_prefect.scheduler.plan import plan_job
from mn_prefect.store import open_store
from mn_prefect.store.base import Event

JOB = "job-1"


@pytest.fixture
def store_url(tmp_path):
    """A running job: planned and booked on gpu-1 (a GPU, a dynamic port, a volume), one failed attempt and
    one restart behind it, and two events."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    store.register_node(node("gpu-1", devices=[gpu("GPU-1a", 0, 24576)], host_paths=["/mnt/models"]))
    bp = blueprint(agent("trainer", {"gpu": 1, "cpu": 2, "ports": [{"label": "api"}],
                                     "volumes": [{"name": "models", "source": "/mnt/models", "target": "/models"}]}))
    snap = store.snapshot()
    plan = plan_job(bp, snap.nodes, snap.holds, job_id=JOB)
    assert store.commit_plan(JOB, list(plan.placements)).ok
    now = time.time()
    trainer = bp.agents[0]
    track = AgentTrack(agent_id="trainer", source_agent_id="trainer", node="gpu-1", booking=JOB, status="running",
                       runs=[AgentRun(run_id="run-a", attempt=1, state="FAILED", message="exit code 3", ended_at=now),
                             AgentRun(run_id="run-b", attempt=2, state="RUNNING")],
                       restarts_ms=[int(now * 1000)], restart=trainer.restart, reschedule=trainer.reschedule)
    JobState(job_id=JOB, job_name="train", job_type="batch", status="running", flow_run_id="coordinator-run",
             pool="mn-lab", plan=plan.as_json(), bookings=[JOB], agents={"trainer": track}).save(store)
    store.record_event(Event(kind="job.placed", job_id=JOB, node="gpu-1", reason="1 placement(s) on gpu-1"))
    store.record_event(Event(kind="agent.restarted", job_id=JOB, node="gpu-1", reason="exit code 3"))
    return url


def test_job_status_shows_plan_placements_allocations_runs_restarts_and_events_as_tables(store_url):
    result = run("job", "status", JOB, "--store-url", store_url)
    out = result.stdout
    assert result.returncode == 0, result.stderr
    for title in ("job job-1", "plan", "placements (planned)", "allocations held now", "agents", "runs",
                  "restarts and reschedules", "recent events (2)"):
        assert title in out, title
    assert "runnable_now" in out and "GPU-1a" in out and "api=tcp:20000" in out and "/mnt/models->/models" in out
    assert "run-a" in out and "exit code 3" in out and "3 per 24h, exponential 1s..30s, then fail" in out
    assert "job.placed" in out and "agent.restarted" in out


def test_job_status_json_carries_the_same_plan_placements_and_events(store_url):
    result = run("job", "status", JOB, "--store-url", store_url, "--json")
    doc = json.loads(result.stdout)
    assert result.returncode == 0
    assert doc["plan"]["status"] == "runnable_now" and doc["plan"]["placements"][0]["node"] == "gpu-1"
    [held] = doc["placements"]
    assert held["allocation"]["devices"][0]["id"] == "GPU-1a" and held["allocation"]["ports"][0]["port"] == 20000
    assert [e["kind"] for e in doc["events"]] == ["job.placed", "agent.restarted"]
    trainer = doc["agents"]["trainer"]
    assert [r["run_id"] for r in trainer["runs"]] == ["run-a", "run-b"] and trainer["remaining"]["restarts"] == 2


def test_a_job_that_holds_nothing_says_so(store_url):
    open_store(store_url).release(JOB)
    result = run("job", "status", JOB, "--store-url", store_url)
    assert result.returncode == 0 and "none: the job holds no booking in the store" in result.stdout
    assert "placements (planned)" in result.stdout  # the plan stays on the record


def test_an_unknown_job_exits_1_naming_it(store_url):
    result = run("job", "status", "nope", "--store-url", store_url)
    assert result.returncode == 1 and "no blueprint job 'nope'" in result.stderr
