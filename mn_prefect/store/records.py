"""Typed records of the store's jobs table: one model per kind of record, told apart by ``kind``.

The table holds several kinds of record. Each backend keeps a row as ``JobRecord`` (job_id, name, job_type,
status, spec as JSON, created_at, updated_at); this module is the typed layer over it:

* the row's ``job_type`` is the record's ``kind`` (the discriminator), ``status`` its status, ``name`` the
  kind's name field (a run's name, a job's name, a step's label, a drain's node) and ``spec`` the rest of it;
* ``to_row`` / ``from_row`` convert, ``put_record`` / ``get_record`` / ``list_records`` read and write a store.

Kinds:

=================  ================================================  ==========================================
kind               what                                              status
=================  ================================================  ==========================================
``flow_run``       a flow run the worker placed (FlowRunRecord)      placed, rescheduled, paused, failed,
                                                                     migrating, migrated
``blueprint_job``  a blueprint job its coordinator runs (JobState)   pending, waiting, running, completed,
                                                                     failed, cancelled
``workflow``       a bundle workflow run (WorkflowRecord)            pending, running, completed, failed,
                                                                     cancelled, crashed
``step_result``    the result of a step run on another node          done
                   (StepResultRecord, job id ``<booking>:result``)
``drain``          a node's drain (DrainRecord, ``drain:<node>``)    active, complete, cancelled
``reservation``    capacity held until it expires                    active, released, expired (refused: only
                   (ReservationRecord, job id = the reservation id   read, from earlier versions)
                   = its booking's id; a refusal leaves none)
``metrics_endpoint``
                   where a node's worker serves its Prometheus      serving
                   metrics (MetricsEndpointRecord, ``metrics:<node>``)
``runtime_history``
                   the durations of the last completed runs of one  current
                   deployment, bundle step or blueprint agent
                   (RuntimeHistoryRecord, ``runtime:<key>``)
=================  ================================================  ==========================================

A row whose kind is unknown, or whose body does not validate, raises ``InvalidRecord`` naming the job id and
the field. Rows written before the kinds existed (a flow run's or a blueprint job's row carried the job type
in ``job_type``) are still read.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal, TypeVar, overload

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from mn_prefect.model.blueprint_job import AgentRun as AgentRun, AgentTrack as AgentTrack, BlueprintJob

# AgentRun and AgentTrack are re-exported: code that imported them from here before they moved keeps working.
from mn_prefect.model.estimates import HISTORY_SIZE
from mn_prefect.model.policies import JobType, RecoveryMode
from mn_prefect.model.pool_policy import PoolPolicy
from mn_prefect.model.states import (
    DrainStatus,
    FlowRunStatus,
    StepOutcome,
    StepResultStatus,
    StepState,
    WorkflowOutcome,
    WorkflowStatus,
)
from mn_prefect.store.base import ClusterStore, JobRecord

Kind = Literal["flow_run", "blueprint_job", "workflow", "step_result", "drain", "reservation"]


class InvalidRecord(ValueError):
    """A row of the jobs table that is no record of a known kind, or whose body does not fit its kind."""

    def __init__(self, job_id: str, kind: str | None, problems: list[tuple[str, str]]):
        self.job_id, self.kind, self.problems = job_id, kind, problems
        what = f"job record {job_id!r}" + (f" ({kind})" if kind else "")
        super().__init__(f"{what}: " + "; ".join(f"{field}: {message}" for field, message in problems))

    @property
    def fields(self) -> list[str]:
        return [field for field, _ in self.problems]


class _Record(BaseModel):
    """What every kind has; ``NAME_FIELD`` is the field kept in the row's ``name`` column."""

    NAME_FIELD: ClassVar[str] = "name"

    job_id: str = Field(min_length=1)
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)


# -- flow runs the worker placed ------------------------------------------------------------------------------

