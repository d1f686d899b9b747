"""``mn-prefect usage``: what the bookings used, GPU-, GPU-memory-, CPU- and memory-seconds, by queue, pool,
deployment, flow, tag, node, owner kind or owner (docs/operating.md, "Usage accounting"; mn_prefect.ops.accounting).

Bad input (a ``--since`` that does not parse, an unknown ``--by`` key, ``--json`` with ``--csv``) exits 2 naming
the option, before the store is opened; the command only reads.
"""

from __future__ import annotations

import csv
import sys
import time
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.table import Table

from mn_prefect.cli import render
from mn_prefect.cli.options import JsonFlag, StoreURLArg, open_store_option
from mn_prefect.model.issues import InvalidInput, Issue
from mn_prefect.ops import accounting

HOUR = 3600.0
GB = 1024.0  # the store's MB are MiB: 1024 of them make the GB shown


def usage(
    since: Annotated[str, typer.Option(
        "--since", help="From when: a duration back from now (30m, 12h, 7d, 2w), an ISO date or time "
                        "(2024-05-01, 2024-05-01T08:00, UTC unless it says), or 'all'.")] = accounting.DEFAULT_SINCE,
    by: Annotated[str, typer.Option(
        "--by", help=f"Group by these keys, a comma list of: {', '.join(accounting.KEYS)} (pool: the work pool; "
                     "kind: the owner's kind; owner: the run, reservation or job).")] = ",".join(accounting.DEFAULT_BY),
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV (the --json rows) instead of a table.")] = False,
    store_url: StoreURLArg = None,
    as_json: JsonFlag = False,
) -> None:
    """GPU-, GPU-memory-, CPU- and memory-seconds the bookings used since --since, grouped by --by: every
    booking from its commit to its release (a live one up to now), as the store's history keeps it. Reservations
    and holds count for their owner. The table shows hours; --json and --csv seconds."""
    now = time.time()
    problems = []
    start = None
    try:
        start = accounting.parse_since(since, now)
    except ValueError as error:
        problems.append(Issue("--since", str(error)))
    keys: tuple[str, ...] = ()
    try:
        keys = accounting.parse_by(by)
    except ValueError as error:
        problems.append(Issue("--by", str(error)))
    if as_json and as_csv:
        problems.append(Issue("--csv", "give --json or --csv, not both"))
    if problems:
        raise InvalidInput(problems)
    assert start is not None
    store = open_store_option(store_url)
    try:
        data = accounting.report(store, since=start, until=now, by=keys)
    finally:
        store.close()
    if as_json:
        render.print_json(data)
    elif as_csv:
        write_csv(data)
    else:
        render.console.print(usage_table(data))


def write_csv(data: dict[str, Any]) -> None:
    columns = [*data["by"], "bookings", *accounting.AMOUNTS, "booked_seconds"]
    writer = csv.DictWriter(sys.stdout, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in data["rows"]:
        writer.writerow(row)


def _when(epoch_s: float) -> str:
    return "the start" if epoch_s <= 0 else datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def usage_table(data: dict[str, Any]) -> Table:
    table = Table(title=f"usage from {_when(data['since'])} to {_when(data['until'])}", title_justify="left",
                  caption="hours of use: a GPU for an hour is 1 GPU-h; GB-h of memory")
    for key in data["by"]:
        table.add_column(key)
    for column in ("bookings", "GPU-h", "GPU mem GB-h", "CPU core-h", "memory GB-h"):
        table.add_column(column, justify="right")
    for row in [*data["rows"], {**{k: "total" if i == 0 else "" for i, k in enumerate(data["by"])},
                                **data["total"]}]:
        table.add_row(*(row[key] for key in data["by"]), str(row["bookings"]), f"{row['gpu_seconds'] / HOUR:.2f}",
                      f"{row['gpu_memory_mb_seconds'] / HOUR / GB:.2f}", f"{row['cpu_seconds'] / HOUR:.2f}",
                      f"{row['memory_mb_seconds'] / HOUR / GB:.2f}")
    return table


# -- resource list --store: what the device watch saw of the booked GPUs ---------------------------------------------

def booked_gpus(store: Any, group: str | None) -> list[dict[str, Any]]:
    """Each booked GPU the workers' device watch sampled lately (``DeviceUseRecord``; a stopped worker's left out),
    of ``group``'s nodes: for ``resource list --store`` (its JSON's ``booked_gpus``)."""
    from mn_prefect.ops.metrics import seen_devices

    nodes = None if group is None else {s.record.name for s in store.list_nodes() if s.record.group == group}
    rows = []
    for record in seen_devices(store, nodes):
        for d in record.devices:
            quiet = max(record.sampled_at - d.quiet_since, 0.0) if d.quiet_since is not None else 0.0
            state = ("idle" if d.idle else "over memory" if d.over_memory
                     else "quiet" if d.quiet_since is not None else "busy")
            rows.append({"node": record.node, "device": d.device, "bookings": d.bookings, "percent": d.percent,
                         "memory_used_mb": d.memory_used_mb, "booked_mb": d.booked_mb, "idle_s": round(quiet, 1),
                         "idle": d.idle, "over_memory": d.over_memory, "state": state,
                         "idle_percent": record.idle_percent, "idle_after_s": record.idle_after_s,
                         "sampled_at": record.sampled_at})
    return rows


def booked_gpus_table(rows: list[dict[str, Any]]) -> Table:
    """The booked GPUs as people read them: ``idle`` (under the pool's threshold for its idle time:
    mn.device.idle), ``over memory`` (shares using more than they booked: mn.device.over_memory), ``quiet`` (under
    the threshold, not yet for long), ``busy``."""
    from mn_prefect.model.estimates import duration_words

    table = Table(title="booked GPUs (device watch)", title_justify="left")
    for column in ("node", "GPU", "booked by", "util %", "memory MB in use/booked", "under threshold", "state"):
        table.add_column(column)
    for row in rows:
        booked = "whole" if row["booked_mb"] is None else f"{row['booked_mb']:g}"
        table.add_row(row["node"], row["device"], ", ".join(row["bookings"]),
                      "-" if row["percent"] is None else f"{row['percent']:g}",
                      f"{row['memory_used_mb']:g}/{booked}",
                      duration_words(row["idle_s"]) if row["idle_s"] else "-",
                      f"[bold red]{row['state']}[/]" if row["idle"] or row["over_memory"] else row["state"])
    return table
