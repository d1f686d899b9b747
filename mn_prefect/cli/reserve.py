"""``mn-prefect reserve``: book capacity now, for a while, for runs placed inside it (docs/operating.md).

Exit codes: 0 booked (or, with --check, would be); 2 not now, nothing booked (runnable later); 3 never
(no node of the group could ever hold it); 1 bad input (naming the field) or a reservation that cannot be
used (unknown id, wrong key, already ended). Usage errors (no --resources, two actions at once) exit 2 as
every command's do. A refused reservation keeps nothing in the store (the reason is in the output), and no
non-zero exit leaves a booking behind.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.table import Table

from mn_prefect.cli import render
from mn_prefect.cli.inputs import check_group_exists, read_resources_text
from mn_prefect.cli.options import GroupOpt, JsonFlag, StoreURLArg, open_store_option
from mn_prefect.model.issues import InvalidInput, Issue, Issues
from mn_prefect.model.placement import Plan
from mn_prefect.model.resources import ResourceRequest
from mn_prefect.placement import reservations
from mn_prefect.placement.reservations import ReservationError
from mn_prefect.store.records import ReservationRecord

EXIT_BAD_INPUT = 1
EXIT_LATER = 2
EXIT_NEVER = 3
_EXIT = {"runnable_now": 0, "runnable_later": EXIT_LATER, "not_runnable": EXIT_NEVER}


def reserve(
    resources: Annotated[str | None, typer.Option(
        "--resources", help="The resource request to hold, as job_variables.resources takes it: JSON text or "
                            "@file.json. GPUs are held whole or as MIG slices; runs inside may share them.")] = None,
    duration: Annotated[str | None, typer.Option(
        "--for", help="How long: 90s, 15m, 2h, 1h30m, 1d. With --extend, the new time left from now (0 ends it).")] = None,
    group: GroupOpt = None,
    node: Annotated[str | None, typer.Option("--node", help="Hold it on this node.")] = None,
    key: Annotated[str | None, typer.Option(
        "--key", help="A secret runs must give to use it (job_variables.reservation_key); needed to release or "
                      "extend it too.")] = None,
    name: Annotated[str | None, typer.Option("--name", help="A name for people.")] = None,
    check: Annotated[bool, typer.Option(
        "--check", help="Say whether it would be booked and where, booking nothing: exit 0 yes, 2 not now, 3 never.")] = False,
    listing: Annotated[bool, typer.Option("--list", help="Show the live reservations.")] = False,
    every: Annotated[bool, typer.Option("--all", help="With --list: ended ones too.")] = False,
    release: Annotated[str | None, typer.Option("--release", metavar="ID", help="End reservation ID now.")] = None,
    extend: Annotated[str | None, typer.Option("--extend", metavar="ID",
                                               help="Move reservation ID's expiry to --for from now.")] = None,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="With a reservation made or refused: the placement's tables too, not only its "
                                "line.")] = False,
    store_url: StoreURLArg = None,
    as_json: JsonFlag = False,
) -> None:
    """Reserve capacity now, for a while: runs inside it (job_variables.reservation) are placed in it without
    competing with other runs; when it expires it holds nothing (its runs are deallocated)."""
    actions = [flag for flag, given in (("--list", listing), ("--release", release is not None),
                                        ("--extend", extend is not None)) if given]
    if len(actions) > 1:
        _usage(f"give one of {', '.join(actions)}", actions[1], as_json)
    if not actions and resources is None:
        _usage("what to reserve: a resource request (or --list, --release ID, --extend ID)", "--resources", as_json)
    if not actions and duration is None:
        _usage("how long to hold it (e.g. 2h)", "--for", as_json)
    if extend is not None and duration is None:
        _usage("the new time left (e.g. 1h; 0 ends it)", "--for", as_json)
    try:
        if duration is not None and not duration.isascii():  # Python's float() reads other scripts' digits
            raise ReservationError("--for", f"{duration!r} is not a duration: write it in ASCII digits "
                                            "(e.g. 90s, 15m, 2h, 1h30m, 1d)")
        seconds = reservations.parse_duration(duration) if duration is not None else None
        store = open_store_option(store_url)
        if listing:
            _show_list(reservations.listing(store, every=every), as_json)
        elif release is not None:
            _show_one(reservations.release(store, release, key), as_json, "released")
        elif extend is not None:
            assert seconds is not None
            _show_one(reservations.extend(store, extend, seconds, key), as_json, "extended")
        else:
            assert resources is not None and seconds is not None
            raw, request = _request(resources, as_json)
            issues = Issues()
            check_group_exists(store, group, issues)
            if node is not None and store.get_node(node) is None:
                issues.add("--node", f"no node {node!r} in the store (`mn-prefect node list` shows them): "
                                     "nothing was reserved")
            if issues:
                _bad(issues.items, as_json)
            if check:
                plan = reservations.check(store, request, group=group, node=node)
                _show_plan(plan, None, as_json, verbose=True)
            else:
                done = reservations.reserve(store, request, raw, seconds, group=group, node=node, key=key, name=name)
                plan = done.plan
                try:
                    _show_plan(plan, done.record, as_json, verbose=verbose)
                except BaseException:  # not reported made: nothing booked is left behind an error exit
                    if done.record is not None:
                        reservations.withdraw(store, done.record.job_id)
                    raise
            raise typer.Exit(_EXIT.get(plan.status, EXIT_NEVER))
    except ReservationError as error:
        _bad([Issue(error.field, error.message)], as_json)
    except InvalidInput as error:  # a bad store URL: exits 2 as every command's; JSON first under --json
        if as_json:
            _print_errors(error.issues)
        raise


def _request(text: str, as_json: bool) -> tuple[Any, ResourceRequest]:
    """``--resources``: JSON text or @file.json, read by the parser of every resource request (``plan
    --request``, flow runs' ``job_variables.resources``, blueprint agents)."""
    issues = Issues()
    read = read_resources_text(text, "--resources", issues, name_file=False)
    if read is None:
        _bad(issues.items, as_json)
    assert read is not None
    return read


def _print_errors(problems: list[Issue]) -> None:
    """With --json, errors are one object on stdout: the first one's message and field, and every one."""
    first = problems[0] if problems else Issue("", "invalid input")
    render.print_json({"error": first.message, "field": first.path, "errors": [i.as_dict() for i in problems]})


def _bad(problems: list[Issue], as_json: bool = False) -> None:
    if as_json:
        _print_errors(problems)
    render.errors.print(render.issues_table(problems, "invalid input"))
    raise typer.Exit(EXIT_BAD_INPUT)


def _usage(message: str, option: str, as_json: bool) -> None:
    """A usage error (exit 2, as every command's); with --json, said on stdout as JSON too."""
    if as_json:
        _print_errors([Issue(option, message)])
    raise typer.BadParameter(message, param_hint=option)


def reserved_line(record: ReservationRecord, now: float | None = None) -> str:
    """The one line a reservation made is said in: ``reserved rsv-3f9c2a41b7de on gpu-1, until 14:05:12 (in
    2h00m)``."""
    left = record.expires_at - (time.time() if now is None else now)
    until = time.strftime("%H:%M:%S", time.localtime(record.expires_at))
    return f"reserved {record.job_id} on {', '.join(record.nodes) or '-'}, until {until} (in {_span(max(left, 0))})"


def _show_plan(plan: Plan, record: ReservationRecord | None, as_json: bool, *, verbose: bool) -> None:
    if as_json:
        out: dict[str, Any] = {"status": plan.status, "reason": plan.reason, "booked": record is not None,
                               "placements": [p.model_dump(mode="json") for p in plan.placements]}
        if record is not None:
            out["reservation"] = reservations.view(record)
        render.print_json(out)
        return
    if not verbose:
        line = reserved_line(record) if record is not None else f"not reserved: {plan.status}: {plan.reason}"
        render.console.print(line, soft_wrap=True, markup=False, highlight=False)
        return
    if record is not None:
        render.console.print(_table([record], "reserved"))
    for table in render.plan_tables(plan):
        render.console.print(table)


def _show_one(record: ReservationRecord, as_json: bool, done: str) -> None:
    if as_json:
        render.print_json(reservations.view(record))
    else:
        render.console.print(_table([record], done))


def _show_list(records: list[ReservationRecord], as_json: bool) -> None:
    if as_json:
        render.print_json([reservations.view(r) for r in records])
    else:
        render.console.print(_table(records, "reservations"))


def _table(records: list[ReservationRecord], title: str) -> Table:
    table = Table(title=title, title_justify="left", caption=None if records else "none", caption_justify="left")
    for column in ("id", "name", "status", "nodes", "group", "resources", "expires", "key"):
        table.add_column(column)
    now = time.time()
    for r in records:
        left = r.expires_at - now
        expires = time.strftime("%H:%M:%S", time.localtime(r.expires_at))
        if r.status == "active":
            expires += f" (in {_span(left)})" if left > 0 else " (due)"
        table.add_row(r.job_id, r.name or "-", r.status if r.status == "active" else f"{r.status}: {r.reason}",
                      ",".join(r.nodes) or "-", r.group or "-", json.dumps(r.resources, separators=(",", ":")),
                      expires, "yes" if r.key_sha256 else "no")
    return table


def _span(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
