"""A MirrorNeuron workflow manifest parsed once, at the edge, into typed models (docs/bundles.md).

``parse_workflow`` reads either manifest format (v2 ``agents`` + ``workflow``, or flat v1 ``nodes``/``edges``,
where the step ledger is disabled) and returns a ``WorkflowSpec`` or every problem with its JSON path. The
agents' resources and policies come from the blueprint model (``parse_blueprint``), so placement reads the
same request a ``plan`` would. Nothing here touches Prefect, a store or the file system.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from mn_prefect.model.blueprint import Blueprint, parse_blueprint
from mn_prefect.model.containers import image_problem
from mn_prefect.model.envnames import env_name_problem
from mn_prefect.model.issues import Issue, Issues, child
from mn_prefect.model.scalars import MAX_QUANTITY, as_object, as_string, shown, too_long_digits, type_name

HOST_LOCAL_RUNNERS = ("MirrorNeuron.Runner.HostLocal", "HostLocal", "host_local")
# The step's command runs in a container of ``config.image`` (the docker driver's settings, drivers/container.py).
DOCKER_RUNNERS = ("MirrorNeuron.Runner.DockerWorker", "DockerWorker", "docker")
TRIGGER_ALIASES = {
    "all_success": "all_success", "all_required": "all_success",
    "all_done": "all_done",
    "one_success": "one_success", "any_success": "one_success",
    "one_done": "one_done", "any_done": "one_done",
    "one_failed": "one_failed", "any_failed": "one_failed",
    "none_failed_min_one_success": "none_failed_min_one_success", "partial_success": "none_failed_min_one_success",
    "quorum_success": "quorum_success", "quorum": "quorum_success",
}
FAILURE_POLICIES = {
    "fail_workflow": "fail_workflow", "fail": "fail_workflow", "fail_job": "fail_workflow",
    "continue_partial": "continue_partial", "continue": "continue_partial",
    "skip": "skip",
}
# MirrorNeuron builtins the engine carries out itself: a step's start, end and joins, and the router (a parallel
# part's fork) that passes each message on as it came.
STEP_CONTROL_TYPES = ("step_source", "step_sink", "step_join", "router")
PATCH_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


class AgentEdge(BaseModel):
    """A physical edge between agents: carries messages of ``message_type`` (``*`` = any)."""

    model_config = ConfigDict(frozen=True)

    edge_id: str
    from_node: str
    to_node: str
    message_type: str = "*"
    conditions: Any = None
    routing_mode: str | None = None


class UploadPath(BaseModel):
    model_config = ConfigDict(frozen=True)

    source: str
    target: str


class AgentSpec(BaseModel):
    """One agent node as the runtime needs it. ``config`` keeps every MirrorNeuron key."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    agent_type: str = "executor"
    template: str = "generic"
    config: dict[str, Any] = Field(default_factory=dict)
    command: tuple[str, ...] | str | None = None
    environment: dict[str, str] = Field(default_factory=dict)
    pass_env: tuple[str, ...] = ()
    upload_path: str | None = None
    upload_as: str | None = None
    upload_paths: tuple[UploadPath, ...] = ()
    image: str | None = None  # set for a DockerWorker agent: its command runs in a container of this image
    build: str | None = None  # where under payloads/ its image is built from, when it is not on the node
    workdir: str | None = None
    timeout_seconds: float | None = None
    max_attempts: int = 1
    retry_backoff_ms: int = 500
    output_type_set: bool = False
    output_message_type: str | None = None
    pool: str = "default"
    pool_slots: int = 1
    workflow_complete_step: bool = True
    failure_message_type: str | None = None

    @property
    def is_sink(self) -> bool:
        return self.agent_type == "aggregator"

    @property
    def is_step_control(self) -> bool:
        """A node MirrorNeuron's converter adds around an expanded step's agents (its start, end, forks and joins):
        the engine carries it out itself, nothing is launched (docs/bundles.md, "Steps expanded from the source
        format")."""
        return self.agent_type in STEP_CONTROL_TYPES

    @property
    def default_emit_type(self) -> str | None:
        """``output_message_type``: absent -> ``executor_result``; null -> no default emit (docs/bundles.md, "The
        default output")."""
        return self.output_message_type if self.output_type_set else "executor_result"


