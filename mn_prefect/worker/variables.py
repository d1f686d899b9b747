"""What a deployment of the ``mn`` pool can ask for: the pool's variables (the form people see in the Prefect
UI, and the schema the server validates job variables against) and the job configuration the worker receives.

The form shows the canonical fields only, typed as what they are (numbers as numbers). The server accepts more
than the form shows: every alias of the resource request (``cpu``, ``memory_gb``, ``gpus``...) and numbers
written as strings ("8", from prefect.yaml or the API), and still refuses a typo or a wrong value with HTTP
422 before a run exists. The worker parses the request once more (``parse_resources``): the schema cannot
express every rule (e.g. legacy ``gpu_count`` agreeing with ``devices``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from prefect.exceptions import ObjectNotFound
from prefect.workers.process import ProcessJobConfiguration, ProcessVariables
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError, to_jsonable_python

from mn_prefect.credentials import is_own_flow
from mn_prefect.model.containers import IMAGE_REFERENCE, container_issues
from mn_prefect.model.estimates import MAX_RUNTIME_S, read_max_runtime
from mn_prefect.model.grace import DEFAULT_GRACE_S, MAX_GRACE_S
from mn_prefect.model.health import HealthCheck
from mn_prefect.model.issues import Issues
from mn_prefect.model.policies import JobType, RecoveryMode, Strategy
from mn_prefect.model.resources import (
    Cores,
    Count,
    DeviceInput,
    PortInput,
    ResourceRequest,
    Size,
    VolumeInput,
    amount_in,
    parse_resources,
)
from mn_prefect.worker.pool_schema import pool_schema
from mn_prefect.worker.templating import templating_error

# The request's grammar (its keys, types, bounds and words) is model/resources.py's: the form shows its input models.
_STRICT = ConfigDict(extra="forbid")



class ResourcesVariable(BaseModel):
    """What each run needs. Every field is optional: leave out what the run does not need."""

    model_config = ConfigDict(extra="forbid", title="Resources")

    cpu_cores: Cores = Field(None, title="CPU cores", description="Fractions allowed, e.g. 0.5.", examples=[2])
    memory_mb: Size = Field(None, title="Memory (MB)", description="1024 MB per GB.", examples=[4096])
    disk_mb: Size = Field(None, title="Disk (MB)", description="Scratch disk on the node, 1024 MB per GB.",
                              examples=[10240])
    gpu_count: Count = Field(None, title="GPUs", description="Any GPUs of the node; for a vendor, driver, memory or "
                                                             "capability, use Devices instead.", examples=[1])
    devices: list[DeviceInput] = Field(
        default_factory=list, title="Devices",
        description="Devices by kind, vendor, driver, memory, capability or id; each is held by one run at a time.",
        examples=[[{"kind": "gpu", "driver": "cuda", "min_memory_mb": 20000, "capabilities": ["bf16"]}]])
    ports: list[PortInput] = Field(
        default_factory=list, title="Ports",
        description="Ports reserved on the node for this run (port 0: any free one, read from MN_PORT_{LABEL}).",
        examples=[[{"label": "api", "port": 0, "protocol": "http"}]])
    volumes: list[VolumeInput] = Field(
        default_factory=list, title="Volumes", description="Host paths the run uses; only nodes that offer them qualify.",
        examples=[[{"name": "models", "source": "/mnt/models", "target": "/models", "mode": "ro"}]])
    runtime_driver: str | None = Field(None, min_length=1, title="Runtime driver",
                                          description="How the run is started: host_local (the default, a process on "
                                                      "the node), docker (a container with the allocation enforced; "
                                                      "set Image) or another driver the node offers.",
                                          examples=["host_local"])

    cores: SkipJsonSchema[Cores] = None
    cpu: SkipJsonSchema[Annotated[float | None, amount_in("cpu")]] = None
    cpu_millis: SkipJsonSchema[Annotated[float | None, amount_in("millicores")]] = None
    cpu_mcores: SkipJsonSchema[Annotated[float | None, amount_in("millicores")]] = None
    memory: SkipJsonSchema[Size] = None
    memory_gb: SkipJsonSchema[Annotated[float | None, amount_in("gb")]] = None
    disk: SkipJsonSchema[Size] = None
    disk_gb: SkipJsonSchema[Annotated[float | None, amount_in("gb")]] = None
    gpus: SkipJsonSchema[Count] = None
    gpu: SkipJsonSchema[Count] = None


class ConstraintVariable(BaseModel):
    model_config = ConfigDict(extra="forbid", title="Constraint")

    attribute: str = Field(min_length=1, title="Attribute",
                           description="capabilities, node, status, role, os, arch, labels.<key>...")
    operator: Literal["==", "=", "!=", "contains", "contains_all", "contains_any", "in", "exists", "not_exists",
                      ">", ">=", "<", "<="] = Field("==", title="Operator")
    value: Any = Field(None, title="Value")


class BookingVariable(BaseModel):
    model_config = ConfigDict(extra="forbid", title="Blueprint booking")

    job_id: str = Field(min_length=1, title="Job", description="The blueprint job that holds the booking.")
    agent_id: str = Field(min_length=1, title="Agent", description="The agent (or agent@node copy) it is for.")


class SystemCopyVariable(BaseModel):
    model_config = ConfigDict(extra="forbid", title="System copy")

    job_id: str = Field(min_length=1, title="System run",
                        description="The system or sysbatch run whose booking holds this copy's part.")
    node: str = Field(min_length=1, title="Node", description="The node this copy runs on.")
    agent_id: str = Field(min_length=1, title="Placement", description="Its placement in that booking (name@node).")


# The check itself is part of the model: a blueprint agent declares the same one (``health`` on the agent).
HealthVariable = HealthCheck


MODULE_NAME = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"  # a preload entry: an importable name


class MNVariables(ProcessVariables):
    """The ``mn`` pool's variables: the resource request and placement policy, plus the process fields."""

    resources: ResourcesVariable = Field(
        default_factory=ResourcesVariable, title="Resources",
        description="What each run needs: CPU, memory, disk, GPUs (by vendor, driver, memory, capability or id), "
                    "ports, host volumes, runtime driver. A run goes to a node that has all of it free.")
    strategy: Literal["binpack", "spread"] = Field(
        "binpack", title="Placement strategy",
        description="binpack fills busy nodes first (keeps others free for big runs); spread balances the load.")
    constraints: list[str | ConstraintVariable] = Field(
        default_factory=list, title="Node constraints",
        description="Which nodes qualify: a capability name such as cuda, or {attribute, operator, value}.",
        examples=[["cuda", {"attribute": "labels.zone", "operator": "==", "value": "a"}]])
    image: str | None = Field(None, min_length=1, pattern=IMAGE_REFERENCE, title="Image",
                                 description="The container image to run in under runtime_driver docker (required "
                                             "there); host_local ignores it.", examples=["python:3.11-slim"])
    preferred_node: str | None = Field(None, title="Preferred node",
                                          description="Run on this node whenever it can take the run.")
    job_type: Literal["service", "batch", "system", "sysbatch"] = Field(
        "batch", title="Job type", description="batch runs to completion; service runs until stopped.")
    recovery_mode: Literal["local_restart", "cluster_recover", "manual_recover"] = Field(
        "local_restart", title="When the node is lost",
        description="local_restart and manual_recover pause the run for review; cluster_recover places it again "
                    "on another node.")
    wait_for_new_nodes: bool = Field(
        False, title="Wait for nodes that may join",
        description="A run that no registered node could ever take (even empty) fails at once, saying why; set "
                    "this to have it wait for a node that can take it to join instead (shown as Never fits, for "
                    "Give up after).")
    not_runnable_timeout_seconds: int = Field(
        600, ge=0, title="Give up after (seconds)",
        description="With Wait for nodes that may join, how long a run that no node could ever take waits for a "
                    "node that can take it, shown as Never fits, then fails (0: at once). One that a node could "
                    "take once it is back (maintenance, a drain, disconnected) waits at least 600 s.")
    priority: int | None = Field(
        None, ge=-1_000_000, le=1_000_000, title="Priority",
        description="Runs of higher priority are placed first (default: the work queue's, set with mn-prefect queue "
                    "set).")
    preemptible: bool = Field(
        False, title="Preemptible",
        description="A run of higher priority that does not fit may stop this run and take its place; it is then "
                    "scheduled again.")
    min_runtime_seconds: int = Field(
        0, ge=0, title="Runs at least (seconds)", description="A preemptible run is not stopped before it has run "
                                                              "this long.")
    preemption_grace_seconds: float = Field(
        DEFAULT_GRACE_S, ge=0, le=MAX_GRACE_S, allow_inf_nan=False, title="Time to checkpoint when preempted (seconds)",
        description="A preemptible run that is preempted is told first (mn_prefect.preemption()) and stopped this "
                    "long after, or as soon as it says it checkpointed (mn_prefect.checkpointed()). At most the "
                    "pool's maximum (600 s unless set with mn-prefect queue policy --max-preemption-grace).")
    reservation: str | None = Field(
        None, title="Reservation", pattern=r"^rsv-[0-9a-f]{8,32}$",
        description="Run inside this reservation (mn-prefect reserve): placed in the capacity it holds, without "
                    "competing with other runs.", examples=["rsv-3f9c2a41b7de"])
    reservation_key: str | None = Field(
        None, title="Reservation key", json_schema_extra={"format": "password"},
        description="The reservation's key, if it was made with one (a Secret block reference keeps it out of the "
                    "deployment: {{ prefect.blocks.secret.NAME }}).")
    max_runtime_seconds: float | None = Field(
        None, gt=0, le=MAX_RUNTIME_S, allow_inf_nan=False, strict=True, title="Runs for about (seconds)",
        description="How long a run takes, in seconds, at most as a rule. Waiting runs are planned around it (who "
                    "can start in the gap before a big run). It never stops a run unless \"Stop at that time\" is "
                    "set. Without it, mn-prefect learns it from the deployment's last completed runs.",
        examples=[3600])
    max_runtime_is_limit: bool = Field(
        False, title="Stop at that time",
        description="Treat \"Runs for about\" as a limit: a run still going after that many seconds is cancelled, "
                    "saying so in its state message.")
    warm_start: bool = Field(
        False, title="Warm start",
        description="Start the run's flow process (runtime_driver host_local) by forking the worker's warm "
                    "launcher, which has Prefect and Preload imported already, instead of starting new "
                    "interpreters; a launcher that cannot take the run makes it start cold. Docker ignores it.")
    preload: list[Annotated[str, StringConstraints(pattern=MODULE_NAME)]] = Field(
        default_factory=list, title="Preload",
        description="With Warm start, modules the launcher imports once for these runs (heavy imports such as "
                    "numpy or torch; it never initialises a GPU). One that does not import is reported once, in "
                    "the worker's log and as an event, and the runs start cold.", examples=[["numpy"]])
    # Not here, so not in the pool's form: ``booking``, ``system_copy`` and ``flow_timeout_seconds``, which mn-prefect
    # itself sets (on the runs it creates; a @requires flow's deployment carries its flow's timeout_seconds):
    # MNJobConfiguration templates them from the run's job variables and checks their shape.

    health: HealthVariable | None = Field(
        None, title="Health check",
        description="Probe the running run on one of its ports (HTTP path or TCP); after failures_to_deallocate "
                    "failures in a row it is cancelled and its booking released.",
        examples=[{"http": "/healthz", "port_label": "api", "interval_s": 30, "timeout_s": 5,
                   "failures_to_deallocate": 3}])

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return pool_schema(super().model_json_schema(*args, **kwargs))


