"""What a deployment of the ``mn`` pool can ask for: the pool's variables (typed forms in the Prefect UI,
validated by the server) and the job configuration the worker receives.

The variable models mirror SPEC section 1 key for key, aliases included, so the server refuses a typo or a
wrong type with HTTP 422 before a run exists; the worker still parses the request once more
(``parse_resources``) because the server-side schema cannot express every rule (e.g. legacy ``gpu_count``
agreeing with ``devices``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints
from typing_extensions import Annotated

from prefect.workers.process import ProcessJobConfiguration, ProcessVariables

NUMERIC = r"^\s*\d+(\.\d+)?\s*$"
Amount = Union[Annotated[float, Field(ge=0)], Annotated[str, StringConstraints(pattern=NUMERIC)]]
_STRICT = ConfigDict(extra="forbid")


class DeviceVariable(BaseModel):
    model_config = _STRICT

    kind: Optional[str] = Field(None, description="Device kind, usually gpu.", examples=["gpu"])
    type: Optional[str] = Field(None, description="Same as kind; may name the vendor: nvidia/gpu.", examples=["nvidia/gpu"])
    count: int = Field(1, ge=1, le=1024, description="How many matching devices.")
    vendor: Optional[str] = Field(None, description="nvidia, amd, apple, intel...", examples=["nvidia"])
    driver: Optional[str] = Field(None, description="cuda, rocm, metal...", examples=["cuda"])
    min_memory_mb: Optional[Amount] = Field(None, description="Minimum memory on each device, MB.")
    memory_operator: Optional[Literal[">", ">=", "==", "="]] = Field(None, description="Default >=.")
    min_api_version: Optional[str] = Field(None, description="Minimum driver API version, e.g. 12.2.")
    api_version_operator: Optional[Literal[">", ">=", "==", "=", "<", "<="]] = Field(None, description="Default >=.")
    capabilities: list[str] = Field(default_factory=list, description="Labels every chosen device must have.",
                                    examples=[["fp16", "bf16"]])
    ids: list[str] = Field(default_factory=list, description="Only these device ids may be chosen.")


class PortVariable(BaseModel):
    model_config = _STRICT

    label: str = Field(min_length=1, description="Becomes MN_PORT_<LABEL> in the run.", examples=["api"])
    port: int = Field(0, ge=0, le=65535, description="A fixed port, or 0 for one from the node's dynamic range.")
    protocol: Literal["tcp", "udp", "http", "grpc"] = Field("tcp", description="http and grpc share TCP's numbers.")


class VolumeVariable(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, description="Becomes MN_VOLUME_<NAME>.", examples=["models"])
    source: str = Field(pattern=r"^/", description="Absolute host path the node must advertise.", examples=["/mnt/models"])
    target: Optional[str] = Field(None, pattern=r"^/", description="Path the run should use (default: source).")
    mode: Literal["ro", "rw"] = "ro"
    type: Literal["host"] = "host"


class ResourcesVariable(BaseModel):
    """SPEC section 1, every alias included. All optional."""

    model_config = _STRICT

    cpu_cores: Optional[Amount] = Field(None, description="CPU cores (fractions allowed).")
    cores: Optional[Amount] = Field(None, description="Alias of cpu_cores.")
    cpu: Optional[Amount] = Field(None, description="Cores; above 64 it is read as millicores.")
    cpu_millis: Optional[Amount] = Field(None, description="Millicores.")
    cpu_mcores: Optional[Amount] = Field(None, description="Millicores.")
    memory_mb: Optional[Amount] = Field(None, description="Memory, MB.")
    memory: Optional[Amount] = Field(None, description="Memory, MB.")
    memory_gb: Optional[Amount] = Field(None, description="Memory, GB.")
    disk_mb: Optional[Amount] = Field(None, description="Disk, MB.")
    disk: Optional[Amount] = Field(None, description="Disk, MB.")
    disk_gb: Optional[Amount] = Field(None, description="Disk, GB.")
    gpu_count: Optional[int] = Field(None, ge=0, le=1024, description="Any GPUs (legacy; use devices for more).")
    gpus: Optional[int] = Field(None, ge=0, le=1024, description="Alias of gpu_count.")
    gpu: Optional[int] = Field(None, ge=0, le=1024, description="Alias of gpu_count.")
    devices: list[DeviceVariable] = Field(default_factory=list, description="Rich device requests.")
    ports: list[PortVariable] = Field(default_factory=list, description="Ports to reserve on the node.")
    volumes: list[VolumeVariable] = Field(default_factory=list, description="Host paths the node must advertise.")
    runtime_driver: Optional[str] = Field(None, min_length=1, description="host_local (default) or another driver.")


class ConstraintVariable(BaseModel):
    model_config = _STRICT

    attribute: str = Field(min_length=1, description="capabilities, node, status, role, os, arch, labels.<key>...")
    operator: Literal["==", "=", "!=", "contains", "contains_all", "contains_any", "in", "exists", "not_exists",
                      ">", ">=", "<", "<="] = "=="
    value: Any = None


class BookingVariable(BaseModel):
    model_config = _STRICT

    job_id: str = Field(min_length=1, description="The blueprint job that holds the booking.")
    agent_id: str = Field(min_length=1, description="The agent (or agent@node copy) the booking is for.")


_STRICT_MODELS = ("ResourcesVariable", "DeviceVariable", "PortVariable", "VolumeVariable", "ConstraintVariable",
                  "BookingVariable")


class MNVariables(ProcessVariables):
    """The ``mn`` pool's variables: the resource request and placement policy, plus the process fields."""

    resources: ResourcesVariable = Field(
        default_factory=ResourcesVariable, title="Resources", json_schema_extra={"default": {}},
        description="What each run needs: CPU, memory, disk, GPUs (by vendor, driver, memory, capability, id), "
                    "ports, host volumes, runtime driver.")
    strategy: Literal["binpack", "spread"] = Field("binpack", description="binpack fills nodes; spread balances them.")
    constraints: list[Union[str, ConstraintVariable]] = Field(
        default_factory=list, description="A capability name, or {attribute, operator, value}.", examples=[["cuda"]])
    preferred_node: Optional[str] = Field(None, description="Use this node when it can take the run.")
    job_type: Literal["service", "batch", "system", "sysbatch"] = Field("batch", description="How the run is treated.")
    recovery_mode: Literal["local_restart", "cluster_recover", "manual_recover"] = Field(
        "local_restart", description="What happens when the run's node is lost.")
    not_runnable_timeout_seconds: int = Field(
        600, ge=0, description="A run that no node could ever take fails after this long (seconds).")
    booking: Optional[BookingVariable] = Field(
        None, description="Set by blueprint jobs on their agent runs: run where the job booked this agent, with "
                          "that allocation (resources are then ignored). Leave empty.")

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        schema = super().model_json_schema(*args, **kwargs)
        # Prefect strips additionalProperties; inside resources an unknown key is a typo, so refuse it.
        for name, definition in schema.get("definitions", {}).items():
            if name in _STRICT_MODELS:
                definition["additionalProperties"] = False
        return schema