class StepSpec(BaseModel):
    """One workflow step with its control settings resolved (docs/bundles.md, "The step ledger")."""

    model_config = ConfigDict(frozen=True)

    id: str
    agent_id: str
    label: str | None = None
    required: bool = True
    failure_policy: str = "fail_workflow"
    trigger_rule: str = "all_success"
    quorum: int | None = None
    max_attempts: int = 1
    backoff_ms: float = 1000.0
    backoff_multiplier: float = 2.0
    timeout_seconds: float = 300.0
    dynamic: bool = False
    template_id: str | None = None
    region_id: str | None = None
    # A step expanded from the source format (``mn.workflow.source/v2``) runs a graph of agents: ``agent_id`` is its
    # start node, ``members`` every node of the graph (start first), ``end_agent_id`` the node that completes it.
    members: tuple[str, ...] = ()
    end_agent_id: str | None = None


class WorkflowEdge(BaseModel):
    """A dependency between steps (no messages travel on it)."""

    model_config = ConfigDict(frozen=True)

    id: str
    source: str
    target: str
    accepts: tuple[str, ...] = ("done",)
    required: bool = True


class Region(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    strategy: str = "replace_path"
    controller: str | None = None
    exit: str | None = None
    templates: tuple[str, ...] = ()
    mutable_edges: tuple[str, ...] = ()


class DynamicSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    max_patches: int = 64
    max_operations_per_patch: int = 64
    max_active_steps: int = 128
    max_instance_input_bytes: int = 32768
    templates: dict[str, dict[str, Any]] = Field(default_factory=dict)
    regions: dict[str, Region] = Field(default_factory=dict)


WorkflowMode = Literal["static_dag", "dynamic_dag"]
ExecutionStrategy = Literal["serial", "parallel"]


class WorkflowSpec(BaseModel):
    """The whole runnable workflow: agents and their edges, steps and their edges, seeds, sink."""

    model_config = ConfigDict(frozen=True)

    blueprint_id: str
    job_name: str
    revision: str | None = None
    blueprint: Blueprint
    agents: dict[str, AgentSpec]
    agent_edges: tuple[AgentEdge, ...] = ()
    entrypoints: tuple[str, ...] = ()
    initial_inputs: dict[str, list[Any]] = Field(default_factory=dict)
    steps: dict[str, StepSpec] = Field(default_factory=dict)
    edges: tuple[WorkflowEdge, ...] = ()
    source: str | None = None
    sink: str | None = None
    mode: WorkflowMode = "static_dag"
    strategy: ExecutionStrategy = "parallel"
    max_parallel_steps: int = 4
    dynamic: DynamicSpec | None = None

    @property
    def ledger_enabled(self) -> bool:
        return bool(self.steps)


# -- small readers -------------------------------------------------------------------------------------

def _str(raw: Any, path: str, issues: Issues, *, required: bool = False) -> str | None:
    if raw is None:
        if required:
            issues.add(path, "is required")
        return None
    if not isinstance(raw, str) or not raw:
        issues.add(path, f"must be a non-empty string, got {type_name(raw)}")
        return None
    return raw


def _num(raw: Any, path: str, issues: Issues, *, default: float, minimum: float = 0.0,
         exclusive: bool = False) -> float:
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        issues.add(path, f"must be a number, got {type_name(raw)}")
        return default
    if isinstance(raw, float) and math.isnan(raw):
        issues.add(path, "must be a number, got NaN")
        return default
    if raw < minimum or (exclusive and raw == minimum):
        issues.add(path, f"must be {'>' if exclusive else '>='} {minimum:g}")
        return default
    if raw > MAX_QUANTITY:  # infinity, or an integer float() cannot hold
        issues.add(path, f"is too large (at most {MAX_QUANTITY:g})")
        return default
    return float(raw)


def _int(raw: Any, path: str, issues: Issues, *, default: int, minimum: int = 0) -> int:
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, int) and not (isinstance(raw, float) and raw.is_integer()):
        issues.add(path, f"must be an integer, got {type_name(raw)}")
        return default
    if raw < minimum:
        issues.add(path, f"must be >= {minimum}")
        return default
    if raw > MAX_QUANTITY:
        issues.add(path, f"is too large (at most {MAX_QUANTITY:g})")
        return default
    return int(raw)


def _ident(raw: Any, default: str, path: str, issues: Issues) -> str:
    """An id as text (a number given for one reads as its digits); ``default`` when none is given."""
    if not raw:
        return default
    if isinstance(raw, (list, dict)):  # no id is a list or an object (and str() of one may raise, see below)
        issues.add(path, f"must be an id (text or a number), got a {'list' if isinstance(raw, list) else 'object'}")
        return default
    if not isinstance(raw, str) and too_long_digits(raw):  # str() of it would raise past Python's digit limit
        issues.add(path, "must be an id of at most 64 digits")
        return default
    return str(raw)


