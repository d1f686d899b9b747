"""The adapter that drives a workflow ``Engine``: each launch is placed by the scheduler (one booking per step
attempt, with its agent's ``resources``), started, and its booking released when it ends.

Decisions stay in ``mn_prefect.workflow``; this module only places, starts, waits and records. How a placed
launch starts is the ``Starter``'s business: a Prefect task run in this process when the launch is placed on
this node, a child flow run on the ``mn`` pool when it is placed on another node (``mn_prefect.bundles.flows``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, cast

from mn_prefect.bundles.bundle import Bundle, run_config
from mn_prefect.bundles.ids import job_id_for
from mn_prefect.bundles.process import CHECKPOINTS_FOLDER
from mn_prefect.model.bookings import StepAttempt
from mn_prefect.model.constraints import Constraint
from mn_prefect.model.containers import DOCKER
from mn_prefect.model.hints import allocation
from mn_prefect.model.names import follows_name_rule, name_rule, shown_name
from mn_prefect.model.placement import Placement
from mn_prefect.model.states import WorkflowOutcome, WorkflowStatus
from mn_prefect.placement import bookings, estimates
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler.ask import ask_for_agent
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import (
    RunControlRecord,
    StepSummary,
    WorkflowRecord,
    get_record,
    list_records,
    put_record,
    run_control_id,
)
from mn_prefect.workflow.engine import Engine, StepLaunch
from mn_prefect.workflow.protocol import ProcessResult, decode
from mn_prefect.workflow.readable import readable

POLL_S = 0.005
WAIT_LOG_S = 10.0
RECORD_EVERY_S = 0.2
PAUSE_READ_S = 1.0  # how often a run looks whether it was paused


class Handle(Protocol):
    def result(self) -> ProcessResult | None:
        """The launch's result once it ended, else None."""

    def cancel(self) -> None: ...


class Starter(Protocol):
    def __call__(self, launch: StepLaunch, placement: Placement, booking: str) -> Handle: ...


@dataclass
class RunOutcome:
    job_id: str
    run_id: str
    state: str  # COMPLETED | FAILED | CANCELLED
    steps: dict[str, dict[str, Any]]
    result: Any
    run_dir: str
    events: list[dict[str, Any]]

    def as_json(self, flow_run_id: str | None = None) -> dict[str, Any]:
        """The run as ``blueprint run --json`` prints it (``run_summary``)."""
        return run_summary(job_id=self.job_id, flow_run_id=flow_run_id, run_id=self.run_id, state=self.state,
                           steps=self.steps, result=self.result, run_dir=self.run_dir,
                           error=None if self.state == "COMPLETED" else failure_text(self.result))


# The keys of a bundle run as ``blueprint run --json`` prints it, in this order (docs/bundles.md, "What `--json`
# prints").
RUN_KEYS = ("job_id", "flow_run_id", "run_id", "state", "steps", "result", "error", "run_dir")


def run_summary(*, job_id: str, flow_run_id: str | None, run_id: str | None, state: str,
                steps: Mapping[str, StepSummary | dict[str, Any]], result: Any, run_dir: str | None,
                error: str | None = None) -> dict[str, Any]:
    """One bundle run as one object with the keys of ``RUN_KEYS``, the same on every path: each step with all of
    its fields, ``result`` the sink's output made readable (``readable``) once the run completed, ``error`` why it
    did not complete."""
    done = state == "COMPLETED"
    return {"job_id": job_id, "flow_run_id": flow_run_id, "run_id": run_id, "state": state,
            "steps": {k: StepSummary.model_validate(s).model_dump(mode="json") for k, s in steps.items()},
            "result": readable(result) if done else None,
            "error": None if done or state == "SCHEDULED" else (error or f"the run ended {state}"),
            "run_dir": run_dir}


def failure_text(result: Any) -> str | None:
    """Why a run failed, from the result it ended with (``{step_id or agent_id, error}``)."""
    if not isinstance(result, dict) or not result.get("error"):
        return None if result is None else json.dumps(result, default=str)[:2000]
    where = f"step {result['step_id']}: " if result.get("step_id") else (
        f"agent {result['agent_id']}: " if result.get("agent_id") else "")
    return f"{where}{result['error']}"


