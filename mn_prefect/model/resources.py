"""The resource request of one agent or flow run (docs/resources.md): its grammar, written once, and its parser.

Two sets of models, one vocabulary: the request as it may be written (``DeviceInput``, ``PortInput``,
``VolumeInput``: every key, its type, bounds, words and examples, which the ``mn`` pool's form and server schema
show, worker/variables.py) and the canonical request it is parsed into (``ResourceRequest`` and its parts, every
alias and unit resolved), both made of the same constants and ``Literal`` types below. The parser
(``parse_resources``) reads exactly the keys of the input models and names the field of anything it refuses.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from mn_prefect.model.amounts import Unit, in_key_unit, read_amount
from mn_prefect.model.envnames import env_suffix
from mn_prefect.model.issues import Issues, child
from mn_prefect.model.node import DRIVER_ALIASES
from mn_prefect.model.scalars import (
    check_keys,
    read_int,
    read_number,
    read_string,
    read_string_list,
    shown,
    type_name,
)

# The vocabulary: each word spelled once, here.
_Compare = Literal[">", ">=", "=="]
_Below = Literal["<", "<="]
_EqualsAlias = Literal["="]  # written for "==", read as it
MemoryOperator = _Compare
VersionOperator = Literal[_Compare, _Below]
PortProtocol = Literal["tcp", "udp", "http", "grpc"]
VolumeMode = Literal["ro", "rw"]
VolumeType = Literal["host"]
PROTOCOLS: tuple[str, ...] = get_args(PortProtocol)
MEMORY_OPERATORS: tuple[str, ...] = get_args(MemoryOperator)
VERSION_OPERATORS: tuple[str, ...] = get_args(VersionOperator)
VOLUME_MODES: tuple[str, ...] = get_args(VolumeMode)
VOLUME_TYPES: tuple[str, ...] = get_args(VolumeType)
MAX_DEVICE_COUNT = 1024
MAX_PORT = 65535
# The smallest fraction of one GPU that books anything (1e-320 would book nothing).
MIN_SHARES = 0.01
ABSOLUTE_PATH = r"^/"

SCALAR_FIELDS: dict[str, tuple[Literal["quantity", "count"], dict[str, Unit]]] = {
    "cpu_cores": ("quantity", {"cpu_cores": "cores", "cores": "cores", "cpu": "cpu", "cpu_millis": "millicores",
                               "cpu_mcores": "millicores"}),
    "memory_mb": ("quantity", {"memory_mb": "mb", "memory": "mb", "memory_gb": "gb"}),
    "disk_mb": ("quantity", {"disk_mb": "mb", "disk": "mb", "disk_gb": "gb"}),
    "gpu_count": ("count", {"gpu_count": "", "gpus": "", "gpu": ""}),
}
"""The request grammar's numbers (docs/resources.md), the one table the parser (``parse_resources``) and the pool
schema (worker/variables.py) both read: canonical field -> (a quantity or a whole count, every name it may be
written as, the canonical one first, with the unit of its bare number; model/amounts.py reads a quantity, a
number or a string with a unit). When several are given, the first in this order is read."""
LIST_FIELDS = ("devices", "ports", "volumes")
RESOURCE_KEYS = frozenset((*(key for _, names in SCALAR_FIELDS.values() for key in names), *LIST_FIELDS,
                           "runtime_driver"))
# NVIDIA's MIG profile names: <GPU slices>g.<memory>gb, with an optional +me / +gfx suffix (1g.10gb+me), and a
# <compute slices>c. prefix for a compute instance smaller than its GPU instance (1c.3g.20gb).
MIG_PROFILE = re.compile(r"^([1-7]c\.)?[1-8]g\.[0-9]+gb(\+[a-z]+)?$")

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class DeviceRequest(BaseModel):
    """A request for ``count`` devices that all match the given filters."""

    model_config = _FROZEN

    kind: str = Field("gpu", description="Device kind, usually `gpu`.", examples=["gpu"])
    count: int = Field(1, ge=1, le=MAX_DEVICE_COUNT, description="How many matching devices.")
    vendor: str | None = Field(None, description="Vendor filter: nvidia, amd, apple, intel...", examples=["nvidia"])
    driver: str | None = Field(None, description="Driver/runtime filter: cuda, rocm, metal...", examples=["cuda"])
    min_memory_mb: float | None = Field(None, ge=0, description="Minimum memory on each device, in MB.")
    memory_operator: MemoryOperator = Field(">=", description="How device memory compares to min_memory_mb.")
    min_api_version: str | None = Field(None, description="Minimum driver API version, e.g. `12.2`.")
    api_version_operator: VersionOperator = Field(">=", description="How the API version compares.")
    capabilities: tuple[str, ...] = Field((), description="Capability labels every chosen device must have.")
    ids: tuple[str, ...] = Field((), description="Only these exact device ids may be chosen.")
    mig_profile: str | None = Field(None, description="MIG slices of this profile (e.g. `1g.10gb`) instead of "
                                                      "whole GPUs.", examples=["1g.10gb"])
    shares: float | None = Field(None, ge=MIN_SHARES, lt=1, description="A fraction of one GPU, in [0.01, 1); count must be 1.")
    memory_mb: float | None = Field(None, gt=0, description="GPU memory of a fractional request, in MB "
                                                            "(default: shares x the GPU's memory).")

    @property
    def whole(self) -> bool:
        """Whole devices: neither slices nor a fraction (what ``gpu_count`` counts)."""
        return self.mig_profile is None and self.shares is None


class PortRequest(BaseModel):
    """A port to reserve on the node; ``port`` 0 means any free port from the node's dynamic range."""

    model_config = _FROZEN

    label: str = Field(description="Name of the port; it becomes MN_PORT_<LABEL>.", examples=["api"])
    port: int = Field(0, ge=0, le=MAX_PORT, description="Static port 1-65535, or 0 for a dynamic port.")
    protocol: PortProtocol = Field("tcp", description="tcp, udp, http or grpc.")

    @property
    def dynamic(self) -> bool:
        return self.port == 0