def _build_source(config: dict[str, Any], cpath: str, issues: Issues) -> str | None:
    """A DockerWorker agent's build context, as MirrorNeuron names it: ``build``, ``docker_worker_image`` or
    ``docker.build``, a folder under ``payloads/`` (or its Dockerfile)."""
    docker: dict[str, Any] = config["docker"] if isinstance(config.get("docker"), dict) else {}
    for raw, where in ((config.get("build"), child(cpath, "build")),
                       (config.get("docker_worker_image"), child(cpath, "docker_worker_image")),
                       (docker.get("build"), child(child(cpath, "docker"), "build"))):
        if raw is not None:
            text = _bundle_relative(raw, where, issues)
            return None if text is None else (text.rstrip("/").removesuffix("Dockerfile").rstrip("/") or ".")
    return None


def _bundle_relative(raw: Any, path: str, issues: Issues) -> str | None:
    """A path inside the bundle's ``payloads/``: relative, and no ``..`` segment (it must not escape)."""
    text = _str(raw, path, issues)
    if text is None:
        return None
    parts = text.replace("\\", "/").split("/")
    if text.startswith("/") or ".." in parts:
        issues.add(path, f"must stay inside the bundle's payloads folder, got {text!r}")
        return None
    return text


def _environment(raw: Any) -> dict[str, str]:
    """``config.environment`` as strings. Its names and values were checked where the blueprint was parsed
    (``parse_blueprint``: the rule ``blueprint validate`` applies too), which reported every problem."""
    if not isinstance(raw, dict):
        return {}
    env: dict[str, str] = {}
    for key, value in raw.items():
        if env_name_problem(key) or isinstance(value, (dict, list)) or value is None or (
                not isinstance(value, str) and too_long_digits(value)):
            continue
        text = value if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
        if "\x00" not in text:
            env[key] = text
    return env


# -- agents ----------------------------------------------------------------------------------------------