class FlowRunRecord(_Record):
    """A flow run the worker placed: what the reconciler and drains need after its node is lost."""

    kind: Literal["flow_run"] = "flow_run"
    name: str | None = Field(None, description="The flow run's name.")
    status: FlowRunStatus = "placed"
    job_type: JobType = "batch"
    recovery_mode: RecoveryMode = "local_restart"
    node: str = Field(description="The node it was placed on.")
    reschedules_ms: list[int] = Field(default_factory=list, description="When it was re-placed after node loss.")
    # Preemption (mn_prefect.preemption): the run's grace when it is preemptible; once preempted, when it was told,
    # until when it may run, for whom, and how it stopped; its last checkpoint; the work preemptions threw away.
    queue: str | None = Field(None, description="The work queue it was placed from.")
    # What usage accounting (ops/accounting.py) labels the run's bookings with: its deployment, flow and tags
    deployment_id: str | None = Field(None, description="The run's deployment (Prefect's id), if any.")
    flow_id: str | None = Field(None, description="The run's flow (Prefect's id).")
    tags: list[str] = Field(default_factory=list, description="The run's tags when it was placed.")
    preemption_grace_s: float | None = None
    noticed_at: float | None = None
    deadline: float | None = None
    preempted_by: str | None = None
    preempted_by_name: str | None = None
    outcome: Literal["checkpointed", "killed"] | None = None
    checkpointed_at: float | None = None
    lost_gpu_s: float = 0.0
    lost_cpu_s: float = 0.0
    preempted_checkpointed: int = 0
    preempted_killed: int = 0


# -- blueprint jobs ---------------------------------------------------------------------------------------------

class JobState(_Record, BlueprintJob):
    """A blueprint job (``BlueprintJob``) as the store keeps it. The coordinator flow writes it whenever it
    changed; ``job status``, the worker's sweep and the lifecycle flows read it."""

    NAME_FIELD: ClassVar[str] = "job_name"

    kind: Literal["blueprint_job"] = "blueprint_job"

    def save(self, store: ClusterStore) -> None:
        put_record(store, self)


BlueprintJobRecord = JobState


# -- bundle workflow runs ---------------------------------------------------------------------------------------

class StepSummary(BaseModel):
    """One step of a workflow run, as ``job status`` and ``job list`` show it."""

    state: StepState
    attempts: int = 0
    node: str | None = None
    launches: int = 0
    outcome: StepOutcome | None = None
    reason: str | None = None


class WorkflowRecord(_Record):
    """A bundle workflow run: where its process runs (for the sweep after a crash) and how its steps stand."""

    NAME_FIELD: ClassVar[str] = "job_name"

    kind: Literal["workflow"] = "workflow"
    job_name: str | None = None
    status: WorkflowStatus = "running"
    run_id: str
    run_dir: str
    pid: int | None = Field(None, description="The process that runs it, on ``host``.")
    host: str | None = None
    flow_run_id: str | None = None
    bundle: str = Field(description="The bundle folder.")
    steps: dict[str, StepSummary] = Field(default_factory=dict)
    state: WorkflowOutcome | None = Field(None, description="Once the run is over: how it ended.")
    result: Any = Field(None, description="Once the run is over: the sink's output (free-form).")
    held: bool = Field(False, description="Its runner starts no new step: an operator paused it (RunControlRecord).")


# -- a step's result, for a workflow whose step ran on another node ----------------------------------------------

class StepResultRecord(_Record):
    """What one step attempt left behind (a ``ProcessResult``), written by the ``mn-step`` flow."""

    NAME_FIELD: ClassVar[str] = "label"

    kind: Literal["step_result"] = "step_result"
    label: str | None = None
    status: StepResultStatus = "done"
    exit_code: int
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    timed_out: bool = False
    refused: str | None = None
    node: str | None = None
    runs: int = 1

    def result_json(self) -> dict[str, Any]:
        """The ``ProcessResult.as_json`` form."""
        return self.model_dump(include={"exit_code", "stdout", "stderr", "seconds", "timed_out", "refused", "node",
                                        "runs"})


# -- drains -----------------------------------------------------------------------------------------------------

def drain_record_id(node: str) -> str:
    return f"drain:{node}"


class DrainRecord(_Record):
    """A node's drain (docs/operating.md), beside the node's ``draining`` status."""

    NAME_FIELD: ClassVar[str] = "node"

    kind: Literal["drain"] = "drain"
    node: str
    status: DrainStatus = "active"
    reason: str
    deadline: float
    started_at: float


# -- an operator's hold on a running bundle run -----------------------------------------------------------------

def run_control_id(run_id: str) -> str:
    return f"run-control:{run_id}"


