"""Placements and plans: the scheduler's output, and the active bookings it takes as input."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mn_prefect.model.issues import Issues, child
from mn_prefect.model.node import Device, issues_from_validation_error
from mn_prefect.model.scalars import type_name

QUEUE_FIELDS = ("queue", "priority", "preemptible", "min_runtime_s", "preempts")
PlanStatus = Literal["runnable_now", "runnable_later", "not_runnable", "invalid"]
Locality = Literal["job_colocated", "agent_spillover", "system"]


class PortAllocation(BaseModel):
    model_config = ConfigDict(frozen=True)

    label: str
    port: int = Field(ge=1, le=65535)
    protocol: str = "tcp"
    dynamic: bool = False


class VolumeAllocation(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    source: str
    target: str
    mode: str = "ro"
    type: str = "host"


class DeviceShare(BaseModel):
    """A fraction of one GPU: ``shares`` of its compute and ``memory_mb`` of its memory (docs/resources.md, "Sharing
    GPUs")."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    id: str
    shares: float = Field(gt=0, le=1)
    memory_mb: float = Field(ge=0)


class Allocation(BaseModel):
    """What a placement holds on its node beyond scalar capacity. A GPU in ``shares`` is shared (a fraction of it
    is booked); every other device in ``devices`` is held whole (a MIG slice is a device of its own)."""

    model_config = ConfigDict(frozen=True)

    devices: tuple[Device, ...] = ()
    shares: tuple[DeviceShare, ...] = ()
    ports: tuple[PortAllocation, ...] = ()
    volumes: tuple[VolumeAllocation, ...] = ()
    runtime_driver: str | None = None


class PlacedResources(BaseModel):
    """Canonical scalars a placement consumes on its node."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    cpu_cores: float = Field(0.0, ge=0)
    memory_mb: float = Field(0.0, ge=0)
    disk_mb: float = Field(0.0, ge=0)
    gpu_count: int = Field(0, ge=0)


class Placement(BaseModel):
    """One agent (or flow run) placed on one node with its concrete allocation."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    agent_id: str
    source_agent_id: str | None = None
    node: str
    resources: PlacedResources = PlacedResources()
    allocation: Allocation = Allocation()
    env: dict[str, str] = Field(default_factory=dict)
    locality: str | None = None
    score: float | None = None
    preferred: Literal["honored", "fallback"] | None = None
    job_id: str | None = None
    group: str | None = Field(None, description="The resource group the run was placed in; the commit refuses "
                                                "a node of another group.")
    reservation: str | None = Field(None, description="The reservation this run is placed inside: it takes the "
                                                      "reservation's capacity, not the node's free capacity.")
    reserves: str | None = Field(None, description="Set on a reservation's own placement: the capacity it holds "
                                                   "for the runs placed inside it.")
    hold: str | None = Field(None, description="Set on a hold's own placement: the hold's id. A hold books the "
                                               "request of the run at the head of the line on the node where it "
                                               "can start soonest, even past what is free, so that capacity "
                                               "freeing there goes to that run.")
    hold_for: str | None = Field(None, description="On a hold's placement: the flow run it holds capacity for.")
    hold_queue: str | None = Field(None, description="On a hold's placement: the work queue of the run it holds "
                                                     "for (holds are counted per queue); not charged to it.")
    hold_start: float | None = Field(None, description="On a hold's placement: when the held run is expected to "
                                                       "start (epoch seconds), from the estimated ends of the "
                                                       "bookings it waits for; None when one of them has no "
                                                       "estimate.")
    ends_by: float | None = Field(None, description="When this booking is expected to be released (epoch seconds): "
                                                   "its commit time plus the run's runtime estimate; None when the "
                                                   "run has no estimate.")
    over_hold: str | None = Field(None, description="The hold whose capacity this placement may take: the held "
                                                    "run itself, or a run backfilled ahead of it because its "
                                                    "estimate ends before the hold's expected start.")
    queue: str | None = Field(None, description="The work queue the run was placed from; its quota is charged.")
    priority: int | None = Field(None, description="The run's priority (its queue's unless it sets its own).")
    preemptible: bool | None = Field(None, description="Whether a run of higher priority may evict it.")
    min_runtime_s: int | None = Field(None, description="A preemptible run is not evicted before it ran this long.")
    preempts: tuple[str, ...] = Field((), description="In a dry run: the bookings placing it would evict.")

    def port(self, label: str) -> int:
        """The reserved port number for ``label``."""
        for port in self.allocation.ports:
            if port.label == label:
                return port.port
        raise KeyError(f"no port labelled {label!r} in this allocation")

    def volume(self, name: str) -> VolumeAllocation:
        for volume in self.allocation.volumes:
            if volume.name == name:
                return volume
        raise KeyError(f"no volume named {name!r} in this allocation")

    @property
    def device_ids(self) -> list[str]:
        return [d.id for d in self.allocation.devices]


class Plan(BaseModel):
    """The answer of the scheduler for one job (the ``plan`` command prints exactly this)."""

    model_config = ConfigDict(frozen=True)

    status: PlanStatus
    job_type: str | None = None
    strategy: str | None = None
    placements: tuple[Placement, ...] = ()
    reason: str | None = None
    agents: dict[str, dict[str, str]] = Field(default_factory=dict)
    errors: list[dict[str, str]] | None = None

    def as_json(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        if data["errors"] is None:
            del data["errors"]
        for placement in data["placements"]:  # queue fields only where a queue placed it
            if placement["queue"] is None:
                for key in QUEUE_FIELDS:
                    del placement[key]
        return data


def parse_active(raw: Any, path: str, issues: Issues) -> list[Placement]:
    """Active bookings: a plan object, a placement, or a list of either."""
    items = raw if isinstance(raw, list) else [raw]
    out: list[Placement] = []
    for i, item in enumerate(items):
        p = child(path, i) if isinstance(raw, list) else path
        if not isinstance(item, dict):
            issues.add(p, f"must be a plan or placement object, got {type_name(item)}")
            continue
        if "placements" in item:
            out.extend(parse_active(item["placements"] or [], child(p, "placements"), issues))
            continue
        if "status" in item and "node" not in item:
            continue  # a refused plan holds nothing
        try:
            out.append(Placement.model_validate(item))
        except ValidationError as error:
            issues_from_validation_error(error, p, issues)
    return out