def _agent(raw: dict, path: str, issues: Issues) -> AgentSpec | None:
    node_id = raw.get("node_id")
    if not isinstance(node_id, str) or not node_id:
        return None  # the blueprint parser already reported it
    config = as_object(raw.get("config"))
    cpath = child(path, "config")
    agent_type = as_string(raw.get("agent_type"), "executor")
    command = config.get("command")
    if command is not None:
        if isinstance(command, list):
            if not command or not all(isinstance(a, str) for a in command):
                issues.add(child(cpath, "command"), "must be a non-empty list of strings (argv)")
                command = None
            else:
                command = tuple(command)
        elif not isinstance(command, str) or not command.strip():
            issues.add(child(cpath, "command"), f"must be a list of strings (argv), got {type_name(command)}")
            command = None
    upload_paths = []
    raw_uploads = config.get("upload_paths")
    if raw_uploads is not None:
        if not isinstance(raw_uploads, list):
            issues.add(child(cpath, "upload_paths"), f"must be a list, got {type_name(raw_uploads)}")
        else:
            for i, entry in enumerate(raw_uploads):
                where = child(child(cpath, "upload_paths"), i)
                if isinstance(entry, str):
                    entry = {"source": entry, "target": entry}
                if not isinstance(entry, dict):
                    issues.add(where, f"must be an object with source and target, got {type_name(entry)}")
                    continue
                source = _bundle_relative(entry.get("source"), child(where, "source"), issues)
                target = _bundle_relative(entry.get("target", entry.get("source")), child(where, "target"), issues)
                if source and target:
                    upload_paths.append(UploadPath(source=source, target=target))
    if config.get("python_environment") is not None:
        issues.add(child(cpath, "python_environment"),
                   "is not supported: building a virtual environment needs the network; install the packages on "
                   "the node and drop python_environment")
    runner = config.get("runner_module")
    image = None
    if agent_type != "aggregator" and runner in DOCKER_RUNNERS:
        if config.get("image") is None:
            issues.add(child(cpath, "image"), f"is required with runner_module {runner} (the container image)")
        elif (image := _str(config["image"], child(cpath, "image"), issues)) and (problem := image_problem(image)):
            issues.add(child(cpath, "image"), problem)
            image = None
    build = _build_source(config, cpath, issues) if image is not None else None
    if agent_type != "aggregator" and runner is not None and runner not in (*HOST_LOCAL_RUNNERS, *DOCKER_RUNNERS):
        issues.add(child(cpath, "runner_module"),
                   f"{shown(runner)} has no runner in mn-prefect (only MirrorNeuron.Runner.HostLocal and DockerWorker)")
    if agent_type == "module":
        issues.add(child(path, "agent_type"), "BEAM module agents cannot run outside MirrorNeuron's runtime")
    pass_env = config.get("pass_env") or []
    if not isinstance(pass_env, list) or not all(isinstance(n, str) for n in pass_env):
        issues.add(child(cpath, "pass_env"), "must be a list of variable names")
        pass_env = []
    output_type = config.get("output_message_type")
    if output_type is not None and not isinstance(output_type, str):
        issues.add(child(cpath, "output_message_type"), f"must be a string or null, got {type_name(output_type)}")
        output_type = None
    timeout = config.get("timeout_seconds")
    return AgentSpec(
        node_id=node_id,
        agent_type=agent_type,
        template=as_string(raw.get("type"), "generic"),
        config=config,
        command=command,
        environment=_environment(config.get("environment")),
        pass_env=tuple(pass_env),
        upload_path=_bundle_relative(config.get("upload_path"), child(cpath, "upload_path"), issues),
        upload_as=_bundle_relative(config.get("upload_as"), child(cpath, "upload_as"), issues),
        upload_paths=tuple(upload_paths),
        image=image,
        build=build,
        workdir=_str(config.get("workdir"), child(cpath, "workdir"), issues),
        timeout_seconds=None if timeout is None else _num(timeout, child(cpath, "timeout_seconds"), issues,
                                                          default=300.0, exclusive=True),
        max_attempts=_int(config.get("max_attempts"), child(cpath, "max_attempts"), issues, default=1, minimum=1),
        retry_backoff_ms=_int(config.get("retry_backoff_ms"), child(cpath, "retry_backoff_ms"), issues, default=500),
        output_type_set="output_message_type" in config,
        output_message_type=output_type,
        pool=_str(config.get("pool"), child(cpath, "pool"), issues) or "default",
        pool_slots=_int(config.get("pool_slots"), child(cpath, "pool_slots"), issues, default=1, minimum=1),
        workflow_complete_step=config.get("workflow_complete_step") is not False,
        failure_message_type=_str(config.get("failure_message_type"), child(cpath, "failure_message_type"), issues),
    )


def _objects(raw: Any, path: str, issues: Issues) -> Iterator[tuple[str, dict[str, Any]]]:
    """The objects of an optional list, each with its path; a non-list or a non-object entry is an issue."""
    if raw is None:
        return
    if not isinstance(raw, list):
        issues.add(path, f"must be a list, got {type_name(raw)}")
        return
    for i, item in enumerate(raw):
        where = child(path, i)
        if isinstance(item, dict):
            yield where, item
        else:
            issues.add(where, f"must be an object, got {type_name(item)}")


def _agent_edges(raw: Any, path: str, agents: dict[str, AgentSpec], issues: Issues) -> list[AgentEdge]:
    out: list[AgentEdge] = []
    for where, edge in _objects(raw, path, issues):
        src = _str(edge.get("from_node"), child(where, "from_node"), issues, required=True)
        dst = _str(edge.get("to_node"), child(where, "to_node"), issues, required=True)
        for end, name in ((src, "from_node"), (dst, "to_node")):
            if end is not None and end not in agents:
                issues.add(child(where, name), f"unknown agent {end!r}")
        mode = edge.get("routing_mode")
        if src and dst and src in agents and dst in agents:
            out.append(AgentEdge(edge_id=_ident(edge.get("edge_id"), f"{src}->{dst}", child(where, "edge_id"), issues),
                                 from_node=src, to_node=dst,
                                 message_type=as_string(edge.get("message_type"), "*"),
                                 conditions=edge.get("conditions", edge.get("condition")),
                                 routing_mode=mode if isinstance(mode, str) else None))
    return out


# -- steps -----------------------------------------------------------------------------------------------