def pool_capacities(environ: dict[str, str]) -> dict[str, int]:
    """Executor pools (docs/bundles.md, "Executor pools"): ``MN_EXECUTOR_MAX_CONCURRENCY`` sizes ``default`` (50, as
    ``mn runtime start`` sets it), ``MN_EXECUTOR_POOL_CAPACITIES="gpu=1,..."`` adds pools."""
    pools = {"default": int(environ.get("MN_EXECUTOR_MAX_CONCURRENCY") or 50)}
    for item in (environ.get("MN_EXECUTOR_POOL_CAPACITIES") or "").split(","):
        name, sep, size = item.partition("=")
        if sep and name.strip() and size.strip().isdigit():
            pools[name.strip()] = int(size)
    return pools


def run_environment(bundle: Bundle, *, job_id: str, run_id: str, runs_root: Path) -> dict[str, str]:
    """Variables every step of a run gets (what MirrorNeuron's CLI injects at submission; docs/bundles.md,
    "Environment")."""
    spec = bundle.spec
    return {"MN_RUN_ID": run_id, "MN_RUNS_ROOT": str(runs_root), "MN_BLUEPRINT_ID": spec.blueprint_id,
            "MN_BLUEPRINT_REVISION": spec.revision or "", "MN_JOB_NAME": spec.job_name,
            "MN_BLUEPRINT_CONFIG_JSON": json.dumps(run_config(bundle, run_id, runs_root), sort_keys=True)}


# -- resuming: the launches a flow run's earlier attempts finished ------------------------------------------------

JOURNAL_FILE = "mn_launches.jsonl"  # in the run's folder


def launch_key(launch: StepLaunch) -> str:
    """What names a launch across the attempts of one flow run: its agent, its message (whose id is derived from
    the run id and the messages before it, so the same on every attempt), its step and attempt, and its body."""
    ctx = launch.context
    body = json.dumps(launch.message.body, sort_keys=True, default=str)
    named = json.dumps([launch.agent_id, launch.message.message_id, launch.step_id,
                        ctx.attempt if ctx is not None else None, body], default=str)
    return hashlib.sha256(named.encode()).hexdigest()[:32]


