"""Checkpoints in the queue-aware simulator (simulate/fair.py): a preempted job resumes from its last checkpoint
and loses only the work since, or starts again from scratch when it never checkpointed; the work lost is reported
as ``lost_gpu_hours`` / ``lost_cpu_hours``. One GPU and hand-made traces, so every figure is worked out by hand."""

from __future__ import annotations

import json
import math

import pytest

from mn_prefect.model.node import NodeRecord
from mn_prefect.model.queues import QueueSpec
from mn_prefect.simulate.fair import last_checkpoint, replay_queues
from mn_prefect.simulate.trace import read_trace

# batch (priority 0) runs preemptible; urgent (priority 10) evicts it
QUEUES = [QueueSpec(name="batch"), QueueSpec(name="urgent", priority=10)]


def one_gpu() -> list[NodeRecord]:
    return [NodeRecord(name="n", cpu_cores=8, memory_mb=65536,
                       devices=[{"id": "g0", "index": 0, "kind": "gpu", "memory_total_mb": 16384}])]


def line(job: str, t: float, duration: float, queue: str, **extra) -> str:
    return json.dumps({"t": t, "job": job, "duration": duration, "resources": {"gpu": 1, "cpu": 2}, "queue": queue,
                       **({"preemptible": True} if queue == "batch" else {}), **extra})


# b0 needs an hour; u0 (10 minutes) arrives at 1500 s and evicts it
ONE_EVICTION = [line("b0", 0, 3600, "batch"), line("u0", 1500, 600, "urgent")]


def replay(lines, every: float = 0.0):
    return replay_queues(one_gpu(), read_trace(lines), QUEUES, "preempt", checkpoint_every_s=every)


@pytest.mark.parametrize(("every", "lost_s", "makespan"), [
    (0.0, 1500, 2100 + 3600),  # no checkpoints: 1500 s lost, it starts again from scratch after u0
    (600.0, 300, 2100 + 2400),  # checkpoints at 600 and 1200 s: 300 s lost, it resumes with 2400 s to go
    (1000.0, 500, 2100 + 2600),  # a checkpoint at 1000 s: 500 s lost
    (3000.0, 1500, 2100 + 3600),  # its first checkpoint would have come at 3000 s: as good as none
])
def test_the_work_lost_to_one_eviction(every, lost_s, makespan):
    result = replay(ONE_EVICTION, every)
    assert result.preemptions == 1 and result.completed == 2
    assert result.lost_gpu_s == pytest.approx(lost_s) and result.lost_cpu_s == pytest.approx(2 * lost_s)
    doc = result.as_dict()
    assert doc["lost_gpu_hours"] == pytest.approx(lost_s / 3600)
    assert doc["lost_cpu_hours"] == pytest.approx(2 * lost_s / 3600)
    assert doc["queues"]["batch"]["lost_gpu_hours"] == pytest.approx(lost_s / 3600)
    assert doc["queues"]["urgent"]["lost_gpu_hours"] == 0
    assert result.makespan == pytest.approx(makespan)
    assert result.util_gpu == pytest.approx((3600 + 600) / makespan)  # useful work only, lost work not counted
    assert result.queues["batch"].wait_p95 == pytest.approx(makespan - 3600)  # lost work counts as waiting


def test_a_trace_line_overrides_the_option_and_0_means_never():
    assert replay([line("b0", 0, 3600, "batch", checkpoint_every_s=1000), ONE_EVICTION[1]],
                  600).lost_gpu_s == pytest.approx(500)
    assert replay([line("b0", 0, 3600, "batch", checkpoint_every_s=0), ONE_EVICTION[1]],
                  600).lost_gpu_s == pytest.approx(1500)
    assert replay([line("b0", 0, 3600, "batch", checkpoint_every_s=600), ONE_EVICTION[1]],
                  0).lost_gpu_s == pytest.approx(300)


def test_checkpoints_count_the_work_of_every_attempt():
    lines = [line("b0", 0, 3600, "batch"), line("u0", 1500, 600, "urgent"),  # lost 300: resumes at 1200 s of work
             line("u1", 2400, 100, "urgent"),  # 300 s into the second attempt, no checkpoint since: lost 300
             line("u2", 3200, 100, "urgent")]  # at 1900 s of work, 1800 was saved at 3100: lost 100
    result = replay(lines, 600)
    assert result.preemptions == 3 and result.queues["batch"].preempted == 3
    assert result.lost_gpu_s == pytest.approx(300 + 300 + 100)
    assert result.makespan == pytest.approx(3300 + 1800)  # resumed at 3300 with 1800 s of work left
    restarts = replay(lines)  # from scratch each time: 1500, 300 and 700 s lost
    assert restarts.lost_gpu_s == pytest.approx(1500 + 300 + 700) and restarts.makespan == pytest.approx(3300 + 3600)


