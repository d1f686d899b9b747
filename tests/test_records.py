"""The store's typed job records (mn_prefect.store.records): every kind round-trips through a real SQLite
store, rows of no known kind or with a bad body fail naming the job id and the field, listing filters by kind,
and each state set is defined once."""

from __future__ import annotations

from typing import get_args

import pytest

from mn_prefect.model.policies import (
    JOB_TYPES,
    RECOVERY_MODES,
    STRATEGIES,
    JobType,
    RecoveryMode,
    RetryPolicy,
    Strategy,
)
from mn_prefect.model.pool_policy import DenyRule, PoolPolicy
from mn_prefect.model.states import FINISHED_JOB_STATUSES, JOB_STATUSES, TERMINAL_RUN_STATES
from mn_prefect.placement.job_state import load_job, release_job
from mn_prefect.store import JobRecord, open_store
from mn_prefect.store.records import (
    KINDS,
    AgentRun,
    AgentTrack,
    BookedDeviceUse,
    DeviceUseRecord,
    DrainRecord,
    FairShareRecord,
    FlowRunRecord,
    InvalidRecord,
    JobState,
    MetricsEndpointRecord,
    PoolPolicyRecord,
    ReservationRecord,
    RunControlRecord,
    RuntimeHistoryRecord,
    ServiceRecord,
    StepResultRecord,
    StepSummary,
    WorkflowRecord,
    from_row,
    get_record,
    list_records,
    put_record,
    to_row,
)


@pytest.fixture
def store(tmp_path):
    store = open_store(f"sqlite:///{tmp_path}/s.db")
    yield store
    store.close()


def _policy() -> RetryPolicy:
    return RetryPolicy(attempts=3, interval_ms=60_000, delay_ms=1000, mode="fail")


def _records() -> list:
    track = AgentTrack(agent_id="a", source_agent_id="a", node="n1", booking="job-1", status="running",
                       runs=[AgentRun(run_id="r1", attempt=1, state="RUNNING")], restart=_policy(),
                       reschedule=_policy())
    return [
        FlowRunRecord(job_id="0b5d3c1e-run", name="brave-fox", job_type="service", recovery_mode="cluster_recover",
                      node="n1", reschedules_ms=[1, 2]),
        JobState(job_id="job-1", job_name="train", job_type="batch", status="running", flow_run_id="coord",
                 pool="mn-lab", plan={"status": "runnable_now"}, bookings=["job-1"], agents={"a": track}),
        WorkflowRecord(job_id="wf-1", job_name="pipeline", run_id="run-1", run_dir="/tmp/runs/run-1", pid=123,
                       host="h", bundle="/b", steps={"s1": StepSummary(state="completed", attempts=1, node="n1",
                                                                        launches=1, outcome="success")},
                       status="completed", state="COMPLETED", result={"answer": [42]}),
        StepResultRecord(job_id="wf-1#3:result", label="s1", exit_code=0, stdout="hi\n", stderr="", seconds=0.5,
                         node="n1"),
        DrainRecord(job_id="drain:n2", node="n2", reason="kernel update", deadline=100.0, started_at=10.0),
        ReservationRecord(job_id="rsv-0123abcd", name="demo", expires_at=200.0, resources={"cpu": 2}, group="lab",
                          nodes=["n1"], key_sha256="ab" * 32),
        RunControlRecord(job_id="run-control:run-1", run_id="run-1", status="paused", reason="an operator"),
        ServiceRecord(job_id="service:run-1:web", name="web", service_id="web", run_id="run-1", node="n1", port=8080,
                      tags=["blue"], status="passing", checks=[{"type": "http", "path": "/health", "port": 8080}]),
        FairShareRecord(job_id="fair-share", half_life_s=600, at=5.0, decayed={"train": {"gpu": 2.5}}),
        PoolPolicyRecord(job_id="pool-policy:prod", pool="prod", policy=PoolPolicy(
            deny=(DenyRule(subject="tag", pattern="exp*", reason="no experiments"),), tag_priorities={"urgent": 50})),
        MetricsEndpointRecord(job_id="metrics:n1", node="n1", pool="prod", url="http://127.0.0.1:9465/metrics",
                              pid=42),
        RuntimeHistoryRecord(job_id="runtime:deployment:d-1", key="deployment:d-1", durations_s=[12.5, 30.0], count=7),
        DeviceUseRecord(job_id="device-use:n1", node="n1", sampled_at=50.0, devices=[
            BookedDeviceUse(device="GPU-a", bookings=["run-1"], percent=2.0, memory_used_mb=512.0,
                            quiet_since=10.0, idle=True)]),
    ]