class VolumeRequest(BaseModel):
    """A host path the node must advertise; handed to the run as MN_VOLUME_<NAME>."""

    model_config = _FROZEN

    name: str = Field(description="Name of the volume; it becomes MN_VOLUME_<NAME>.", examples=["models"])
    source: str = Field(description="Absolute host path on the node.", examples=["/mnt/models"])
    target: str = Field(description="Absolute path the run should use (defaults to source).", examples=["/models"])
    mode: VolumeMode = Field("ro", description="ro or rw.")
    type: VolumeType = Field("host", description="Only host volumes exist.")


class ResourceRequest(BaseModel):
    """Canonical resource request: every alias and unit already resolved."""

    model_config = _FROZEN

    cpu_cores: float = Field(0.0, ge=0, description="CPU cores (fractions allowed).")
    memory_mb: float = Field(0.0, ge=0, description="Memory in MB.")
    disk_mb: float = Field(0.0, ge=0, description="Disk in MB.")
    gpu_count: int = Field(0, ge=0, description="Whole GPUs asked for by the device requests (MIG slices and "
                                                "fractions are not counted).")
    devices: tuple[DeviceRequest, ...] = ()
    ports: tuple[PortRequest, ...] = ()
    volumes: tuple[VolumeRequest, ...] = ()
    runtime_driver: str | None = Field(None, description="host_local, docker, or a driver a node advertises.")

    def scalars(self) -> dict[str, float | int]:
        """The scalar part, as placements record it."""
        return {
            "cpu_cores": self.cpu_cores,
            "memory_mb": self.memory_mb,
            "disk_mb": self.disk_mb,
            "gpu_count": self.gpu_count,
        }

    def canonical(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# The request as it may be written: what the parser reads and the pool's form shows (worker/variables.py; the
# server refuses the rest before a run exists). Numbers may come as numeric strings ("8", from prefect.yaml or the
# API) or, for amounts, with a unit of their own (model/amounts.py); "=" stands for "=="; the parser fills the
# defaults the form leaves empty and checks what a schema cannot express.

def _quantity(value: Any) -> Any:
    """A non-negative number; a numeric string ("8", "8.5") counts as one (docs/resources.md)."""
    if value is None:
        return None
    issues = Issues()
    number = read_number(value, "", issues)
    if issues:
        raise ValueError(issues.items[0].message)
    return number


def amount_in(unit: Unit) -> BeforeValidator:
    """A quantity in ``unit``, the key's: a number, or a string with a unit of its own (model/amounts.py: "4G",
    "512Mi", "500m") converted to the key's unit."""
    def read(value: Any) -> Any:
        if not isinstance(value, str) or not re.search("[A-Za-z]", value):  # a number as it is, in the key's unit
            return _quantity(value)
        issues = Issues()
        amount = read_amount(value, "", issues, unit)
        if issues or amount is None:
            raise ValueError(issues.items[0].message)
        return in_key_unit(amount, unit)
    return BeforeValidator(read)


def _count(value: Any) -> Any:
    number = _quantity(value)
    if number is not None and number != int(number):
        raise ValueError(f"must be a whole number, got {value!r}")
    return None if number is None else int(number)


# Amounts as written; the pool schema shows each as a number (worker/pool_schema.py).
Cores = Annotated[float | None, amount_in("cores")]
Size = Annotated[float | None, amount_in("mb")]
Count = Annotated[int | None, BeforeValidator(_count)]


class DeviceInput(BaseModel):  # a device request as written (``DeviceRequest`` once parsed)
    model_config = ConfigDict(extra="forbid", title="Device")

    kind: str | None = Field(None, title="Kind", description="Usually gpu.", examples=["gpu"])
    type: str | None = Field(None, title="Type", description="Same as kind; may name the vendor, as in nvidia/gpu.",
                             examples=["nvidia/gpu"])
    count: int = Field(1, ge=1, le=MAX_DEVICE_COUNT, title="Count", description="How many matching devices.")
    vendor: str | None = Field(None, title="Vendor", description="nvidia, amd, apple, intel...", examples=["nvidia"])
    driver: str | None = Field(None, title="Driver", description="cuda, rocm, metal...", examples=["cuda"])
    min_memory_mb: Size = Field(None, title="Minimum memory (MB)", description="On each device.")
    memory_operator: Literal[MemoryOperator, _EqualsAlias] | None = Field(None, title="Memory comparison",
                                                                          description="Default >=.")
    min_api_version: str | None = Field(None, title="Minimum driver API version", examples=["12.2"])
    api_version_operator: Literal[_Compare, _EqualsAlias, _Below] | None = Field(
        None, title="API version comparison", description="Default >=.")
    capabilities: list[str] = Field(default_factory=list, title="Capabilities",
                                    description="Every chosen device must have all of these.", examples=[["bf16"]])
    ids: list[str] = Field(default_factory=list, title="Device ids", description="Only these devices may be chosen.")
    mig_profile: str | None = Field(None, title="MIG profile", pattern=MIG_PROFILE.pattern,
                                    description="MIG slices of this profile instead of whole GPUs; CUDA_VISIBLE_DEVICES "
                                                "then holds their MIG UUIDs.", examples=["1g.10gb"])
    shares: float | None = Field(None, ge=MIN_SHARES, lt=1, title="Shares of one GPU",
                                 description="A fraction of one GPU, e.g. 0.25 (count 1). Told to the run as "
                                             "MN_GPU_SHARES and CUDA MPS limits, not enforced by the kernel.")
    memory_mb: Size = Field(None, title="GPU memory (MB)",
                            description="With shares: the GPU memory booked (default: shares x the GPU's).")


class PortInput(BaseModel):  # a port request as written (``PortRequest`` once parsed)
    model_config = ConfigDict(extra="forbid", title="Port")

    label: str = Field(min_length=1, title="Label", description="The run reads its port from MN_PORT_{LABEL}.",
                       examples=["api"])
    port: int = Field(0, ge=0, le=MAX_PORT, title="Port",
                      description="A fixed port, or 0 for a free one from the node's dynamic range.")
    protocol: PortProtocol = Field("tcp", title="Protocol", description="http and grpc share TCP's port numbers.")


class VolumeInput(BaseModel):  # a volume request as written (``VolumeRequest`` once parsed)
    model_config = ConfigDict(extra="forbid", title="Volume")

    name: str = Field(min_length=1, title="Name", description="The run reads the path from MN_VOLUME_{NAME}.",
                      examples=["models"])
    source: str = Field(pattern=ABSOLUTE_PATH, title="Host path",
                        description="An absolute path on the node, under one of the paths it advertises.",
                        examples=["/mnt/models"])
    target: str | None = Field(None, pattern=ABSOLUTE_PATH, title="Path in the run",
                               description="Default: the host path.")
    mode: VolumeMode = Field("ro", title="Mode", description="ro (read-only) or rw.")
    type: VolumeType = Field("host", title="Type", description="host: a path on the node itself.")


DEVICE_KEYS = frozenset(DeviceInput.model_fields)
PORT_KEYS = frozenset(PortInput.model_fields)
VOLUME_KEYS = frozenset(VolumeInput.model_fields)


# Bounded where parsed so that comparing versions never meets Python's digit limit.
_VERSION = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})*")
_VERSION_MAX_CHARS = 64