def _trigger(step: dict, control: dict, path: str, issues: Issues) -> tuple[str, int | None]:
    """``step.trigger_rule`` | ``control.trigger_rule`` | ``join`` forms | ``all_success`` (docs/bundles.md, "The step
    ledger")."""
    join = as_object(step.get("join"))
    raw, where = step.get("trigger_rule"), child(path, "trigger_rule")
    if raw is None:
        raw, where = control.get("trigger_rule"), child(child(path, "control"), "trigger_rule")
    if raw is None:
        raw = join.get("trigger_rule") or join.get("rule") or join.get("mode")
        where = child(path, "join")
    quorum_raw = None
    if isinstance(raw, dict):
        quorum_raw = raw.get("quorum", raw.get("count", raw.get("minimum")))
        raw = raw.get("rule") or raw.get("mode")
    if quorum_raw is None:
        quorum_raw = control.get("quorum", join.get("quorum"))
    if raw is None:
        return "all_success", None
    if not isinstance(raw, str) or raw not in TRIGGER_ALIASES:
        issues.add(where, f"unknown trigger rule {shown(raw)} (allowed: {', '.join(sorted(TRIGGER_ALIASES))})")
        return "all_success", None
    rule = TRIGGER_ALIASES[raw]
    quorum = None
    if rule == "quorum_success":
        if isinstance(quorum_raw, bool) or not isinstance(quorum_raw, int) or quorum_raw < 1:
            issues.add(where, "quorum_success needs a quorum: an integer >= 1")
        else:
            quorum = quorum_raw
    return rule, quorum


def _step(raw: Any, path: str, agents: dict[str, AgentSpec], issues: Issues, *,
          dynamic: bool = False, template_id: str | None = None) -> StepSpec | None:
    if not isinstance(raw, dict):
        issues.add(path, f"must be an object, got {type_name(raw)}")
        return None
    step_id = _str(raw.get("id"), child(path, "id"), issues, required=True)
    if step_id is None:
        return None
    candidates = [raw.get(k) for k in ("agent_id", "run", "id") if isinstance(raw.get(k), str)]
    agent_id = next((c for c in candidates if c in agents), None)
    if agent_id is None:
        field = "agent_id" if "agent_id" in raw else "run" if "run" in raw else "id"
        issues.add(child(path, field), f"names no agent of the manifest ({', '.join(map(repr, candidates))}; "
                                       f"agents: {', '.join(sorted(agents))})")
        return None
    control = as_object(raw.get("control"))
    cpath = child(path, "control")
    retry = as_object(control.get("retry"))
    node_config = agents[agent_id].config
    attempts_raw = retry.get("max_attempts", control.get("max_attempts", node_config.get("max_attempts")))
    max_attempts = _int(attempts_raw, child(child(cpath, "retry"), "max_attempts"), issues, default=1, minimum=1)
    if control.get("retry_backoff_ms") is not None:
        backoff = _num(control.get("retry_backoff_ms"), child(cpath, "retry_backoff_ms"), issues, default=1000)
    elif isinstance(node_config.get("retry_backoff_ms"), (int, float)) and "backoff_seconds" not in retry:
        backoff = _num(node_config["retry_backoff_ms"], child(cpath, "retry_backoff_ms"), issues, default=1000)
    elif retry.get("backoff_seconds") is not None:
        backoff = 1000 * _num(retry.get("backoff_seconds"), child(child(cpath, "retry"), "backoff_seconds"),
                              issues, default=1)
    else:
        backoff = 1000.0
    multiplier = _num(retry.get("backoff_multiplier"), child(child(cpath, "retry"), "backoff_multiplier"),
                      issues, default=2.0)
    timeout_raw = control.get("timeout_seconds", node_config.get("timeout_seconds"))
    timeout = _num(timeout_raw, child(cpath, "timeout_seconds"), issues, default=300.0, exclusive=True)
    policy_raw = control.get("failure_policy", "fail_workflow")
    if not isinstance(policy_raw, str) or policy_raw not in FAILURE_POLICIES:
        issues.add(child(cpath, "failure_policy"), f"unknown failure policy {shown(policy_raw)} "
                                                    f"(allowed: {', '.join(sorted(FAILURE_POLICIES))})")
        policy_raw = "fail_workflow"
    rule, quorum = _trigger(raw, control, path, issues)
    members, end_agent_id = _step_graph(raw, path, agent_id, agents, issues)
    return StepSpec(id=step_id, agent_id=agent_id, label=raw.get("label") if isinstance(raw.get("label"), str) else None,
                    required=control.get("required") is not False, failure_policy=FAILURE_POLICIES[policy_raw],
                    trigger_rule=rule, quorum=quorum, max_attempts=max_attempts, backoff_ms=backoff,
                    backoff_multiplier=multiplier, timeout_seconds=timeout, dynamic=dynamic, template_id=template_id,
                    members=members, end_agent_id=end_agent_id)


