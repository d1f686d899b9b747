"""The ``mn-prefect`` command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from mn_prefect import __version__
from mn_prefect.cli import render
from mn_prefect.cli.inputs import read_active, read_blueprint, read_limits, read_nodes
from mn_prefect.model.issues import InvalidInput, Issues
from mn_prefect.model.placement import Plan
from mn_prefect.scheduler.plan import plan_job
from mn_prefect.scheduler.usage import cluster_usage

EXIT_INVALID = 2

app = typer.Typer(help="Resource-aware placement for Prefect flow runs.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
blueprint_app = typer.Typer(help="Validate MirrorNeuron blueprints.", no_args_is_help=True)
resource_app = typer.Typer(help="Inspect node resources.", no_args_is_help=True)
app.add_typer(blueprint_app, name="blueprint")
app.add_typer(resource_app, name="resource")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for programs instead of tables.")]


def _version(value: bool) -> None:
    if value:
        print(__version__)
        raise typer.Exit()


@app.callback()
def root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print the version and exit.")] = False) -> None:
    """mn-prefect: Nomad-style placement of Prefect flow runs on CPU and GPU machines."""


@blueprint_app.command("validate")
def blueprint_validate(file: Annotated[Path, typer.Argument(help="Blueprint JSON (flat v1 or mn.workflow/v2).")],
                       as_json: JsonFlag = False) -> None:
    """Validate a blueprint: exit 0 when valid, 1 when not, listing every error with its JSON path."""
    blueprint, issues = read_blueprint(file)
    if as_json:
        render.print_json({"valid": not issues, "errors": [i.as_dict() for i in issues]})
    elif issues:
        render.console.print(render.issues_table(issues, f"{file}: {len(issues)} error(s)"))
    else:
        render.console.print(f"[green]valid[/]: {file} ({blueprint.format}, {blueprint.job_type}, "
                             f"{len(blueprint.agents)} agents)", soft_wrap=True)
    raise typer.Exit(1 if issues else 0)


@app.command("plan")
def plan(
    file: Annotated[Path, typer.Argument(help="Blueprint JSON (either format).")],
    nodes: Annotated[Path, typer.Option("--nodes", help="JSON list of node records.")],
    active: Annotated[Optional[Path], typer.Option("--active", help="Earlier plan(s) or placements that hold capacity.")] = None,
    strategy: Annotated[Optional[str], typer.Option("--strategy", help="binpack or spread (overrides the blueprint).")] = None,
    limits: Annotated[Optional[str], typer.Option("--limits", help="cpu=75,memory=75,gpu=100,disk=75")] = None,
    table: Annotated[bool, typer.Option("--table", help="Render the plan as tables for people.")] = False,
) -> None:
    """Dry-run placement. Prints the plan as JSON; exit 0 runnable_now, 1 runnable_later/not_runnable, 2 invalid."""
    blueprint, problems = read_blueprint(file)
    issues = Issues()
    issues.extend(problems)
    node_records = read_nodes(nodes, issues)
    held = read_active(active, issues)
    limit_values = read_limits(limits, issues)
    if strategy is not None and strategy not in ("binpack", "spread"):
        issues.add("--strategy", f"unknown scheduler strategy {strategy!r} (allowed: binpack, spread)")
    if issues or blueprint is None:
        result = Plan(status="invalid", errors=[i.as_dict() for i in issues.items],
                      reason=f"{len(issues)} input error(s)")
    else:
        result = plan_job(blueprint, node_records, held, strategy=strategy, limits=limit_values)
    if table:
        for t in render.plan_tables(result):
            render.console.print(t)
        if result.errors:
            render.console.print(render.issues_table(issues.items, "input errors"))
    else:
        render.print_json(result.as_json())
    raise typer.Exit({"runnable_now": 0, "invalid": EXIT_INVALID}.get(result.status, 1))


@resource_app.command("list")
def resource_list(
    nodes: Annotated[Optional[Path], typer.Option("--nodes", help="JSON list of node records (default: this machine).")] = None,
    active: Annotated[Optional[Path], typer.Option("--active", help="Plans or placements that hold capacity.")] = None,
    limits: Annotated[Optional[str], typer.Option("--limits", help="cpu=75,memory=75,gpu=100,disk=75")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Per-node totals, used and free capacity, devices, drivers and host paths."""
    issues = Issues()
    if nodes is not None:
        records = read_nodes(nodes, issues)
    else:
        from mn_prefect.inventory import local_nodes

        records = local_nodes()
    held = read_active(active, issues)
    limit_values = read_limits(limits, issues)
    if issues:
        raise InvalidInput(issues.items)
    usage = cluster_usage(records, held, limit_values)
    if as_json:
        render.print_json(usage.model_dump(mode="json"))
    else:
        for t in render.usage_tables(usage):
            render.console.print(t)


def main() -> None:
    """Entry point: input errors exit 2 with their paths, never a traceback."""
    try:
        app(standalone_mode=True)
    except InvalidInput as error:
        render.errors.print(render.issues_table(error.issues, "invalid input"))
        sys.exit(EXIT_INVALID)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as error:  # last line of defence: a message, not a traceback
        if os.environ.get("MN_DEBUG"):
            raise
        render.errors.print(f"[red]error[/]: {type(error).__name__}: {error} (set MN_DEBUG=1 for the traceback)")
        sys.exit(1)


if __name__ == "__main__":
    main()
