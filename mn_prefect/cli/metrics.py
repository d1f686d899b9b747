"""``mn-prefect metrics ...``: the cluster's numbers for Prometheus (docs/operating.md, "Metrics for Prometheus and
Grafana"): ``serve`` (the cluster view at /metrics), ``show`` (the same numbers once, here), ``targets`` (where
each worker serves its own)."""

from __future__ import annotations

import errno
from typing import Annotated

import typer
from rich.table import Table

from mn_prefect.cli import render
from mn_prefect.cli.options import JsonFlag, StoreURLArg, open_store_option
from mn_prefect.cli.serving import wait_until_stopped

metrics_app = typer.Typer(help="Prometheus metrics of the cluster: capacity, use, devices, bookings, node states.",
                          no_args_is_help=True)

DEFAULT_PORT = 9464
PORT_FIELD_ERRORS = (errno.EADDRINUSE, errno.EACCES)  # about the port; anything else is about the address


@metrics_app.command("serve")
def metrics_serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port (0: a free one).")] = DEFAULT_PORT,
    store_url: StoreURLArg = None,
) -> None:
    """Serve the whole cluster's metrics at http://HOST:PORT/metrics, read from the store at each scrape, until
    stopped (Ctrl-C, SIGTERM); prints the URL once it listens. Exit 1 naming --port (or --host) when it cannot
    listen there."""
    from mn_prefect.http_serving import serve_metrics
    from mn_prefect.ops.metrics import cluster_registry, url_for

    store = open_store_option(store_url)
    try:
        server = serve_metrics(host, port, cluster_registry(store))
    except OSError as error:
        store.close()
        why = error.strerror or str(error)
        if error.errno in PORT_FIELD_ERRORS:
            render.errors.print(f"[red]error[/]: --port: cannot listen on port {port} of {host}: {why} (another "
                                "process has it? choose another --port, or 0 for a free one)", soft_wrap=True)
        else:
            render.errors.print(f"[red]error[/]: --host: cannot listen on {host} port {port}: {why}", soft_wrap=True)
        raise typer.Exit(1) from None
    url = url_for(host, server.server_port)
    render.errors.print(f"cluster metrics of store {store.url.safe} at {url}; Ctrl-C stops it", soft_wrap=True,
                        highlight=False)
    print(url, flush=True)
    try:
        wait_until_stopped()
    finally:
        server.shutdown()
        server.server_close()
        store.close()


@metrics_app.command("show")
def metrics_show(store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """The numbers `metrics serve` exposes, read once: one row per series (a node's states other than its own and
    the device descriptions left out of the table; --json has every sample)."""
    from mn_prefect.ops.metrics import cluster_registry

    store = open_store_option(store_url)
    try:
        samples = [(s.name, s.labels, s.value) for family in cluster_registry(store).collect()
                   for s in family.samples]
    finally:
        store.close()
    if as_json:
        render.print_json([{"name": name, "labels": labels, "value": value} for name, labels, value in samples])
        return
    table = Table(title="mn-prefect cluster metrics", title_justify="left")
    for column in ("metric", "labels", "value"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for name, labels, value in samples:
        if (name == "mn_node_state" and not value) or name == "mn_device_info":
            continue
        table.add_row(name, ", ".join(f"{k}={v}" for k, v in labels.items() if v != ""), f"{value:.15g}")
    render.console.print(table)


@metrics_app.command("targets")
def metrics_targets(
    store_url: StoreURLArg = None, as_json: JsonFlag = False,
    file_sd: Annotated[bool, typer.Option("--file-sd", help="Print Prometheus file_sd_configs targets (JSON).")]
    = False,
) -> None:
    """Where each node's worker serves its metrics (workers started with MN_METRICS_PORT record it in the store)."""
    from mn_prefect.ops import metrics

    store = open_store_option(store_url)
    try:
        rows = metrics.endpoints(store)
    finally:
        store.close()
    if file_sd:
        render.print_json(metrics.file_sd(rows))
        return
    render.json_or_table(rows, as_json, "worker metrics endpoints", ("node", "pool", "url", "pid", "node status"),
                         ((r["node"], r["pool"] or "-", r["url"], str(r["pid"] or "-"), r["node_status"]) for r in rows))