class LaunchJournal:
    """The launches of a flow run that completed, one JSON line each in the run's folder (``mn_launches.jsonl``),
    so that the flow run's next attempt (after a preemption, or a node lost) does not run them again: the engine
    is deterministic, so replaying their recorded results in the order it asks for them rebuilds the step ledger,
    the agents' state and every message sent, and what was not finished runs again. Only lines of the same flow
    run count (a new flow run with the same ``--run-id`` runs everything); a launch that failed, or that was
    stopped with the run, is not recorded, so it runs again."""

    def __init__(self, path: Path, flow_run_id: str, logger: logging.Logger | logging.LoggerAdapter | None = None):
        self.path, self.flow_run_id = path, flow_run_id
        self._logger = logger or logging.getLogger("mn_prefect")
        self._done: dict[str, list[dict[str, Any]]] = {}
        for line in _lines(path):
            try:
                entry = json.loads(line)
            except ValueError:  # a line cut short when its writer was killed
                continue
            if isinstance(entry, dict) and entry.get("flow_run_id") == flow_run_id and \
                    isinstance(entry.get("key"), str) and isinstance(entry.get("result"), dict):
                self._done.setdefault(entry["key"], []).append(entry["result"])

    def __len__(self) -> int:
        return sum(len(results) for results in self._done.values())

    def take(self, launch: StepLaunch) -> ProcessResult | None:
        """The recorded result of ``launch`` from an earlier attempt of this flow run (each is used once), else
        None: it must run."""
        results = self._done.get(launch_key(launch))
        if not results:
            return None
        try:
            return ProcessResult.from_json(results.pop(0))
        except (TypeError, ValueError):
            return None

    def record(self, launch: StepLaunch, result: ProcessResult) -> None:
        """Keep ``launch``'s result for the next attempt (a write error loses it: the step would run again)."""
        ctx = launch.context
        entry = {"flow_run_id": self.flow_run_id, "key": launch_key(launch), "label": launch.label,
                 "agent_id": launch.agent_id, "message_id": launch.message.message_id,
                 "attempt": ctx.attempt if ctx is not None else None, "launch": launch.id,
                 "recorded_at": time.time(), "result": result.as_json()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as out:
                out.write(json.dumps(entry, sort_keys=True, default=str) + "\n")
                out.flush()
                os.fsync(out.fileno())
        except OSError as error:
            self._logger.warning("could not record step %s as done (%s): it would run again after a preemption",
                                 launch.label, error)


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


@dataclass
class _Active:
    launch: StepLaunch
    booking: str
    handle: Handle
    node: str
    booked_at: float  # epoch seconds: its booking's commit (an inline starter returns once the step is over)


def preemptible_fields(driver: Placement | None) -> dict[str, object]:
    """What a step's booking carries of its run's own placement (``driver``, from ``MN_ALLOCATION_JSON``) when the
    run is preemptible: its priority and minimum runtime, so that a preemption that evicts the run counts what its
    steps hold as freed too (their queue is not stamped: the run's queue is charged for the run's own booking)."""
    if driver is None or not driver.preemptible:
        return {}
    return {"preemptible": True, "priority": driver.priority, "min_runtime_s": driver.min_runtime_s}


@dataclass
class BundleRun:
    """One run of a bundle: the engine, the store it books in, and how launches start."""

    bundle: Bundle
    store: ClusterStore
    starter: Starter
    job_id: str
    run_id: str
    runs_root: Path
    preferred_node: str | None = None
    group: str | None = None  # the resource group its steps are placed in (None: any node)
    logger: logging.Logger | logging.LoggerAdapter = field(default_factory=lambda: logging.getLogger("mn_prefect"))
    on_change: Callable[[BundleRun], None] | None = None
    flow_run_id: str | None = None
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        import os

        self.engine = Engine(self.bundle.spec, job_id=self.job_id, run_id=self.run_id,
                             pools=pool_capacities(dict(os.environ)))
        self.active: dict[int, _Active] = {}
        self.waiting: list[StepLaunch] = []
        self._waiting_logged: dict[int, float] = {}
        self._estimates: dict[str, float | None] = {}  # by step label: seconds, or None (unknown)
        self.run_dir = self.runs_root / self.run_id
        self._recorded = 0.0
        self._control_read, self._pause_seen = -PAUSE_READ_S, False
        self.journal = LaunchJournal(self.run_dir / JOURNAL_FILE, self.flow_run_id, self.logger) \
            if self.flow_run_id else None
        self.resumed: list[str] = []  # the labels of the launches taken from an earlier attempt, in order
        self._preemptible = preemptible_fields(allocation(dict(os.environ), required=False))
        agents = {a.agent_id: a for a in self.bundle.spec.blueprint.agents}
        services = tuple(s for s in self.bundle.spec.blueprint.required_services if s.required)
        self._asks = {aid: _in_its_runner(ask_for_agent(a, self.bundle.spec.blueprint.constraints, services),
                                          self.bundle.spec.agents[aid].image is not None)
                      for aid, a in agents.items()}

    # -- the loop -----------------------------------------------------------------------------------------

    def run(self) -> RunOutcome:
        engine = self.engine
        problems = engine.pool_problems()
        self._record("running")
        try:
            if problems:
                engine.start(self.clock())
                engine._fail({"agent_id": None, "error": "; ".join(problems)}, self.clock())
            else:
                engine.start(self.clock())
            unrecorded = False
            if self.journal is not None and len(self.journal):
                self.logger.info("run %s resumes: %d launch(es) of its earlier attempts completed and are not run "
                                 "again", self.run_id, len(self.journal))
            while not engine.done:
                resumed = self._resume(engine.take(self.clock()))
                started = not self._paused() and self._place_waiting()
                progressed = self._collect() or started or resumed
                engine.tick(self.clock())
                unrecorded = unrecorded or progressed  # a change waits at most RECORD_EVERY_S for the store
                if unrecorded and time.monotonic() - self._recorded > RECORD_EVERY_S:
                    self._record("running")
                    unrecorded = False
                if self.on_change and progressed:
                    self.on_change(self)
                if not progressed and not engine.done:
                    time.sleep(POLL_S)
        except BaseException as error:  # cancelled (TerminationSignal) or interrupted: end cleanly, then re-raise
            engine.cancel(self.clock(), f"the run was stopped: {type(error).__name__}")
            raise
        finally:
            self._stop_all()
            self._write_run_dir()
            self._record(cast(WorkflowStatus, engine.status))
            if self.on_change:
                self.on_change(self)
        self._drop_checkpoints()
        return self.outcome()

    def _drop_checkpoints(self) -> None:
        """The run is over for good (completed, failed or cancelled by its workflow; an attempt that is stopped,
        to be scheduled again, never gets here): its steps' checkpoint folders (MN_CHECKPOINT_DIR) are removed from
        its run store; the rest of its run folder stays."""
        folder = self.run_dir / CHECKPOINTS_FOLDER
        if folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            self.logger.info("run %s is over: its steps' checkpoints (%s) are removed", self.run_id, folder)

    def outcome(self) -> RunOutcome:
        state = {"completed": "COMPLETED", "failed": "FAILED", "cancelled": "CANCELLED"}.get(self.engine.status,
                                                                                             "RUNNING")
        return RunOutcome(job_id=self.job_id, run_id=self.run_id, state=state, steps=self.engine.steps_summary(),
                          result=self._result(), run_dir=str(self.run_dir), events=self.engine.events)

    def _result(self) -> Any:
        result = self.engine.result
        if self.engine.status == "completed" and isinstance(result, dict):
            return result.get("output")  # the sink's output; the whole record is in the run dir
        return result

    # -- placing and starting -----------------------------------------------------------------------------

    def _resume(self, launches: list[StepLaunch]) -> bool:
        """Finish the launches an earlier attempt of this flow run completed with their recorded results; the others
        wait to be placed. True when one was finished so."""
        finished = False
        for launch in launches:
            result = self.journal.take(launch) if self.journal is not None else None
            if result is None:
                self.waiting.append(launch)
                continue
            self.logger.info("step %s completed in an earlier attempt of this run (on %s): not run again",
                             launch.label, result.node or "?")
            self.resumed.append(launch.label)
            self.engine.finish(launch, result, self.clock())
            finished = True
        return finished

    def _paused(self) -> bool:
        """Whether an operator paused this run (``mn job pause``): then no new step starts. Read at most once
        a second."""
        if time.monotonic() - self._control_read < PAUSE_READ_S:
            return self._pause_seen
        self._control_read = time.monotonic()
        control = get_record(self.store, run_control_id(self.run_id), RunControlRecord)
        paused = control is not None and control.status == "paused"
        if paused != self._pause_seen:
            what = f"paused ({control.reason}): no new step starts until it is resumed" if paused and control \
                else "resumed"
            self.logger.warning("run %s %s", self.run_id, what)
            self._pause_seen = paused
            self._record("running")  # the pause's answer: its record says the run holds (or no longer)
        return paused

    def _place_waiting(self) -> bool:
        """Place and start what waits and fits; True when a step started."""
        started = False
        for launch in list(self.waiting):
            ask = self._asks[launch.agent_id]
            if self.preferred_node and not ask.preferred_node:
                ask = _with_preferred(ask, self.preferred_node)
            booking = str(StepAttempt(self.job_id, str(launch.id)))
            seconds = self._estimate(launch)
            update = {**self._preemptible, **({"ends_by": time.time() + seconds} if seconds is not None else {})}
            placed = place_and_commit(self.store, booking, [_renamed(ask, launch.label)],
                                      strategy=self.bundle.spec.blueprint.strategy, group=self.group,
                                      update=update or None)
            commit = placed.commit
            if commit is not None and commit.ok:  # placed.placed
                booked_at = time.time()
                self.waiting.remove(launch)
                placement = commit.placements[0]
                if getattr(self.starter, "inline", False):  # it returns when the step is over: say it runs first
                    self._record("running")
                try:
                    handle = self.starter(launch, placement, booking)
                except Exception as error:
                    bookings.release(self.store, bookings.parse(booking), "step_ended")
                    self.engine.finish(launch, ProcessResult(exit_code=1, stdout="", stderr="",
                                                             refused=f"could not start: {error}"), self.clock())
                    continue
                self.active[launch.id] = _Active(launch, booking, handle, placement.node, booked_at)
                started = True
                continue
            plan = placed.plan
            if plan.status == "not_runnable":
                self.waiting.remove(launch)
                self.engine.finish(launch, ProcessResult(exit_code=1, stdout="", stderr="",
                                                         refused=f"no node can ever take it: {plan.reason}"),
                                   self.clock())
            elif self.clock() - self._waiting_logged.get(launch.id, 0) > WAIT_LOG_S:
                self._waiting_logged[launch.id] = self.clock()
                self.logger.warning("step %s waits for capacity: %s", launch.label, plan.reason)
        return started

    def _collect(self) -> bool:
        progressed = False
        for launch_id, active in list(self.active.items()):
            result = active.handle.result()
            if result is None:
                continue
            progressed = True
            del self.active[launch_id]
            bookings.release(self.store, bookings.parse(active.booking), "step_ended")
            if result.ok:  # a completed attempt teaches its step's estimate; a failed one is no sample
                self._learn_runtime(active, time.time() - active.booked_at)
            result.node = result.node or active.node
            self.engine.finish(active.launch, result, self.clock())
            if self.journal is not None and self._completed(active.launch, result):
                self.journal.record(active.launch, result)
        return progressed

    def _completed(self, launch: StepLaunch, result: ProcessResult) -> bool:
        """Whether ``launch`` (just finished) is one the next attempt of the flow run takes as done: it succeeded,
        its output says no error and its step's attempt did not fail by it. A failed launch runs again."""
        if not result.ok or self.engine.status == "failed" or decode(result.stdout).error is not None:
            return False
        ctx = launch.context
        step = self.engine.ledger.steps.get(launch.step_id) if launch.step_id else None
        if step is None or ctx is None or ctx.attempt is None:
            return True
        return not any(a.get("attempt") == ctx.attempt and a.get("outcome") == "failed" for a in step.attempts)

    def _estimate(self, launch) -> float | None:
        """How long the step's attempt is expected to hold its booking: what the step's past attempts took (learned;
        read once per step, again after each it completes), never past its timeout (the step is stopped there: a
        bound that always holds, and the estimate while nothing is learned), else unknown. Its booking's ``ends_by``
        says it to holds reckoning when a busy node frees; a store error leaves only the timeout."""
        label = launch.label
        if label not in self._estimates:
            try:
                key = estimates.step_key(self.bundle.spec.blueprint_id, label)
                self._estimates[label] = estimates.estimate_for(self.store, key).seconds
            except Exception as error:
                self.logger.debug("no estimate for step %s: %s", label, error)
                self._estimates[label] = None
        known = [s for s in (self._estimates[label], launch.timeout_s) if s is not None]
        return float(min(known)) if known else None

    def _learn_runtime(self, active: _Active, seconds: float) -> None:
        """Record that ``active``'s attempt held its booking ``seconds`` (commit to release) under its step's key;
        a store error loses the sample, never the run."""
        try:
            estimates.record_duration(self.store, estimates.step_key(self.bundle.spec.blueprint_id,
                                                                     active.launch.label), seconds)
            self._estimates.pop(active.launch.label, None)  # read again with this sample
        except Exception as error:
            self.logger.debug("did not record step %s's runtime: %s", active.launch.label, error)

    def _stop_all(self) -> None:
        for active in list(self.active.values()):
            try:
                active.handle.cancel()
            except Exception as error:  # cleanup goes on: every booking below is released regardless
                self.logger.warning("could not stop step %s: %s", active.launch.label, error)
            bookings.release(self.store, bookings.parse(active.booking), "bundle_ended")
        self.active.clear()
        self.waiting.clear()

    # -- records ------------------------------------------------------------------------------------------

    def _record(self, status: WorkflowStatus) -> None:
        """The run's record in the store: how ``job status`` and a sweep after a crash find it."""
        self._recorded = time.monotonic()
        done = self.engine.done
        steps = {k: StepSummary.model_validate(v) for k, v in self.engine.steps_summary().items()}
        put_record(self.store, WorkflowRecord(
            job_id=self.job_id, job_name=self.bundle.spec.job_name, status=status, run_id=self.run_id,
            run_dir=str(self.run_dir), pid=os.getpid(), host=socket.gethostname(), flow_run_id=self.flow_run_id,
            bundle=str(self.bundle.root), steps=steps, held=self._pause_seen and not done,
            state=cast(WorkflowOutcome, self.outcome().state) if done else None,
            result=self._result() if done else None))

    def _write_run_dir(self) -> None:
        """The runtime's own events and job record beside what the workers wrote (docs/bundles.md, "Run store and
        events")."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        events = self.engine.events
        with open(self.run_dir / "runtime_events.jsonl", "w") as out:
            for event in events:
                out.write(json.dumps(event, sort_keys=True, default=str) + "\n")
        worker_events = self.run_dir / "events.jsonl"
        seen = worker_events.read_text() if worker_events.exists() else ""
        with open(worker_events, "a") as out:
            for event in events:
                line = json.dumps({"run_id": self.run_id, "source": "runtime", **event}, sort_keys=True, default=str)
                if line not in seen:
                    out.write(line + "\n")
        job = {"job_id": self.job_id, "run_id": self.run_id, "status": self.engine.status,
               "blueprint_id": self.bundle.spec.blueprint_id, "result": self.engine.result,
               "steps": self.engine.steps_summary()}
        (self.run_dir / "mn_job.json").write_text(json.dumps(job, indent=2, sort_keys=True, default=str))


def sweep_dead_runs(store: ClusterStore) -> int:
    """Release the step bookings of bundle runs on this host whose process is gone (killed mid-run), so a
    crash never leaves a device booked; returns how many bookings were released."""
    released = 0
    host = socket.gethostname()
    for record in list_records(store, WorkflowRecord, status="running"):
        if record.host != host or _alive(record.pid):
            continue
        for job_id in {p.job_id for p in store.active_placements() if p.job_id and
                       p.job_id.startswith(f"{record.job_id}#")}:
            released += bookings.release(store, bookings.parse(job_id), "bundle_ended")
        record.status = "crashed"
        put_record(store, record)
    return released


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return True  # not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _in_its_runner(ask, in_container: bool):
    """A DockerWorker agent's step needs a node whose worker can start containers (one offering docker)."""
    if not in_container:
        return ask
    return replace(ask, constraints=(*ask.constraints, Constraint(attribute="runtime_drivers", operator="contains",
                                                                  value=DOCKER)))


def _renamed(ask, label: str):
    return replace(ask, agent_id=label)


def _with_preferred(ask, node: str):
    return replace(ask, preferred_node=node)


def run_id_issue(run_id: str) -> str | None:
    """Why ``run_id`` cannot name a run (its folder in the run store must stay inside it), or None."""
    if follows_name_rule(run_id):
        return None
    return f"{shown_name(run_id)} is not a run id: {name_rule()} (it names a folder of the run store)"


def new_ids(run_id: str | None, flow_run_id: str | None, job_name: str) -> tuple[str, str]:
    """(job id, run id): the run id is ``--run-id``, else the flow run's id (docs/bundles.md, "Run store and
    events"). Raises ValueError naming run_id when it could leave the run store."""
    if run_id and (why := run_id_issue(run_id)):
        raise ValueError(f"run_id: {why}")
    run_id = run_id or flow_run_id or str(uuid.uuid4())
    return job_id_for(job_name, run_id), run_id