class RunControlRecord(_Record):
    """A pause of a running bundle run (``mn job pause``): while ``paused``, its runner starts no new step;
    steps already running go on. The runner reads it; resuming sets ``running``."""

    NAME_FIELD: ClassVar[str] = "run_id"

    kind: Literal["run_control"] = "run_control"
    run_id: str
    status: Literal["paused", "running"] = "paused"
    reason: str | None = None


# -- services a bundle run offers ----------------------------------------------------------------------------------

ServiceStatus = Literal["passing", "warning", "critical", "deregistered"]


def service_record_id(run_id: str, service_id: str) -> str:
    return f"service:{run_id}:{service_id}"


class ServiceRecord(_Record):
    """A service a running bundle offers (the manifest's ``services``), with the status its run's checks give it;
    ``deregistered`` once the run ended, gone once ``expires_at`` passes unrenewed (a run that was killed)."""

    NAME_FIELD: ClassVar[str] = "name"

    kind: Literal["bundle_service"] = "bundle_service"  # not "service": old rows keep that job type in its column
    name: str
    service_id: str
    run_id: str
    bundle_job_id: str | None = None
    node: str | None = None
    address: str = "127.0.0.1"
    port: int | None = None
    tags: list[str] = Field(default_factory=list)
    status: ServiceStatus = "critical"
    checks: list[dict[str, Any]] = Field(default_factory=list)
    # Renewed by the run while it lives: past it, the run is gone (killed, its node lost) and so is the service
    expires_at: float | None = None
    note: str | None = None


# -- reservations -------------------------------------------------------------------------------------------------

# "refused" is only read: earlier versions kept a record of each refused reservation; none is written now, and
# the ones kept are never listed (placement.reservations.listing).
ReservationStatus = Literal["active", "released", "expired", "refused"]


class ReservationRecord(_Record):
    """A reservation (docs/operating.md): what was asked, where it is held and until when. Its booking has the
    same id; the record is written before the booking, so a crash in between leaves a record that expires."""

    kind: Literal["reservation"] = "reservation"
    name: str | None = Field(None, description="A name people gave it.")
    status: ReservationStatus = "active"
    expires_at: float = Field(description="Seconds since the epoch; from this instant it holds nothing.")
    resources: dict[str, Any] = Field(default_factory=dict, description="The resource request it holds.")
    group: str | None = None
    node: str | None = Field(None, description="The node asked for, if any.")
    nodes: list[str] = Field(default_factory=list, description="Where it is held.")
    key_sha256: str | None = Field(None, description="The key's SHA-256 (runs inside it must give the key).")
    reason: str | None = Field(None, description="Why it ended.")
    ended_at: float | None = None
    announced: bool = Field(False, description="Whether its end was announced (event, notification).")


# -- fair share -----------------------------------------------------------------------------------------------------

FAIR_SHARE_ID = "fair-share"


class FairShareRecord(_Record):
    """Every queue's past use, decaying over ``half_life_s`` (scheduler/fairshare.py), as of ``at``: the pool's
    announcer moves it on from the queues' accounts; every worker orders its waiting runs with it."""

    NAME_FIELD: ClassVar[str] = "job_id"

    kind: Literal["fair_share"] = "fair_share"
    status: Literal["current"] = "current"
    half_life_s: float = Field(3600.0, ge=0, description="Seconds over which a queue's past use halves.")
    at: float = 0.0
    decayed: dict[str, dict[str, float]] = Field(default_factory=dict)


def pool_policy_id(pool: str) -> str:
    return f"pool-policy:{pool}"


class PoolPolicyRecord(_Record):
    """A pool's deny-list and default priorities by tag (model/pool_policy.py), read by its workers."""

    NAME_FIELD: ClassVar[str] = "pool"

    kind: Literal["pool_policy"] = "pool_policy"
    status: Literal["current"] = "current"
    pool: str
    policy: PoolPolicy = Field(default_factory=PoolPolicy)


# -- metrics endpoints ----------------------------------------------------------------------------------------------

def metrics_endpoint_id(node: str) -> str:
    return f"metrics:{node}"


class MetricsEndpointRecord(_Record):
    """Where node ``node``'s worker serves its Prometheus metrics (docs/operating.md), written when it starts
    serving, so tools find a port the worker chose (``MN_METRICS_PORT=0``): ``mn-prefect metrics targets``."""

    NAME_FIELD: ClassVar[str] = "node"

    kind: Literal["metrics_endpoint"] = "metrics_endpoint"
    status: Literal["serving"] = "serving"
    node: str
    pool: str | None = None
    url: str = Field(description="http://HOST:PORT/metrics")
    pid: int | None = None


