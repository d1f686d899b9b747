"""Command-line inputs: files become typed models here, once, with every problem as a path-named issue."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mn_prefect.bundles.source import expand, is_source
from mn_prefect.model.blueprint import Blueprint, load_json_file, parse_blueprint
from mn_prefect.model.constraints import parse_constraints
from mn_prefect.model.estimates import Estimate, estimate_of, read_max_runtime
from mn_prefect.model.issues import InvalidInput, Issue, Issues, child
from mn_prefect.model.json_text import parse_json
from mn_prefect.model.node import NodeRecord, parse_nodes
from mn_prefect.model.placement import Placement, parse_active
from mn_prefect.model.policies import STRATEGIES
from mn_prefect.model.queues import check_name, parse_queues
from mn_prefect.model.resources import ResourceRequest, parse_resources
from mn_prefect.model.scalars import shown, type_name
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.limits import Limits, parse_limits
from mn_prefect.scheduler.quotas import Queues, RunQueue

MN_POOL_TYPE = "mn"


def read_blueprint(path: Path) -> tuple[Blueprint | None, list[Issue]]:
    """A blueprint file; a manifest in MirrorNeuron's source format is expanded first (mn_prefect.bundles.source),
    with the file's folder as the blueprint's."""
    raw, problems = load_json_file(path)
    if problems:
        return None, problems
    if is_source(raw):
        try:
            raw = expand(raw, path.resolve().parent)
        except InvalidInput as error:
            return None, list(error.issues)
    return parse_blueprint(raw)


def read_nodes(path: Path, issues: Issues) -> list[NodeRecord]:
    raw, problems = load_json_file(path)
    if problems:
        issues.extend(problems)
        return []
    return parse_nodes(raw, path.name, issues)


def read_active(path: Path | None, issues: Issues) -> list[Placement]:
    if path is None:
        return []
    raw, problems = load_json_file(path)
    if problems:
        issues.extend(problems)
        return []
    return parse_active(raw, path.name, issues)


def read_limits(texts: list[str] | None, issues: Issues) -> Limits | None:
    if not texts:
        return None
    return parse_limits(texts, "--limits", issues)


# -- what to plan: a blueprint, a bare request, or a Prefect deployment's job variables -------------------


@dataclass(frozen=True)
class RunRequest:
    """One flow run's ask for the scheduler, as the ``mn`` worker builds it, and the strategy that ranks nodes."""

    ask: Ask
    strategy: str = "binpack"
    group: str | None = None  # a deployment's run is placed in its pool's group (docs/operating.md)
    estimate: Estimate | None = None  # when its job variables declare max_runtime_seconds (or carry a timeout)


def ask_for_run(name: str, variables: Mapping[str, Any], path: str, issues: Issues) -> RunRequest | None:
    """The ask of one flow run from its job variables (``resources``, ``constraints``, ``preferred_node``,
    ``strategy``), parsed as the worker parses them; None when any of them is wrong."""
    before = len(issues)
    resources = variables.get("resources")
    request = (resources if isinstance(resources, ResourceRequest)  # already parsed: a job configuration's
               else parse_resources(resources, child(path, "resources"), issues))
    constraints = parse_constraints(variables.get("constraints"), child(path, "constraints"), issues)
    if len(issues) > before or request is None:
        return None
    preferred, strategy = variables.get("preferred_node"), variables.get("strategy")
    if preferred not in (None, "") and not isinstance(preferred, str):
        issues.add(child(path, "preferred_node"), f"must be a node's name, got {type_name(preferred)}")
    if strategy not in (None, "", *STRATEGIES):
        issues.add(child(path, "strategy"), f"unknown scheduler strategy {shown(strategy)} (allowed: "
                                            f"{', '.join(STRATEGIES)})")
    declared = read_max_runtime(variables.get("max_runtime_seconds"), child(path, "max_runtime_seconds"), issues)
    timeout = read_max_runtime(variables.get("flow_timeout_seconds"), child(path, "flow_timeout_seconds"), issues)
    if len(issues) > before:
        return None
    ask = Ask(agent_id=name, source_agent_id=name, request=request, constraints=tuple(constraints),
              preferred_node=preferred or None)
    estimate = (None if declared is None and timeout is None
                else estimate_of(declared, timeout, (), is_limit=variables.get("max_runtime_is_limit") is True))
    return RunRequest(ask=ask, strategy=strategy or "binpack", estimate=estimate)


