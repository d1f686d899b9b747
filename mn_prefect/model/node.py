"""The node record (docs/nodes.md): what one machine offers to the scheduler."""

from __future__ import annotations

import posixpath
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mn_prefect.model.issues import Issues, child
from mn_prefect.model.names import MAX_GROUP_NAME, check_model_name
from mn_prefect.model.node_status import SCHEDULABLE_STATES, NodeStatus
from mn_prefect.model.scalars import MAX_QUANTITY, type_name

# MirrorNeuron's names for mn-prefect's drivers, in requests and inventories alike: its DockerWorker runs steps in
# containers, as the docker driver does.
DRIVER_ALIASES = {"docker_worker": "docker"}

DEFAULT_DYNAMIC_PORT_RANGE = (20000, 32000)
DEFAULT_GROUP = "default"

_RECORD = ConfigDict(extra="allow", allow_inf_nan=False, validate_assignment=False)


def _lower_list(values: list[str]) -> list[str]:
    out: list[str] = []
    for value in values:
        value = value.strip().lower()
        if value and value not in out:
            out.append(value)
    return out


class Device(BaseModel):
    """One device on a node (a GPU, usually)."""

    model_config = _RECORD

    id: str = Field(min_length=1, description="Stable device id, e.g. the NVIDIA UUID.")
    index: int = Field(0, ge=0, description="Index the driver uses (CUDA_VISIBLE_DEVICES).")
    kind: str = "gpu"
    vendor: str | None = None
    driver: str | None = None
    model: str | None = None
    memory_total_mb: float | None = Field(None, ge=0, le=MAX_QUANTITY)
    memory_free_mb: float | None = Field(None, ge=0, le=MAX_QUANTITY)
    api_version: str | None = None
    capabilities: list[str] = Field(default_factory=list)
    mig_mode: bool = Field(False, description="The GPU is in MIG mode: its slices are devices of their own.")
    parent: str | None = Field(None, description="For a MIG slice: the id of the GPU it is cut from.")
    mig_profile: str | None = Field(None, description="For a MIG slice: its profile, e.g. 1g.10gb.")

    @property
    def is_slice(self) -> bool:
        return self.parent is not None

    @field_validator("kind", "vendor", "driver", "mig_profile")
    @classmethod
    def _lower(cls, value: str | None) -> str | None:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("api_version", mode="before")
    @classmethod
    def _version_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    @field_validator("capabilities")
    @classmethod
    def _caps(cls, value: list[str]) -> list[str]:
        return _lower_list(value)


class ExecutionProfile(BaseModel):
    """A named way of running agents that a node supports; ``gpu: true`` implies at least one GPU."""

    model_config = _RECORD

    name: str = Field(min_length=1)
    gpu: bool = False

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


class ServiceCheck(BaseModel):
    """How the node's worker probes a service: an HTTP GET of a path, or a TCP connect, on the service's port."""

    model_config = ConfigDict(extra="forbid")

    http: str | None = Field(None, pattern=r"^/", description="GET this path; a 2xx or 3xx answer passes.",
                             examples=["/healthz"])
    tcp: bool = Field(False, description="Instead of HTTP: passes when the port accepts a connection.")

    @model_validator(mode="after")
    def _one_kind(self) -> ServiceCheck:
        if (self.http is None) == (not self.tcp):
            raise ValueError("set exactly one of http (a path) or tcp: true")
        return self