# -- what each worker's device watch saw ----------------------------------------------------------------------------

def device_use_id(node: str) -> str:
    return f"device-use:{node}"


class BookedDeviceUse(BaseModel):
    """One booked GPU at the device watch's last sample (worker/device_watch.py): who booked it, what it did, and
    what the pool's rule made of it."""

    device: str = Field(min_length=1, description="The GPU's id (its UUID).")
    bookings: list[str] = Field(default_factory=list)
    percent: float | None = Field(None, ge=0, le=100, description="Utilisation (NVML), percent; None: not reported.")
    memory_used_mb: float = Field(0.0, ge=0)
    booked_mb: float | None = Field(None, ge=0, description="What its shares booked; None: held whole.")
    quiet_since: float | None = Field(None, description="Since when it has been under the idle threshold.")
    idle: bool = Field(False, description="Under the threshold for the pool's idle_gpu_seconds (mn.device.idle).")
    over_memory: bool = Field(False, description="Shared, and using more memory than its shares booked.")


class DeviceUseRecord(_Record):
    """What node ``node``'s device watch saw of its booked GPUs at its last sample, rewritten at each sample: what
    ``resource list --store`` and the cluster's metrics show of booked GPUs that do nothing or use more memory
    than they booked."""

    NAME_FIELD: ClassVar[str] = "node"

    kind: Literal["device_use"] = "device_use"
    status: Literal["current"] = "current"
    node: str = Field(min_length=1)
    sampled_at: float = Field(description="When the sample was taken (seconds since the epoch).")
    every_s: float = Field(30.0, gt=0, description="How often the worker samples.")
    idle_percent: float = Field(5.0, ge=0, le=100)
    idle_after_s: float = Field(1800.0, ge=0)
    devices: list[BookedDeviceUse] = Field(default_factory=list)


# -- runtime histories ---------------------------------------------------------------------------------------------

def runtime_history_id(key: str) -> str:
    return f"runtime:{key}"


class RuntimeHistoryRecord(_Record):
    """How long the last completed runs under ``key`` (``deployment:<id>``, ``step:<bundle>/<step>``,
    ``agent:<blueprint>/<agent>``) held their bookings, in seconds, oldest first (at most
    ``model.estimates.HISTORY_SIZE``), and how many were ever recorded: what a learned estimate is taken from
    (placement/estimates.py)."""

    NAME_FIELD: ClassVar[str] = "key"

    kind: Literal["runtime_history"] = "runtime_history"
    status: Literal["current"] = "current"
    key: str = Field(min_length=1)
    durations_s: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        default_factory=list, max_length=HISTORY_SIZE, description="Seconds each run held its booking.")
    count: int = Field(0, ge=0, description="Completed runs ever recorded under the key.")


# -- rows <-> records ---------------------------------------------------------------------------------------------

Record = (FlowRunRecord | JobState | WorkflowRecord | StepResultRecord | DrainRecord | ReservationRecord
          | RunControlRecord | ServiceRecord | FairShareRecord | PoolPolicyRecord | MetricsEndpointRecord
          | RuntimeHistoryRecord | DeviceUseRecord)
AnyRecord = Annotated[Record, Field(discriminator="kind")]
R = TypeVar("R", FlowRunRecord, JobState, WorkflowRecord, StepResultRecord, DrainRecord, ReservationRecord,
            RunControlRecord, ServiceRecord, FairShareRecord, PoolPolicyRecord, MetricsEndpointRecord,
            RuntimeHistoryRecord, DeviceUseRecord)

KINDS: dict[str, type[Record]] = {"flow_run": FlowRunRecord, "blueprint_job": JobState, "workflow": WorkflowRecord,
                                  "step_result": StepResultRecord, "drain": DrainRecord,
                                  "reservation": ReservationRecord, "run_control": RunControlRecord,
                                  "bundle_service": ServiceRecord, "fair_share": FairShareRecord,
                                  "pool_policy": PoolPolicyRecord, "metrics_endpoint": MetricsEndpointRecord,
                                  "runtime_history": RuntimeHistoryRecord, "device_use": DeviceUseRecord}
