"""``mn-prefect store audit``: the independent re-check of every booking, and of who owns each one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.table import Table

from mn_prefect.cli import render
from mn_prefect.cli.options import JsonFlag, open_store_option
from mn_prefect.lifecycle.owner_audit import Finding, owner_findings, repair
from mn_prefect.lifecycle.owners import RunState
from mn_prefect.store.audit import audit


def store_audit(
    url: Annotated[str | None, typer.Argument(help="Store URL.")] = None,
    fix: Annotated[bool, typer.Option("--repair", help="Fix what the audit of owners found, each with an event.")]
    = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --repair: say what it would fix, change nothing.")]
    = False,
    as_json: JsonFlag = False,
) -> None:
    """Independently re-check every booking: no node over capacity, no device or port held twice, every hold
    owned by one live job; and every booking's owner: a booking whose owner ended (run over, job finished or
    deleted, reservation ended), a live reservation that holds no capacity, held capacity no booking accounts
    for. Flow runs are read from the Prefect server when one is configured. --repair fixes the owners'
    findings (--dry-run first). Exit 0 sound, 1 problems found (or left after a repair)."""
    if dry_run and not fix:
        render.errors.print("[red]error[/]: --dry-run: only with --repair", highlight=False)
        raise typer.Exit(2)
    store = open_store_option(url)
    with _run_reader() as (run_state, flow_runs):
        findings = owner_findings(store, run_state=run_state)
        if fix and not dry_run:
            repair(store, findings)
    problems = audit(store.consistent_view())
    left = [f for f in findings if not f.repaired] if fix and not dry_run else findings
    if as_json:
        render.print_json({"sound": not problems and not left, "problems": problems, "flow_runs": flow_runs,
                           "repair": "done" if fix and not dry_run else "dry run" if fix else None,
                           "findings": [f.as_json() for f in findings]})
    else:
        render.console.print("[green]bookings sound[/]" if not problems else "\n".join(problems), soft_wrap=True)
        render.console.print(_table(findings, fix, dry_run, flow_runs))
    raise typer.Exit(1 if problems or left else 0)


@contextlib.contextmanager
def _run_reader() -> Iterator[tuple[RunState | None, str]]:
    """Flow run states from the configured Prefect server (None when there is none: flow runs go unjudged)."""
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        yield None, "not checked: no Prefect server is configured"
        return
    from prefect.client.orchestration import get_client

    from mn_prefect.ops.flows import PrefectRunEffects

    with get_client(sync_client=True) as client:
        yield PrefectRunEffects(client).run_state, f"read from {PREFECT_API_URL.value()}"


def _table(findings: list[Finding], fix: bool, dry_run: bool, flow_runs: str) -> Table:
    title = "owners" + (" (dry run: nothing changed)" if dry_run else " (repaired)" if fix else "")
    table = Table(title=title, title_justify="left", caption=f"flow runs: {flow_runs}"
                  + ("" if findings else "; every booking has a live owner"), caption_justify="left")
    for column in ("kind", "finding", "repair", "outcome"):
        table.add_column(column, overflow="fold")
    for f in findings:
        outcome = f.outcome or ("would " + f.repair if dry_run else "-" if not fix else "not repaired")
        table.add_row(f.kind, f.text, f.repair, outcome)
    return table
