"""``blueprint run`` and ``blueprint deploy`` for MirrorNeuron bundles (a folder with manifest.json, or a
workflow manifest file); flat v1 agent jobs go on to ``mn_prefect.cli.jobs`` as before."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from mn_prefect.cli import jobs, render
from mn_prefect.cli.options import EXIT_INVALID, JsonFlag, StoreURLArg, open_store_option
from mn_prefect.model.issues import InvalidInput, Issue, Issues
from mn_prefect.model.states import TERMINAL_RUN_STATES
from mn_prefect.store.records import WorkflowRecord, get_record, list_records

PathArg = Annotated[Path | None, typer.Argument(
    help="A bundle folder (manifest.json, payloads/, config/), a workflow manifest, or a flat v1 blueprint.")]
FolderOpt = Annotated[Path | None, typer.Option("--folder", help="The bundle folder (MirrorNeuron's spelling).")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Config override KEY.PATH=VALUE (repeatable).")]
RunsRootOpt = Annotated[str | None, typer.Option(
    "--runs-root", help="Where workers write the run store (MN_RUNS_ROOT; default ~/.mn/runs).")]


@contextmanager
def json_errors(as_json: bool):
    """With --json, a refusal is JSON on stdout too (exit 2 for invalid input, 1 otherwise)."""
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except InvalidInput as error:
        if not as_json:
            raise
        print(json.dumps({"state": "INVALID", "errors": [i.as_dict() for i in error.issues]}))
        raise typer.Exit(EXIT_INVALID) from None
    except Exception as error:
        if not as_json or os.environ.get("MN_DEBUG"):
            raise
        print(json.dumps({"state": "ERROR", "error": f"{type(error).__name__}: {error}"}))
        raise typer.Exit(1) from None


def pick_target(path: Path | None, folder: Path | None) -> Path:
    chosen = folder or path
    if chosen is None or (folder is not None and path is not None and folder != path):
        raise typer.BadParameter("give the bundle as PATH or --folder PATH (one of them)")
    return chosen


def check_exists(target: Path) -> None:
    """PATH must name a file or folder that is there: said plainly, before anything reads it."""
    if not target.expanduser().exists():
        raise InvalidInput([Issue("PATH", f"{target}: no such file or folder")])


def validate(target: Path) -> tuple[str | None, list[Issue]]:
    """What ``blueprint run`` would read from ``target``, checked by the same code without running anything: a
    bundle folder as ``load_bundle`` loads it (manifest, config layers, bindings, payloads; a source manifest
    expanded), and so a ``manifest.json`` file as its folder; another workflow manifest file by the manifest's
    rules (``parse_workflow``), a flat v1 blueprint by ``parse_blueprint``. Returns (a
    line saying what is valid, []) or (None, every issue)."""
    from mn_prefect.cli.inputs import read_blueprint
    from mn_prefect.model.blueprint import load_json_file
    from mn_prefect.workflow.manifest import parse_workflow

    try:
        check_exists(target)
        if target.is_file() and target.name == "manifest.json":  # a bundle's manifest: its folder, as mn takes it
            target = target.parent
        if target.is_dir():
            spec = _load(target, None)[0].spec
        elif is_bundle(target):
            raw, problems = load_json_file(target)
            spec, problems = (None, problems) if problems else parse_workflow(raw)
            if problems or spec is None:
                return None, list(problems)
        else:
            blueprint, problems = read_blueprint(target)
            if problems or blueprint is None:
                return None, list(problems)
            return f"{blueprint.format}, {blueprint.job_type}, {len(blueprint.agents)} agents", []
    except InvalidInput as error:
        return None, list(error.issues)
    b = spec.blueprint
    return f"{b.format}, {b.job_type}, {len(b.agents)} agents; workflow {spec.blueprint_id}, {len(spec.steps)} steps", []


def is_bundle(path: Path) -> bool:
    """A folder, or a manifest that describes a workflow: run by the step ledger, not as an agent job."""
    from mn_prefect.workflow.manifest import is_workflow_document

    if path.is_dir():
        return True
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return is_workflow_document(doc)


def _load(path: Path, sets: list[str] | None):
    from mn_prefect.bundles.bundle import load_bundle, parse_set

    issues = Issues()
    overrides = parse_set(sets or [], issues)
    issues.raise_if_any()
    return load_bundle(path, overrides), overrides


def blueprint_run(path: PathArg = None, folder: FolderOpt = None,
                  local: Annotated[bool, typer.Option("--local", help="Run on this machine alone: its own SQLite "
                                                                      "store, no worker to start first.")] = False,
                  pool: jobs.PoolOpt = jobs.DEFAULT_POOL,
                  wait: Annotated[bool, typer.Option("--wait", help="Follow the steps live until the run ends.")] = False,
                  timeout: Annotated[float, typer.Option("--timeout", help="With --wait: give up after this many seconds.")] = 3600,
                  runs_root: RunsRootOpt = None,
                  run_id: Annotated[str | None, typer.Option("--run-id", help="The run id (MN_RUN_ID; default: "
                                                                                 "the flow run's id).")] = None,
                  sets: SetOpt = None, store_url: StoreURLArg = None, as_json: JsonFlag = False) -> None:
    """Run a bundle (or a blueprint): every step placed by the scheduler and run under MirrorNeuron's worker
    contract; --wait follows it live and exits 0 only when the workflow completes."""
    with json_errors(as_json):
        _blueprint_run(path, folder, local, pool, wait, timeout, runs_root, run_id, sets, store_url, as_json)


def _blueprint_run(path, folder, local, pool, wait, timeout, runs_root, run_id, sets, store_url, as_json) -> None:
    from mn_prefect.bundles.runner import run_id_issue

    if run_id is not None and (why := run_id_issue(run_id)):
        raise InvalidInput([Issue("--run-id", why)])
    target = pick_target(path, folder)
    check_exists(target)
    if not is_bundle(target):
        if local:
            raise InvalidInput([Issue("--local", "runs bundles and workflow manifests; a flat v1 agent job runs "
                                                 "on a pool (drop --local)")])
        jobs.blueprint_run(target, pool=pool, wait=wait, timeout=timeout, store_url=store_url, as_json=as_json)
        return
    bundle, overrides = _load(target, sets)
    if local:
        outcome = _run_local(bundle, run_id=run_id, runs_root=runs_root, overrides=overrides,
                             live=wait and not as_json, quiet=wait or as_json)
    else:
        outcome = _run_on_pool(bundle, pool=pool, wait=wait, timeout=timeout, run_id=run_id, runs_root=runs_root,
                               overrides=overrides, store_url=store_url, live=not as_json)
    _finish(outcome, as_json)


def _finish(outcome: dict[str, Any], as_json: bool) -> None:
    """Print the run (``run_summary``: the same keys on every path) and exit 0 when it completed, or when it was
    only submitted (a pool without --wait)."""
    state = outcome["state"]
    if as_json:
        print(json.dumps(outcome, default=str, separators=(",", ":")), flush=True)
    else:
        if outcome["steps"]:
            caption = f"flow run {outcome['flow_run_id']}; run store: {outcome['run_dir']}"
            render.console.print(render.steps_table(f"job {outcome['job_id']}: {state}", outcome["steps"],
                                                    caption=caption))
        else:
            render.console.print(f"job {outcome['job_id']}: {state}", soft_wrap=True)
        if outcome["error"]:
            render.errors.print(f"[red]{escape(outcome['error'])}[/]", soft_wrap=True)
    if state not in ("COMPLETED", "SCHEDULED"):
        raise typer.Exit(1)


def _summary(record: WorkflowRecord | None, *, job_id: str, flow_run_id: str, run_id: str | None, state: str,
             error: str | None = None) -> dict[str, Any]:
    """The run as ``--json`` prints it, from its record in the store (none yet for a run only submitted)."""
    from mn_prefect.bundles.runner import run_summary

    if record is None:
        return run_summary(job_id=job_id, flow_run_id=flow_run_id, run_id=run_id, state=state, steps={},
                           result=None, run_dir=None, error=error)
    if error is None and state != "COMPLETED":
        error = jobs.workflow_reason(record)
    return run_summary(job_id=job_id, flow_run_id=flow_run_id, run_id=record.run_id, state=state,
                       steps=record.steps, result=record.result, run_dir=record.run_dir, error=error)


def _use_local_prefect() -> None:
    """A reachable server (PREFECT_API_URL or the profile) is used; without one Prefect starts a temporary
    server in a subprocess, which takes several seconds: say so on stderr."""
    from mn_prefect.local_lab import healthy

    api = os.environ.get("PREFECT_API_URL")
    if api and healthy(api):
        return
    if api:
        render.errors.print(f"the Prefect server at {api} does not answer: using a temporary one", soft_wrap=True)
        os.environ.pop("PREFECT_API_URL")
    else:
        render.errors.print("no Prefect server configured: starting a temporary one for this run (several "
                            "seconds; `mn-prefect up` keeps a server running)", soft_wrap=True)
    os.environ["PREFECT_SERVER_EPHEMERAL_ENABLED"] = "true"
    os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = "true"
    # Prefect gives a temporary server 20 s to start; a busy laptop or CI runner can need more.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # A server for one run sends no usage heartbeat: offline it prints a failure to the terminal, and at start it
    # can race the server's own database setup ("database is locked").
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import get_current_settings

    # The temporary server keeps its database in PREFECT_HOME and cannot open it in a folder that is not there.
    get_current_settings().home.mkdir(parents=True, exist_ok=True)


def _run_local(bundle, *, run_id, runs_root, overrides, live: bool, quiet: bool) -> dict[str, Any]:
    from mn_prefect.bundles.flows import local_store_url, run_local
    from mn_prefect.store import open_store

    _use_local_prefect()
    if quiet:
        keep_prefect_off_console()
    store = open_store(local_store_url())
    try:
        if live:
            state = _with_live_table(store, bundle, lambda: run_local(bundle.root, run_id=run_id, runs_root=runs_root,
                                                                        overrides=overrides))
        else:
            state = run_local(bundle.root, run_id=run_id, runs_root=runs_root, overrides=overrides)
        return _local_summary(store, bundle, state, run_id)
    finally:
        store.close()


def _with_live_table(store, bundle, work: Callable[[], Any]) -> Any:
    """``work()`` in a thread while the live table follows the run's record in ``store``; its return value."""
    holder: dict[str, Any] = {}

    def run() -> None:
        try:
            holder["outcome"] = work()
        except BaseException as error:  # shown below; the thread must not die silently
            holder["error"] = error

    thread = threading.Thread(target=run, name="mn-bundle-run", daemon=True)
    thread.start()
    with Live(Table(), console=render.console, refresh_per_second=4, transient=True) as view:
        while thread.is_alive():
            record = _latest_record(store, bundle.spec.job_name)
            if record is not None:
                view.update(render.steps_table(f"job {record.job_id}: {record.status}", record.steps))
            thread.join(0.25)
    if "error" in holder:
        raise holder["error"]
    return holder["outcome"]