_ADAPTER: TypeAdapter[Record] = TypeAdapter(AnyRecord)
_COLUMNS = {"kind", "job_id", "status", "created_at", "updated_at"}


def _legacy_kind(row: JobRecord) -> str | None:
    """The kind of a row written before kinds existed (the job type in ``job_type``, a marker in ``spec``)."""
    marker = row.spec.get("kind")
    if marker == "flow_run":
        return "flow_run"
    if marker == "bundle_run":
        return "workflow"
    if "agents" in row.spec and "job_name" in row.spec:
        return "blueprint_job"
    return None


def kind_of(row: JobRecord) -> str:
    """The row's kind; InvalidRecord when it is none of the known kinds."""
    if row.job_type in KINDS:
        return row.job_type
    legacy = _legacy_kind(row)
    if legacy is None:
        raise InvalidRecord(row.job_id, None, [("job_type", f"unknown record kind {row.job_type!r} (known: "
                                                            f"{', '.join(KINDS)})")])
    return legacy


def _field(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "spec"


def _invalid(job_id: str, kind: str, error: ValidationError) -> InvalidRecord:
    problems = []
    for item in error.errors(include_url=False):
        loc = tuple(item["loc"])
        if loc and loc[0] == kind:  # the tagged union's own level
            loc = loc[1:]
        problems.append((_field(loc), item["msg"]))
    return InvalidRecord(job_id, kind, problems)


def from_row(row: JobRecord) -> Record:
    """The typed record a row holds; InvalidRecord (naming the job id and the field) when it holds none."""
    kind = kind_of(row)
    model = KINDS[kind]
    if not isinstance(row.spec, dict):
        raise InvalidRecord(row.job_id, kind, [("spec", f"must be an object, got {type(row.spec).__name__}")])
    data: dict[str, Any] = {**row.spec, "kind": kind, "job_id": row.job_id, "status": row.status,
                            "created_at": row.created_at, "updated_at": row.updated_at}
    if row.name is not None:
        data[model.NAME_FIELD] = row.name
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as error:
        raise _invalid(row.job_id, kind, error) from None


def to_row(record: Record) -> JobRecord:
    """The row that stores ``record``; InvalidRecord when the record no longer validates (a field set to a
    value its kind does not allow), so nothing unreadable is written."""
    body = record.model_dump(mode="json", exclude=_COLUMNS | {record.NAME_FIELD}, warnings=False)
    row = JobRecord(job_id=record.job_id, name=getattr(record, record.NAME_FIELD), job_type=record.kind,
                    status=record.status, spec=body, created_at=record.created_at, updated_at=record.updated_at)
    from_row(row)  # the check on write: what is stored reads back
    return row


# -- in a store ------------------------------------------------------------------------------------------------

def put_record(store: ClusterStore, record: Record) -> None:
    """Write ``record`` (the store keeps the row's first ``created_at`` and sets ``updated_at``)."""
    store.put_job(to_row(record))


@overload
def get_record(store: ClusterStore, job_id: str) -> Record | None: ...
@overload
def get_record(store: ClusterStore, job_id: str, kind: type[R]) -> R | None: ...
def get_record(store: ClusterStore, job_id: str, kind: type[Any] | None = None) -> Any:
    """The record ``job_id``; with ``kind``, None also when the row is of another kind."""
    row = store.get_job(job_id)
    if row is None:
        return None
    if kind is not None and kind_of(row) != _kind_name(kind):
        return None
    return from_row(row)


@overload
def list_records(store: ClusterStore, *, status: str | None = None) -> list[Record]: ...
@overload
def list_records(store: ClusterStore, kind: type[R], *, status: str | None = None) -> list[R]: ...
def list_records(store: ClusterStore, kind: type[Any] | None = None, *, status: str | None = None) -> list[Any]:
    """Every record (of ``kind``; with ``status``, in that status), in the store's order."""
    wanted = None if kind is None else _kind_name(kind)
    return [from_row(row) for row in store.list_jobs(status=status) if wanted is None or kind_of(row) == wanted]


def _kind_name(kind: type[Any]) -> str:
    name = kind.model_fields["kind"].default
    if name not in KINDS:
        raise TypeError(f"{kind.__name__} is not a record kind")
    return name
