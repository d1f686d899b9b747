"""Tables for people; ``--json`` prints the same data for programs."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from mn_prefect.model.issues import Issue
from mn_prefect.model.placement import Placement, Plan
from mn_prefect.ops.usage import booked_words, held_amounts, held_words
from mn_prefect.scheduler.usage import ClusterUsage
from mn_prefect.store.records import StepSummary

# Piped output (logs, CI) gets a wide fixed width so ids and reasons are not wrapped mid-word.
console = Console() if sys.stdout.isatty() else Console(width=200)
errors = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=200)


def print_json(data: Any) -> None:
    # Plain print: rich would wrap long lines and break the JSON for programs.
    print(json.dumps(data, indent=2, sort_keys=False))


def json_or_table(data: Any, as_json: bool, title: str, columns: Sequence[str],
                  rows: Iterable[Sequence[str]]) -> None:
    """``data`` as JSON with ``--json``; else a table titled ``title`` of ``rows`` under ``columns``."""
    if as_json:
        print_json(data)
        return
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def issues_table(issues: list[Issue], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("path", style="cyan")
    table.add_column("problem")
    for issue in issues:
        table.add_row(issue.path or "(file)", issue.message)
    return table


def plan_tables(plan: Plan) -> list[Table]:
    tables = [plan_head(plan)]
    if plan.placements:
        tables.append(placements_table(plan.placements, "placements"))
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


def plan_head(plan: Plan, title: str = "plan") -> Table:
    style = {"runnable_now": "green", "runnable_later": "yellow"}.get(plan.status, "red")
    head = Table(show_header=False, title=title, title_justify="left")
    head.add_row("status", f"[{style}]{plan.status}[/]")
    head.add_row("job type", plan.job_type or "-")
    head.add_row("strategy", plan.strategy or "-")
    head.add_row("reason", plan.reason or "")
    return head


def placements_table(placements, title: str) -> Table:
    """Placements (planned or held): node, resources, devices, ports, volumes, driver, locality, score."""
    table = Table(title=title, title_justify="left")
    for col in ("agent", "node", "cpu", "memory MB", "gpus", "devices", "ports", "volumes", "driver",
                "locality", "score"):
        table.add_column(col)
    for p in placements:
        score = "-" if p.score is None else f"{p.score:.3f}"
        table.add_row(
            p.agent_id, p.node, f"{p.resources.cpu_cores:g}", f"{p.resources.memory_mb:g}",
            str(p.resources.gpu_count), _devices(p), _ports(p), _volumes(p),
            p.allocation.runtime_driver or "-", p.locality or "-",
            score + (f" ({p.preferred})" if p.preferred else ""),
        )
    return table


def _devices(p: Placement) -> str:
    """Device ids; a shared GPU with its shares and memory: ``GPU-1 (0.25, 4096 MB)``."""
    shares = {s.id: s for s in p.allocation.shares}
    return ", ".join(d.id + (f" ({shares[d.id].shares:g}, {shares[d.id].memory_mb:g} MB)" if d.id in shares else "")
                     for d in p.allocation.devices) or "-"


def _ports(p: Placement) -> str:
    return ", ".join(f"{x.label}={x.protocol}:{x.port}" for x in p.allocation.ports) or "-"


def _volumes(p: Placement) -> str:
    return ", ".join(f"{v.name}={v.source}" + (f"->{v.target}" if v.target != v.source else "") + f" ({v.mode})"
                     for v in p.allocation.volumes) or "-"


# -- one blueprint job (``job status``): drawn from the very dict ``job status --json`` prints ------------


def job_status_tables(data: dict[str, Any]) -> list[Table]:
    """The job, its plan, its placements, the allocations held now, its agents, their runs, restart and
    reschedule history with attempts left, and its recent events."""
    tables = [_job_head(data)]
    plan = Plan.model_validate(data["plan"]) if data.get("plan") else None
    if plan is None:
        tables.append(Table(title="plan: none yet (the coordinator has not planned this job)", title_justify="left"))
    else:
        tables.append(plan_head(plan))
        if plan.placements:
            tables.append(placements_table(plan.placements, "placements (planned)"))
    held = [Placement.model_validate(p) for p in data.get("placements", [])]
    tables.append(_allocations_table(held))
    tables.append(_agents_table(data["agents"]))
    tables.append(_runs_table(data["agents"]))
    tables.append(_attempts_table(data["agents"]))
    tables.append(_events_table(data.get("events", [])))
    return tables


def _job_head(data: dict[str, Any]) -> Table:
    style = {"completed": "green", "running": "green", "failed": "red", "cancelled": "red"}.get(data["status"], "yellow")
    head = Table(show_header=False, title=f"job {data['job_id']}", title_justify="left")
    head.add_row("name", data.get("name") or "-")
    head.add_row("job type", data.get("job_type") or "-")
    head.add_row("status", f"[{style}]{data['status']}[/]")
    head.add_row("reason", data.get("reason") or "-")
    head.add_row("coordinator run", data.get("flow_run_id") or "-")
    head.add_row("pool", data.get("pool") or "-")
    recovery = data.get("recovery", {})
    head.add_row("strategy", recovery.get("strategy") or "-")
    head.add_row("recovery mode", recovery.get("recovery_mode") or "-")
    return head


def _allocations_table(held: list[Placement]) -> Table:
    table = Table(title="allocations held now", title_justify="left",
                  caption=None if held else "none: the job holds no booking in the store", caption_justify="left")
    for col in ("agent", "node", "cpu", "memory MB", "disk MB", "devices", "ports", "volumes", "driver"):
        table.add_column(col)
    for p in held:
        devices = ", ".join(f"{d.id} ({d.model or d.vendor or d.kind}"
                            + (f", {d.memory_total_mb:g} MB" if d.memory_total_mb is not None else "") + ")"
                            for d in p.allocation.devices) or "-"
        table.add_row(p.agent_id, p.node, f"{p.resources.cpu_cores:g}", f"{p.resources.memory_mb:g}",
                      f"{p.resources.disk_mb:g}", devices, _ports(p), _volumes(p), p.allocation.runtime_driver or "-")
    return table


def _agents_table(agents: dict[str, dict]) -> Table:
    table = Table(title="agents", title_justify="left")
    for col in ("agent", "node", "status", "runs", "run state", "restarts", "left", "reschedules", "left",
                "next start", "last reason"):
        table.add_column(col)
    for agent_id, a in agents.items():
        runs = a.get("runs", [])
        left = a.get("remaining", {})
        table.add_row(agent_id, a.get("node") or "-", a["status"], str(len(runs)), runs[-1]["state"] if runs else "-",
                      str(len(a.get("restarts_ms", []))), _left(left.get("restarts")),
                      str(len(a.get("reschedules_ms", []))), _left(left.get("reschedules")),
                      _when(a.get("next_start_at")), a.get("reason") or "-")
    return table


def _runs_table(agents: dict[str, dict]) -> Table:
    runs = [(agent_id, r) for agent_id, a in agents.items() for r in a.get("runs", [])]
    table = Table(title="runs", title_justify="left", caption=None if runs else "none yet", caption_justify="left")
    for col in ("agent", "attempt", "flow run", "state", "started", "ended", "message"):
        table.add_column(col)
    for agent_id, r in runs:
        table.add_row(agent_id, str(r["attempt"]), r["run_id"], r["state"], _when(r.get("started_at")),
                      _when(r.get("ended_at")), r.get("message") or "-")
    return table


def _attempts_table(agents: dict[str, dict]) -> Table:
    """Restart and reschedule history per agent, with the policy and the attempts its window still allows."""
    table = Table(title="restarts and reschedules", title_justify="left")
    for col in ("agent", "kind", "used", "left", "at", "policy"):
        table.add_column(col)
    for agent_id, a in agents.items():
        for kind, times_key in (("restart", "restarts_ms"), ("reschedule", "reschedules_ms")):
            times = a.get(times_key, [])
            left = a.get("remaining", {}).get(f"{kind}s")
            table.add_row(agent_id, kind, str(len(times)), _left(left),
                          ", ".join(_when(t / 1000) for t in times) or "-", _policy(a.get(kind) or {}))
    return table


def _events_table(events: list[dict]) -> Table:
    table = Table(title=f"recent events ({len(events)})", title_justify="left",
                  caption=None if events else "none recorded", caption_justify="left")
    for col in ("at", "event", "node", "reason"):
        table.add_column(col)
    for e in events:
        table.add_row(_when(e.get("at")), e["kind"], e.get("node") or "-", e.get("reason") or "-")
    return table


def _left(value: int | None) -> str:
    return "unlimited" if value is None else str(value)


def _when(epoch_s: float | None) -> str:
    return "-" if epoch_s is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch_s))


def _policy(p: dict[str, Any]) -> str:
    """A retry policy in a line: ``3 per 10m, exponential 1s..30s, then fail``."""
    if not p:
        return "-"
    if not p.get("unlimited") and not p.get("attempts"):
        return "disabled"
    count = "unlimited" if p.get("unlimited") else f"{p['attempts']} per {_duration(p.get('interval_ms', 0))}"
    delay = f"{p.get('delay_function', 'constant')} {_duration(p.get('delay_ms', 0))}"
    if p.get("max_delay_ms"):
        delay += f"..{_duration(p['max_delay_ms'])}"
    return f"{count}, {delay}, then {p.get('mode', 'fail')}"


def _duration(ms: int) -> str:
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms / 1000:g}s" if ms >= 1000 else f"{ms}ms"


def size_words(mb: float) -> str:
    """A size in MB (2**20 bytes, as requests read it) for people: ``512 MB``, ``64 GB``, ``1.2 TB``."""
    for unit, scale in (("TB", 1024 * 1024), ("GB", 1024)):
        if abs(mb) >= scale:
            return f"{mb / scale:.3g} {unit}" if mb / scale < 1000 else f"{mb / scale:,.0f} {unit}"
    return f"{mb:.4g} MB"


def _used_of(used: float, total: float) -> str:
    """``used/total`` sizes in one unit: ``12/64 GB``."""
    for unit, scale in (("TB", 1024 * 1024), ("GB", 1024), ("MB", 1)):
        if total >= scale or unit == "MB":
            return f"{used / scale:.3g}/{total / scale:.3g} {unit}"
    return ""  # pragma: no cover (MB always matches)


def usage_tables(usage: ClusterUsage, gpu_memory_free: dict[str, float] | None = None,
                 holds: Mapping[str, Sequence[Placement]] | None = None, *, wide: bool = False) -> list[Table]:
    """``resource list``: nodes (a GPU with any share or slice booked is used, not free; what holds book is held,
    neither used nor free) and their devices; ``gpu_memory_free`` is each node's GPU memory not booked, ``holds``
    each node's hold placements. Within 120 columns, sizes in MB/GB/TB; ``wide``: every column (group, eligible,
    GPU memory, host paths)."""
    if not wide:
        return _narrow_usage_tables(usage, gpu_memory_free or {}, holds or {})
    free_mb = gpu_memory_free or {}
    held = holds or {}
    nodes = Table(title="nodes", title_justify="left")
    for col in ("node", "group", "status", "eligible", "cpu used/sched", "memory used/sched", "disk free",
                "gpus used/sched", "gpus free", "held", "GPU memory", "GPU memory free", "drivers",
                "host paths"):
        nodes.add_column(col)
    for n in usage.nodes:
        nodes.add_row(
            n.name, n.group, n.status, "yes" if n.scheduling_eligible else "no",
            f"{n.used.cpu_cores:g}/{n.schedulable.cpu_cores:g}", _used_of(n.used.memory_mb, n.schedulable.memory_mb),
            size_words(n.free.disk_mb), f"{n.used.gpu_count:g}/{n.schedulable.gpu_count:g}", f"{n.free.gpu_count:g}",
            held_words(held.get(n.name, ())), size_words(n.gpu_memory_total_mb),
            size_words(free_mb[n.name]) if n.name in free_mb else "-", ",".join(n.runtime_drivers),
            ",".join(n.host_paths) or "-",
        )
    t = usage
    nodes.add_section()
    nodes.add_row("[bold]cluster[/]", "", "", "", f"{t.used.cpu_cores:g}/{t.schedulable.cpu_cores:g}",
                  _used_of(t.used.memory_mb, t.schedulable.memory_mb), size_words(t.free.disk_mb),
                  f"{t.used.gpu_count:g}/{t.schedulable.gpu_count:g}", f"{t.free.gpu_count:g}",
                  booked_words(held_amounts(p for placed in held.values() for p in placed)),
                  size_words(t.gpu_memory_total_mb), size_words(sum(free_mb.values())) if free_mb else "-", "", "")
    return [nodes, *_devices_table(usage)]


def _narrow_usage_tables(usage: ClusterUsage, free_mb: dict[str, float],
                         held: Mapping[str, Sequence[Placement]]) -> list[Table]:
    """``resource list`` within 120 columns: the node's status says when it is not eligible; GPUs free with
    their memory free."""
    nodes = Table(title="nodes", title_justify="left", caption="all columns: --wide", caption_justify="left",
                  pad_edge=False)
    for col in ("node", "status", "cpu used/sched", "mem used/sched", "disk free", "gpus used/sched",
                "GPU mem free", "held", "drivers"):
        nodes.add_column(col)
    for n in usage.nodes:
        nodes.add_row(
            n.name, n.status if n.scheduling_eligible else f"{n.status}, ineligible",
            f"{n.used.cpu_cores:g}/{n.schedulable.cpu_cores:g}", _used_of(n.used.memory_mb, n.schedulable.memory_mb),
            size_words(n.free.disk_mb), f"{n.used.gpu_count:g}/{n.schedulable.gpu_count:g}",
            size_words(free_mb[n.name]) if n.name in free_mb else "-", held_words(held.get(n.name, ())),
            ",".join(n.runtime_drivers))
    t = usage
    nodes.add_section()
    nodes.add_row("[bold]cluster[/]", "", f"{t.used.cpu_cores:g}/{t.schedulable.cpu_cores:g}",
                  _used_of(t.used.memory_mb, t.schedulable.memory_mb), size_words(t.free.disk_mb),
                  f"{t.used.gpu_count:g}/{t.schedulable.gpu_count:g}",
                  size_words(sum(free_mb.values())) if free_mb else "-",
                  booked_words(held_amounts(p for placed in held.values() for p in placed)), "")
    return [nodes, *_devices_table(usage)]


def _devices_table(usage: ClusterUsage) -> list[Table]:
    devices = Table(title="devices", title_justify="left")
    for col in ("node", "id", "index", "vendor", "driver", "model", "memory", "capabilities", "booked"):
        devices.add_column(col)
    for n in usage.nodes:
        slices = {d.parent: sum(1 for s in n.devices if s.parent == d.parent) for d in n.devices if d.parent}
        for d in n.devices:
            devices.add_row(n.name, (f"  └ {d.id} ({d.mig_profile})" if d.parent else d.id), str(d.index),
                            d.vendor or "-", d.driver or "-", d.model or "-",
                            size_words(d.memory_total_mb) if d.memory_total_mb is not None else "-",
                            ",".join(d.capabilities) or "-", _booked(d, slices.get(d.id, 0)))
    return [devices] if devices.row_count else []


def reservations_table(rows: list[dict[str, Any]]) -> Table:
    """Live reservations: what each holds, what the runs inside it use, when it ends."""
    table = Table(title="reservations", title_justify="left")
    for col in ("id", "nodes", "cpu used/held", "memory MB used/held", "gpus used/held", "devices held", "runs inside",
                "ends in"):
        table.add_column(col)
    for r in rows:
        held, used = r["held"], r["used"]
        table.add_row(r["id"], ",".join(r["nodes"]) or "-", f"{used['cpu_cores']:g}/{held['cpu_cores']:g}",
                      f"{used['memory_mb']:g}/{held['memory_mb']:g}", f"{used['gpu_count']:g}/{held['gpu_count']:g}",
                      ",".join(held["devices"]) or "-", str(len(r["runs"])), f"{r['seconds_left']:g} s")
    return table


def _booked(d, slices: int) -> str:
    """How a device is booked: whole, in fractions (shares and memory), or as MIG slices."""
    if d.held:
        return "whole"
    if d.shares_booked > 0:
        return f"{d.shares_booked:g} shares, {d.memory_booked_mb:g} MB"
    if d.slices_booked:
        return f"{d.slices_booked} of {slices} slices"
    return "-"


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
    for col in ("node", "group", "status", "eligible", "cpu", "memory MB", "devices", "last heartbeat"):
        table.add_column(col)
    for n in nodes:
        age = n["heartbeat_age_s"]
        table.add_row(n["name"], n["record"]["group"], n["status"], "yes" if n["scheduling_eligible"] else "no",
                      f"{n['record']['cpu_cores']:g}",
                      f"{n['record']['memory_mb']:g}", ", ".join(n["devices"]) or "-",
                      "-" if age is None else f"{age:.0f} s ago")
    return table


def groups_table(groups) -> Table:
    """Resource groups, from the same records ``group list --json`` prints."""
    table = Table(title="groups", title_justify="left")
    for col in ("group", "nodes", "created"):
        table.add_column(col)
    for g in groups:
        created = "built in" if g.created_at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(g.created_at))
        table.add_row(g.name, str(g.nodes), created)
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


def _runs(count: int) -> str:
    return f"{count} run{'' if count == 1 else 's'}"


def drain_sentence(data: dict, deadline_s: float | None = None) -> str:
    """What a drain (``dry_run``: would) do, in a sentence: the table's actions counted, and where it leaves the
    node."""
    node, actions = data["node"], data.get("actions", [])
    if data.get("dry_run") and not actions:
        return f"{node} has no runs; draining it would put it in maintenance at once."
    counts: dict[str, int] = {}
    for action in actions:
        counts[action["action"]] = counts.get(action["action"], 0) + 1
    within = f" within {duration(deadline_s)}" if deadline_s is not None else " before the deadline"
    parts = [text for key, text in (
        ("migrate", f"move {_runs(counts.get('migrate', 0))} to other nodes"),
        ("wait", f"wait for {_runs(counts.get('wait', 0))} to finish{within}"),
        ("pause", f"pause {_runs(counts.get('pause', 0))} for review"),
        ("ignore", f"leave {_runs(counts.get('ignore', 0))} of system work in place"),
        ("migrated", f"have moved {_runs(counts.get('migrated', 0))}")) if counts.get(key)]
    if data.get("dry_run"):
        return f"Draining {node} would {', '.join(parts)}, then put it in maintenance."
    return f"Draining {node}: it will {', '.join(parts) or 'finish at its next pass'}, then be in maintenance."


def back_in_service(node: str) -> str:
    """How to bring a drained (or draining) node back, the line printed after a drain."""
    return (f"To bring {node} back: mn-prefect node maintenance {node} --disable --reason '...' once the drain is "
            f"complete, or mn-prefect node undrain {node} --reason '...' --mark-eligible to cancel it now.")


STATE_STYLE = {"completed": "green", "failed": "red", "running": "cyan", "retry_wait": "yellow", "skipped": "dim",
               "partial": "yellow", "blocked": "yellow"}


def steps_table(title: str, steps: Mapping[str, StepSummary | dict[str, Any]], caption: str | None = None) -> Table:
    """The steps of a workflow run: from its store record (StepSummary) or a run's JSON outcome (dicts)."""
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for column in ("step", "state", "attempt", "launches", "node", "reason"):
        table.add_column(column)
    for step_id, step in steps.items():
        s = step.model_dump() if isinstance(step, StepSummary) else step
        state = s.get("state", "?")
        table.add_row(step_id, f"[{STATE_STYLE.get(state, 'white')}]{state}[/]", str(s.get("attempts", 0)),
                      str(s.get("launches", 0)), s.get("node") or "-", (s.get("reason") or "")[:80])
    return table


def duration(seconds: float) -> str:
    """Seconds for people: ``42.0 s``, ``12.5 min``, ``3.20 h``."""
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.2f} h"