def _local_summary(store, bundle, state, run_id: str | None) -> dict[str, Any]:
    """A local run as ``--json`` prints it, read from its record in the local store; a flow run that ended before
    its workflow did (it could not load the bundle, say) raises what ended it."""
    from mn_prefect.bundles.ids import job_id_for

    flow_run_id = str(state.state_details.flow_run_id or "")
    job_id = job_id_for(bundle.spec.job_name, run_id or flow_run_id) if flow_run_id else ""
    record = get_record(store, job_id, WorkflowRecord) if flow_run_id else None
    if record is None or record.state is None:
        ended = state.result(raise_on_failure=False)
        if isinstance(ended, BaseException):
            raise ended
        if record is None:
            raise RuntimeError(f"the flow run ended {state.name} ({state.message or 'no message'}) and left no "
                               f"record of job {job_id or '?'} in the local store")
    return _summary(record, job_id=job_id, flow_run_id=flow_run_id, run_id=record.run_id,
                    state=record.state or state.type.value, error=None if record.state else state.message)


def keep_prefect_off_console() -> Callable[[], None]:
    """The run's own log lines (its flow and task runs) and Prefect's chatter below WARNING stay off the terminal:
    the console handlers drop them, while the run's API handler still sends its lines to the flow run (the Prefect
    UI shows them). Returns how to undo it; the CLI leaves it in place to the end, so that Prefect's "Stopping
    temporary server" at exit stays quiet too."""
    added = []
    for logger in (logging.getLogger(), *(logging.getLogger(name) for name in ("prefect", *_RUN_LOGGERS))):
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) and \
                    not any(isinstance(f, _OffConsole) for f in handler.filters):
                off = _OffConsole()
                handler.addFilter(off)
                added.append((handler, off))

    def undo() -> None:
        for handler, off in added:
            handler.removeFilter(off)

    return undo


