"""``mn-prefect node ...``: register and list nodes, maintenance, undrain, and one sweep of missed heartbeats."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Annotated

import typer

from mn_prefect.cli import render
from mn_prefect.cli.options import EXIT_REFUSED, JsonFlag, StoreURLArg, open_store_option
from mn_prefect.lifecycle import NodeStateRefused, Transition, advance_node_states, set_maintenance, undrain
from mn_prefect.model.issues import InvalidInput, Issue
from mn_prefect.store.base import ClusterStore, NodeNotRegistered, StoredNode

node_app = typer.Typer(help="Nodes registered in the store: list, maintenance, undrain, state sweep.",
                       no_args_is_help=True)

NodeArg = Annotated[str, typer.Argument(help="The node's registered name.", show_default=False)]
ReasonOpt = Annotated[str, typer.Option("--reason", help="Why; recorded with the state change event.",
                                        show_default=False)]


@node_app.command("register")
def node_register(store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """Register this machine (detected, plus MN_INVENTORY_FILE and MN_NODE_*) in the store."""
    from mn_prefect.inventory import local_node

    record = open_store_option(store_url).register_node(local_node())
    if as_json:
        render.print_json(record.model_dump(mode="json"))
    else:
        render.console.print(f"registered {record.name} ({record.status}, {len(record.devices)} devices)")


def node_summary(stored: StoredNode, now: float) -> dict:
    """What ``node list`` shows of a node, for the table and ``--json`` alike (ages in seconds)."""
    r = stored.record
    return {"name": r.name, "status": r.status, "scheduling_eligible": r.scheduling_eligible,
            "last_heartbeat": stored.last_heartbeat,
            # never negative: a heartbeat stamped by a clock a little ahead of this one is a fresh one
            "heartbeat_age_s": None if stored.last_heartbeat is None else round(max(0.0, now - stored.last_heartbeat), 3),
            "devices": [d.id for d in r.devices], "record": r.model_dump(mode="json")}


@node_app.command("list")
def node_list(store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """Registered nodes: status, scheduling eligibility, last heartbeat age, devices."""
    stored = open_store_option(store_url).list_nodes()
    now = time.time()  # after the read: a heartbeat written while the store was read is not in the future
    summaries = [node_summary(n, now) for n in stored]
    if as_json:
        render.print_json(summaries)
    else:
        render.console.print(render.nodes_table(summaries))


@node_app.command("maintenance")
def node_maintenance(
    node: NodeArg,
    reason: ReasonOpt,
    enable: Annotated[bool | None, typer.Option(
        "--enable/--disable", help="Enable: no new placements (not scheduling-eligible), nothing moves. Disable: "
                                   "back to healthy, with the eligibility the node had before.",
        show_default=False)] = None,
    store_url: StoreURLArg = None,
    as_json: JsonFlag = False,
) -> None:
    """Put a node in maintenance or take it out. Exit 2 for bad input or an unknown node, 1 when refused
    (a draining node: use undrain)."""
    if enable is None:
        raise InvalidInput([Issue("--enable/--disable", "say which: --enable or --disable")])
    store = open_store_option(store_url)
    _change(store, node, as_json, lambda: set_maintenance(store, node, enable, reason))


@node_app.command("undrain")
def node_undrain(
    node: NodeArg,
    reason: ReasonOpt,
    mark_eligible: Annotated[bool, typer.Option(
        "--mark-eligible", help="Make the node healthy and scheduling-eligible instead of leaving it in maintenance.")] = False,
    store_url: StoreURLArg = None,
    as_json: JsonFlag = False,
) -> None:
    """Cancel a drain: the node stays in maintenance unless --mark-eligible. Exit 2 for bad input or an unknown
    node, 1 when refused (the node is not draining)."""
    store = open_store_option(store_url)
    _change(store, node, as_json, lambda: undrain(store, node, reason, mark_eligible))


@node_app.command("states")
def node_states(store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """One sweep of missed heartbeats: silent healthy/joining nodes become disconnected after
    MN_HEARTBEAT_TIMEOUT_SECONDS (30), disconnected ones offline after MN_DISCONNECT_GRACE_SECONDS (30) more.
    Prints the transitions."""
    changes = advance_node_states(open_store_option(store_url))
    if as_json:
        render.print_json([c.model_dump() for c in changes])
    elif changes:
        render.console.print(render.transitions_table(changes))
    else:
        render.console.print("no node changed state")


def _change(store: ClusterStore, node: str, as_json: bool, apply: Callable[[], Transition | None]) -> None:
    """Apply one operator change of ``node`` and report it; an unknown node is bad input (exit 2), a refusal
    exits 1 with the reason."""
    try:
        change = apply()
    except NodeNotRegistered as error:
        raise InvalidInput([Issue("NODE", str(error))]) from None
    except NodeStateRefused as error:
        if as_json:
            render.print_json({"node": node, "changed": False, "error": str(error)})
        render.errors.print(f"[red]refused[/]: {error}", soft_wrap=True)
        raise typer.Exit(EXIT_REFUSED) from None
    stored = store.get_node(node)
    assert stored is not None  # apply() raised NodeNotRegistered otherwise
    record = stored.record
    if as_json:
        render.print_json({"node": node, "changed": change is not None,
                           "transition": change.model_dump() if change else None, "status": record.status,
                           "scheduling_eligible": record.scheduling_eligible})
    elif change is not None:
        render.console.print(f"{node}: {change.from_status} -> {change.to_status} ({change.reason}); scheduling "
                             f"eligible: {'yes' if record.scheduling_eligible else 'no'}", soft_wrap=True)
    else:
        render.console.print(f"{node}: unchanged ({record.status})")


@node_app.command("reconcile")
def node_reconcile(
    node: Annotated[str | None, typer.Argument(help="Only this node's bookings (default: every lost node).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Decide and report; change nothing.")] = False,
    store_url: StoreURLArg = None,
    as_json: JsonFlag = False,
) -> None:
    """One reconcile pass after node loss (leader-fenced): counters checked, recovered, paused, blocked,
    skipped, failed, and what was done per job."""
    from prefect.client.orchestration import get_client

    from mn_prefect.ops.flows import reconcile_once

    store = open_store_option(store_url)
    if node is not None and store.get_node(node) is None:
        raise InvalidInput([Issue("NODE", f"no node named {node!r} is registered")])
    with get_client(sync_client=True) as client:
        result = reconcile_once(store, client, node=node, dry_run=dry_run)
    if as_json:
        render.print_json(result)
        return
    render.console.print(render.reconcile_table(result))


@node_app.command("drain")
def node_drain(
    node: NodeArg,
    reason: ReasonOpt,
    deadline: Annotated[str, typer.Option("--deadline", help="How long batch work may finish in place: 30m, 2h, 90s.")] = "30m",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what the drain would do; change nothing.")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Advance the drain and show progress until it completes.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="With --wait: give up after this many seconds.")] = 7200,
    store_url: StoreURLArg = None,
    as_json: JsonFlag = False,
) -> None:
    """Drain a node: no new placements; service work with cluster_recover migrates now, batch work may finish
    until the deadline, system work stays; a completed drain leaves the node in maintenance."""
    from mn_prefect.lifecycle.drain import DrainRefused, parse_duration, preview_drain, start_drain

    seconds = parse_duration(deadline)
    if seconds is None:
        raise InvalidInput([Issue("--deadline", f"not a duration: {deadline!r} (examples: 30m, 2h, 90s)")])
    if not reason.strip():
        raise InvalidInput([Issue("--reason", "a reason is required: it is recorded with the drain")])
    store = open_store_option(store_url)
    if store.get_node(node) is None:
        raise InvalidInput([Issue("NODE", f"no node named {node!r} is registered")])
    if dry_run:
        actions = preview_drain(store, node)
        data = {"node": node, "dry_run": True, "deadline_s": seconds, "actions": actions,
                "summary": render.drain_sentence({"node": node, "dry_run": True, "actions": actions}, seconds)}
        if as_json:
            render.print_json(data)
            return
        if actions:
            render.console.print(render.drain_table(data))
        render.console.print(data["summary"], soft_wrap=True)
        return
    try:
        drain = start_drain(store, node, reason.strip(), deadline_s=seconds)
    except DrainRefused as refused:
        render.errors.print(f"[red]refused[/]: {refused}")
        raise typer.Exit(EXIT_REFUSED) from None
    if not wait:
        actions = preview_drain(store, node)
        data = {"node": node, "status": "draining", "deadline": drain.deadline, "actions": actions,
                "summary": render.drain_sentence({"node": node, "actions": actions}, seconds),
                "back_in_service": render.back_in_service(node)}
        if as_json:
            render.print_json(data)
            return
        if actions:
            render.console.print(render.drain_table(data))
        render.console.print(data["summary"], soft_wrap=True)
        render.console.print(data["back_in_service"], soft_wrap=True)
        return
    data = _follow_drain(store, node, timeout, live=not as_json)
    data["back_in_service"] = render.back_in_service(node)
    if as_json:
        render.print_json(data)
    else:
        render.console.print(render.drain_table(data))
        render.console.print(data["back_in_service"], soft_wrap=True)
    raise typer.Exit(0 if data["status"] == "complete" else 1)


def _follow_drain(store: ClusterStore, node: str, timeout: float, *, live: bool) -> dict:
    """Advance the drain until it completes, showing each pass live."""
    from prefect.client.orchestration import get_client
    from rich.live import Live

    from mn_prefect.ops.flows import drain_until_done

    start = {"node": node, "status": "draining", "actions": []}
    with get_client(sync_client=True) as client, Live(render.drain_table(start), console=render.console,
                                                     transient=True, auto_refresh=False) if live else nullcontext() as view:
        show = (lambda data: view.update(render.drain_table(data), refresh=True)) if view is not None else None
        return drain_until_done(store, client, node, timeout_s=timeout, on_pass=show)