def read_request(text: str, issues: Issues) -> RunRequest | None:
    """``--request``: a resource request in the syntax of ``job_variables.resources``, as JSON text or
    ``@file.json``."""
    read = read_resources_text(text, "--request", issues)
    if read is None:
        return None
    return RunRequest(ask=Ask(agent_id="request", source_agent_id="request", request=read[1]))


def read_resources_text(text: str, option: str, issues: Issues, *,
                        name_file: bool = True) -> tuple[Any, ResourceRequest] | None:
    """A resource request given on the command line (``plan --request``, ``reserve --resources``): JSON text
    or ``@file.json``, parsed by ``parse_resources`` as every resource request is (flow runs' job variables,
    blueprint agents), aliases and all. Returns (the JSON as given, the request), or None with every problem
    in ``issues``, each path under ``option`` (or under the file's name for ``@file`` when ``name_file``)."""
    if text.startswith("@"):
        path = Path(text[1:])
        raw, problems = load_json_file(path)
        where = path.name if name_file else option
    else:
        where, problems = option, []
        try:
            raw = parse_json(text)
        except json.JSONDecodeError as error:
            problems = [Issue(where, f"malformed JSON at line {error.lineno} column {error.colno}: {error.msg}")]
        except RecursionError:
            problems = [Issue(where, "JSON is nested too deeply")]
    if problems:
        issues.extend(problems)
        return None
    before = len(issues)
    request = parse_resources(raw, where, issues)
    if len(issues) > before or request is None:
        return None
    return raw, request


def read_deployment(name: str, issues: Issues) -> RunRequest | None:
    """``--deployment flow/deployment``: one run of that Prefect deployment, read through the Prefect API:
    its job variables over its ``mn`` pool's defaults (the configuration the worker would receive)."""
    if name.count("/") != 1 or not all(part.strip() for part in name.split("/")):
        issues.add("--deployment", f"must be <flow name>/<deployment name> (as prefect deployment run takes), "
                                   f"got {name!r}")
        return None
    try:
        variables = asyncio.run(_deployment_variables(name))
    except InvalidInput as error:
        issues.extend(error.issues)
        return None
    run = ask_for_run(name, variables, "job_variables", issues)
    return replace(run, group=variables["pool"]) if run is not None else None


async def _deployment_variables(name: str) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from pydantic import ValidationError

    from mn_prefect.worker.variables import MNJobConfiguration

    async with get_client() as client:
        try:
            deployment = await client.read_deployment_by_name(name)
            pool = await client.read_work_pool(deployment.work_pool_name) if deployment.work_pool_name else None
        except ObjectNotFound:
            raise InvalidInput([Issue("--deployment", f"no deployment {name!r} at {client.api_url}")]) from None
        except Exception as error:  # unreachable server, refused request: say where it asked
            raise InvalidInput([Issue("--deployment", f"cannot read {name!r} from the Prefect API at "
                                                      f"{client.api_url}: {error}")]) from None
        if pool is None or pool.type != MN_POOL_TYPE:
            where = "no work pool" if pool is None else f"pool {pool.name!r} of type {pool.type!r}"
            raise InvalidInput([Issue("--deployment", f"{name!r} is on {where}, not an {MN_POOL_TYPE} pool: "
                                                      "mn-prefect does not place its runs")])
        try:
            config: MNJobConfiguration = await MNJobConfiguration.from_template_and_values(
                base_job_template=pool.base_job_template, values=dict(deployment.job_variables or {}), client=client)
        except ValidationError as error:  # as the worker would fail the run: every problem named
            problems = []
            for e in error.errors(include_url=False):
                if e["type"] == "resources":  # the request's own issues, each with its path
                    problems += [Issue(**i) for i in e.get("ctx", {}).get("issues", [])] or [Issue("", e["msg"])]
                else:
                    problems.append(Issue(f"job_variables.{'.'.join(str(p) for p in e['loc'])}", e["msg"]))
            raise InvalidInput(problems) from None
    return {"resources": config.resources.request(), "constraints": config.constraints,
            "preferred_node": config.preferred_node, "strategy": config.strategy, "pool": pool.name,
            "max_runtime_seconds": config.max_runtime_seconds, "max_runtime_is_limit": config.max_runtime_is_limit,
            "flow_timeout_seconds": config.flow_timeout_seconds}


