"""Tables for people; ``--json`` prints the same data for programs."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from mn_prefect.model.issues import Issue
from mn_prefect.model.placement import Plan
from mn_prefect.scheduler.usage import ClusterUsage

# Piped output (logs, CI) gets a wide fixed width so ids and reasons are not wrapped mid-word.
console = Console() if sys.stdout.isatty() else Console(width=200)
errors = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=200)


def print_json(data: Any) -> None:
    # Plain print: rich would wrap long lines and break the JSON for programs.
    print(json.dumps(data, indent=2, sort_keys=False))


def issues_table(issues: list[Issue], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("path", style="cyan")
    table.add_column("problem")
    for issue in issues:
        table.add_row(issue.path or "(file)", issue.message)
    return table


def plan_tables(plan: Plan) -> list[Table]:
    style = {"runnable_now": "green", "runnable_later": "yellow"}.get(plan.status, "red")
    tables = []
    head = Table(show_header=False, title="plan", title_justify="left")
    head.add_row("status", f"[{style}]{plan.status}[/]")
    head.add_row("job type", str(plan.job_type))
    head.add_row("strategy", str(plan.strategy))
    head.add_row("reason", plan.reason or "")
    tables.append(head)
    if plan.placements:
        table = Table(title="placements", title_justify="left")
        for col in ("agent", "node", "cpu", "memory MB", "gpus", "devices", "ports", "volumes", "driver",
                    "locality", "score"):
            table.add_column(col)
        for p in plan.placements:
            table.add_row(
                p.agent_id, p.node, f"{p.resources.cpu_cores:g}", f"{p.resources.memory_mb:g}",
                str(p.resources.gpu_count), ", ".join(p.device_ids) or "-",
                ", ".join(f"{x.label}={x.protocol}:{x.port}" for x in p.allocation.ports) or "-",
                ", ".join(f"{v.name}={v.source}" for v in p.allocation.volumes) or "-",
                p.allocation.runtime_driver or "-", str(p.locality),
                f"{p.score:.3f}" + (f" ({p.preferred})" if p.preferred else ""),
            )
        tables.append(table)
    refused = [(agent, node, why) for agent, per in plan.agents.items() for node, why in sorted(per.items())]
    if refused:
        table = Table(title="nodes refused", title_justify="left")
        table.add_column("agent")
        table.add_column("node")
        table.add_column("reason")
        for row in refused:
            table.add_row(*row)
        tables.append(table)
    return tables


def usage_tables(usage: ClusterUsage) -> list[Table]:
    nodes = Table(title="nodes", title_justify="left")
    for col in ("node", "status", "eligible", "cpu used/sched", "memory MB used/sched", "disk MB free",
                "gpus used/sched", "GPU memory MB", "drivers", "host paths"):
        nodes.add_column(col)
    for n in usage.nodes:
        nodes.add_row(
            n.name, n.status, "yes" if n.scheduling_eligible else "no",
            f"{n.used.cpu_cores:g}/{n.schedulable.cpu_cores:g}", f"{n.used.memory_mb:g}/{n.schedulable.memory_mb:g}",
            f"{n.free.disk_mb:g}", f"{n.used.gpu_count:g}/{n.schedulable.gpu_count:g}", f"{n.gpu_memory_total_mb:g}",
            ",".join(n.runtime_drivers), ",".join(n.host_paths) or "-",
        )
    t = usage
    nodes.add_section()
    nodes.add_row("[bold]cluster[/]", "", "", f"{t.used.cpu_cores:g}/{t.schedulable.cpu_cores:g}",
                  f"{t.used.memory_mb:g}/{t.schedulable.memory_mb:g}", f"{t.free.disk_mb:g}",
                  f"{t.used.gpu_count:g}/{t.schedulable.gpu_count:g}", f"{t.gpu_memory_total_mb:g}", "", "")
    devices = Table(title="devices", title_justify="left")
    for col in ("node", "id", "index", "vendor", "driver", "model", "memory MB", "capabilities", "held"):
        devices.add_column(col)
    for n in usage.nodes:
        for d in n.devices:
            devices.add_row(n.name, d.id, str(d.index), d.vendor or "-", d.driver or "-", d.model or "-",
                            f"{d.memory_total_mb:g}" if d.memory_total_mb is not None else "-",
                            ",".join(d.capabilities) or "-", "yes" if d.held else "no")
    return [nodes, devices] if devices.row_count else [nodes]


def store_table(info) -> Table:
    table = Table(show_header=False, title="store", title_justify="left")
    table.add_row("backend", info.backend)
    table.add_row("url", info.url)
    table.add_row("reachable", "[green]yes[/]" if info.reachable else f"[red]no[/]: {info.error}")
    table.add_row("version", info.version or "-")
    for key, value in info.counts.items():
        table.add_row(key, str(value))
    return table


def nodes_table(nodes: list[dict]) -> Table:
    """Registered nodes, from the same summaries ``node list --json`` prints."""
    table = Table(title="nodes", title_justify="left")
    for col in ("node", "status", "eligible", "cpu", "memory MB", "devices", "last heartbeat"):
        table.add_column(col)
    for n in nodes:
        age = n["heartbeat_age_s"]
        table.add_row(n["name"], n["status"], "yes" if n["scheduling_eligible"] else "no", f"{n['record']['cpu_cores']:g}",
                      f"{n['record']['memory_mb']:g}", ", ".join(n["devices"]) or "-",
                      "-" if age is None else f"{age:.0f} s ago")
    return table


def transitions_table(transitions) -> Table:
    table = Table(title="node state changes", title_justify="left")
    for col in ("node", "from", "to", "reason"):
        table.add_column(col)
    for t in transitions:
        table.add_row(t.node, t.from_status, t.to_status, t.reason or "-")
    return table


def reconcile_table(result: dict) -> Table:
    counters = ", ".join(f"{k} {result[k]}" for k in ("checked", "recovered", "paused", "blocked", "skipped", "failed"))
    leader = "" if result.get("leader", True) else " (not the leader: nothing done)"
    dry = " (dry run)" if result.get("dry_run") else ""
    table = Table(title=f"reconcile: {counters}{dry}{leader}", title_justify="left")
    for col in ("job", "node", "action", "reason"):
        table.add_column(col)
    for action in result["actions"]:
        table.add_row(action["job_id"], action["node"], action["action"], action["reason"])
    return table


def drain_table(data: dict) -> Table:
    title = f"drain {data['node']}: {data.get('status', 'dry run' if data.get('dry_run') else '')}"
    table = Table(title=title, title_justify="left")
    for col in ("job", "action", "reason"):
        table.add_column(col)
    for action in data.get("actions", []):
        table.add_row(action["job_id"], action["action"], action["reason"])
    return table