class ServiceInstance(BaseModel):
    """A service instance running on a node, with its health. Without a ``check`` the status is what the inventory
    says; with one, the node's worker probes 127.0.0.1:``port`` every ``interval_s`` and the status is live:
    ``critical`` until the first pass (as Consul does), ``passing`` after a pass, ``critical`` again after
    ``failures_to_critical`` failures in a row."""

    model_config = _RECORD

    name: str = Field(min_length=1)
    tags: list[str] = Field(default_factory=list)
    status: Literal["passing", "warning", "critical"] = "passing"
    check: ServiceCheck | None = Field(None, description="Probe the service, e.g. {http: /healthz} or {tcp: true}.")
    port: int | None = Field(None, ge=1, le=65535, validate_default=True,
                             description="The port the check probes on this node (required with a check).")
    interval_s: float = Field(10, gt=0, description="Seconds between probes.")
    timeout_s: float = Field(2, gt=0, description="A probe slower than this many seconds fails.")
    failures_to_critical: int = Field(3, ge=1, description="Failed probes in a row that make the service critical.")

    @field_validator("port")
    @classmethod
    def _port_with_check(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None and info.data.get("check") is not None:
            raise ValueError("port is required with a check")
        return value


class NodeRecord(BaseModel):
    """Everything the scheduler knows about one node. Unknown keys are kept (dotted-path constraints read them)."""

    model_config = _RECORD

    name: str = Field(min_length=1, description="Unique node name.")
    status: NodeStatus = "healthy"
    scheduling_eligible: bool = True
    role: str = "runtime"
    group: str = Field(DEFAULT_GROUP, min_length=1, description="The resource group the node belongs to.")
    cpu_cores: float = Field(0.0, ge=0, le=MAX_QUANTITY)
    memory_mb: float = Field(0.0, ge=0, le=MAX_QUANTITY)
    disk_mb: float = Field(0.0, ge=0, le=MAX_QUANTITY)
    devices: list[Device] = Field(default_factory=list)
    capabilities: list[str] = Field(default_factory=list)
    host_paths: list[str] = Field(default_factory=list)
    runtime_drivers: list[str] = Field(default_factory=lambda: ["host_local"])
    profiles: list[ExecutionProfile] = Field(default_factory=list)
    services: list[ServiceInstance] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    dynamic_port_range: tuple[int, int] = DEFAULT_DYNAMIC_PORT_RANGE
    cpuset: str | None = Field(None, description="The cores this node's containers are pinned to, e.g. 0-3,6 "
                                                 "(Docker's cpuset_cpus); each below the node's core count.")
    os: str | None = None
    arch: str | None = None

    @field_validator("dynamic_port_range", mode="before")
    @classmethod
    def _port_range(cls, value: Any) -> Any:
        if isinstance(value, str) and "-" in value:
            low, _, high = value.partition("-")
            return (low.strip(), high.strip())
        if isinstance(value, dict):
            return (value.get("min", value.get("start")), value.get("max", value.get("end")))
        return value

    @field_validator("name")
    @classmethod
    def _node_name(cls, value: str, info: ValidationInfo) -> str:
        if value.startswith("@"):
            raise ValueError(f"{value!r}: a node name may not start with @ (the store's queue accounts do)")
        return check_model_name(value, "node", info.context)

    @field_validator("group")
    @classmethod
    def _group_name(cls, value: str, info: ValidationInfo) -> str:
        return check_model_name(value, "group", info.context, MAX_GROUP_NAME)

    @field_validator("runtime_drivers")
    @classmethod
    def _driver_names(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(DRIVER_ALIASES.get(name, name) for name in value))

    @field_validator("labels", mode="before")
    @classmethod
    def _label_text(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: (str(v).lower() if isinstance(v, bool) else str(v)) if isinstance(v, (int, float, bool)) else v
                    for k, v in value.items()}
        return value

    @field_validator("host_paths", mode="before")
    @classmethod
    def _host_path_items(cls, value: Any) -> Any:
        # Also accept [{"path": "/mnt/models", ...}] as MirrorNeuron's inventory prints it.
        if isinstance(value, list):
            return [v.get("path") if isinstance(v, dict) and "path" in v else v for v in value]
        return value

    @field_validator("host_paths")
    @classmethod
    def _absolute_paths(cls, value: list[str]) -> list[str]:
        for path in value:
            if not path.startswith("/") or ".." in path.split("/"):
                raise ValueError(f"host path {path!r} must be absolute without '..'")
        return [posixpath.normpath(p) for p in value]

    @model_validator(mode="after")
    def _derived(self) -> NodeRecord:
        if self.cpuset is not None:
            self.cpuset = check_cpuset(self.cpuset, self.cpu_cores)
        low, high = self.dynamic_port_range
        if not (1 <= low <= high <= 65535):
            raise ValueError(f"dynamic_port_range {low}-{high} must lie within 1-65535, low <= high")
        ids = [d.id for d in self.devices]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"duplicate device ids {duplicates}")
        check_slices(self.devices)
        derived = list(self.capabilities)
        for device in self.devices:
            derived.extend(x for x in (device.kind, device.vendor, device.driver) if x)
        self.capabilities = _lower_list(derived)
        return self

    @property
    def schedulable(self) -> bool:
        return self.status in SCHEDULABLE_STATES and self.scheduling_eligible is not False

    @property
    def gpu_devices(self) -> list[Device]:
        """The whole GPUs (a MIG slice is never counted as a GPU)."""
        return [d for d in self.devices if d.kind == "gpu" and d.parent is None]


