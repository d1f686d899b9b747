"""The ``mn-prefect`` command line."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from mn_prefect import __version__
from mn_prefect.cli import bundles, jobs, render
from mn_prefect.cli.audit import store_audit
from mn_prefect.cli.events import event_app
from mn_prefect.cli.groups import group_app
from mn_prefect.cli.human import human_app
from mn_prefect.cli.inputs import (
    check_group_exists,
    read_active,
    read_blueprint,
    read_cluster,
    read_deployment,
    read_limits,
    read_nodes,
    read_request,
    read_run_queue,
)
from mn_prefect.cli.metrics import metrics_app
from mn_prefect.cli.mn_api import mn_api_app
from mn_prefect.cli.nodes import node_app
from mn_prefect.cli.options import (
    EXIT_INVALID,
    GroupOpt,
    JsonFlag,
    StoreURLArg,
    VerboseFlag,
    apply_settings,
    explain_error,
    open_store_option as _open_store,
)
from mn_prefect.cli.plan_hold import PlanHoldFacts, own_hold, plan_hold, read_hold_facts
from mn_prefect.cli.queues import queue_app
from mn_prefect.cli.reserve import reserve as reserve_command
from mn_prefect.cli.services import service_app
from mn_prefect.cli.simulate import simulate as simulate_command
from mn_prefect.cli.up import lab_down
from mn_prefect.cli.usage import usage as usage_command
from mn_prefect.model.issues import InvalidInput, Issue, Issues
from mn_prefect.model.placement import Plan
from mn_prefect.scheduler.ask import asks_for_blueprint
from mn_prefect.scheduler.plan import plan_asks, plan_job
from mn_prefect.scheduler.preemption import preempting_plan
from mn_prefect.scheduler.view import ClusterView
from mn_prefect.store.base import StoreError

app = typer.Typer(help="Resource-aware placement for Prefect flow runs.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
blueprint_app = typer.Typer(help="Validate, plan, deploy and run MirrorNeuron blueprints.", no_args_is_help=True)
resource_app = typer.Typer(help="Inspect node resources.", no_args_is_help=True)
app.add_typer(blueprint_app, name="blueprint")
blueprint_app.command("deploy")(bundles.blueprint_deploy)
blueprint_app.command("run")(bundles.blueprint_run)
blueprint_app.add_typer(human_app, name="human")
app.add_typer(jobs.job_app, name="job")
app.add_typer(jobs.ops_app, name="ops")
store_app = typer.Typer(help="The cluster state store.", no_args_is_help=True)
app.add_typer(resource_app, name="resource")
app.add_typer(store_app, name="store")
app.add_typer(node_app, name="node")
app.add_typer(group_app, name="group")
app.add_typer(queue_app, name="queue")
app.add_typer(mn_api_app, name="mn-api")
app.add_typer(event_app, name="event")
app.add_typer(service_app, name="service")
app.add_typer(metrics_app, name="metrics")
app.command("reserve")(reserve_command)
app.command("usage")(usage_command)



def _version(value: bool) -> None:
    if value:
        print(__version__)
        raise typer.Exit()


@app.callback()
def root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print the version and exit.")] = False,
         verbose: VerboseFlag = False) -> None:
    """mn-prefect: Nomad-style placement of Prefect flow runs on CPU and GPU machines."""
    apply_settings(verbose)  # flag > env > ~/.mn-prefect/config > default, for every command


@blueprint_app.command("validate")
def blueprint_validate(file: bundles.PathArg = None, folder: bundles.FolderOpt = None,
                       as_json: JsonFlag = False) -> None:
    """Validate what `blueprint run` takes (a bundle folder, a workflow manifest, a flat v1 blueprint) by the
    rules it applies: exit 0 when valid, 1 when not, listing every error with its JSON path."""
    target = bundles.pick_target(file, folder)
    summary, issues = bundles.validate(target)
    if as_json:
        render.print_json({"valid": not issues, "errors": [i.as_dict() for i in issues]})
    elif issues:
        render.console.print(render.issues_table(issues, f"{target}: {len(issues)} error(s)"))
    else:
        render.console.print(f"[green]valid[/]: {target} ({summary})", soft_wrap=True)
    raise typer.Exit(1 if issues else 0)


@app.command("plan")
def plan(
    file: Annotated[Path | None, typer.Argument(metavar="FILE", help="Blueprint JSON (either format).")] = None,
    request: Annotated[str | None, typer.Option(
        "--request", help='One run\'s resource request as JSON, the syntax of job_variables.resources '
                          '(\'{"gpu": 1}\'), or @file.json.')] = None,
    deployment: Annotated[str | None, typer.Option(
        "--deployment", help="One run of this Prefect deployment (flow/deployment), with its job variables.")] = None,
    nodes: Annotated[Path | None, typer.Option(
        "--nodes", help="JSON list of node records (default: the nodes and bookings in the store).")] = None,
    active: Annotated[Path | None, typer.Option("--active", help="Earlier plan(s) or placements that hold capacity.")] = None,
    strategy: Annotated[str | None, typer.Option("--strategy", help="binpack or spread (overrides the blueprint or deployment).")] = None,
    limits: Annotated[list[str] | None, typer.Option(
        "--limits", help="cpu=75,memory=75,gpu=100,disk=75; repeat it with NODE:cpu=100 for one node's overrides")] = None,
    group: GroupOpt = None,
    queues: Annotated[Path | None, typer.Option(
        "--queues", help='JSON of queues by name: {"a": {"quota": {"gpu": 4}, "borrow": {...}, "priority": P, '
                         '"weight": W, "cohort": C}} (default: the store\'s, when planning against it).')] = None,
    queue: Annotated[str | None, typer.Option("--queue", help="Plan the run as placed from this queue: charged to "
                                                               "its quota.")] = None,
    priority: Annotated[int | None, typer.Option("--priority", help="The run's priority (default: its queue's).")] = None,
    preemptible: Annotated[bool, typer.Option("--preemptible", help="The run may be preempted.")] = False,
    flow_run: Annotated[str | None, typer.Option(
        "--flow-run", help="Against the store: plan a --request or --deployment as this flow run (its id); the "
                           "head-of-line hold standing for it is its own, its capacity free for it.")] = None,
    store_url: StoreURLArg = None,
    table: Annotated[bool, typer.Option("--table", help="Render the plan as tables for people.")] = False,
) -> None:
    """Dry-run placement of a blueprint FILE, a bare --request or a --deployment's run, against --nodes or the
    store (only the nodes of --group; against the store, a --deployment's run, as its worker would, in its
    pool's group unless --group says otherwise). Prints the plan as JSON; exit 0 runnable_now, 1 runnable_later/not_runnable,
    2 invalid. Against the store, a run that would fit once running bookings end (runnable_later) is told where its
    head-of-line hold stands or would go, and when it is expected to start there (``hold``)."""
    given = [name for name, value in (("FILE", file), ("--request", request), ("--deployment", deployment))
             if value is not None]
    if len(given) != 1:
        raise typer.BadParameter(f"give exactly one of FILE, --request or --deployment, got {' and '.join(given) or 'none'}",
                                 param_hint="FILE / --request / --deployment")
    issues = Issues()
    blueprint = run_request = None
    if file is not None:
        blueprint, problems = read_blueprint(file)
        issues.extend(problems)
    elif request is not None:
        run_request = read_request(request, issues)
    else:
        assert deployment is not None  # exactly one of the three was given
        run_request = read_deployment(deployment, issues)
    if strategy is not None and strategy not in ("binpack", "spread"):
        issues.add("--strategy", f"unknown scheduler strategy {strategy!r} (allowed: binpack, spread)")
    group, named_by = _group(group, issues), "--group"
    if group is None and nodes is None and run_request is not None and run_request.group is not None:
        group, named_by = run_request.group, "--deployment"  # its worker would plan in its pool's group
    if flow_run is not None and (nodes is not None or file is not None):
        issues.add("--flow-run", "holds stand in the store, for flow runs: give it with --request or --deployment, "
                                 "without --nodes")
    cluster = read_cluster(nodes, active, limits, store_url, issues, group, named_by)
    run_queue = read_run_queue(queues, queue, priority, preemptible, cluster, issues)
    facts = _hold_facts(store_url, group) if flow_run is not None and not issues else None
    own = own_hold(facts, flow_run)
    if issues or (blueprint is None and run_request is None):
        result = Plan(status="invalid", errors=[i.as_dict() for i in issues.items],
                      reason=f"{len(issues)} input error(s)")
    elif blueprint is not None:
        result = plan_job(blueprint, cluster.nodes, cluster.held, strategy=strategy, limits=cluster.limits,
                          queue=run_queue, queues=cluster.queues)
    else:  # one flow run, planned as the worker plans it
        assert run_request is not None
        view = None
        if own is not None:  # the run's own hold: its capacity is free for it (placement.holding.place_over)
            view = ClusterView(cluster.nodes, cluster.held, cluster.limits, cluster.queues)
            for p in own.placements:
                view.unhold(p)
        result = plan_asks([run_request.ask], cluster.nodes, cluster.held, strategy=strategy or run_request.strategy,
                           limits=cluster.limits, queue=run_queue, queues=cluster.queues, view=view)
    asks = [] if result.status == "invalid" else \
        asks_for_blueprint(blueprint) if blueprint is not None else [run_request.ask]  # type: ignore[union-attr]
    if result.status == "runnable_later" and run_queue is not None:  # would evicting preemptible runs make room?
        job_type = blueprint.job_type if blueprint is not None else "batch"
        result = preempting_plan(asks, cluster.nodes, cluster.held, cluster.limits, cluster.queues, run_queue,
                                 job_type, strategy or result.strategy or "binpack", math.inf) or result
    hold, now = None, time.time()
    if result.status == "runnable_later" and nodes is None:  # a store plan: where its hold stands or would go
        facts = facts or _hold_facts(store_url, group)
        if facts is not None:
            hold = plan_hold(ClusterView(cluster.nodes, cluster.held, cluster.limits), asks, facts, own,
                             result.reason, now)
    estimate = run_request.estimate if run_request is not None and result.status != "invalid" else None
    if table:
        for t in render.plan_tables(result):
            render.console.print(t)
        if estimate is not None:
            render.console.print(f"runtime estimate: {estimate.describe()}", soft_wrap=True)
        if hold is not None:
            render.console.print(f"hold: {hold.words(now)}", soft_wrap=True)
        if result.errors:
            render.console.print(render.issues_table(issues.items, "input errors"))
    else:
        out = result.as_json()
        if estimate is not None:
            out["estimate"] = estimate.as_json()
        if hold is not None:
            out["hold"] = hold.as_json(now)
        render.print_json(out)
    raise typer.Exit({"runnable_now": 0, "invalid": EXIT_INVALID}.get(result.status, 1))




@resource_app.command("list")
def resource_list(
    nodes: Annotated[Path | None, typer.Option("--nodes", help="JSON list of node records (default: this machine).")] = None,
    active: Annotated[Path | None, typer.Option("--active", help="Plans or placements that hold capacity.")] = None,
    limits: Annotated[list[str] | None, typer.Option(
        "--limits", help="cpu=75,memory=75,gpu=100,disk=75; repeat it with NODE:cpu=100 for one node's overrides")] = None,
    from_store: Annotated[bool, typer.Option("--store", help="The nodes, bookings and limits registered in the store.")] = False,
    wide: Annotated[bool, typer.Option("--wide", help="Every column (group, eligibility, GPU memory, host paths); "
                                                      "by default the table fits 120 columns.")] = False,
    group: GroupOpt = None,
    store_url: StoreURLArg = None,
    as_json: JsonFlag = False,
) -> None:
    """Per-node totals, used, held and free capacity, devices, drivers and host paths (and each node's group; with
    --group, only that group's nodes and totals). Held: what head-of-line holds book for the runs they wait for,
    counted apart from used; free is what neither takes."""
    from mn_prefect.cli.usage import booked_gpus, booked_gpus_table
    from mn_prefect.ops.usage import hold_json, store_usage, usage_report

    issues = Issues()
    held = read_active(active, issues)
    limit_values = read_limits(limits, issues)
    group = _group(group, issues)
    if from_store or store_url:
        store = _open_store(store_url)
        check_group_exists(store, group, issues)
        if issues:
            raise InvalidInput(issues.items)
        report = store_usage(store, group=group, active=held, limits=limit_values)
    else:
        if nodes is not None:
            records = read_nodes(nodes, issues)
        else:
            from mn_prefect.inventory import local_nodes

            records = local_nodes()
        records = [n for n in records if group is None or n.group == group]
        if issues:
            raise InvalidInput(issues.items)
        report = usage_report(records, held, limit_values, held)
    usage, gpu_memory_free = report.usage, report.gpu_memory_free
    reserved = None
    if from_store or store_url:
        from mn_prefect.placement.reservations import holdings

        reserved = holdings(store, group=group)
    if as_json:
        doc = usage.model_dump(mode="json")
        for n in doc["nodes"]:
            n["gpu_memory_free_mb"] = gpu_memory_free[n["name"]]
            n["held"] = report.held(n["name"]).model_dump(mode="json")
            n["holds"] = [hold_json(p) for p in report.holds.get(n["name"], [])]
        doc["gpu_memory_free_mb"] = sum(gpu_memory_free.values())
        doc["held"] = report.held_total().model_dump(mode="json")
        gpus = {"booked_gpus": booked_gpus(store, group)} if reserved is not None else {}
        render.print_json({"group": group, **doc, **({"reservations": reserved} if reserved is not None else {}),
                           **gpus})
    else:
        for t in render.usage_tables(usage, gpu_memory_free, report.holds, wide=wide):
            render.console.print(t)
        if reserved:
            render.console.print(render.reservations_table(reserved))
        if reserved is not None and (gpus_seen := booked_gpus(store, group)):  # the device watch's last samples
            render.console.print(booked_gpus_table(gpus_seen))


def _hold_facts(store_url: str | None, group: str | None) -> PlanHoldFacts | None:
    """The holds standing in the store and its bookings' estimated ends, for a store plan's hold; None when the
    store cannot be read now (the plan is shown without its hold)."""
    try:
        store = _open_store(store_url)
        try:
            return read_hold_facts(store, group)
        finally:
            store.close()
    except (StoreError, InvalidInput):
        return None


def _group(name: str | None, issues: Issues) -> str | None:
    """``--group``, checked as a group name (a bad one is an issue naming the option)."""
    from mn_prefect.store.groups import check_group_name

    if name is None:
        return None
    try:
        return check_group_name(name, "--group")
    except ValueError as error:
        issues.add("--group", str(error).removeprefix("--group: "))
        return None


@resource_app.command("set")
def resource_set(
    cpu: Annotated[int | None, typer.Option("--cpu", min=1, max=100, help="Percent of each node's CPU to schedule.")] = None,
    memory: Annotated[int | None, typer.Option("--memory", min=1, max=100)] = None,
    gpu: Annotated[int | None, typer.Option("--gpu", min=1, max=100, help="Percent of GPUs (counts round down).")] = None,
    disk: Annotated[int | None, typer.Option("--disk", min=1, max=100)] = None,
    node: Annotated[str | None, typer.Option("--node", help="Set an override for this node only.")] = None,
    store_url: StoreURLArg = None,
    as_json: JsonFlag = False,
) -> None:
    """Coarse limits, cluster-wide or for one node, kept in the store."""
    store = _open_store(store_url)
    if node is not None and store.get_node(node) is None:  # most likely a typo: it would bind no node
        raise InvalidInput([Issue("--node", f"no node {node!r} in the store (`mn-prefect node list` shows them): "
                                            "no limit was set")])
    current = store.get_limits()
    given = {k: v for k, v in (("cpu", cpu), ("memory", memory), ("gpu", gpu), ("disk", disk)) if v is not None}
    if node is not None:
        per_node = {**current.per_node, node: {**current.per_node.get(node, {}), **given}}
        updated = current.model_copy(update={"per_node": per_node})
    else:
        updated = current.model_copy(update=given)
    store.set_limits(updated)
    if as_json:
        render.print_json(updated.model_dump())
    else:
        render.console.print(f"limits: cpu {updated.cpu}%, memory {updated.memory}%, gpu {updated.gpu}%, disk {updated.disk}%"
                             + (f"; per node {updated.per_node}" if updated.per_node else ""), soft_wrap=True)


@store_app.command("check")
def store_check(url: Annotated[str | None, typer.Argument(help="Store URL (default: MN_STORE_URL or the SQLite file).")] = None,
                as_json: JsonFlag = False) -> None:
    """Is the store reachable: backend, server version, counts. Exit 0 reachable, 1 not."""
    from mn_prefect.store import parse_store_url
    from mn_prefect.store.base import StoreInfo
    from mn_prefect.store.urls import default_url

    try:
        info = _open_store(url).check()
    except StoreError as error:  # unreachable while opening (SQL backends create their tables on open)
        parsed = parse_store_url(url or default_url())
        info = StoreInfo(backend=parsed.backend, url=parsed.safe, reachable=False, error=str(error))
    if as_json:
        render.print_json(info.model_dump())
    else:
        render.console.print(render.store_table(info))
    raise typer.Exit(0 if info.reachable else 1)


store_app.command("audit")(store_audit)


@app.command("up")
def lab_up(
    project: Annotated[Path, typer.Option("--project", help="The mn-prefect checkout (flows/, deployments/).")] = Path("."),
    nodes: Annotated[Path, typer.Option("--nodes", help="Mock node records, one worker each.")] = Path("deployments/mock-nodes.json"),
    port: Annotated[int | None, typer.Option("--port", help="Port of the local Prefect server (and UI); refused when taken "
                                                "(0: any free port). Default 4200, or a free port when 4200 is taken.")] = None,
    runs: Annotated[int, typer.Option("--runs", min=0, help="Runs of each example deployment.")] = 2,
    exit_when_done: Annotated[bool, typer.Option("--exit-when-done", help="Stop once the example runs finish.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Give up waiting for the runs after this many seconds.")] = 600,
) -> None:
    """A whole lab on this machine: Prefect server, mn pool, one worker per (mock) node, the examples deployed and
    run, and a live table of where each run went. Ctrl-C stops everything it started."""
    from mn_prefect.cli.up import up

    raise typer.Exit(up(project.resolve(), nodes if nodes.is_absolute() else project / nodes, port, runs,
                        exit_when_done, timeout))


app.command("down")(lab_down)
app.command("simulate")(simulate_command)


def main() -> None:
    """Entry point: input errors exit 2 with their paths, never a traceback."""
    try:
        app(standalone_mode=True)
    except InvalidInput as error:
        render.errors.print(render.issues_table(error.issues, "invalid input"))
        sys.exit(EXIT_INVALID)
    except StoreError as error:  # messages never carry passwords
        render.errors.print(f"[red]store error[/]: {explain_error(error) or error}", soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as error:  # last line of defence: a message, not a traceback
        if os.environ.get("MN_DEBUG"):
            raise
        render.errors.print(f"[red]error[/]: {explain_error(error) or f'{type(error).__name__}: {error}'} "
                            "(set MN_DEBUG=1 for the traceback)", soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