@pytest.mark.parametrize("index", range(7), ids=["flow_run", "blueprint_job", "workflow", "step_result", "drain",
                                                 "reservation", "run_control"])
def test_each_kind_round_trips_through_the_store(store, index):
    record = _records()[index]
    put_record(store, record)
    back = get_record(store, record.job_id)
    assert type(back) is type(record) and _same(back, record)
    row = store.get_job(record.job_id)
    assert row.job_type == record.kind and row.status == record.status  # the storage row: kind in job_type
    assert _same(get_record(store, record.job_id, type(record)), record)


def _same(a, b) -> bool:
    """Equal but for ``updated_at``, which the store sets on every write."""
    return a.model_copy(update={"updated_at": 0}) == b.model_copy(update={"updated_at": 0})


def test_the_name_column_holds_each_kind_s_name(store):
    for record in _records():
        put_record(store, record)
    names = {r.job_id: r.name for r in store.list_jobs()}
    assert names == {"0b5d3c1e-run": "brave-fox", "job-1": "train", "wf-1": "pipeline", "wf-1#3:result": "s1",
                     "drain:n2": "n2", "rsv-0123abcd": "demo", "run-control:run-1": "run-1", "service:run-1:web": "web",
                     "fair-share": "fair-share", "pool-policy:prod": "prod", "metrics:n1": "n1",
                     "runtime:deployment:d-1": "deployment:d-1", "device-use:n1": "n1"}


def test_a_lookup_of_another_kind_is_none(store):
    put_record(store, _records()[0])
    assert get_record(store, "0b5d3c1e-run", JobState) is None and load_job(store, "0b5d3c1e-run") is None
    assert get_record(store, "nope") is None and get_record(store, "nope", FlowRunRecord) is None


def test_listing_filters_by_kind_and_status(store):
    for record in _records():
        put_record(store, record)
    put_record(store, FlowRunRecord(job_id="run-2", node="n2", status="migrating"))
    assert sorted(r.job_id for r in list_records(store, FlowRunRecord)) == ["0b5d3c1e-run", "run-2"]
    assert [r.job_id for r in list_records(store, FlowRunRecord, status="migrating")] == ["run-2"]
    assert [r.job_id for r in list_records(store, JobState)] == ["job-1"]
    assert [r.job_id for r in list_records(store, DrainRecord)] == ["drain:n2"]
    assert list_records(store, JobState, status="migrating") == []
    assert {r.kind for r in list_records(store)} == set(KINDS)


def test_an_unknown_kind_names_the_job_id_and_the_field(store):
    store.put_job(JobRecord(job_id="mystery", job_type="teleport", spec={"x": 1}))
    with pytest.raises(InvalidRecord) as caught:
        get_record(store, "mystery")
    message = str(caught.value)
    assert "'mystery'" in message and "job_type" in message and "teleport" in message
    assert caught.value.job_id == "mystery" and caught.value.fields == ["job_type"]
    with pytest.raises(InvalidRecord, match="mystery"):
        list_records(store, FlowRunRecord)  # a row of no known kind is an error, not skipped silently