def _step_graph(raw: dict, path: str, agent_id: str, agents: dict[str, AgentSpec],
                issues: Issues) -> tuple[tuple[str, ...], str | None]:
    """The nodes of an expanded step (``agent_ids``, ``end_agent_id``: docs/bundles.md, "Steps expanded from the
    source format"); ``((), None)`` for a step that one agent runs."""
    end = raw.get("end_agent_id")
    if end is None:
        return (), None
    if not isinstance(end, str) or end not in agents:
        issues.add(child(path, "end_agent_id"), f"names no agent of the manifest ({shown(end)})")
        return (), None
    listed = raw.get("agent_ids")
    if listed is not None and (not isinstance(listed, list) or not all(isinstance(a, str) for a in listed)):
        issues.add(child(path, "agent_ids"), f"must be a list of agent ids, got {type_name(listed)}")
        listed = None
    unknown = [a for a in listed or [] if a not in agents]
    if unknown:
        issues.add(child(path, "agent_ids"), f"names no agent of the manifest ({', '.join(map(repr, unknown))})")
    members = [agent_id, *(a for a in listed or [] if a in agents), end]
    return tuple(dict.fromkeys(members)), end


def _workflow_edges(raw: Any, path: str, steps: dict[str, StepSpec], issues: Issues) -> list[WorkflowEdge]:
    out: list[WorkflowEdge] = []
    for where, edge in _objects(raw, path, issues):
        src = _str(edge.get("from"), child(where, "from"), issues, required=True)
        dst = _str(edge.get("to"), child(where, "to"), issues, required=True)
        bad = False
        for end, name in ((src, "from"), (dst, "to")):
            if end is not None and end not in steps:
                issues.add(child(where, name), f"unknown step {end!r}")
                bad = True
        accepts = edge.get("accepts", ["done"])
        if isinstance(accepts, str):
            accepts = [accepts]
        if not isinstance(accepts, list) or not all(isinstance(a, str) for a in accepts):
            issues.add(child(where, "accepts"), "must be a list of outcome names (done, failed, partial, skipped)")
            accepts = ["done"]
        if src and dst and not bad:
            out.append(WorkflowEdge(id=_ident(edge.get("id"), f"{src}->{dst}", child(where, "id"), issues),
                                    source=src, target=dst,
                                    accepts=tuple(accepts), required=edge.get("required") is not False))
    return out


def find_cycle(step_ids: list[str], edges: list[WorkflowEdge] | tuple[WorkflowEdge, ...]) -> list[str] | None:
    """One cycle among the steps (as a list of ids, first repeated last), or None for a DAG.

    A depth-first walk with its own stack (a chain of thousands of steps is deeper than Python's recursion
    limit), visiting steps and their successors in the order given."""
    out: dict[str, list[str]] = {s: [] for s in step_ids}
    for e in edges:
        out.setdefault(e.source, []).append(e.target)
    color: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in step_ids:
        if color.get(start) is not None:
            continue
        color[start] = 1
        path = [start]
        pending = [iter(out.get(start, []))]
        while pending:
            nxt = next(pending[-1], None)
            if nxt is None:
                color[path.pop()] = 2
                pending.pop()
            elif color.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif color.get(nxt) is None:
                color[nxt] = 1
                path.append(nxt)
                pending.append(iter(out.get(nxt, [])))
    return None