RESOURCES_PATH = "job_variables.resources"
HEALTH_PATH = "job_variables.health"
MAX_RUNTIME_PATH = "job_variables.max_runtime_seconds"
# Set by mn-prefect, read from the run's job variables: not in the pool's template, so not in its form.
_UNTEMPLATED = ("booking", "system_copy", "flow_timeout_seconds")


class RunResources(ResourceRequest):
    """The resource request of one run as the worker receives it: what deployments send (any alias, unit or
    numeric string, a partial object or nothing) parsed once into the canonical ``ResourceRequest``."""

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, data: Any) -> Any:
        data = to_jsonable_python(data)  # a request (or its python dump, with tuples) reads as its JSON
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise PydanticCustomError("resources", "{path}: must be an object, got {got}",
                                      {"path": RESOURCES_PATH, "got": type(data).__name__})
        raw = {k: v for k, v in data.items() if v is not None}  # null is absent (as the form leaves a field)
        issues = Issues()
        request = parse_resources(raw, RESOURCES_PATH, issues)
        if issues or request is None:
            raise _resources_error(issues)
        return dict(request)

    def request(self) -> ResourceRequest:
        """The placement request, as the scheduler takes it."""
        return ResourceRequest.model_validate({name: getattr(self, name) for name in ResourceRequest.model_fields})