@pytest.mark.parametrize("row, field", [
    (JobRecord(job_id="drain:n", name="n", job_type="drain", status="active",
               spec={"reason": "r", "deadline": "soon", "started_at": 1.0}), "deadline"),
    (JobRecord(job_id="drain:n", name="n", job_type="drain", status="active",
               spec={"deadline": 2.0, "started_at": 1.0}),
     "reason"),
    (JobRecord(job_id="run", job_type="flow_run", status="placed", spec={"node": "n", "recovery_mode": "pray"}),
     "recovery_mode"),
    (JobRecord(job_id="run", job_type="flow_run", status="exploded", spec={"node": "n"}), "status"),
    (JobRecord(job_id="wf", job_type="workflow", status="running",
               spec={"run_id": "r", "run_dir": "/d", "bundle": "/b", "steps": {"s1": {"state": "dreaming"}}}),
     "steps.s1.state"),
])
def test_a_bad_body_names_the_job_id_and_the_field(store, row, field):
    store.put_job(row)
    with pytest.raises(InvalidRecord) as caught:
        get_record(store, row.job_id)
    assert f"'{row.job_id}'" in str(caught.value) and field in caught.value.fields, str(caught.value)


def test_a_record_with_a_field_set_to_a_value_its_kind_does_not_allow_is_not_written(store):
    record = FlowRunRecord(job_id="run", node="n")
    record.status = "exploded"  # type: ignore[assignment]
    with pytest.raises(InvalidRecord, match="'run'.*status"):
        put_record(store, record)
    assert store.get_job("run") is None


def test_rows_written_before_kinds_existed_are_read(store):
    """Flow runs and blueprint jobs kept the job type in ``job_type``; their bodies say what they are."""
    store.put_job(JobRecord(job_id="old-run", name="r", job_type="service", status="paused",
                            spec={"kind": "flow_run", "recovery_mode": "cluster_recover", "node": "n1",
                                  "reschedules_ms": [5]}))
    job = JobState(job_id="old-job", job_name="train", job_type="system")
    store.put_job(JobRecord(job_id="old-job", name="train", job_type="system", status="pending",
                            spec=job.model_dump(mode="json", exclude={"kind"})))
    old_run = get_record(store, "old-run", FlowRunRecord)
    assert old_run is not None and old_run.reschedules_ms == [5] and old_run.recovery_mode == "cluster_recover"
    assert old_run.job_type == "batch"  # the body had no job type: the default (it was in the column)
    assert load_job(store, "old-job").job_type == "system"


def test_a_released_job_keeps_its_created_time_and_is_finished(store):
    job = _records()[1]
    job.save(store)
    created = store.get_job("job-1").created_at
    release_job(store, job, "completed", "done")
    back = load_job(store, "job-1")
    assert back.finished and back.status in FINISHED_JOB_STATUSES and back.agents["a"].status == "stopped"
    assert store.get_job("job-1").created_at == created
    with pytest.raises(ValueError, match="not 'running'"):
        release_job(store, back, "running", "no")


def test_to_row_and_from_row_are_inverse():
    for record in _records():
        row = to_row(record)
        assert isinstance(row, JobRecord) and from_row(row) == record
        assert "kind" not in row.spec and "job_id" not in row.spec and "status" not in row.spec


def test_state_sets_are_defined_once_and_agree_with_the_policies():
    assert set(get_args(JobType)) == set(JOB_TYPES) and set(get_args(Strategy)) == set(STRATEGIES)
    assert set(get_args(RecoveryMode)) == set(RECOVERY_MODES)
    assert FINISHED_JOB_STATUSES <= set(JOB_STATUSES)
    from prefect.client.schemas.objects import StateType

    assert {StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED} == {
        s for s in StateType if s in TERMINAL_RUN_STATES}


def test_a_runtime_history_round_trips_and_refuses_a_negative_or_endless_duration(store):
    [record] = [r for r in _records() if isinstance(r, RuntimeHistoryRecord)]
    put_record(store, record)
    assert _same(get_record(store, record.job_id, RuntimeHistoryRecord), record)
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="durations_s"):
            RuntimeHistoryRecord(job_id="runtime:k", key="k", durations_s=[bad])


def test_a_device_use_record_round_trips_and_refuses_a_utilisation_out_of_range(store):
    [record] = [r for r in _records() if isinstance(r, DeviceUseRecord)]
    put_record(store, record)
    assert _same(get_record(store, record.job_id, DeviceUseRecord), record)
    with pytest.raises(ValueError, match="percent"):
        BookedDeviceUse(device="GPU-a", percent=101.0)