@pytest.mark.parametrize(("start", "saved", "every", "now", "expected"), [
    (0, 0, 600, 1500, 1200),
    (0, 0, 600, 500, -math.inf),  # none yet
    (2100, 1200, 600, 2400, -math.inf),  # resumed from 1200 s, next at 1800 s of work
    (2500, 1200, 600, 3200, 3100),
    (0, 0, 0, 5000, -math.inf),  # 0: never
])
def test_when_a_job_last_checkpointed(start, saved, every, now, expected):
    assert last_checkpoint(start, saved, every, now) == expected


def test_the_least_lost_work_goes_first():
    # two batch jobs on two GPUs: b-old checkpointed a minute before u0 arrives, b-new (started later) never did
    two = [NodeRecord(name="n", cpu_cores=8, memory_mb=65536,
                      devices=[{"id": f"g{k}", "index": k, "kind": "gpu", "memory_total_mb": 16384} for k in (0, 1)])]
    lines = [line("b-old", 0, 7200, "batch", checkpoint_every_s=1140), line("b-new", 600, 7200, "batch"),
             line("u0", 2340, 600, "urgent")]
    result = replay_queues(two, read_trace(lines), QUEUES, "preempt")
    assert result.lost_gpu_s == pytest.approx(60)  # b-old, not b-new (1740 s)
    assert result.log is not None and result.log.started[0] == pytest.approx(2940)  # b-old resumed after u0


@pytest.mark.parametrize(("value", "says"), [
    (-1, "checkpoint_every_s"), ('"abc"', "checkpoint_every_s: must be a number"),
    ("Infinity", "checkpoint_every_s"), ("NaN", "checkpoint_every_s"), ("true", "checkpoint_every_s"),
])
def test_a_bad_checkpoint_every_s_is_refused_naming_the_field(value, says):
    text = ('{"t": 0, "job": "x", "duration": 10, "resources": {"gpu": 1}, "queue": "batch", '
            f'"checkpoint_every_s": {value}}}')
    trace = read_trace([text])
    assert len(trace) == 0 and trace.bad_count == 1
    assert says in str(trace.bad[0]) and trace.bad[0].problems[0].path == "checkpoint_every_s"


@pytest.mark.parametrize("every", [-1.0, math.inf, math.nan])
def test_a_bad_option_is_refused_by_the_replay(every):
    with pytest.raises(ValueError, match="checkpoint_every_s"):
        replay(ONE_EVICTION, every)


def test_the_command_reports_lost_gpu_hours(tmp_path):
    from test_cli import run

    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps([n.model_dump(mode="json") for n in one_gpu()]))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(ONE_EVICTION))
    queues = tmp_path / "q.json"
    queues.write_text(json.dumps({"batch": {}, "urgent": {"priority": 10}}))
    base = ("simulate", "--nodes", nodes, "--trace", trace, "--queues", queues, "--policies", "fair,preempt")
    result = run(*base, "--checkpoint-every", "600", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["checkpoint_every_s"] == 600
    assert doc["policies"]["preempt"]["lost_gpu_hours"] == pytest.approx(300 / 3600)
    assert doc["policies"]["fair"]["lost_gpu_hours"] == 0
    restarts = json.loads(run(*base, "--json").stdout)
    assert restarts["checkpoint_every_s"] == 0 and restarts["policies"]["preempt"]["lost_gpu_hours"] == \
        pytest.approx(1500 / 3600)
    table = run(*base, "--checkpoint-every", "600")
    assert table.returncode == 0 and "lost GPU-h" in table.stdout
    for bad in ("-5", "inf", "nan", "ten"):
        refused = run(*base, "--checkpoint-every", bad)
        assert refused.returncode == 2 and "--checkpoint-every" in refused.stderr, (bad, refused.stderr)
    alone = run("simulate", "--nodes", nodes, "--trace", trace, "--checkpoint-every", "600")
    assert alone.returncode == 2 and "--queues" in alone.stderr