def _dynamic(raw: Any, path: str, agents: dict[str, AgentSpec], issues: Issues) -> DynamicSpec:
    raw = raw if isinstance(raw, dict) else {}
    limits = as_object(raw.get("limits"))
    lpath = child(path, "limits")
    templates: dict[str, dict[str, Any]] = {}
    raw_templates = raw.get("templates") or {}
    if isinstance(raw_templates, list):
        raw_templates = {t.get("id"): t for t in raw_templates if isinstance(t, dict) and isinstance(t.get("id"), str)}
    if not isinstance(raw_templates, dict):
        issues.add(child(path, "templates"), f"must be an object, got {type_name(raw_templates)}")
        raw_templates = {}
    for tid, template in raw_templates.items():
        where = child(child(path, "templates"), str(tid))
        if not isinstance(template, dict):
            issues.add(where, f"must be an object, got {type_name(template)}")
            continue
        probe = Issues()
        _step({**template, "id": template.get("id") or tid}, where, agents, probe, dynamic=True)
        issues.extend(probe)
        templates[str(tid)] = {**template, "id": template.get("id") or tid}
    regions: dict[str, Region] = {}
    raw_regions = raw.get("regions") or []
    if not isinstance(raw_regions, list):
        issues.add(child(path, "regions"), f"must be a list, got {type_name(raw_regions)}")
        raw_regions = []
    for i, region in enumerate(raw_regions):
        where = child(child(path, "regions"), i)
        if not isinstance(region, dict) or not isinstance(region.get("id"), str):
            issues.add(where, "must be an object with an id")
            continue
        names = {key: region.get(key) or [] for key in ("templates", "mutable_edges")}
        for key, value in names.items():
            if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
                issues.add(child(where, key), f"must be a list of names, got {type_name(value)}")
                names[key] = []
        for tid in names["templates"]:
            if tid not in templates:
                issues.add(child(where, "templates"), f"unknown template {tid!r}")
        regions[region["id"]] = Region(
            id=region["id"], strategy=_str(region.get("strategy"), child(where, "strategy"), issues) or "replace_path",
            controller=_str(region.get("controller"), child(where, "controller"), issues),
            exit=_str(region.get("exit"), child(where, "exit"), issues), templates=tuple(names["templates"]),
            mutable_edges=tuple(names["mutable_edges"]))
    return DynamicSpec(
        max_patches=_int(limits.get("max_patches"), child(lpath, "max_patches"), issues, default=64, minimum=1),
        max_operations_per_patch=_int(limits.get("max_operations_per_patch"),
                                      child(lpath, "max_operations_per_patch"), issues, default=64, minimum=1),
        max_active_steps=_int(limits.get("max_active_steps"), child(lpath, "max_active_steps"), issues,
                              default=128, minimum=1),
        max_instance_input_bytes=_int(limits.get("max_instance_input_bytes"),
                                      child(lpath, "max_instance_input_bytes"), issues, default=32768, minimum=1),
        templates=templates, regions=regions)


def _initial_inputs(doc: dict, issues: Issues) -> dict[str, list[Any]]:
    runtime = as_object(doc.get("runtime"))
    raw = runtime.get("initial_inputs", doc.get("initial_inputs"))
    path = "runtime.initial_inputs" if "initial_inputs" in runtime else "initial_inputs"
    out: dict[str, list[Any]] = {}
    if raw is not None:
        if not isinstance(raw, dict):
            issues.add(path, f"must be an object of agent ids to lists of payloads, got {type_name(raw)}")
        else:
            for key, value in raw.items():
                out[str(key)] = value if isinstance(value, list) else [value]
    bindings = as_object(runtime.get("bindings"))
    for name, binding in bindings.items():
        seeds = binding.get("seed_inputs") if isinstance(binding, dict) else None
        if isinstance(seeds, list) and name not in out:
            out[name] = seeds
    return out


