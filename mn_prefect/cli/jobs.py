"""Blueprint jobs on the command line: ``blueprint deploy``, ``blueprint run``, ``job list``, ``job status``."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.table import Table

from mn_prefect.cli import render
from mn_prefect.cli.options import EXIT_REFUSED, JsonFlag, StoreURLArg, open_store_option
from mn_prefect.model.blueprint import load_json_file
from mn_prefect.model.issues import InvalidInput
from mn_prefect.model.states import FINISHED_JOB_STATUSES, FINISHED_WORKFLOW_STATUSES, TERMINAL_RUN_STATES
from mn_prefect.placement.job_state import JobState, load_job
from mn_prefect.store.records import WorkflowRecord, get_record, list_records
from mn_prefect.workflow.readable import readable

POOL_VAR = "MN_PREFECT_POOL"
DEFAULT_POOL = "mn-lab"

job_app = typer.Typer(help="Blueprint jobs: what runs where, restarts, history.", no_args_is_help=True)

FileArg = Annotated[Path, typer.Argument(help="Blueprint JSON (flat v1 or mn.workflow/v2).")]
PoolOpt = Annotated[str, typer.Option("--pool", envvar=POOL_VAR, help="An mn work pool.")]


def _compile(file: Path):
    """Validate and pre-check: invalid input exits 2 with every path (BlueprintInvalid is an InvalidInput); a
    job mn-prefect cannot run exits 1 naming each agent and why (nothing is deployed)."""
    from mn_prefect.jobs.deploy import compile_blueprint
    from mn_prefect.jobs.preflight import JobRefused

    raw, problems = load_json_file(file)
    if problems:
        raise InvalidInput(problems)
    try:
        return compile_blueprint(raw)
    except JobRefused as refused:
        table = Table(title=f"{file}: refused, nothing was deployed or booked", title_justify="left")
        table.add_column("agent", style="cyan")
        table.add_column("why it cannot run here")
        for agent, why in refused.reasons.items():
            table.add_row(agent, why)
        render.errors.print(table)
        raise typer.Exit(EXIT_REFUSED) from None


def blueprint_deploy(file: FileArg, pool: PoolOpt = DEFAULT_POOL,
                     name: Annotated[str | None, typer.Option("--name", help="Deployment name (default: the job name).")] = None,
                     as_json: JsonFlag = False) -> None:
    """Compile a blueprint into a Prefect deployment of the mn-blueprint-job flow on an mn pool."""
    from prefect.client.orchestration import get_client

    from mn_prefect.jobs.deploy import deploy_blueprint

    job = _compile(file)
    with get_client(sync_client=True) as client:
        deployment_id, full_name = deploy_blueprint(client, job, pool, name)
    data = {"deployment": full_name, "deployment_id": str(deployment_id), "pool": pool,
            "job_name": job.blueprint.job_name, "job_type": job.blueprint.job_type,
            "agents": [a.agent_id for a in job.blueprint.agents]}
    if as_json:
        render.print_json(data)
        return
    render.console.print(f"deployed [bold]{full_name}[/] on pool {pool} ({job.blueprint.job_type}, "
                         f"{len(job.blueprint.agents)} agents); run it with: prefect deployment run '{full_name}'",
                         soft_wrap=True)


def blueprint_run(file: FileArg, pool: PoolOpt = DEFAULT_POOL,
                  wait: Annotated[bool, typer.Option("--wait", help="Follow the agents live until the job ends.")] = False,
                  timeout: Annotated[float, typer.Option("--timeout", help="With --wait: give up after this many seconds.")] = 3600,
                  store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """Deploy a blueprint and start a run of it; with --wait, show each agent live (placed, running,
    restarts, completed) and exit 0 only when the job completes."""
    from prefect.client.orchestration import get_client

    from mn_prefect.jobs.deploy import start_job

    job = _compile(file)
    store = open_store_option(store_url)
    with get_client(sync_client=True) as client:
        job_id, run = start_job(client, job, pool)
        if not as_json:
            render.console.print(f"job [bold]{job_id}[/]: coordinator run {run.id} on pool {pool}", soft_wrap=True)
        if not wait:
            if as_json:
                render.print_json({"job_id": job_id, "flow_run_id": str(run.id), "pool": pool})
            return
        state = _follow(client, store, job_id, run.id, timeout, live=not as_json)
    final = load_job(store, job_id)
    if as_json:
        render.print_json({"job_id": job_id, "flow_run_id": str(run.id), "pool": pool, "state": state,
                           **(_status_data(store, final) if final else {})})
    else:
        render.console.print(agents_table(final) if final else f"job {job_id}: no record in the store")
        render.console.print(f"job {job_id}: coordinator run {state}", soft_wrap=True)
    raise typer.Exit(0 if state == "COMPLETED" else 1)


def _follow(client, store, job_id: str, run_id, timeout: float, *, live: bool) -> str:
    """Poll the job's record and its coordinator run until the run ends; returns the run's final state."""
    deadline = time.monotonic() + timeout
    with Live(Table(), console=render.console, refresh_per_second=2, transient=True) if live else nullcontext() as view:
        while True:
            state = client.read_flow_run(run_id).state
            job = load_job(store, job_id)
            if view is not None:  # a Live display when live
                view.update(agents_table(job, coordinator=state.name if state else "?") if job else
                            Table(title=f"job {job_id}: coordinator {state.name if state else '?'}"))
            if state is not None and state.type.value in TERMINAL_RUN_STATES:
                return state.type.value
            if time.monotonic() > deadline:
                return "TIMED_OUT"
            time.sleep(1)


def agents_table(job: JobState, coordinator: str | None = None) -> Table:
    head = f"job {job.job_id} ({job.job_type}): {job.status}"
    if coordinator:
        head += f", coordinator {coordinator}"
    table = Table(title=head, caption=job.reason, title_justify="left", caption_justify="left")
    for col in ("agent", "node", "status", "attempt", "run state", "restarts", "left", "last reason"):
        table.add_column(col)
    for track in job.agents.values():
        left = track.remaining()["restarts"]
        current = track.current
        table.add_row(track.agent_id, track.node or "-", track.status, str(len(track.runs)),
                      current.state if current else "-", str(len(track.restarts_ms)),
                      "unlimited" if left is None else str(left), track.reason or "-")
    return table


@job_app.command("list")
def job_list(running_only: Annotated[bool, typer.Option("--running-only", help="Only jobs not yet finished.")] = False,
             store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """Blueprint jobs in the store, newest first."""
    store = open_store_option(store_url)
    jobs = list_records(store, JobState)
    if running_only:
        jobs = [j for j in jobs if j.status not in FINISHED_JOB_STATUSES]
    dated: list[tuple[float, dict[str, Any]]] = [(j.created_at, {
        "job_id": j.job_id, "name": j.job_name, "type": j.job_type, "status": j.status, "agents": len(j.agents),
        "nodes": sorted({t.node for t in j.agents.values() if t.node}),
        "restarts": sum(len(t.restarts_ms) for t in j.agents.values()), "flow_run_id": j.flow_run_id,
        "reason": j.reason}) for j in jobs]
    for record in list_records(store, WorkflowRecord):  # bundle runs: their steps stand where agents do
        if running_only and record.status in FINISHED_WORKFLOW_STATUSES:
            continue
        steps = record.steps
        dated.append((record.created_at, {
            "job_id": record.job_id, "name": record.job_name, "type": "workflow", "status": record.status,
            "agents": len(steps), "nodes": sorted({s.node for s in steps.values() if s.node}),
            "restarts": sum(max(s.attempts - 1, 0) for s in steps.values()),
            "flow_run_id": record.flow_run_id, "reason": workflow_reason(record)}))
    dated.sort(key=lambda pair: pair[0], reverse=True)  # newest first; ties keep the store's order
    rows = [row for _, row in dated]
    if as_json:
        render.print_json(rows)
        return
    table = Table(title=f"jobs ({len(rows)})", title_justify="left")
    for col in ("job", "name", "type", "status", "agents", "nodes", "restarts", "reason"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["job_id"], r["name"], r["type"], r["status"], str(r["agents"]), ",".join(r["nodes"]) or "-",
                      str(r["restarts"]), r["reason"] or "-")
    render.console.print(table)


def workflow_reason(record: WorkflowRecord) -> str | None:
    """Why a bundle run is in its state: the error it ended with, the steps under way, or nothing once it
    completed (its run folder is in ``job status``)."""
    if record.status == "completed":
        return None
    if record.status == "crashed":
        return "its process died; a later sweep released its step bookings"
    if record.status in ("failed", "cancelled"):  # the run's result is then the error it ended with
        ended = record.result if isinstance(record.result, dict) else {}
        if ended.get("error"):
            return f"step {ended['step_id']}: {ended['error']}" if ended.get("step_id") else str(ended["error"])
        failed = [(sid, s.reason) for sid, s in record.steps.items() if s.state == "failed" and s.reason]
        return f"step {failed[0][0]}: {failed[0][1]}" if failed else record.status
    under_way = {state: [sid for sid, s in record.steps.items() if s.state == state]
                 for state in ("running", "retry_wait", "queued")}
    parts = [f"{state.replace('_', ' ')}: {', '.join(ids)}" for state, ids in under_way.items() if ids]
    return "; ".join(parts) or None


@job_app.command("status")
def job_status(job_id: Annotated[str, typer.Argument(help="The job id (job list shows them).")],
               store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """One job: its plan, placements (node, devices, ports), the allocations it holds now, each agent's runs,
    restart and reschedule history with the attempts left, recovery settings and recent events; ``--json``
    prints the same as one object."""
    store = open_store_option(store_url)
    job = load_job(store, job_id)
    record = get_record(store, job_id, WorkflowRecord) if job is None else None
    if record is not None:
        if as_json:
            data = record.model_dump(mode="json", exclude={"kind", "created_at", "updated_at"})
            if record.status == "completed":  # the sink's output as JSON, each step's output once
                data["result"] = readable(data["result"])
            render.print_json(data)
        else:
            render.console.print(render.steps_table(f"bundle run {job_id}: {record.status}", record.steps,
                                                    caption=f"run store: {record.run_dir}"))
        return
    if job is None:
        render.errors.print(f"[red]no blueprint job {job_id!r}[/] in the store (mn-prefect job list shows them)")
        raise typer.Exit(EXIT_REFUSED)
    data = _status_data(store, job)
    if as_json:
        render.print_json(data)
        return
    for table in render.job_status_tables(data):
        render.console.print(table)


def _status_data(store, job: JobState) -> dict[str, Any]:
    now_ms = int(time.time() * 1000)
    placements = [p.model_dump(mode="json", exclude={"env"}) for b in job.bookings
                  for p in store.active_placements(job_id=b)]
    agents = {}
    for agent_id, track in job.agents.items():
        entry = track.model_dump(mode="json")
        entry["remaining"] = track.remaining(now_ms)
        agents[agent_id] = entry
    return {
        "job_id": job.job_id, "name": job.job_name, "job_type": job.job_type, "status": job.status,
        "reason": job.reason, "flow_run_id": job.flow_run_id, "pool": job.pool, "plan": job.plan,
        "placements": placements, "agents": agents,
        "recovery": {"recovery_mode": job.recovery_mode, "strategy": job.strategy,
                     "reschedule_policies": {a: t.reschedule.model_dump() for a, t in job.agents.items()}},
        "events": [e.model_dump(mode="json") for e in store.events(job_id=job.job_id, limit=50)],
    }


ops_app = typer.Typer(help="Scheduled operations flows.", no_args_is_help=True)


@ops_app.command("deploy")
def ops_deploy(pool: PoolOpt = DEFAULT_POOL,
               interval: Annotated[int, typer.Option("--interval", min=1, help="Seconds between reconcile runs.")] = 60,
               as_json: JsonFlag = False) -> None:
    """Deploy the reconcile flow on ``pool`` every ``--interval`` seconds, at most one run at a time."""
    from prefect.client.orchestration import get_client

    from mn_prefect.ops.flows import deploy_ops

    with get_client(sync_client=True) as client:
        done = deploy_ops(client, pool, interval_s=interval)
    names, kept = done["deployments"], done["kept"]
    if as_json:
        render.print_json({"deployments": names, "pool": pool, "interval_s": interval, "kept": kept})
        return
    if kept:  # one reconcile schedule per pool: the one there stays, no second one is added
        every = ", ".join(f"{k['deployment']}" + (f" every {k['interval_s']:g} s" if k["interval_s"] else "")
                          for k in kept)
        render.console.print(f"pool {pool} already reconciles on a schedule ({every}): kept it, no second reconcile "
                             f"schedule added; deployed [bold]{names[-1]}[/]", soft_wrap=True, highlight=False)
        return
    render.console.print(f"deployed [bold]{names[0]}[/] every {interval} s (concurrency limit 1) and "
                         f"[bold]{names[1]}[/] on pool {pool}")
