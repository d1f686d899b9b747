"""``mn-prefect blueprint human ...``: the requests a bundle run's steps make to a person, and the answers."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from mn_prefect.cli import render
from mn_prefect.cli.options import JsonFlag
from mn_prefect.model.issues import InvalidInput, Issue

human_app = typer.Typer(help="A run's requests to a person (a step's human-control gate), and answering them.",
                        no_args_is_help=True)

RunArg = Annotated[str, typer.Argument(metavar="RUN_ID", help="The bundle run's id (its folder in the run store).")]
RootOpt = Annotated[str | None, typer.Option("--runs-root", help="The run store (MN_RUNS_ROOT; default ~/.mn/runs).")]


def _run_dir(run_id: str, runs_root: str | None):
    from mn_prefect.bundles.bundle import runs_root as resolve

    root = resolve(runs_root)
    folder = root / run_id
    if "/" in run_id or run_id in ("", ".", "..") or not folder.is_dir():
        raise InvalidInput([Issue("RUN_ID", f"no run {run_id!r} in the run store {root}")])
    return folder


@human_app.command("list")
def human_list(run_id: RunArg, pending: Annotated[bool, typer.Option("--pending", help="Only unanswered ones.")] = False,
               runs_root: RootOpt = None, as_json: JsonFlag = False) -> None:
    """The run's requests: id, status (pending, answered, timed out), prompt and answer."""
    from mn_prefect.bundles.human import read_events, requests

    found = requests(read_events(_run_dir(run_id, runs_root)))
    rows = [{"request_id": rid, "status": r["status"], "prompt": r["payload"].get("prompt"),
             "allowed_decisions": r["payload"].get("allowed_decisions"), "requested_at": r.get("ts"),
             "answer": r.get("answer")} for rid, r in found.items() if not pending or r["status"] == "pending"]
    if as_json:
        render.print_json(rows)
        return
    table = Table(title=f"human requests of run {run_id}", title_justify="left")
    for column in ("request", "status", "prompt", "answer"):
        table.add_column(column)
    for row in rows:
        answer = row["answer"] or {}
        table.add_row(row["request_id"], row["status"], row["prompt"] or "",
                      f"{answer.get('decision')} by {answer.get('reviewer')}" if answer else "")
    render.console.print(table)


@human_app.command("respond")
def human_respond(
    run_id: RunArg,
    request_id: Annotated[str, typer.Argument(metavar="REQUEST_ID", help="The request to answer (`human list`).")],
    decision: Annotated[str, typer.Option("--decision", help="approve or reject (or what the request allows).")],
    notes: Annotated[str, typer.Option("--notes", help="What the reviewer says.")] = "",
    reviewer: Annotated[str, typer.Option("--reviewer", help="Who answers.")] = "mn-prefect",
    runs_root: RootOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """Answer a pending request: the waiting step goes on, and the run's flow run, Paused in Prefect for it,
    resumes. Exit 2 for an unknown run or request, one already answered, or a decision it does not allow."""
    from mn_prefect.bundles.human import record_response

    folder = _run_dir(run_id, runs_root)
    try:
        event = record_response(folder, request_id, decision, notes=notes, reviewer=reviewer)
    except ValueError as error:
        field, _, message = str(error).partition(": ")
        raise InvalidInput([Issue(field, message)]) from None
    if as_json:
        render.print_json({"run_id": run_id, **event["payload"]})
    else:
        render.console.print(f"request {request_id} of run {run_id}: {decision}", soft_wrap=True)
