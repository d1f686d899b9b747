"""``mn-prefect service ...``: the services the nodes run and their health (a node's inventory ``services``)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from mn_prefect.cli import render
from mn_prefect.cli.options import JsonFlag, StoreURLArg, open_store_option
from mn_prefect.model.issues import InvalidInput, Issue

service_app = typer.Typer(help="The services the nodes run, with the health their workers probe.",
                          no_args_is_help=True)

NodeOpt = Annotated[str | None, typer.Option("--node", help="Only this node's (its name or mirror_neuron@HOST).")]
AllOpt = Annotated[bool, typer.Option("--all", help="Warning and critical instances too (default: passing only).")]


def _table(rows: list[dict], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("service", "node", "address", "port", "status", "tags", "check"):
        table.add_column(column)
    style = {"passing": "green", "warning": "yellow", "critical": "red"}
    for r in rows:
        check = r["check"] or {}
        table.add_row(r["name"], r["node"], r["address"], str(r["port"] or "-"),
                      f"[{style[r['status']]}]{r['status']}[/]", ",".join(r["tags"]),
                      f"http {check['http']}" if check.get("http") else "tcp" if check.get("tcp") else "-")
    return table


@service_app.command("list")
def service_list(name: Annotated[str | None, typer.Option("--name", help="Only this service.")] = None,
                 node: NodeOpt = None,
                 status: Annotated[str | None, typer.Option("--status", help="passing, warning or critical.")] = None,
                 all_statuses: AllOpt = False, store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """Every service instance of the registered nodes (passing ones unless --all or --status)."""
    from mn_prefect.ops.services import instances, status_problem

    if problem := status_problem(status):
        raise InvalidInput([Issue("--status", problem)])
    rows = instances(open_store_option(store_url), name=name, node=node, status=status,
                     passing_only=not all_statuses and status is None)
    if as_json:
        render.print_json(rows)
    else:
        render.console.print(_table(rows, "services"))


@service_app.command("resolve")
def service_resolve(name: Annotated[str, typer.Argument(metavar="NAME", help="The service's name.")],
                    tag: Annotated[list[str] | None, typer.Option("--tag", help="Required tag (repeatable).")] = None,
                    node: NodeOpt = None, all_statuses: AllOpt = False, store_url: StoreURLArg = None,
                    as_json: JsonFlag = False) -> None:
    """Where to reach NAME: its passing instances (address and port). Exit 1 when there is none."""
    from mn_prefect.ops.services import instances

    rows = instances(open_store_option(store_url), name=name, node=node, tags=tag or [],
                     passing_only=not all_statuses)
    if as_json:
        render.print_json({"name": name, "services": rows})
    else:
        render.console.print(_table(rows, f"instances of {name}"))
    if not rows:
        render.errors.print(f"no {'' if all_statuses else 'passing '}instance of {name}", soft_wrap=True)
        raise typer.Exit(1)
