"""``mn-prefect group ...``: create, list and delete resource groups (docs/operating.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from mn_prefect.cli import render
from mn_prefect.cli.options import EXIT_REFUSED, JsonFlag, StoreURLArg, open_store_option
from mn_prefect.model.issues import InvalidInput, Issue
from mn_prefect.store.base import GroupInUse, UnknownGroup
from mn_prefect.store.groups import check_group_name

group_app = typer.Typer(help="Resource groups: each mn work pool places its runs on the nodes of its own group.",
                        no_args_is_help=True)

NameArg = Annotated[str, typer.Argument(metavar="NAME", help="The group's name (an mn pool's group has the pool's name).",
                                        show_default=False)]


def _name(name: str) -> str:
    try:
        return check_group_name(name, "NAME")
    except ValueError as error:
        raise InvalidInput([Issue("NAME", str(error).removeprefix("NAME: "))]) from None


@group_app.command("create")
def group_create(name: NameArg, store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """Create a group; nodes join it by reporting it (a worker of the pool of that name, or MN_NODE_GROUP).
    Creating one that exists changes nothing and exits 0."""
    created = open_store_option(store_url).create_group(_name(name))
    if as_json:
        render.print_json({"group": name, "created": created})
    else:
        render.console.print(f"created group {name}" if created else f"group {name} already exists", soft_wrap=True)


@group_app.command("list")
def group_list(store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """Every group, ``default`` included, with how many registered nodes belong to it."""
    groups = open_store_option(store_url).list_groups()
    if as_json:
        render.print_json([g.model_dump() for g in groups])
    else:
        render.console.print(render.groups_table(groups))


@group_app.command("delete")
def group_delete(name: NameArg, store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """Delete a group. Refused (exit 1, with the reason) while any node belongs to it, for an unknown group,
    and for ``default``."""
    try:
        open_store_option(store_url).delete_group(_name(name))
    except (UnknownGroup, GroupInUse, ValueError) as error:
        reason = str(error)
        if as_json:
            render.print_json({"group": name, "deleted": False, "reason": reason})
        render.errors.print(f"[red]refused[/]: {reason}", soft_wrap=True)
        raise typer.Exit(EXIT_REFUSED) from None
    if as_json:
        render.print_json({"group": name, "deleted": True, "reason": None})
    else:
        render.console.print(f"deleted group {name}", soft_wrap=True)