def parse_workflow(doc: Any) -> tuple[WorkflowSpec | None, list[Issue]]:
    """Validate and normalise a manifest for running; returns (spec, []) or (None, every issue)."""
    blueprint, problems = parse_blueprint(doc)
    issues = Issues()
    issues.extend(problems)
    if not isinstance(doc, dict):
        return None, issues.items
    agents_section = doc.get("agents")
    graph = agents_section if isinstance(agents_section, dict) and "nodes" in agents_section else doc
    gpath = "agents" if graph is not doc else ""
    agents: dict[str, AgentSpec] = {}
    for i, node in enumerate(graph.get("nodes") or [] if isinstance(graph.get("nodes"), list) else []):
        if isinstance(node, dict):
            if node.get("uses") is not None:
                issues.add(child(child(child(gpath, "nodes"), i), "uses"),
                           f"catalog agent {shown(node.get('uses'))} cannot run: no agent catalog is configured")
            agent = _agent(node, child(child(gpath, "nodes"), i), issues)
            if agent is not None:
                agents[agent.node_id] = agent
    agent_edges = _agent_edges(graph.get("edges"), child(gpath, "edges"), agents, issues)
    raw_entrypoints = graph.get("entrypoints") or []
    if not isinstance(raw_entrypoints, list):
        issues.add(child(gpath, "entrypoints"), f"must be a list of agent ids, got {type_name(raw_entrypoints)}")
        raw_entrypoints = []
    entrypoints = [e for e in raw_entrypoints if isinstance(e, str)]
    for i, e in enumerate(entrypoints):
        if e not in agents:
            issues.add(child(child(gpath, "entrypoints"), i), f"unknown agent {e!r}")

    workflow = doc.get("workflow")
    steps: dict[str, StepSpec] = {}
    wf_edges: list[WorkflowEdge] = []
    dynamic = None
    mode, strategy, max_parallel, source, sink = "static_dag", "parallel", 4, None, None
    if workflow is not None and not isinstance(workflow, dict):
        issues.add("workflow", f"must be an object, got {type_name(workflow)}")
    elif isinstance(workflow, dict):
        raw_steps = workflow.get("steps")
        if raw_steps is None or raw_steps == []:
            issues.add("workflow.steps", "must contain at least one step (an agent job without steps has no "
                                         "workflow section)")
            raw_steps = []
        elif not isinstance(raw_steps, list):
            issues.add("workflow.steps", f"must be a list, got {type_name(raw_steps)}")
            raw_steps = []
        for i, raw in enumerate(raw_steps):
            step = _step(raw, child("workflow.steps", i), agents, issues)
            if step is None:
                continue
            if step.id in steps:
                issues.add(child(child("workflow.steps", i), "id"), f"duplicate step id {step.id!r}")
                continue
            steps[step.id] = step
        wf_edges = _workflow_edges(workflow.get("edges"), "workflow.edges", steps, issues)
        mode = workflow.get("mode") or "static_dag"
        if mode not in ("static_dag", "dynamic_dag"):
            issues.add("workflow.mode", f"unknown mode {shown(mode)} (allowed: static_dag, dynamic_dag)")
            mode = "static_dag"
        cycle = find_cycle(list(steps), wf_edges)
        if cycle:
            issues.add("workflow.edges", f"the step graph has a cycle: {' -> '.join(cycle)}")
        execution = as_object(workflow.get("execution"))
        strategy = execution.get("strategy") or "parallel"
        if strategy not in ("serial", "parallel"):
            issues.add("workflow.execution.strategy", f"unknown strategy {shown(strategy)} (allowed: serial, parallel)")
            strategy = "parallel"
        max_parallel = _int(execution.get("max_parallel_steps"), "workflow.execution.max_parallel_steps", issues,
                            default=4, minimum=1)
        for key in ("source", "entrypoint", "sink"):
            value = workflow.get(key)
            if value is not None and (not isinstance(value, str) or value not in steps):
                issues.add(f"workflow.{key}", f"unknown step {shown(value)}")
        source = workflow.get("source") or workflow.get("entrypoint")
        sink = workflow.get("sink")
        raw_dynamic = workflow.get("dynamic")
        if mode == "dynamic_dag" and isinstance(raw_dynamic, dict) and raw_dynamic.get("enabled") is True:
            dynamic = _dynamic(raw_dynamic, "workflow.dynamic", agents, issues)

    if issues or blueprint is None:
        return None, issues.items
    ident = doc.get("id") or doc.get("graph_id") or doc.get("job_name") or blueprint.job_name
    where = "id" if doc.get("id") else "graph_id" if doc.get("graph_id") else "job_name"
    if isinstance(workflow, dict) and not doc.get("id") and workflow.get("workflow_id"):
        ident, where = workflow["workflow_id"], "workflow.workflow_id"
    blueprint_id = _ident(ident, blueprint.job_name, where, issues)
    version = doc.get("version")
    revision = None if version is None else _ident(version, "", "version", issues) if version else str(version)
    spec = WorkflowSpec(
        blueprint_id=blueprint_id, job_name=blueprint.job_name, revision=revision,
        blueprint=blueprint, agents=agents, agent_edges=tuple(agent_edges), entrypoints=tuple(entrypoints),
        initial_inputs=_initial_inputs(doc, issues), steps=steps, edges=tuple(wf_edges), source=source, sink=sink,
        # mode and strategy were checked against their allowed values above.
        mode=cast(WorkflowMode, mode), strategy=cast(ExecutionStrategy, strategy), max_parallel_steps=max_parallel,
        dynamic=dynamic)
    if issues:
        return None, issues.items
    return spec, []


def is_workflow_document(doc: Any) -> bool:
    """A MirrorNeuron workflow manifest (run by the step ledger) rather than a flat agent job."""
    return isinstance(doc, dict) and (doc.get("kind") == "Workflow" or isinstance(doc.get("workflow"), dict)
                                      or str(doc.get("apiVersion", "")).startswith("mn.workflow/"))
