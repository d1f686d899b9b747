"""Bundles as Prefect flows: ``mn-bundle-run`` (one flow run per bundle run; each step attempt a task run, or
a child ``mn-step`` flow run when the scheduler places it on another node) and ``mn-step``.

Both are deployed by module path, so any machine with mn-prefect installed runs them without pulling code;
the bundle folder is read from the same path on every node (a shared or copied folder).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, State
from prefect.deployments import run_deployment
from prefect.runtime import flow_run as current_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote

from mn_prefect.bundles.bundle import Bundle, declared_runs_root, load_bundle, runs_root as resolve_runs_root
from mn_prefect.bundles.human import HumanGate
from mn_prefect.bundles.ids import job_id_for
from mn_prefect.bundles.process import run_launch
from mn_prefect.bundles.runner import (
    BundleRun,
    RunOutcome,
    failure_text,
    new_ids,
    run_environment,
    sweep_dead_runs,
)
from mn_prefect.bundles.services import ServiceWatch, parse_services
from mn_prefect.bundles.triggers import BUNDLE_FLOW_NAME, TRIGGER_ENV, parse_trigger_parameter
from mn_prefect.model.hints import allocation, env_hints
from mn_prefect.model.issues import Issues
from mn_prefect.model.placement import Placement
from mn_prefect.model.states import TERMINAL_RUN_STATES
from mn_prefect.store import ClusterStore, open_store
from mn_prefect.store.records import StepResultRecord, get_record, put_record
from mn_prefect.workflow.engine import Message, StepLaunch
from mn_prefect.workflow.ledger import AttemptContext
from mn_prefect.workflow.protocol import ProcessResult

STEP_FLOW_NAME = "mn-step"
BUNDLE_ENTRYPOINT = "mn_prefect.bundles.flows.bundle_run"
STEP_ENTRYPOINT = "mn_prefect.bundles.flows.mn_step"


class StepFailed(RuntimeError):
    pass


LOG_LINE_CHARS = 2000


def _short(text: str) -> str:
    """A step's output line as logged (the whole output stays in the run's messages and run store)."""
    return text if len(text) <= LOG_LINE_CHARS else f"{text[:LOG_LINE_CHARS]}... [{len(text)} characters]"


# -- launches as JSON (for a step that runs on another node) ------------------------------------------------

def launch_doc(launch: StepLaunch) -> dict[str, Any]:
    ctx = launch.context
    return {"id": launch.id, "agent_id": launch.agent_id, "step_id": launch.step_id, "timeout_s": launch.timeout_s,
            "message_doc": launch.message_doc, "context_doc": launch.context_doc, "workflow_env": launch.workflow_env,
            "body": launch.message.body, "started_at": launch.started_at,
            "context": None if ctx is None else ctx.__dict__}


def launch_from_doc(bundle: Bundle, doc: dict[str, Any]) -> StepLaunch:
    envelope = doc["message_doc"].get("envelope", {})
    message = Message(message_id=envelope.get("message_id", ""), source=envelope.get("from", ""),
                      target=doc["agent_id"], type=envelope.get("type", ""), body=doc.get("body"),
                      headers=doc["message_doc"].get("headers", {}))
    ctx = doc.get("context")
    return StepLaunch(id=doc["id"], agent=bundle.spec.agents[doc["agent_id"]], message=message,
                      step_id=doc.get("step_id"), context=AttemptContext(**ctx) if ctx else None,
                      timeout_s=doc.get("timeout_s"), message_doc=doc["message_doc"], context_doc=doc["context_doc"],
                      workflow_env=doc["workflow_env"], started_at=doc.get("started_at", 0.0))


# -- starting a step here: a task run in this flow run -------------------------------------------------------

class _StepProcess:
    """A step running in this process; ``cancel`` kills its process group."""

    def __init__(self) -> None:
        self.result: ProcessResult | None = None
        self.pid: int | None = None
        self.done = threading.Event()

    def cancel(self) -> None:
        if self.pid is not None and not self.done.is_set():
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@task(name="mn-step", cache_policy=NO_CACHE, retries=0, log_prints=False)
def step_task(launch: StepLaunch, bundle: Bundle, placement: Placement, job_id: str, run_env: dict[str, str],
              box: _StepProcess) -> dict[str, Any]:
    """Run one step attempt on this node with the booking's hints; fails when the step's process fails."""
    logger = get_run_logger()

    def line(stream: str, text: str) -> None:
        (logger.warning if stream == "stderr" else logger.info)("[%s] %s", launch.label, _short(text))

    try:
        result = run_launch(launch, bundle.upload_roots, job_id=job_id, run_env=run_env, hints=env_hints(placement),
                            on_line=line, node=placement.node, on_start=lambda pid: setattr(box, "pid", pid),
                            placement=placement)
    except BaseException as error:
        box.result = ProcessResult(exit_code=1, stdout="", stderr="", refused=f"the step crashed: {error}")
        raise
    finally:
        box.done.set()
    box.result = result
    if not result.ok:
        raise StepFailed(f"step {launch.label} on {placement.node}: {result.error_text()}")
    return {"exit_code": result.exit_code, "node": placement.node, "seconds": round(result.seconds, 3)}


class _Finished:
    def __init__(self, box: _StepProcess):
        self.box = box

    def result(self) -> ProcessResult | None:
        return self.box.result

    def cancel(self) -> None:
        self.box.cancel()


class _TaskHandle:
    def __init__(self, future, box: _StepProcess):
        self.future, self.box = future, box

    def result(self) -> ProcessResult | None:
        if not self.box.done.is_set() and not self.future.wrapped_future.done():
            return None
        self.box.done.wait(5)
        return self.box.result or ProcessResult(exit_code=1, stdout="", stderr="", refused="the step task ended "
                                                                                           "without a result")

    def cancel(self) -> None:
        self.box.cancel()


# -- starting a step on another node: a child flow run pinned to its booking ----------------------------------

def result_key(booking: str) -> str:
    return f"{booking}:result"


class _ChildHandle:
    def __init__(self, store: ClusterStore, booking: str, flow_run_id: UUID):
        self.store, self.booking, self.flow_run_id = store, booking, flow_run_id
        self._next_check = 0.0

    def result(self) -> ProcessResult | None:
        if time.monotonic() < self._next_check:
            return None
        self._next_check = time.monotonic() + 0.5
        record = get_record(self.store, result_key(self.booking), StepResultRecord)
        if record is not None:
            return ProcessResult.from_json(record.result_json())
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(self.flow_run_id).state
        if state is not None and state.type in TERMINAL_RUN_STATES:
            record = get_record(self.store, result_key(self.booking), StepResultRecord)
            if record is not None:
                return ProcessResult.from_json(record.result_json())
            return ProcessResult(exit_code=1, stdout="", stderr="",
                                 refused=f"the step's flow run ended {state.name} without a result")
        return None

    def cancel(self) -> None:
        from prefect.states import Cancelling

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(self.flow_run_id, Cancelling(message="the workflow ended"), force=True)


def ensure_step_deployment(client, pool: str) -> UUID:
    from mn_prefect.jobs.deploy import _upsert

    return _upsert(client, STEP_FLOW_NAME, mn_step.fn, f"{pool}-steps", STEP_ENTRYPOINT, pool,
                   job_variables={"resources": {}},
                   description="One attempt of one bundle step, pinned to the node its workflow booked for it.")


@flow(name=STEP_FLOW_NAME, log_prints=True, retries=0)
def mn_step(bundle_path: str, launch: dict[str, Any], job_id: str, run_env: dict[str, str], booking: str,
            overrides: dict[str, Any] | None = None) -> dict:
    """One step attempt of a bundle run, started on the node the scheduler booked for it."""
    logger = get_run_logger()
    bundle = load_bundle(bundle_path, overrides)
    step = launch_from_doc(bundle, launch)
    placement = allocation()
    store = open_store()
    try:
        def line(stream: str, text: str) -> None:
            (logger.warning if stream == "stderr" else logger.info)("[%s] %s", step.label, _short(text))

        result = run_launch(step, bundle.upload_roots, job_id=job_id, run_env=run_env, hints=env_hints(placement),
                            on_line=line, node=placement.node, placement=placement)
        put_record(store, StepResultRecord(job_id=result_key(booking), label=step.label, **result.as_json()))
    finally:
        store.close()
    if not result.ok:
        raise StepFailed(f"step {step.label} on {placement.node}: {result.error_text()}")
    return {"exit_code": result.exit_code, "node": placement.node}


class PrefectStarter:
    """Starts placed launches: here as task runs when placed on ``own_node`` (or when there is no pool),
    elsewhere as child ``mn-step`` flow runs on ``pool``."""

    def __init__(self, bundle: Bundle, store: ClusterStore, job_id: str, run_env: dict[str, str], *,
                 own_node: str | None, pool: str | None, bundle_path: str, overrides: dict[str, Any] | None):
        self.bundle, self.store, self.job_id, self.run_env = bundle, store, job_id, run_env
        self.own_node, self.pool = own_node, pool
        self.bundle_path, self.overrides = bundle_path, overrides
        spec = bundle.spec
        self.inline = spec.strategy == "serial" or spec.max_parallel_steps == 1
        self._deployment: UUID | None = None

    def __call__(self, launch: StepLaunch, placement: Placement, booking: str):
        if self.pool is None or placement.node == self.own_node:
            box = _StepProcess()
            named = step_task.with_options(task_run_name=f"{launch.label} #{launch.id}")
            # quote(): Prefect would otherwise walk every object in the arguments (the whole bundle) looking for
            # futures to wait on, about 50 ms a step; none of them holds one.
            args: list[Any] = [quote(launch), quote(self.bundle), quote(placement), self.job_id, quote(self.run_env),
                               quote(box)]
            if self.inline:
                # One launch at a time (serial strategy): run it right here, no hand-off to a thread.
                try:
                    named(*args)
                except StepFailed:
                    pass  # the result in the box says how it failed
                return _Finished(box)
            future = named.submit(*args)
            return _TaskHandle(future, box)
        with get_client(sync_client=True) as client:
            if self._deployment is None:
                self._deployment = ensure_step_deployment(client, self.pool)
        run = run_deployment(self._deployment, timeout=0, as_subflow=True,
                             parameters={"bundle_path": self.bundle_path, "launch": launch_doc(launch),
                                         "job_id": self.job_id, "run_env": self.run_env, "booking": booking,
                                         "overrides": self.overrides},
                             job_variables={"booking": {"job_id": booking, "agent_id": launch.label}},
                             flow_run_name=f"{self.job_id}-{launch.label}-{launch.id}".replace("[", "-").replace("]", ""))
        if not isinstance(run, FlowRun):  # run_deployment returns a coroutine only when called from async code
            raise TypeError(f"run_deployment returned a {type(run).__name__}, not a flow run")
        return _ChildHandle(self.store, booking, run.id)


def local_store_url() -> str:
    from mn_prefect.store.urls import home

    return f"sqlite:///{home() / 'local' / 'state.db'}"


# Prefect's flow() asks for TaskRunner[PrefectFuture[Any]], invariant in the future type, which no concrete runner is.
@flow(name=BUNDLE_FLOW_NAME, log_prints=True, retries=0,
      task_runner=ThreadPoolTaskRunner(max_workers=16))  # type: ignore[arg-type]
def bundle_run(bundle_path: str, run_id: str | None = None, runs_root: str | None = None,
               overrides: dict[str, Any] | None = None, pool: str | None = None,
               store_url: str | None = None, trigger: Any = None) -> dict[str, Any] | State[Any]:
    """Run a MirrorNeuron bundle: the workflow's steps placed one attempt at a time, run under the worker
    contract; the result is the sink's output. Fails when the workflow fails. ``trigger``: the event that started
    the run (set by the bundle's trigger automations), which every step reads from MN_TRIGGER_EVENT_JSON."""
    logger = get_run_logger()
    bundle = load_bundle(bundle_path, overrides)
    flow_run_id = current_run.get_id()
    _, run_id = new_ids(run_id, flow_run_id, bundle.spec.job_name)  # (checks the run id)
    job_id = job_id_for(bundle.spec.job_name, run_id)  # one per run id
    # The run store the manifest's steps were given (MirrorNeuron's CLI names its shared storage) is where they
    # write: the runner's records and its human gate follow them there.
    root = resolve_runs_root(declared_runs_root(bundle) or runs_root)
    store = open_store(store_url) if store_url else open_store()
    own_node = None
    try:
        own = allocation(required=False)
        # Steps are placed in the pool's group (docs/operating.md, "Resource groups"); a local run, in this machine's
        # own group.
        group = pool or (own.group if own is not None else None)
        if own is not None:
            own_node = own.node
        else:  # not placed by an mn worker (a local run): this machine is the node
            from mn_prefect.drivers.launchers import this_node
            from mn_prefect.store.groups import reported_group

            local = this_node(logger)[0]
            registered = store.register_node(local.model_copy(update={"group": reported_group(local, pool, os.environ)}))
            own_node, group = registered.name, group or registered.group
            released = sweep_dead_runs(store)
            if released:
                logger.warning("released %d step booking(s) left by bundle runs that were killed", released)
        run_env = run_environment(bundle, job_id=job_id, run_id=run_id, runs_root=root)
        event = parse_trigger_parameter(trigger)
        if event is not None:
            run_env[TRIGGER_ENV] = json.dumps(event, sort_keys=True)
            logger.info("started by event %s %s", event.get("event"), event.get("id") or "")
        starter = PrefectStarter(bundle, store, job_id, run_env, own_node=own_node, pool=pool,
                                 bundle_path=str(bundle.root), overrides=overrides)
        logger.info("bundle %s: job %s, run %s, run store %s", bundle.spec.blueprint_id, job_id, run_id, root / run_id)
        run = BundleRun(bundle=bundle, store=store, starter=starter, job_id=job_id, run_id=run_id, runs_root=root,
                        preferred_node=own_node, group=group, logger=logger, flow_run_id=flow_run_id)
        gate = HumanGate(root / run_id, flow_run_id, lambda: get_client(sync_client=True), logger).start() \
            if flow_run_id else None
        offered = ServiceWatch(store, parse_services(bundle.document, Issues()), run_id=run_id, job_id=job_id,
                               node=own_node, logger=logger).start()
        try:
            outcome = run.run()
        finally:
            offered.stop()
            if gate is not None:
                gate.stop()
    finally:
        store.close()
    _publish(outcome, flow_run_id)
    result = outcome.as_json(flow_run_id)
    if outcome.state != "COMPLETED":
        from prefect.states import Failed

        # No data: Prefect reads a failed state's data as the exception it raises, and a dict is none (the steps
        # are in the run's table artifact and its run store).
        return Failed(message=f"workflow {outcome.state.lower()}: {failure_text(outcome.result)}"[:2000])
    return result


def _publish(outcome: RunOutcome, flow_run_id: str | None) -> None:
    """The steps as a table artifact on the run (what a person looks for first)."""
    if not flow_run_id:
        return
    from prefect.artifacts import create_table_artifact

    rows = [{"step": sid, "state": s["state"], "attempts": s["attempts"], "launches": s.get("launches", 0),
             "node": s.get("node") or "-", "reason": s.get("reason") or ""} for sid, s in outcome.steps.items()]
    try:
        create_table_artifact(rows, key=None, description=f"workflow {outcome.state}; run store {outcome.run_dir}")
    except Exception:  # visibility must never fail the run
        pass


def run_local(bundle_path: str | Path, *, run_id: str | None, runs_root: str | None,
              overrides: dict[str, Any] | None) -> State:
    """``blueprint run --local``: the flow in this process against this machine's own SQLite store; returns the
    flow run's final state (the run itself is in the store's ``WorkflowRecord``)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, temporary_settings

    # Prefect's settings were read before the CLI chose: without a server, allow the temporary one here.
    ephemeral = {PREFECT_SERVER_EPHEMERAL_ENABLED: True} if not os.environ.get("PREFECT_API_URL") else {}
    with temporary_settings(updates=ephemeral, restore_defaults={PREFECT_API_URL} if ephemeral else None):
        return bundle_run(str(bundle_path), run_id=run_id, runs_root=runs_root, overrides=overrides,
                          store_url=local_store_url(), return_state=True)
