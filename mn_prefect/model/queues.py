"""Queues of a shared fleet: what a work queue of the ``mn`` pool may use, and how it shares with its cohort.

A queue is one of the pool's Prefect work queues. It may have a **quota** per dimension (what it is entitled to),
a **borrowing limit** per dimension (how far past its quota it may go by using what other queues of its
**cohort** leave unused), a **weight** (its share when several queues want more than there is) and a
**priority** (the default priority of its runs). A dimension without a quota is not limited for the queue.

The dimensions, each with the names it may be written as (``memory_gb=64`` is ``memory=65536``):

- ``cpu`` (cores), ``memory`` and ``disk`` (MB), as in a resource request (``memory=64G``, ``cpu=500m`` too);
- ``gpu``: GPUs handed to runs; a whole GPU or a MIG slice counts 1, a fraction counts its share;
- ``gpu_memory`` (MB): the memory of the GPUs handed to runs (a fraction: the memory it books);
- ``gpu:<model>``: ``gpu`` counting only GPUs whose model contains ``<model>`` (any case): ``gpu:a100=4``.

Pure: parsing with path-named errors, no store, no Prefect.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mn_prefect.model.amounts import Unit, read_amount
from mn_prefect.model.issues import Issues, child
from mn_prefect.model.names import check_model_name, name_issue
from mn_prefect.model.scalars import MAX_QUANTITY, check_keys, read_int, read_number, read_string, type_name

# alias -> (dimension, factor to its unit)
QUOTA_ALIASES: dict[str, tuple[str, float]] = {
    "cpu": ("cpu", 1.0), "cores": ("cpu", 1.0), "cpu_cores": ("cpu", 1.0),
    "memory": ("memory", 1.0), "memory_mb": ("memory", 1.0), "memory_gb": ("memory", 1024.0),
    "disk": ("disk", 1.0), "disk_mb": ("disk", 1.0), "disk_gb": ("disk", 1024.0),
    "gpu": ("gpu", 1.0), "gpus": ("gpu", 1.0), "gpu_count": ("gpu", 1.0),
    "gpu_memory": ("gpu_memory", 1.0), "gpu_memory_mb": ("gpu_memory", 1.0), "gpu_memory_gb": ("gpu_memory", 1024.0),
}
BASE_DIMENSIONS = ("cpu", "memory", "disk", "gpu", "gpu_memory")
MODEL_PREFIX = "gpu:"
# The dimensions read as a request's amounts are (model/amounts.py: "64G", "500m"), by the unit of a bare number.
_AMOUNT_UNITS: dict[str, Unit] = {"cpu": "cores", "memory": "mb", "disk": "mb", "gpu_memory": "mb"}
UNITS = {"cpu": "cores", "memory": "MB of memory", "disk": "MB of disk", "gpu": "GPUs",
         "gpu_memory": "MB of GPU memory"}
QUEUE_KEYS = ("quota", "borrow", "weight", "priority", "cohort")
# Prefect refuses these in names; a GPU model in a ``gpu:<model>`` dimension may not hold them either.
_BAD_NAME = re.compile(r"[/%&<>\x00-\x1f]")
MAX_PRIORITY = 1_000_000


class QueueSpec(BaseModel):
    """One queue's settings. ``borrow`` None: in a cohort it may borrow whatever the cohort leaves unused,
    outside one nothing (a queue alone has no one to borrow from)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, description="The Prefect work queue's name.")
    quota: dict[str, float] = Field(default_factory=dict, description="What the queue is entitled to, per dimension.")
    borrow: dict[str, float] | None = Field(None, description="How far past its quota it may borrow, per dimension.")
    weight: float = Field(1.0, gt=0, le=MAX_QUANTITY, description="Its share when queues compete (fair share).")
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="Its runs' default priority.")
    cohort: str | None = Field(None, min_length=1, description="The queues it lends to and borrows from.")

    @field_validator("name", "cohort")
    @classmethod
    def _names(cls, value: str | None, info: ValidationInfo) -> str | None:
        kind = "queue" if info.field_name == "name" else "cohort"
        return value if value is None else check_model_name(value, kind, info.context)

    def borrow_limit(self, dim: str) -> float | None:
        """The most it may borrow in ``dim``: None for no limit (in a cohort, nothing set), 0 outside a cohort."""
        if self.cohort is None:
            return 0.0
        if self.borrow is None:
            return None
        return self.borrow.get(dim)

    @property
    def models(self) -> tuple[str, ...]:
        """The GPU models it has a quota or a borrowing limit for (``gpu:<model>`` dimensions)."""
        dims = {*self.quota, *(self.borrow or {})}
        return tuple(sorted(d[len(MODEL_PREFIX):] for d in dims if d.startswith(MODEL_PREFIX)))


def unit(dim: str) -> str:
    if dim.startswith(MODEL_PREFIX):
        return f"{dim[len(MODEL_PREFIX):]} GPUs"
    return UNITS.get(dim, dim)


def amount_words(value: float, dim: str) -> str:
    """``4 GPUs``, ``1 GPU``, ``32 cores``, ``65536 MB of memory``."""
    words = unit(dim)
    if value == 1 and words.endswith(("GPUs", "cores")):
        words = words[:-1]
    return f"{value:g} {words}"