_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class _OffConsole(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        if any(name == run or name.startswith(f"{run}.") for run in _RUN_LOGGERS):
            return False
        return not ((name == "prefect" or name.startswith("prefect.")) and record.levelno < logging.WARNING)


def _latest_record(store, job_name: str) -> WorkflowRecord | None:
    records = [r for r in list_records(store, WorkflowRecord) if r.job_name == job_name]
    return max(records, key=lambda r: r.updated_at) if records else None


def _run_on_pool(bundle, *, pool, wait, timeout, run_id, runs_root, overrides, store_url, live) -> dict[str, Any]:
    from prefect.client.orchestration import get_client

    from mn_prefect.bundles.deploy import deploy_bundle, start_bundle

    store = open_store_option(store_url)
    with get_client(sync_client=True) as client:
        deployment_id, name = deploy_bundle(client, bundle, pool, runs_root=runs_root, overrides=overrides,
                                             lifecycle="keep")
        run, job_id = start_bundle(client, bundle, deployment_id, run_id=run_id)
        if live:
            render.errors.print(f"job [bold]{job_id}[/]: flow run {run.id} ({name}) on pool {pool}", soft_wrap=True)
        if not wait:
            return _summary(None, job_id=job_id, flow_run_id=str(run.id), run_id=run_id or str(run.id),
                            state="SCHEDULED")
        state, message = _follow(client, store, job_id, run.id, timeout, live=live)
    record = get_record(store, job_id, WorkflowRecord)
    error = None
    if state == "TIMED_OUT":
        error = f"still running after --timeout {timeout:g} s (flow run {run.id} goes on)"
    elif state != "COMPLETED" and (record is None or record.state is None):
        error = message or f"the flow run ended {state}"
    return _summary(record, job_id=job_id, flow_run_id=str(run.id), run_id=run_id or str(run.id), state=state,
                    error=error)


def _follow(client, store, job_id: str, flow_run_id, timeout: float, *, live: bool) -> tuple[str, str | None]:
    """(the flow run's final state type, or TIMED_OUT; its state's message)."""
    deadline = time.monotonic() + timeout
    with Live(Table(), console=render.console, refresh_per_second=2, transient=True) if live else nullcontext() as view:
        while True:
            state = client.read_flow_run(flow_run_id).state
            record = get_record(store, job_id, WorkflowRecord)
            if view is not None:  # a Live display when live
                view.update(render.steps_table(f"job {job_id}: {state.name if state else '?'}",
                                               record.steps if record else {}))
            if state is not None and state.type.value in TERMINAL_RUN_STATES:
                return state.type.value, state.message
            if time.monotonic() > deadline:
                return "TIMED_OUT", None
            time.sleep(0.5)


def blueprint_deploy(path: PathArg = None, folder: FolderOpt = None, pool: jobs.PoolOpt = jobs.DEFAULT_POOL,
                     name: Annotated[str | None, typer.Option("--name", help="Deployment name (default: the job name).")] = None,
                     runs_root: RunsRootOpt = None, sets: SetOpt = None, as_json: JsonFlag = False) -> None:
    """Turn a bundle (or a blueprint) into a Prefect deployment on an mn pool; run it with
    `prefect deployment run`, the UI or a schedule."""
    target = pick_target(path, folder)
    with json_errors(as_json):
        check_exists(target)
    if not is_bundle(target):
        jobs.blueprint_deploy(target, pool=pool, name=name, as_json=as_json)
        return
    from prefect.client.orchestration import get_client

    from mn_prefect.bundles.deploy import deploy_bundle

    with json_errors(as_json):
        bundle, overrides = _load(target, sets)
        with get_client(sync_client=True) as client:
            deployment_id, full_name = deploy_bundle(client, bundle, pool, name=name, runs_root=runs_root,
                                                     overrides=overrides, lifecycle="register")
    data = {"deployment": full_name, "deployment_id": str(deployment_id), "pool": pool,
            "blueprint_id": bundle.spec.blueprint_id, "bundle": str(bundle.root),
            "steps": list(bundle.spec.steps), "agents": list(bundle.spec.agents)}
    if as_json:
        print(json.dumps(data))
        return
    render.console.print(f"deployed [bold]{full_name}[/] on pool {pool} ({len(bundle.spec.steps)} steps); run it "
                         f"with: prefect deployment run '{full_name}'", soft_wrap=True)


__all__ = ["blueprint_run", "blueprint_deploy", "EXIT_INVALID"]