# -- against what: a nodes file, or the live store -------------------------------------------------------


def check_group_exists(store, group: str | None, issues: Issues, named_by: str = "--group") -> None:
    """The group (given by ``named_by``) must be one of the store's."""
    if group is not None and group not in {g.name for g in store.list_groups()}:
        issues.add(named_by, f"no group {group!r} in the store (`mn-prefect group list` shows them; an mn pool's "
                             "workers create its group when they start)")


@dataclass
class Cluster:
    """What a plan is made against: node records, what already holds capacity, and the coarse limits."""

    nodes: list[NodeRecord]
    held: list[Placement]
    limits: Limits | None
    queues: Queues | None = None  # the store's queues, when read from it (``read_run_queue`` may replace them)


def read_cluster(nodes: Path | None, active: Path | None, limits: list[str] | None, store_url: str | None,
                 issues: Issues, group: str | None = None, named_by: str = "--group") -> Cluster:
    """``--nodes`` (with ``--active`` and ``--limits``), or without ``--nodes`` the nodes, bookings and limits
    registered in the store (``--active`` adds holds, ``--limits`` replaces the store's); with ``group``, only
    that resource group's nodes (a group the store does not have is an error naming ``--group``)."""
    held = read_active(active, issues)
    limit_values = read_limits(limits, issues)
    if nodes is not None:
        records = read_nodes(nodes, issues)
        return Cluster([n for n in records if group is None or n.group == group], held, limit_values)
    from mn_prefect.cli.options import open_store_option
    from mn_prefect.store.base import StoreError

    try:
        store = open_store_option(store_url)
        try:
            check_group_exists(store, group, issues, named_by)
            snap = store.snapshot(group=group)
        finally:
            store.close()
    except InvalidInput as error:
        issues.extend(error.issues)
        return Cluster([], held, limit_values)
    except StoreError as error:  # store messages never carry passwords
        issues.add("--store-url", f"cannot read the store (give --nodes to plan without it): {error}")
        return Cluster([], held, limit_values)
    queues = Queues.of(snap.queues, snap.cohorts)
    for placement in held:  # --active adds what its placements charge their queues
        queues.add(placement.queue or "", queues.amounts(placement.queue or "", [placement]))
    return Cluster(snap.nodes, snap.holds + held, limit_values or snap.limits, queues)


def read_run_queue(path: Path | None, name: str | None, priority: int | None, preemptible: bool, cluster: Cluster,
                   issues: Issues) -> RunQueue | None:
    """``--queue`` with ``--priority`` and ``--preemptible``; ``--queues`` (a file) replaces the cluster's queues,
    their use counted from its placements (``--active``)."""
    if path is not None:
        raw, problems = load_json_file(path)
        if problems:
            issues.extend(problems)
            return None
        try:
            specs = parse_queues(raw, path.name)
        except InvalidInput as error:
            issues.extend(error.issues)
            return None
        cluster.queues = Queues.build(specs.values(), cluster.held)
        if name is not None and name not in specs:
            issues.add("--queue", f"{name!r} is not one of the queues in --queues ({', '.join(specs) or 'none'})")
    if name is None:
        for option, given in (("--priority", priority is not None), ("--preemptible", preemptible)):
            if given:
                issues.add(option, "needs --queue: a run's priority and preemptibility come with its queue")
        return None
    if check_name(name, "--queue", issues) is None:
        return None
    return RunQueue(name=name, priority=priority, preemptible=preemptible)