def check_name(value: Any, path: str, issues: Issues, kind: str = "queue") -> str | None:
    """``value`` when it is a valid queue (or cohort, ``kind``) name (model/names.py); else an issue at ``path``."""
    name = read_string(value, path, issues)
    if name is None:
        return None
    if why := name_issue(name, kind):
        issues.add(path, why)
        return None
    return name


def parse_amounts(raw: Any, path: str, issues: Issues) -> dict[str, float] | None:
    """Amounts per dimension: ``{"gpu": 4, "memory_gb": 64}`` or the command line's ``gpu=4,memory_gb=64``;
    memory, disk and GPU memory also with a unit (``memory=64G``), CPU in millicores (``cpu=500m``)."""
    if isinstance(raw, str):
        pairs: dict[str, Any] = {}
        for part in (p.strip() for p in raw.split(",")):
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                issues.add(path, f"{part!r} is not DIMENSION=AMOUNT (e.g. gpu=4,cpu=32)")
                return None
            pairs[key.strip()] = value.strip()
        raw = pairs
    if not isinstance(raw, dict):
        issues.add(path, f"must be an object of amounts per dimension, got {type_name(raw)}")
        return None
    out: dict[str, float] = {}
    for key, value in raw.items():
        where = child(path, key)
        dim, factor = _dimension(key)
        if dim is None:
            issues.add(where, "unknown dimension (allowed: " + ", ".join(QUOTA_ALIASES) + ", gpu:<model>)")
            continue
        unit = _AMOUNT_UNITS.get(dim)
        number = (read_number(value, where, issues) if unit is None
                  else read_amount(value, where, issues, "gb" if factor == 1024 else unit))
        if number is None:
            continue
        if dim in out:
            issues.add(where, f"{dim} is given twice")
            continue
        out[dim] = number * (factor if unit is None else 1.0)
    return out


def _dimension(key: Any) -> tuple[str | None, float]:
    if not isinstance(key, str):
        return None, 1.0
    key = key.strip()
    if key.lower().startswith(MODEL_PREFIX):
        model = key[len(MODEL_PREFIX):].strip().lower()
        return (MODEL_PREFIX + model if model and not _BAD_NAME.search(model) else None), 1.0
    return QUOTA_ALIASES.get(key, (None, 1.0))


def parse_queue(name: Any, raw: Any, path: str, issues: Issues) -> QueueSpec | None:
    """One queue from its JSON object (``{"quota": {...}, "borrow": {...}, "weight": W, "priority": P,
    "cohort": C}``); errors are added to ``issues`` naming the field."""
    checked = check_name(name, path, issues)
    if not isinstance(raw, dict):
        issues.add(path, f"must be an object with {', '.join(QUEUE_KEYS)}, got {type_name(raw)}")
        return None
    check_keys(raw, QUEUE_KEYS, path, issues)
    before = len(issues.items)
    fields: dict[str, Any] = {}
    if "quota" in raw:
        fields["quota"] = parse_amounts(raw["quota"], child(path, "quota"), issues)
    if raw.get("borrow") is not None:
        fields["borrow"] = parse_amounts(raw["borrow"], child(path, "borrow"), issues)
    if "weight" in raw:
        weight = read_number(raw["weight"], child(path, "weight"), issues)
        if weight is not None and weight <= 0:
            issues.add(child(path, "weight"), f"must be greater than 0, got {raw['weight']!r}")
        fields["weight"] = weight
    if "priority" in raw:
        fields["priority"] = read_int(raw["priority"], child(path, "priority"), issues, minimum=-MAX_PRIORITY,
                                      maximum=MAX_PRIORITY)
    if raw.get("cohort") is not None:
        fields["cohort"] = check_name(raw["cohort"], child(path, "cohort"), issues, "cohort")
    if checked is None or len(issues.items) > before:
        return None
    return QueueSpec(name=checked, **fields)


def parse_queues(raw: Any, path: str = "queues") -> dict[str, QueueSpec]:
    """A queues file: ``{name: {...}}`` (or ``{"queues": {name: {...}}}``); InvalidInput naming every bad field."""
    issues = Issues()
    if isinstance(raw, dict) and set(raw) == {"queues"}:
        raw, path = raw["queues"], child(path, "queues")
    if not isinstance(raw, dict):
        issues.add(path, f"must be an object of queues by name, got {type_name(raw)}")
        issues.raise_if_any()
    out: dict[str, QueueSpec] = {}
    for name, body in raw.items():
        spec = parse_queue(name, body, child(path, str(name)), issues)
        if spec is not None:
            out[spec.name] = spec
    issues.raise_if_any()
    return out


class QueueRecord(BaseModel):
    """A queue as the store holds it: its settings, what its runs hold now (per dimension) and its version, which
    grows with every change of its settings (a commit decided under old settings is decided again)."""

    spec: QueueSpec
    used: dict[str, float] = Field(default_factory=dict)
    version: int = 0


class CohortRecord(BaseModel):
    """A cohort as the store holds it: the sum of its queues' quotas (``nominal``), what they hold now in the
    dimensions they have quotas for, and its version (it grows when any of its queues' settings change)."""

    name: str
    nominal: dict[str, float] = Field(default_factory=dict)
    used: dict[str, float] = Field(default_factory=dict)
    version: int = 0
