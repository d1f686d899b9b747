"""Blueprints (docs/blueprints.md): flat v1 and ``mn.workflow/v2`` manifests, normalised to one model.

``parse_blueprint`` never raises on any JSON value: it returns the model or every issue, each with its path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mn_prefect.model.constraints import Constraint, parse_constraints
from mn_prefect.model.containers import container_issues
from mn_prefect.model.envnames import env_name_problem
from mn_prefect.model.health import HealthCheck, parse_health
from mn_prefect.model.issues import InvalidInput, Issue, Issues, child
from mn_prefect.model.json_text import parse_json
from mn_prefect.model.policies import (
    JOB_TYPES,
    RECOVERY_MODES,
    STRATEGIES,
    JobType,
    RecoveryMode,
    RetryPolicy,
    Strategy,
    default_reschedule,
    default_restart,
    layered,
    parse_policy_fields,
)
from mn_prefect.model.resources import ResourceRequest, parse_resources
from mn_prefect.model.scalars import (
    read_bool,
    read_number,
    read_string,
    read_string_list,
    shown,
    too_long_digits,
    type_name,
)

V2_API = "mn.workflow/v2"


class ServiceRequirement(BaseModel):
    """A service that must have a passing instance on the chosen node."""

    model_config = ConfigDict(frozen=True)

    name: str
    tags: tuple[str, ...] = ()
    required: bool = True


class AgentConfig(BaseModel):
    """How an agent runs. Unknown MirrorNeuron keys are kept."""

    model_config = ConfigDict(extra="allow", frozen=True)

    command: tuple[str, ...] | None = None
    environment: dict[str, str] = Field(default_factory=dict)
    pass_env: tuple[str, ...] = ()
    workdir: str | None = None
    timeout_seconds: float | None = None
    execution_profile: str | None = None
    runner_module: str | None = None
    image: str | None = Field(None, description="The container image under resources.runtime_driver docker.")
    idempotent: bool = False
    safe_to_retry: bool = False
    idempotency_key: str | None = None


class Agent(BaseModel):
    """One blueprint node with its effective policies."""

    model_config = ConfigDict(frozen=True)

    agent_id: str
    agent_type: str | None = None
    config: AgentConfig = AgentConfig()
    resources: ResourceRequest = ResourceRequest()
    constraints: tuple[Constraint, ...] = ()
    restart: RetryPolicy
    reschedule: RetryPolicy
    preferred_node: str | None = None
    requires_services: tuple[ServiceRequirement, ...] = ()
    uses: str | None = None
    health: HealthCheck | None = Field(None, description="Probed by the node's worker while the agent runs; failing "
                                                          "it cancels the agent's run (docs/prefect.md, Health checks).")


class Blueprint(BaseModel):
    """A normalised job description."""

    model_config = ConfigDict(frozen=True)

    job_name: str
    format: str = Field(description="v1 (flat) or v2 (agents.nodes).")
    job_type: JobType = "batch"
    strategy: Strategy = "binpack"
    constraints: tuple[Constraint, ...] = ()
    recovery_mode: RecoveryMode = "local_restart"
    drain: dict[str, Any] = Field(default_factory=dict)
    agents: tuple[Agent, ...]
    edges: tuple[dict[str, Any], ...] = ()
    entrypoints: tuple[str, ...] = ()
    required_services: tuple[ServiceRequirement, ...] = ()

    def agent(self, agent_id: str) -> Agent:
        for agent in self.agents:
            if agent.agent_id == agent_id:
                return agent
        raise KeyError(agent_id)


def _read_choice(raw: Any, path: str, allowed: tuple[str, ...], what: str, issues: Issues) -> str | None:
    if not isinstance(raw, str) or raw not in allowed:
        issues.add(path, f"unknown {what} {shown(raw)} (allowed: {', '.join(allowed)})")
        return None
    return raw


def _parse_services(raw: Any, path: str, issues: Issues) -> list[ServiceRequirement]:
    if raw is None:
        return []
    if isinstance(raw, (str, dict)):
        raw = [raw]
    if not isinstance(raw, list):
        issues.add(path, f"must be a list of services, got {type_name(raw)}")
        return []
    out = []
    for i, item in enumerate(raw):
        p = child(path, i)
        if isinstance(item, str) and item.strip():
            out.append(ServiceRequirement(name=item.strip()))
            continue
        if not isinstance(item, dict):
            issues.add(p, f"must be a service name or object, got {type_name(item)}")
            continue
        name = read_string(item.get("name"), child(p, "name"), issues)
        tags = read_string_list(item.get("tags", []), child(p, "tags"), issues)
        required = read_bool(item.get("required", True), child(p, "required"), issues)
        if name and tags is not None and required is not None:
            out.append(ServiceRequirement(name=name, tags=tuple(tags), required=required))
    return out


def _parse_config(raw: Any, path: str, issues: Issues) -> AgentConfig:
    if raw is None:
        return AgentConfig()
    if not isinstance(raw, dict):
        issues.add(path, f"must be an object, got {type_name(raw)}")
        return AgentConfig()
    fields: dict[str, Any] = dict(raw)
    before = len(issues)
    if raw.get("command") is not None:
        command = raw["command"]
        if not isinstance(command, list) or not command:
            issues.add(child(path, "command"), f"must be a non-empty argv list of strings, got {type_name(command)}")
        else:
            for i, arg in enumerate(command):
                if not isinstance(arg, str):
                    issues.add(child(child(path, "command"), i), f"must be a string, got {type_name(arg)}")
            fields["command"] = tuple(command)
    if raw.get("environment") is not None:
        env = raw["environment"]
        if not isinstance(env, dict):
            issues.add(child(path, "environment"), f"must be an object of strings, got {type_name(env)}")
        else:
            clean = {}
            for key, value in env.items():
                where = child(child(path, "environment"), key)
                problem = env_name_problem(key)
                if problem:
                    issues.add(where, problem)
                elif isinstance(value, (dict, list)) or value is None:
                    issues.add(where, f"must be a string, got {type_name(value)}")
                elif not isinstance(value, str) and too_long_digits(value):  # str() of it raises past Python's digit limit
                    issues.add(where, "must be a string, got a number of more than 64 digits")
                else:
                    clean[key] = str(value).lower() if isinstance(value, bool) else str(value)
                    if "\x00" in clean[key]:
                        issues.add(where, "must not contain a NUL character")
            fields["environment"] = clean
    if raw.get("pass_env") is not None:
        names = read_string_list(raw["pass_env"], child(path, "pass_env"), issues)
        for i, name in enumerate(names or ()):
            problem = env_name_problem(name)
            if problem:
                issues.add(child(child(path, "pass_env"), i), problem)
        fields["pass_env"] = tuple(names or ())
    for key in ("workdir", "execution_profile", "runner_module", "idempotency_key", "image"):
        if raw.get(key) is not None:
            read_string(raw[key], child(path, key), issues)
    if raw.get("timeout_seconds") is not None:
        read_number(raw["timeout_seconds"], child(path, "timeout_seconds"), issues, allow_strings=False)
    for key in ("idempotent", "safe_to_retry"):
        if raw.get(key) is not None:
            read_bool(raw[key], child(path, key), issues)
    if len(issues) > before:
        return AgentConfig()
    return AgentConfig.model_validate({k: v for k, v in fields.items() if v is not None})


def _job_policies(doc: dict[str, Any], issues: Issues) -> dict[str, Any]:
    """Job-level settings with their sources resolved (policies.*, policies.scheduler.*, top-level type)."""
    policies = doc.get("policies")
    if policies is None:
        policies = {}
    if not isinstance(policies, dict):
        issues.add("policies", f"must be an object, got {type_name(policies)}")
        policies = {}
    scheduler = policies.get("scheduler") or {}
    if not isinstance(scheduler, dict):
        issues.add("policies.scheduler", f"must be an object, got {type_name(scheduler)}")
        scheduler = {}
    out: dict[str, Any] = {}

    for source, path in ((policies, "policies.job_type"), (scheduler, "policies.scheduler.job_type"), (doc, "type")):
        key = "type" if source is doc else "job_type"
        if source.get(key) is not None:
            out["job_type"] = _read_choice(source[key], path, JOB_TYPES, "job type", issues) or "batch"
            break
    out.setdefault("job_type", "batch")

    for source, key, path in ((policies, "scheduler_strategy", "policies.scheduler_strategy"),
                              (scheduler, "strategy", "policies.scheduler.strategy")):
        if source.get(key) is not None:
            out["strategy"] = _read_choice(source[key], path, STRATEGIES, "scheduler strategy", issues) or "binpack"
            break
    out.setdefault("strategy", "binpack")

    mode = policies.get("recovery_mode")
    out["recovery_mode"] = (
        _read_choice(mode, "policies.recovery_mode", RECOVERY_MODES, "recovery mode", issues) if mode is not None else None
    ) or "local_restart"
    out["constraints"] = parse_constraints(policies.get("constraints"), "policies.constraints", issues)
    out["restart"] = parse_policy_fields(policies.get("restart"), "policies.restart", issues) or {}
    out["reschedule"] = parse_policy_fields(policies.get("reschedule"), "policies.reschedule", issues) or {}
    drain = policies.get("drain") or {}
    if not isinstance(drain, dict):
        issues.add("policies.drain", f"must be an object, got {type_name(drain)}")
        drain = {}
    out["drain"] = drain
    return out


def _parse_agent(raw: Any, path: str, job: dict[str, Any], issues: Issues) -> Agent | None:
    if not isinstance(raw, dict):
        issues.add(path, f"must be an object, got {type_name(raw)}")
        return None
    before = len(issues)
    node_id = raw.get("node_id")
    if not isinstance(node_id, str) or not node_id.strip():
        issues.add(child(path, "node_id"), "is required and must be a non-empty string")
    uses = raw.get("uses")
    if uses is not None and read_string(uses, child(path, "uses"), issues) is None:
        uses = None
    # The catalog form keeps its configuration under `with`.
    config_key = "config" if "config" in raw or uses is None else "with"
    config_raw = raw.get(config_key)
    config = _parse_config(config_raw, child(path, config_key), issues)

    if raw.get("resources") is not None or not isinstance(config_raw, dict) or config_raw.get("resources") is None:
        resources = parse_resources(raw.get("resources"), child(path, "resources"), issues)
    else:
        resources = parse_resources(config_raw["resources"], child(child(path, config_key), "resources"), issues)

    if resources is not None:
        container_issues(resources, config.image, resources_path=child(path, "resources"),
                         image_path=child(child(path, config_key), "image"), issues=issues)

    constraints = parse_constraints(raw.get("constraints"), child(path, "constraints"), issues)
    if isinstance(config_raw, dict) and config_raw.get("constraints") is not None:
        constraints += parse_constraints(config_raw["constraints"], child(child(path, config_key), "constraints"), issues)

    policies = raw.get("policies") or {}
    if not isinstance(policies, dict):
        issues.add(child(path, "policies"), f"must be an object, got {type_name(policies)}")
        policies = {}
    ppath = child(path, "policies")
    restart_fields = parse_policy_fields(policies.get("restart"), child(ppath, "restart"), issues)
    reschedule_fields = parse_policy_fields(policies.get("reschedule"), child(ppath, "reschedule"), issues)
    scheduler = policies.get("scheduler") or {}
    preferred = None
    if not isinstance(scheduler, dict):
        issues.add(child(ppath, "scheduler"), f"must be an object, got {type_name(scheduler)}")
    elif scheduler.get("preferred_node") is not None:
        preferred = read_string(scheduler["preferred_node"], child(child(ppath, "scheduler"), "preferred_node"), issues)

    services_raw = raw.get("requires_services")
    services_path = child(path, "requires_services")
    if services_raw is None and isinstance(config_raw, dict):
        services_raw, services_path = config_raw.get("requires_services"), child(child(path, config_key), "requires_services")
    services = _parse_services(services_raw, services_path, issues)

    health_raw, health_path = raw.get("health"), child(path, "health")
    if health_raw is None and isinstance(config_raw, dict):
        health_raw, health_path = config_raw.get("health"), child(child(path, config_key), "health")
    labels = [port.label for port in resources.ports] if resources is not None else []
    health = parse_health(health_raw, health_path, labels, issues)

    agent_type = raw.get("agent_type", raw.get("type"))
    if len(issues) > before:
        return None
    assert isinstance(node_id, str) and resources is not None  # each reported an issue otherwise
    return Agent(
        agent_id=node_id.strip(),
        agent_type=agent_type if isinstance(agent_type, str) else None,
        config=config,
        resources=resources,
        constraints=tuple(constraints),
        restart=layered(default_restart(job["job_type"]), job["restart"], restart_fields),
        reschedule=layered(default_reschedule(job["job_type"], job["recovery_mode"]), job["reschedule"],
                           reschedule_fields),
        preferred_node=preferred,
        requires_services=tuple(services),
        uses=uses,
        health=health,
    )


def _graph(doc: dict[str, Any], issues: Issues) -> tuple[str, dict[str, Any]]:
    """Where the agent graph lives: ``agents`` (v2 layout) or the top level (flat v1)."""
    agents = doc.get("agents")
    if isinstance(agents, dict) and "nodes" in agents:
        return "agents", agents
    if doc.get("apiVersion") == V2_API and "nodes" not in doc:
        if agents is None:
            issues.add("agents", f"is required for apiVersion {V2_API}")
        else:
            issues.add("agents", f"must be an object with nodes, got {type_name(agents)}")
        return "agents", {}
    return "", doc


def parse_blueprint(raw: Any) -> tuple[Blueprint | None, list[Issue]]:
    """Validate and normalise a blueprint; returns (blueprint, []) or (None, every issue)."""
    issues = Issues()
    if not isinstance(raw, dict):
        issues.add("", f"a blueprint must be a JSON object, got {type_name(raw)}")
        return None, issues.items
    prefix, graph = _graph(raw, issues)
    job = _job_policies(raw, issues)
    nodes_path = child(prefix, "nodes") if prefix else "nodes"
    nodes = graph.get("nodes")
    agents: list[Agent] = []
    seen: dict[str, int] = {}
    if nodes is None and (graph or not prefix):  # a v2 document without agents was reported by _graph
        issues.add(nodes_path, "is required: a blueprint needs at least one agent")
    elif nodes is not None and not isinstance(nodes, list):
        issues.add(nodes_path, f"must be a list of agents, got {type_name(nodes)}")
    elif nodes is not None:
        if not nodes:
            issues.add(nodes_path, "must contain at least one agent")
        for i, item in enumerate(nodes):
            node_id = item.get("node_id") if isinstance(item, dict) else None
            if isinstance(node_id, str) and node_id.strip():
                if node_id.strip() in seen:
                    issues.add(child(child(nodes_path, i), "node_id"),
                               f"duplicate node id {node_id!r} (also {nodes_path}[{seen[node_id.strip()]}])")
                seen.setdefault(node_id.strip(), i)
            agent = _parse_agent(item, child(nodes_path, i), job, issues)
            if agent is not None:
                agents.append(agent)

    edges_path = child(prefix, "edges") if prefix else "edges"
    edges = graph.get("edges") or []
    if not isinstance(edges, list):
        issues.add(edges_path, f"must be a list, got {type_name(edges)}")
        edges = []
    for i, edge in enumerate(edges):
        if not isinstance(edge, dict):
            issues.add(child(edges_path, i), f"must be an object, got {type_name(edge)}")
            continue
        for key, alt in (("from_node", "from"), ("to_node", "to")):
            name = edge.get(key, edge.get(alt))
            if name is None:
                issues.add(child(child(edges_path, i), key), "is required")
            elif not isinstance(name, str) or name not in seen:
                issues.add(child(child(edges_path, i), key), f"names unknown node {shown(name)}")
    entry_path = child(prefix, "entrypoints") if prefix else "entrypoints"
    entrypoints = read_string_list(graph.get("entrypoints") or [], entry_path, issues) or []
    for i, name in enumerate(entrypoints):
        if name not in seen:
            issues.add(child(entry_path, i), f"names unknown node {name!r}")
    required = _parse_services(raw.get("required_services"), "required_services", issues)

    if issues:
        return None, issues.items
    name = next((raw[k] for k in ("job_name", "graph_id", "id", "name") if isinstance(raw.get(k), str) and raw[k]),
                "job")
    return Blueprint(
        job_name=name,
        format="v2" if prefix else "v1",
        job_type=job["job_type"],
        strategy=job["strategy"],
        constraints=tuple(job["constraints"]),
        recovery_mode=job["recovery_mode"],
        drain=job["drain"],
        agents=tuple(agents),
        edges=tuple(edges),
        entrypoints=tuple(entrypoints),
        required_services=tuple(required),
    ), []


def load_json_file(path: str | Path) -> tuple[Any, list[Issue]]:
    """Read a JSON file; problems (missing, empty, malformed) come back as issues naming the file."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, [Issue(name, "no such file")]
    except (OSError, UnicodeDecodeError) as error:
        return None, [Issue(name, f"cannot be read: {error}")]
    if not text.strip():
        return None, [Issue(name, "is empty")]
    try:
        return parse_json(text), []
    except json.JSONDecodeError as error:
        return None, [Issue(name, f"malformed JSON at line {error.lineno} column {error.colno}: {error.msg}")]
    except RecursionError:
        return None, [Issue(name, "JSON is nested too deeply")]


def load_blueprint(path: str | Path) -> Blueprint:
    """Load and validate a blueprint file; raises InvalidInput with every issue."""
    raw, problems = load_json_file(path)
    if problems:
        raise InvalidInput(problems)
    blueprint, problems = parse_blueprint(raw)
    if problems:
        raise InvalidInput(problems)
    assert blueprint is not None
    return blueprint