def _resources_error(issues: Issues) -> PydanticCustomError:
    """Every issue of a run's request as one error of type ``resources`` (the worker reports each by its path)."""
    return PydanticCustomError("resources", "{detail}", {"detail": "; ".join(str(i) for i in issues.items),
                                                         "issues": [i.as_dict() for i in issues.items]})


def _marker(name: str, value: Any) -> dict[str, str] | None:
    """A run's ``booking`` or ``system_copy`` marker, checked (ValidationError naming the field when malformed)."""
    if value is None:
        return None
    return (BookingVariable if name == "booking" else SystemCopyVariable).model_validate(value).model_dump()


class MNJobConfiguration(ProcessJobConfiguration):
    """What the worker receives for one run (templated from the variables)."""

    resources: RunResources = Field(default_factory=RunResources, json_schema_extra={"template": "{{ resources }}"})
    strategy: Strategy = Field("binpack", json_schema_extra={"template": "{{ strategy }}"})
    constraints: list[Any] = Field(default_factory=list, json_schema_extra={"template": "{{ constraints }}"})
    image: str | None = Field(None, json_schema_extra={"template": "{{ image }}"})
    preferred_node: str | None = Field(None, json_schema_extra={"template": "{{ preferred_node }}"})
    job_type: JobType = Field("batch", json_schema_extra={"template": "{{ job_type }}"})
    recovery_mode: RecoveryMode = Field("local_restart", json_schema_extra={"template": "{{ recovery_mode }}"})
    wait_for_new_nodes: bool = Field(False, json_schema_extra={"template": "{{ wait_for_new_nodes }}"})
    not_runnable_timeout_seconds: int = Field(600, json_schema_extra={"template": "{{ not_runnable_timeout_seconds }}"})
    priority: int | None = Field(None, json_schema_extra={"template": "{{ priority }}"})
    preemptible: bool = Field(False, json_schema_extra={"template": "{{ preemptible }}"})
    min_runtime_seconds: int = Field(0, json_schema_extra={"template": "{{ min_runtime_seconds }}"})
    preemption_grace_seconds: float = Field(DEFAULT_GRACE_S,
                                            json_schema_extra={"template": "{{ preemption_grace_seconds }}"})
    reservation: str | None = Field(None, json_schema_extra={"template": "{{ reservation }}"})
    reservation_key: str | None = Field(None, json_schema_extra={"template": "{{ reservation_key }}"})
    # Set by mn-prefect on the runs it creates, read from the run's own job variables
    # (from_template_and_values): not in the pool's template, so not in its form.
    booking: SkipJsonSchema[dict[str, str] | None] = None
    system_copy: SkipJsonSchema[dict[str, str] | None] = None
    health: HealthVariable | None = Field(None, json_schema_extra={"template": "{{ health }}"})
    max_runtime_seconds: float | None = Field(None, json_schema_extra={"template": "{{ max_runtime_seconds }}"})
    max_runtime_is_limit: bool = Field(False, json_schema_extra={"template": "{{ max_runtime_is_limit }}"})
    warm_start: bool = Field(False, json_schema_extra={"template": "{{ warm_start }}"})
    preload: list[Annotated[str, StringConstraints(pattern=MODULE_NAME)]] = Field(
        default_factory=list, json_schema_extra={"template": "{{ preload }}"})
    # The deployment's flow's own timeout_seconds (Prefect keeps it on the flow, not on the server: @requires
    # writes it into the deployment's job variables), in seconds: the run's estimate when none is declared.
    flow_timeout_seconds: SkipJsonSchema[float | None] = None

    _user_env: dict[str, str | None] = PrivateAttr(default_factory=dict)
    _run_env: dict[str, str | None] = PrivateAttr(default_factory=dict)
    _entrypoint: str | None = PrivateAttr(default=None)

    @field_validator("env", mode="before")
    @classmethod
    def _env_is_an_object(cls, value: Any) -> Any:
        """The run's environment is NAME: value, null for none (Prefect's own check would fail on anything else with
        an AttributeError, and the run's placement with it at every poll)."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise PydanticCustomError("env", "{detail}", {
                "detail": f"job_variables.env: must be an object of NAME: value, got {type(value).__name__}"})
        return value

    @field_validator("booking", "system_copy", mode="before")
    @classmethod
    def _internal_marker(cls, value: Any, info: ValidationInfo) -> Any:
        return _marker(str(info.field_name), value)

    @field_validator("max_runtime_seconds", "flow_timeout_seconds", mode="before")
    @classmethod
    def _runtime(cls, value: Any, info: ValidationInfo) -> Any:
        """Seconds: a positive finite number of at most ten years (not a string, not a bool)."""
        issues = Issues()
        seconds = read_max_runtime(value, "", issues)
        if issues:
            raise PydanticCustomError("runtime", "{detail}", {"detail": issues.items[0].message})
        return seconds

    @field_validator("max_runtime_is_limit", mode="before")
    @classmethod
    def _limit_flag(cls, value: Any) -> Any:
        if value is None:
            return False
        if not isinstance(value, bool):
            raise PydanticCustomError("runtime", "{detail}", {"detail": f"must be true or false, got {value!r}"})
        return value

    @classmethod
    async def from_template_and_values(cls, base_job_template: dict[str, Any], values: dict[str, Any],
                                       client: Any = None) -> Any:
        """The run's configuration, with ``booking``, ``system_copy`` and ``flow_timeout_seconds`` taken from its job
        variables: they are not in the pool's template (a pool made by an older mn-prefect templates the first two:
        its value stands), and the model's checks (a health check on a booked port) must see them."""
        template = base_job_template.get("job_configuration") or {}
        markers = {name: values[name] for name in _UNTEMPLATED
                   if values.get(name) is not None and name not in template}
        if markers:
            base_job_template = {**base_job_template, "job_configuration": {**template, **markers}}
        # Prefect injects a client when none is passed (inject_client): pass one only when given.
        try:
            return await super().from_template_and_values(base_job_template, values,
                                                           **({"client": client} if client is not None else {}))
        except ValidationError:
            raise
        except (TypeError, ValueError, ObjectNotFound) as error:  # Prefect's templating (worker/templating.py)
            raise templating_error(cls.__name__, values, error) from None

    @model_validator(mode="after")
    def _runnable_in_its_driver(self) -> MNJobConfiguration:
        """A docker run names a valid image and memory Docker can enforce (checked before anything is booked)."""
        issues = Issues()
        container_issues(self.resources, self.image, resources_path=RESOURCES_PATH, image_path="job_variables.image",
                         issues=issues)
        if issues:
            raise _resources_error(issues)
        return self

    @model_validator(mode="after")
    def _limit_has_a_runtime(self) -> MNJobConfiguration:
        """A limit needs the seconds it stops the run at."""
        if self.max_runtime_is_limit and self.max_runtime_seconds is None:
            raise PydanticCustomError("resources", "{detail}", {
                "detail": f"job_variables.max_runtime_is_limit: is true, but {MAX_RUNTIME_PATH} is not set (the "
                          "limit needs its seconds)"})
        return self

    @model_validator(mode="after")
    def _health_on_a_booked_port(self) -> MNJobConfiguration:
        """A health check probes one of the run's own ports: a label it does not book is a typo."""
        labels = [port.label for port in self.resources.ports]
        if self.booking:  # a blueprint agent's run: its ports are in the job's booking, checked with the blueprint
            return self
        if self.health is not None and self.health.port_label not in labels:
            booked = ", ".join(repr(label) for label in labels) or "none"
            raise PydanticCustomError("resources", "{detail}", {
                "detail": f"{HEALTH_PATH}.port_label: {self.health.port_label!r} is not one of the run's "
                          f"{RESOURCES_PATH}.ports labels ({booked})"})
        return self

    def prepare_for_flow_run(self, flow_run, deployment=None, flow=None, work_pool=None, worker_name=None,
                             worker_id=None) -> None:
        # The deployment's own env, before the worker's environment is merged in: hints never override it.
        self._user_env = dict(self.env)
        self._entrypoint = getattr(deployment, "entrypoint", None)
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        # With no command set, Prefect's process worker starts a supervisor interpreter that prepares a workspace and
        # starts the engine in a second one. The engine runs the deployment's pull steps itself, so an mn run starts
        # it directly (the command set above): one interpreter per run, about two CPU seconds less.
        if "_command_configured" in self.__private_attributes__:
            self._command_configured = True
        # What a container gets: Prefect's variables for this run and the deployment's env, never the worker's
        # whole environment (which the process worker hands its subprocesses).
        run_env = {**self._base_environment(), **self._base_flow_run_environment(flow_run),
                   **self._base_attribution_environment(flow_run=flow_run, deployment=deployment, flow=flow,
                                                        worker_id=worker_id, worker_name=worker_name),
                   **self._user_env}
        self._run_env = {key: value for key, value in run_env.items() if value is not None}

    @property
    def run_env(self) -> dict[str, str | None]:
        """The run's own environment (set by prepare_for_flow_run): for drivers that isolate the run."""
        return dict(self._run_env)

    @property
    def own_flow(self) -> bool:
        """Whether the run is of one of mn-prefect's own flows, the only ones given the worker's store
        (``mn_prefect.credentials``)."""
        return is_own_flow(self._entrypoint)