class MNJobConfiguration(ProcessJobConfiguration):
    """What the worker receives for one run (templated from the variables)."""

    resources: dict[str, Any] = Field(default_factory=dict, json_schema_extra={"template": "{{ resources }}"})
    strategy: str = Field("binpack", json_schema_extra={"template": "{{ strategy }}"})
    constraints: list[Any] = Field(default_factory=list, json_schema_extra={"template": "{{ constraints }}"})
    preferred_node: Optional[str] = Field(None, json_schema_extra={"template": "{{ preferred_node }}"})
    job_type: str = Field("batch", json_schema_extra={"template": "{{ job_type }}"})
    recovery_mode: str = Field("local_restart", json_schema_extra={"template": "{{ recovery_mode }}"})
    not_runnable_timeout_seconds: int = Field(600, json_schema_extra={"template": "{{ not_runnable_timeout_seconds }}"})
    booking: Optional[dict[str, str]] = Field(None, json_schema_extra={"template": "{{ booking }}"})

    _user_env: dict[str, Optional[str]] = PrivateAttr(default_factory=dict)

    def prepare_for_flow_run(self, flow_run, deployment=None, flow=None, work_pool=None, worker_name=None,
                             worker_id=None) -> None:
        # The deployment's own env, before the worker's environment is merged in: hints never override it.
        self._user_env = dict(self.env)
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