def _first_present(raw: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        if key in raw and raw[key] is not None:
            return key
    return None


def _parse_devices(raw: Any, path: str, issues: Issues) -> list[DeviceRequest]:
    if not isinstance(raw, list):
        issues.add(path, f"must be a list of device requests, got {type_name(raw)}")
        return []
    devices = []
    for i, item in enumerate(raw):
        device = _parse_device(item, child(path, i), issues)
        if device is not None:
            devices.append(device)
    return devices


def _parse_device(raw: Any, path: str, issues: Issues) -> DeviceRequest | None:
    if not isinstance(raw, dict):
        issues.add(path, f"must be an object, got {type_name(raw)}")
        return None
    before = len(issues)
    check_keys(raw, DEVICE_KEYS, path, issues)
    fields: dict[str, Any] = {}
    kind_key = _first_present(raw, ("kind", "type"))
    vendor_from_type = None
    if kind_key:
        kind = read_string(raw[kind_key], child(path, kind_key), issues)
        if kind:
            kind = kind.strip().lower()
            if "/" in kind:  # vendor-qualified type such as nvidia/gpu
                vendor_from_type, _, kind = kind.partition("/")
                if not vendor_from_type or not kind:
                    issues.add(child(path, kind_key), f"must be a kind or vendor/kind, got {raw[kind_key]!r}")
            fields["kind"] = kind
    if "count" in raw:
        fields["count"] = read_int(raw["count"], child(path, "count"), issues, minimum=1, maximum=MAX_DEVICE_COUNT)
    for key in ("vendor", "driver"):
        if raw.get(key) is not None:
            text = read_string(raw[key], child(path, key), issues)
            if text:
                fields[key] = text.strip().lower()
    if vendor_from_type:
        if fields.get("vendor") and fields["vendor"] != vendor_from_type:
            issues.add(child(path, "vendor"), f"{fields['vendor']!r} disagrees with type {raw[kind_key]!r}")
        fields["vendor"] = vendor_from_type
    if raw.get("min_memory_mb") is not None:
        fields["min_memory_mb"] = read_amount(raw["min_memory_mb"], child(path, "min_memory_mb"), issues, "mb")
    for key, allowed in (("memory_operator", MEMORY_OPERATORS), ("api_version_operator", VERSION_OPERATORS)):
        if key in raw:
            op = raw[key]
            if op == "=":
                op = "=="
            if op not in allowed:
                issues.add(child(path, key), f"unknown operator {shown(raw[key])} (allowed: {', '.join(allowed)})")
            else:
                fields[key] = op
    if raw.get("min_api_version") is not None:
        version = raw["min_api_version"]
        if isinstance(version, (int, float)) and not isinstance(version, bool):
            version = str(version)
        text = read_string(version, child(path, "min_api_version"), issues)
        if text:
            text = text.strip()
            if _VERSION.fullmatch(text) and len(text) <= _VERSION_MAX_CHARS:
                fields["min_api_version"] = text
            else:
                issues.add(
                    child(path, "min_api_version"),
                    f"must be a version of ASCII digits and dots (e.g. 12.2), at most {_VERSION_MAX_CHARS} "
                    "characters with at most 9 digits a part",
                )
    _parse_sharing(raw, path, issues, fields)
    for key in ("capabilities", "ids"):
        if key in raw and raw[key] is not None:
            values = read_string_list(raw[key], child(path, key), issues)
            if values is not None:
                fields[key] = tuple(v.lower() for v in values) if key == "capabilities" else tuple(values)
    if len(issues) > before:
        return None
    return DeviceRequest(**{k: v for k, v in fields.items() if v is not None})


def _parse_sharing(raw: dict[str, Any], path: str, issues: Issues, fields: dict[str, Any]) -> None:
    """``mig_profile`` (slices) or ``shares`` with ``memory_mb`` (a fraction of one GPU), into ``fields``."""
    if raw.get("mig_profile") is not None:
        profile = read_string(raw["mig_profile"], child(path, "mig_profile"), issues)
        if profile is not None:
            profile = profile.strip().lower()
            if not MIG_PROFILE.match(profile):
                issues.add(child(path, "mig_profile"), f"unknown MIG profile {raw['mig_profile']!r} (NVIDIA's names "
                                                       "look like 1g.10gb, 3g.40gb, 7g.80gb)")
            else:
                fields["mig_profile"] = profile
    if raw.get("shares") is not None:
        shares = read_number(raw["shares"], child(path, "shares"), issues)
        if shares is not None:
            if not MIN_SHARES <= shares < 1:
                issues.add(child(path, "shares"), f"must be a fraction of one GPU, at least {MIN_SHARES:g} and below 1, "
                                                  f"got {shown(raw['shares'])} (ask for count: N for whole GPUs)")
            else:
                fields["shares"] = shares
        if fields.get("count", 1) != 1:
            issues.add(child(path, "count"), f"must be 1 with shares (a fraction of one GPU), got {shown(raw['count'])}")
        if raw.get("mig_profile") is not None:
            issues.add(child(path, "shares"), "cannot be combined with mig_profile: a MIG slice is held whole")
    if raw.get("memory_mb") is not None:
        memory = read_amount(raw["memory_mb"], child(path, "memory_mb"), issues, "mb")
        if raw.get("shares") is None:
            issues.add(child(path, "memory_mb"), "is the memory of a fractional request and needs shares; "
                                                 "use min_memory_mb to choose whole GPUs by memory")
        elif memory is not None:
            if memory <= 0:
                issues.add(child(path, "memory_mb"), f"must be above 0, got {shown(raw['memory_mb'])}")
            else:
                fields["memory_mb"] = memory


def _parse_ports(raw: Any, path: str, issues: Issues) -> list[PortRequest]:
    if not isinstance(raw, list):
        issues.add(path, f"must be a list of port requests, got {type_name(raw)}")
        return []
    ports: list[PortRequest] = []
    seen: dict[str, int] = {}
    seen_env: dict[str, str] = {}
    for i, item in enumerate(raw):
        p = child(path, i)
        if not isinstance(item, dict):
            issues.add(p, f"must be an object, got {type_name(item)}")
            continue
        before = len(issues)
        check_keys(item, PORT_KEYS, p, issues)
        label = read_string(item.get("label"), child(p, "label"), issues) if "label" in item else None
        if "label" not in item:
            issues.add(child(p, "label"), "is required")
        elif label is not None:
            suffix = env_suffix(label)
            if label in seen:
                issues.add(child(p, "label"), f"duplicate port label {label!r} (also ports[{seen[label]}])")
            elif not suffix:
                issues.add(child(p, "label"), f"{label!r} gives an empty MN_PORT_ variable name")
            elif suffix in seen_env:
                issues.add(child(p, "label"), f"{label!r} and {seen_env[suffix]!r} both become MN_PORT_{suffix}")
            seen.setdefault(label, i)
            seen_env.setdefault(suffix, label)
        number = 0
        if item.get("port") is not None:
            scratch = Issues()
            value = read_int(item["port"], child(p, "port"), scratch, minimum=0, maximum=MAX_PORT)
            if scratch:
                issues.add(child(p, "port"), f"must be between 1 and {MAX_PORT} (0 or absent = dynamic), got {shown(item['port'])}")
            number = value if value is not None else 0
        protocol = item.get("protocol", "tcp")
        if not isinstance(protocol, str) or protocol.lower() not in PROTOCOLS:
            issues.add(child(p, "protocol"), f"unknown protocol {shown(protocol)} (allowed: {', '.join(PROTOCOLS)})")
        if len(issues) == before and label is not None:
            ports.append(PortRequest(label=label, port=number, protocol=protocol.lower()))
    return ports


def _check_abs_path(value: Any, path: str, issues: Issues) -> str | None:
    text = read_string(value, path, issues)
    if text is None:
        return None
    if not text.startswith("/"):
        issues.add(path, f"must be an absolute path, got {text!r}")
        return None
    if ".." in text.split("/"):
        issues.add(path, f"must not contain a '..' segment, got {text!r}")
        return None
    if "\x00" in text:
        issues.add(path, "must not contain a NUL character")
        return None
    return posixpath.normpath(text) if text != "/" else "/"


def _parse_volumes(raw: Any, path: str, issues: Issues) -> list[VolumeRequest]:
    if not isinstance(raw, list):
        issues.add(path, f"must be a list of volume requests, got {type_name(raw)}")
        return []
    volumes: list[VolumeRequest] = []
    seen: dict[str, int] = {}
    seen_env: dict[str, str] = {}
    for i, item in enumerate(raw):
        p = child(path, i)
        if not isinstance(item, dict):
            issues.add(p, f"must be an object, got {type_name(item)}")
            continue
        before = len(issues)
        check_keys(item, VOLUME_KEYS, p, issues)
        name = None
        if "name" not in item:
            issues.add(child(p, "name"), "is required")
        else:
            name = read_string(item["name"], child(p, "name"), issues)
            if name is not None:
                suffix = env_suffix(name)
                if name in seen:
                    issues.add(child(p, "name"), f"duplicate volume name {name!r} (also volumes[{seen[name]}])")
                elif not suffix:
                    issues.add(child(p, "name"), f"{name!r} gives an empty MN_VOLUME_ variable name")
                elif suffix in seen_env:
                    issues.add(child(p, "name"), f"{name!r} and {seen_env[suffix]!r} both become MN_VOLUME_{suffix}")
                seen.setdefault(name, i)
                seen_env.setdefault(suffix, name)
        source = None
        if "source" not in item:
            issues.add(child(p, "source"), "is required")
        else:
            source = _check_abs_path(item["source"], child(p, "source"), issues)
        target = source
        if item.get("target") is not None:
            target = _check_abs_path(item["target"], child(p, "target"), issues)
        mode = item.get("mode", "ro")
        if mode not in VOLUME_MODES:
            issues.add(child(p, "mode"), f"unknown volume mode {shown(mode)} (allowed: ro, rw)")
        vtype = item.get("type", "host")
        if vtype not in VOLUME_TYPES:
            issues.add(child(p, "type"), f"unknown volume type {shown(vtype)} (allowed: host)")
        if len(issues) == before and name and source and target:
            volumes.append(VolumeRequest(name=name, source=source, target=target, mode=mode, type=vtype))
    return volumes


def parse_resources(raw: Any, path: str, issues: Issues) -> ResourceRequest | None:
    """Parse a raw ``resources`` object into a ResourceRequest; problems go to ``issues`` with paths.

    Returns None when anything is wrong (the caller reports every issue at once).
    """
    if raw is None:
        return ResourceRequest()
    if not isinstance(raw, dict):
        issues.add(path, f"must be an object, got {type_name(raw)}")
        return None
    before = len(issues)
    check_keys(raw, RESOURCE_KEYS, path, issues)
    fields: dict[str, Any] = {}

    for name, (kind, keys) in SCALAR_FIELDS.items():
        key = _first_present(raw, tuple(keys)) if kind == "quantity" else None  # the count: with the devices below
        if key:
            amount = read_amount(raw[key], child(path, key), issues, keys[key])
            if amount is not None:
                fields[name] = amount

    devices = _parse_devices(raw["devices"], child(path, "devices"), issues) if raw.get("devices") is not None else []
    gpu_total = sum(d.count for d in devices if d.kind == "gpu" and d.whole)
    key = _first_present(raw, tuple(SCALAR_FIELDS["gpu_count"][1]))
    if key:
        legacy = read_int(raw[key], child(path, key), issues, minimum=0, maximum=MAX_DEVICE_COUNT)
        if legacy is not None:
            if raw.get("devices") is None:
                if legacy > 0:
                    devices = [DeviceRequest(kind="gpu", count=legacy)]
                gpu_total = legacy
            elif legacy != gpu_total:
                issues.add(child(path, key), f"is {legacy} but the GPU device requests total {gpu_total}")
    fields["devices"] = tuple(devices)
    fields["gpu_count"] = gpu_total

    if raw.get("ports") is not None:
        fields["ports"] = tuple(_parse_ports(raw["ports"], child(path, "ports"), issues))
    if raw.get("volumes") is not None:
        fields["volumes"] = tuple(_parse_volumes(raw["volumes"], child(path, "volumes"), issues))
    if "runtime_driver" in raw:
        driver = raw["runtime_driver"]
        if not isinstance(driver, str) or not driver.strip():
            issues.add(child(path, "runtime_driver"), f"must be a non-empty string, got {shown(driver)}")
        else:
            fields["runtime_driver"] = DRIVER_ALIASES.get(driver.strip(), driver.strip())
    if len(issues) > before:
        return None
    return ResourceRequest(**fields)


def resource_request(raw: Any = None, **aliases: Any) -> ResourceRequest:
    """Parse a request from a dict and/or keyword aliases; raises InvalidInput listing every problem."""
    merged = {**(raw or {}), **aliases} if (raw is None or isinstance(raw, dict)) else raw
    issues = Issues()
    request = parse_resources(merged, "resources", issues)
    issues.raise_if_any()
    assert request is not None
    return request
