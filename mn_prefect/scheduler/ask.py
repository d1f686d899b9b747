"""An agent's request compiled for the scheduler: resources plus everything that filters nodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mn_prefect.model.blueprint import Agent, Blueprint, ServiceRequirement
from mn_prefect.model.constraints import Constraint
from mn_prefect.model.resources import ResourceRequest
from mn_prefect.scheduler.constraints import is_class_attribute


class ShapeKey:
    """A key of cached results, hashed once: its parts hold pydantic models, which hash field by field."""

    __slots__ = ("parts", "_hash")

    def __init__(self, parts: tuple[Any, ...]):
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, ShapeKey) and self._hash == other._hash and self.parts == other.parts)


@dataclass(frozen=True, slots=True)
class Ask:
    """What one agent (or one flow run) needs from a node."""

    agent_id: str
    request: ResourceRequest
    constraints: tuple[Constraint, ...] = ()
    profile: str | None = None
    services: tuple[ServiceRequirement, ...] = ()
    preferred_node: str | None = None
    source_agent_id: str | None = None
    class_constraints: tuple[Constraint, ...] = field(init=False)
    escaped_constraints: tuple[Constraint, ...] = field(init=False)
    static_key: ShapeKey = field(init=False)
    capacity_key: ShapeKey = field(init=False)  # static_key plus the scalars: one ranking of the nodes
    devices_key: ShapeKey = field(init=False)  # what a node's device fit depends on

    def __post_init__(self) -> None:
        own = tuple(c for c in self.constraints if is_class_attribute(c.attribute))
        escaped = tuple(c for c in self.constraints if not is_class_attribute(c.attribute))
        object.__setattr__(self, "class_constraints", own)
        object.__setattr__(self, "escaped_constraints", escaped)
        request = self.request
        # Everything static feasibility reads, and every name its reasons quote: asks with equal keys share the
        # cached results of every view and node class (scheduler/classes.py).
        key = (
            tuple(c.key() for c in self.constraints),
            self.profile,
            tuple((s.name, s.tags) for s in self.services),
            request.runtime_driver,
            tuple((v.name, v.source) for v in request.volumes),
            request.devices,
            request.gpu_count == 0,
        )
        static = ShapeKey(key)
        object.__setattr__(self, "static_key", static)
        object.__setattr__(self, "capacity_key", ShapeKey((static, request.cpu_cores, request.memory_mb,
                                                           request.disk_mb, request.gpu_count)))
        object.__setattr__(self, "devices_key", ShapeKey((request.devices, self.profile)))

    @property
    def needs_dynamic_check(self) -> bool:
        """Ports or devices must be picked per node (scalars alone do not settle it)."""
        return bool(self.request.ports or self.request.devices or self.profile)


def asks_for_blueprint(blueprint: Blueprint) -> list[Ask]:
    """One Ask per agent: job-level constraints first, then the agent's own; required services only."""
    job_services = tuple(s for s in blueprint.required_services if s.required)
    return [ask_for_agent(agent, blueprint.constraints, job_services) for agent in blueprint.agents]


def ask_for_agent(agent: Agent, global_constraints: tuple[Constraint, ...] = (),
                  job_services: tuple[ServiceRequirement, ...] = ()) -> Ask:
    return Ask(
        agent_id=agent.agent_id,
        source_agent_id=agent.agent_id,
        request=agent.resources,
        constraints=tuple(global_constraints) + agent.constraints,
        profile=agent.config.execution_profile,
        services=job_services + tuple(s for s in agent.requires_services if s.required),
        preferred_node=agent.preferred_node,
    )