def check_slices(devices: list[Device]) -> None:
    """Every MIG slice names a profile and a parent GPU of the node that is in MIG mode; ValueError otherwise."""
    by_id = {d.id: d for d in devices}
    for device in devices:
        if device.parent is None:
            if device.mig_profile is not None:
                raise ValueError(f"device {device.id}: mig_profile {device.mig_profile!r} without a parent "
                                 "(only a MIG slice has a profile)")
            continue
        parent = by_id.get(device.parent)
        if parent is None:
            raise ValueError(f"device {device.id}: parent {device.parent!r} is not a device of this node")
        if parent.parent is not None or parent.kind != device.kind:
            raise ValueError(f"device {device.id}: parent {device.parent!r} must be a whole {device.kind}")
        if not parent.mig_mode:
            raise ValueError(f"device {device.id}: parent {device.parent!r} is not in MIG mode (mig_mode: true)")
        if not device.mig_profile:
            raise ValueError(f"device {device.id}: a MIG slice needs its mig_profile, e.g. 1g.10gb")


def cpuset_cores(text: str) -> list[int]:
    """The core numbers of a cpuset list such as ``0-3,6``. Raises ValueError naming what is wrong."""
    cores: list[int] = []
    for part in text.replace(" ", "").split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"cpuset {text!r} must be core numbers and ranges such as 0-3,6")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"cpuset {text!r}: range {part} runs backwards")
        cores.extend(range(first, last + 1))
    return cores


def check_cpuset(text: str, cpu_cores: float) -> str:
    """``text`` without spaces when every core in it exists on a node of ``cpu_cores`` cores (numbered from 0)."""
    cores = cpuset_cores(text)
    outside = [c for c in cores if c >= cpu_cores]
    if outside:
        raise ValueError(f"cpuset {text!r}: core {outside[0]} is outside this node's {cpu_cores:g} cores "
                         f"(0-{max(int(cpu_cores) - 1, 0)})")
    return text.replace(" ", "")


def issues_from_validation_error(error: ValidationError, path: str, issues: Issues) -> None:
    """Turn pydantic's errors into path-named issues."""
    for item in error.errors():
        where = path
        for part in item["loc"]:
            where = child(where, part) if isinstance(part, int) else child(where, str(part))
        message = item["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, "):]
        issues.add(where, message)


def parse_node(raw: Any, path: str, issues: Issues) -> NodeRecord | None:
    if not isinstance(raw, dict):
        issues.add(path, f"must be a node record object, got {type_name(raw)}")
        return None
    try:
        return NodeRecord.model_validate(raw)
    except ValidationError as error:
        issues_from_validation_error(error, path, issues)
        return None


def parse_nodes(raw: Any, path: str, issues: Issues) -> list[NodeRecord]:
    """A list of node records (or ``{"nodes": [...]}``); duplicate names are errors."""
    if isinstance(raw, dict) and "nodes" in raw:
        raw, path = raw["nodes"], child(path, "nodes")
    if not isinstance(raw, list):
        issues.add(path, f"must be a list of node records, got {type_name(raw)}")
        return []
    nodes: list[NodeRecord] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(raw):
        node = parse_node(item, child(path, i), issues)
        if node is None:
            continue
        if node.name in seen:
            issues.add(child(child(path, i), "name"), f"duplicate node name {node.name!r} (also [{seen[node.name]}])")
            continue
        seen[node.name] = i
        nodes.append(node)
    return nodes
