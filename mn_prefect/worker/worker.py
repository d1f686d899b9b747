"""The ``mn`` worker type: places each flow run of its pool on a node of the cluster, books it in the store,
runs the runs placed on its own node as subprocesses with the env hints, and releases the booking after.

Protocol (docs/prefect.md, "What happens to a run"; docs/architecture.md, "Design notes"): every worker registers its
node and heartbeats; every worker may place any Scheduled run of the pool (the store's atomic commit, keyed by the run
id, makes exactly one placement stand); only the worker of the chosen node proposes Pending and runs it. The store, not
the run's job variables, is the source of truth for the allocation.

Who says what, once: the worker whose commit created a booking announces it (artifact, committed event);
the worker that wins a blueprint agent's Pending attaches that agent's artifact; one worker per pool (the
holder of the pool's announcer lease) reports runs that wait and fails runs no node can ever take.

System and sysbatch runs (``mn_prefect.worker.system``): one commit books a copy on every node where it fits;
the worker that made it creates a flow run for each node but the run's own, and each copy releases only its
node's part when it ends.

``MNWorker`` translates between Prefect and the parts of the worker, each given what it needs:
``membership.Membership`` (store, node registration, heartbeat, announcer lease, SIGTERM, leaving),
``routing.Router`` (which node a polled run goes to, placing it), ``releasing.Releaser`` (every release and
deallocation), ``wakeups.Wakeups`` (a store change or a new run polls at once), ``services.ServiceProbes`` (node service
checks) and ``sweeps.Sweeps`` (this node's bookings, runs whose end never reached the server). What to do is
decided by the pure rules of ``mn_prefect.worker.decisions``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple, ParamSpec, TypeVar

import anyio
import anyio.to_thread
from prefect.exceptions import InfrastructureNotFound, ObjectNotFound, Pause
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker, ProcessWorkerResult

from mn_prefect import notify
from mn_prefect.blocks import readme_url
from mn_prefect.drivers import docker as docker_io
from mn_prefect.drivers.launchers import DOCKER_PID_PREFIX, Launcher, LaunchRefused, this_node
from mn_prefect.lifecycle.settings import device_sample_s, orphan_pending_s
from mn_prefect.model.issues import InvalidInput
from mn_prefect.model.node import NodeRecord
from mn_prefect.placement.placing import Placer
from mn_prefect.preemption import run_folder
from mn_prefect.store import ClusterStore
from mn_prefect.store.urls import STORE_URL_VAR
from mn_prefect.worker import decisions, device_watch, metrics, visibility
from mn_prefect.worker.api_retries import RetryingClient, call_with_retries
from mn_prefect.worker.launching import Launching, PausedBeforeStart, propose_pending, run_environment
from mn_prefect.worker.membership import (
    ANNOUNCER_LEASE_SECONDS,
    HEARTBEAT_SECONDS_VAR,
    STOP_DEADLINE_SECONDS,
    STOP_STEP_SECONDS,
    STORE_BLOCK_VAR,
    STORE_START_WAIT_SECONDS,
    STORE_START_WAIT_VAR,
    Membership,
)
from mn_prefect.worker.releasing import Releaser
from mn_prefect.worker.routing import Remembered, Router, copy_of, invalid_configuration
from mn_prefect.worker.services import ServiceProbes
from mn_prefect.worker.sweeps import Sweeps
from mn_prefect.worker.variables import MNJobConfiguration, MNVariables
from mn_prefect.worker.wakeups import WAKEUP_GATHER_SECONDS, WAKEUP_WAIT_SECONDS, Wakeups
from mn_prefect.worker.warm_start import WarmLaunchers, run_warm

# Kept importable from here, where they were defined before the worker was split.
__all__ = ["ANNOUNCER_LEASE_SECONDS", "HEARTBEAT_SECONDS_VAR", "STOP_DEADLINE_SECONDS", "STOP_STEP_SECONDS",
           "STORE_BLOCK_VAR", "STORE_START_WAIT_SECONDS", "STORE_START_WAIT_VAR", "WAKEUP_GATHER_SECONDS",
           "WAKEUP_WAIT_SECONDS", "MNWorker", "propose_pending"]
_invalid_configuration = invalid_configuration

_P = ParamSpec("_P")
_T = TypeVar("_T")



class _Logger:
    """The worker's logger as it is at each use: Prefect replaces it once the server gives the worker its id."""

    def __init__(self, worker: MNWorker):
        self._worker = worker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker._logger, name)


class _Parts(NamedTuple):
    """What setup() makes of the store and the node."""

    placer: Placer
    router: Router
    releaser: Releaser
    sweeps: Sweeps
    launching: Launching


class MNWorker(ProcessWorker):
    type = "mn"
    job_configuration = MNJobConfiguration
    # Prefect annotates this as ``type[ProcessVariables] | None`` in a class body whose ``type`` is a str
    # attribute, so mypy reads that annotation as None.
    job_configuration_variables = MNVariables  # type: ignore[assignment]
    _description = ("Resource-aware placement across machines: each run goes to a node that has the CPU, memory, "
                    "GPUs, ports and volumes it asks for, booked atomically; runs there as a process or, with "
                    "runtime_driver docker, as a container with the booking enforced.")
    _display_name = "mn (resource-aware)"
    # The README's section on the worker once pyproject declares the project's URL, else "" (Prefect's default);
    # no logo: the project has none, and Prefect's would say this worker is Prefect's.
    _documentation_url = readme_url("using-it-with-prefect") or ""
    _logo_url = ""

    def __init__(self, *args: Any, **kwargs: Any):
        self._api: RetryingClient | None = None
        super().__init__(*args, **kwargs)
        self._store_lock = threading.Lock()
        self._membership = Membership(pool=self._work_pool_name, logger=_Logger(self), store_lock=self._store_lock,
                                      in_store=self._in_store, client=lambda: self.client,
                                      work_pool=lambda: self._work_pool)
        self._remembered = Remembered()
        self._running: set[str] = set()
        self._handed_over: set[Any] = set()
        self._paused_before_start: set[Any] = set()  # runs paused between their Pending and Prefect's Submitting
        self._stopping = False
        self._store_env: dict[str, str] = {}
        self._parts: _Parts | None = None  # made by setup()
        self._poll_lock: anyio.Lock | None = None  # one poll at a time, the loop's or a wake-up's (setup makes it)
        self._scheduled_ids: set[str] = set()  # the pool's Scheduled runs in the last poll
        self._warm: WarmLaunchers | None = None  # the warm launchers (setup starts the pool's)

    @property
    def store(self) -> ClusterStore | None:
        """The cluster store, once setup() opened it."""
        return self._membership.store

    @property
    def node(self) -> NodeRecord | None:
        """This worker's node, once setup() registered it."""
        return self._membership.node

    @property
    def _node(self) -> NodeRecord:
        """This worker's node, as registered in the store by setup()."""
        if self.node is None:
            raise RuntimeError("the mn worker has no node yet: setup() has not run")
        return self.node

    @property
    def _part(self) -> _Parts:
        if self._parts is None:
            raise RuntimeError("the mn worker has no placer yet: setup() has not run")
        return self._parts

    @property
    def _router(self) -> Router:
        return self._part.router

    @property
    def _releaser(self) -> Releaser:
        return self._part.releaser

    @property
    def _task_group(self) -> anyio.abc.TaskGroup:
        """Prefect's task group for the runs and their side tasks (there while the worker is started)."""
        if self._runs_task_group is None:
            raise RuntimeError("the mn worker is not started: it has no task group for runs")
        return self._runs_task_group

    @property
    def client(self):
        """Prefect's client, with the worker's reads, state proposals and run updates retried on transient API
        errors (api_retries): used by this class and by the base worker's submission alike."""
        inner = super().client
        if self._api is None or self._api.inner is not inner:
            self._api = RetryingClient(inner, self._logger)
        return self._api

    async def _give_worker_labels_to_flow_run(self, flow_run_id) -> None:
        """The worker's labels on the run, retried; labels are attribution only, so a failure is a warning
        (the base worker lets it mark the run Crashed)."""
        try:
            await call_with_retries(lambda: super(MNWorker, self)._give_worker_labels_to_flow_run(flow_run_id),
                                    what="update_flow_run_labels", logger=self._logger)
        except Exception as error:
            self._logger.warning("could not label run %s with this worker; it runs unlabelled: %s", flow_run_id, error)

    # -- lifecycle --------------------------------------------------------------------------------------

    async def setup(self) -> None:
        membership = self._membership
        membership.stop_on_sigterm()  # first: once the node is registered, a SIGTERM must stop it
        await super().setup()
        local, launchers = await anyio.to_thread.run_sync(this_node, self._logger)
        store = await membership.open_store()
        await membership.create_pool_group()
        # Runs of this pool go to nodes of its group only; each poll invalidates the view before it refuses.
        placer = Placer(store, group=self._work_pool_name, reread="on_invalidate")
        # Runs (blueprint coordinators above all) open the worker's own store, even when it came from a block.
        self._store_env = {STORE_URL_VAR: store.url.raw}
        node = await membership.register(local)
        try:
            await self._set_up_parts(store, placer, node, launchers)
        except BaseException:  # a SIGTERM (or a failure) after the node registered: it leaves, as a stop would
            await membership.leave()
            raise

    async def _set_up_parts(self, store: ClusterStore, placer: Placer, node: NodeRecord,
                            launchers: dict[str, Launcher]) -> None:
        membership, pool = self._membership, self._work_pool_name
        common: dict[str, Any] = dict(store=store, placer=placer, node=node.name, in_store=self._in_store,
                                      client=lambda: self.client, work_pool=lambda: self._work_pool,
                                      logger=_Logger(self), run_logger=self.get_flow_run_logger)
        releaser = Releaser(forget=self._remembered.forget, **common)
        router = Router(remembered=self._remembered, releaser=releaser, template=lambda: self.work_pool.base_job_template,
                        start_soon=lambda fn, *args: self._task_group.start_soon(fn, *args),
                        is_announcer=membership.is_announcer, **common)
        try:
            orphan_grace_s = orphan_pending_s(os.environ)
        except InvalidInput as error:
            await membership.refuse_start(error)
        sweeps = Sweeps(pool=pool, busy=self._busy, release=releaser.release, release_part=releaser.release_part,
                        orphan_grace_s=orphan_grace_s, **common)
        launching = Launching(launchers=launchers, store_env=self._store_env, node=lambda: self._node,
                              client=lambda: self.client, work_pool=lambda: self._work_pool, logger=_Logger(self),
                              run_logger=self.get_flow_run_logger)
        self._parts = _Parts(placer, router, releaser, sweeps, launching)
        self._warm = WarmLaunchers(logger=_Logger(self), node=node.name)
        if self._pool_default("warm_start", False):
            self._warm.start(tuple(self._pool_default("preload", [])))  # in the background: nothing waits on it
        if "docker" in launchers:
            await launching.sweep_orphaned_containers()
        membership.start()
        # The sweeps, on a timer of their own once the announcer lease can be checked.
        self._spawn(sweeps.every_few_seconds, lambda: self._scheduled_ids, lambda: self._stopping,
                    membership.is_announcer, router.preempter.pool_pass,
                    functools.partial(router.preempter.node_pass, node.name))
        self._spawn(functools.partial(
            device_watch.watch, store=store, node=node.name, in_store=self._in_store, policy=router.rules.policy,
            collector=device_watch.collector_for(node.name), every_s=device_sample_s(),
            stopping=lambda: self._stopping, logger=_Logger(self)))
        await metrics.serve(store, node, pool, self._in_store, _Logger(self))  # /metrics when MN_METRICS_PORT is set
        self._poll_lock = anyio.Lock()
        await Wakeups(store=store, placer=placer, node=node.name, poll=self.get_and_submit_flow_runs,
                      stopping=lambda: self._stopping, scheduled_seen=lambda: len(self._scheduled_ids), spawn=self._spawn,
                      logger=_Logger(self), run_logger=self.get_flow_run_logger,
                      pool_id=lambda: getattr(self._work_pool, "id", None)).start()
        if any(service.check is not None for service in node.services):
            probes = ServiceProbes(store=store, node=node, in_store=self._in_store, logger=_Logger(self),
                                   published=membership.node_changed)
            self._spawn(probes.run)

    def _pool_default(self, name: str, default: Any) -> Any:
        """A job variable's default in this pool's template; ``default`` while the pool is not known (a worker
        started while the Prefect API is away: its first warm run starts the launcher it needs)."""
        if self._work_pool is None:
            return default
        try:
            return self._work_pool.base_job_template["variables"]["properties"][name].get("default", default)
        except (AttributeError, KeyError, TypeError):
            return default

    def _spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Start ``fn(*args, scope)`` in the runs' task group; Prefect's teardown cancels ``scope`` before it
        closes the task group."""
        scope = anyio.CancelScope()
        self._scheduled_task_scopes.add(scope)
        self._task_group.start_soon(functools.partial(fn, *args, scope))

    async def teardown(self, *exc_info: Any) -> None:
        """The stop (SIGTERM or SIGINT: ``prefect worker start`` turns both into cancelling the worker): no more
        polls or heartbeats, the node leaves the cluster, then Prefect's teardown cancels what is in flight.

        A run this worker was launching that never reached Running goes back to Scheduled, unbooked
        (``Router.put_back``). Runs that reached Running keep their bookings and their Running state: Prefect
        ends those processes with the worker, and a stopped worker is a lost node to the cluster, so
        reconcile applies each run's recovery_mode once the node is offline (or this node's sweep, when its
        worker is back, releases what ended). Releasing here could hand a GPU to the next run while a
        process that ignores SIGTERM still holds it.
        """
        self._stopping = True
        await self._membership.leave()
        try:
            await super().teardown(*exc_info)
        finally:
            if self._warm is not None:
                self._warm.close()  # runs it started keep going (their keepers report them), as cold ones do

    def _busy(self) -> set[str]:
        """The ids of the runs this worker is submitting or running now: no sweep judges them."""
        return self._running | {str(i) for i in self._submitting_flow_run_ids}

    async def _in_store(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Store calls are blocking: run them in a thread, one at a time (the Placer is not thread-safe)."""
        def call() -> _T:
            with self._store_lock:
                return fn(*args, **kwargs)
        return await anyio.to_thread.run_sync(call)

    async def get_and_submit_flow_runs(self):
        """One poll at a time, the loop's or a wake-up's: two at once would place the same runs twice over."""
        async with self._poll_lock or contextlib.nullcontext():
            return await super().get_and_submit_flow_runs()

    async def _get_scheduled_flow_runs(self):
        runs = await super()._get_scheduled_flow_runs()
        self._scheduled_ids = {str(run.flow_run.id) for run in runs}
        return runs

    # -- placement --------------------------------------------------------------------------------------

    async def _submit_scheduled_flow_runs(self, flow_run_response):
        submitted = []
        if self._stopping:
            return submitted  # a poll that was under way when the stop began places and starts nothing
        router = self._router
        # Anything may have changed since the last poll (another process released, a reservation ended, a node
        # came back): this poll's first refusal re-reads the store before the run is told to wait or failed.
        self._part.placer.invalidate()
        flow_run_response = await router.in_order(flow_run_response)  # who goes next: priority, then fair share
        for entry in flow_run_response:
            if self._stopping:
                break
            flow_run = entry.flow_run
            # Prefect 3.8 does not skip runs this worker is already submitting: do it here.
            if flow_run.id in self._submitting_flow_run_ids:
                continue
            try:
                node = await router.placement_node(flow_run)
            except Exception as error:  # one run's failure never stops the poll: said on the run, tried again
                await router.placement_failed(flow_run, error)
                continue
            if node == self._node.name:
                # Submit at once rather than after placing the whole batch: placement must not delay starts.
                submitted += await super()._submit_scheduled_flow_runs([entry])
        return submitted

    async def _propose_pending_state(self, flow_run) -> bool:
        """Pending, with the placement as the state message: visible on the run at no extra API call."""
        logger = self.get_flow_run_logger(flow_run)
        config = self._remembered.configs.get(flow_run.id)
        booking = config.booking if config is not None else None
        if booking:
            placement = await self._router.booked(booking)
        else:
            placement = await self._router.own_placement(flow_run, config)
        message = visibility.message(placement) if placement is not None else None
        state = await propose_pending(self.client, flow_run.id, message, logger)
        if state is None:
            return False
        if state.is_pending() and booking and placement is not None:
            # The job booked this agent, not a worker: the one worker that wins the agent run's Pending shows it.
            self._task_group.start_soon(self._router.show, flow_run, placement)
        return state.is_pending()

    async def _submit_run(self, flow_run) -> None:
        try:
            await super()._submit_run(flow_run)
        except anyio.get_cancelled_exc_class():
            if flow_run.id not in self._handed_over:  # stopped before the launch task began: nothing else will
                with anyio.move_on_after(STOP_STEP_SECONDS, shield=True):
                    await self._router.put_back(flow_run)
            raise
        except Exception:
            # Only the deployment read before Pending raises here (after retries): the run is still Scheduled
            # and booked, so the next poll submits it again. Raised, it would end the worker's task group.
            self.get_flow_run_logger(flow_run).exception("could not submit flow run %s; the next poll tries again",
                                                         flow_run.id)
            self._release_limit_slot(flow_run.id)
            self._submitting_flow_run_ids.discard(flow_run.id)
            if self._cancelling_observer is not None:
                self._cancelling_observer.remove_in_flight_flow_run_id(flow_run.id)

    async def _propose_submitting_state(self, flow_run) -> None:
        """Prefect's Submitting state, proposed between Pending and the launch. A run paused in between (the
        reconcile paused it: its node was lost) is not started: ``run`` leaves it and its booking to the recovery
        that paused it. Prefect raises the server's refusal as ``Pause``, which would end the worker."""
        try:
            await super()._propose_submitting_state(flow_run)
        except Pause as paused:
            self._paused_before_start.add(flow_run.id)
            self.get_flow_run_logger(flow_run).info("mn: not started: the run was paused before it started (%s)",
                                                    paused)

    async def _submit_run_and_capture_errors(self, flow_run, task_status=None):
        self._handed_over.add(flow_run.id)
        try:
            return await super()._submit_run_and_capture_errors(flow_run, task_status)
        except anyio.get_cancelled_exc_class():
            # Unwinding has ended the flow process (Prefect's process manager): judge the run now.
            with anyio.move_on_after(STOP_STEP_SECONDS, shield=True):
                await self._router.put_back(flow_run)
            raise
        finally:
            self._handed_over.discard(flow_run.id)

    # -- running and releasing --------------------------------------------------------------------------

    async def run(self, flow_run, configuration: ProcessJobConfiguration, task_status=None) -> ProcessWorkerResult:
        if not isinstance(configuration, MNJobConfiguration):  # the base worker builds it from job_configuration
            raise TypeError(f"an mn worker runs an MNJobConfiguration, not a {type(configuration).__name__}")
        job_id = str(flow_run.id)
        if flow_run.id in self._paused_before_start:
            self._paused_before_start.discard(flow_run.id)
            if task_status is not None:
                task_status.started(PausedBeforeStart(job_id))
            return ProcessWorkerResult(status_code=0, identifier="paused")
        booking = configuration.booking
        copy = copy_of(flow_run, configuration)
        if booking:  # an agent of a blueprint job: the job owns the booking and releases it
            found = await self._router.booked(booking)
        else:  # a run's own booking; a system copy's part of its run's booking, which it releases
            found = await self._router.own_placement(flow_run, configuration)
        if found is None or found.node != self._node.name:
            held = f"part of run {copy.job_id}'s booking" if copy is not None else "booking"
            raise RuntimeError(f"run {job_id} has no {held} on node {self._node.name}; refusing to start it")
        placement = found
        folder = run_folder(job_id)
        configuration.env = run_environment(configuration, placement, self._store_env, folder)
        self._running.add(job_id)
        stopping = False
        checks = anyio.CancelScope()
        try:
            notify.publish("ONLINE", "mn.run.started", node=placement.node, job_id=job_id,
                           reason=f"run {flow_run.name} starting on {placement.node}",
                           allocation=visibility.summary(placement))
            if configuration.health is not None:
                self._task_group.start_soon(self._releaser.watch_health, flow_run, configuration, placement, copy,
                                             checks)
            return await self._part.launching.launch(
                flow_run, configuration, placement, task_status,
                run_process=lambda status: self._run_process(flow_run, configuration, status))
        except LaunchRefused as refused:
            await self._part.launching.refuse(flow_run, placement, str(refused), task_status)
            return ProcessWorkerResult(status_code=0, identifier="refused")
        except anyio.get_cancelled_exc_class():
            stopping = True  # the worker stops: the run's fate is decided by put_back and teardown, not here
            raise
        finally:
            checks.cancel()  # the run is over: no more probes
            self._running.discard(job_id)
            if not stopping and not booking:
                await self._releaser.release_run(flow_run, placement, copy, "the run ended", "run_ended")
            if not stopping:
                await anyio.to_thread.run_sync(functools.partial(shutil.rmtree, folder, ignore_errors=True))

    async def _run_process(self, flow_run, configuration: MNJobConfiguration, task_status) -> ProcessWorkerResult:
        """A host process: forked by the warm launcher with ``warm_start`` (cold when it cannot), else Prefect's
        process worker's."""
        if configuration.warm_start and self._warm is not None:
            return await run_warm(flow_run, configuration, task_status, launchers=self._warm,
                                  preload=tuple(configuration.preload), logger=self.get_flow_run_logger(flow_run))
        return await super().run(flow_run, configuration, task_status)

    async def kill_infrastructure(self, infrastructure_pid: str, configuration, grace_seconds: int = 30) -> None:
        """Stop a run's container (Prefect calls this for a run cancelled before its flow started); a host
        process is the process worker's to end."""
        if not infrastructure_pid.startswith(DOCKER_PID_PREFIX):
            return await super().kill_infrastructure(infrastructure_pid, configuration, grace_seconds)
        container_id = infrastructure_pid[len(DOCKER_PID_PREFIX):]
        if not await anyio.to_thread.run_sync(docker_io.stop_container, container_id, grace_seconds):
            raise InfrastructureNotFound(f"container {container_id} not found")

    async def _propose_crashed_state(self, flow_run, message: str, client=None) -> None:
        """Prefect's crash report, then an OFFLINE notification when the run did end Crashed (a run that already
        failed is not crashed again). A report the API did not take (it was away: a server restart outlasts the
        client's retries) is made again (``decisions.crash_report_next``): else the run would sit Pending, unbooked
        and with no process, until the pool's sweep of unreported ends judges it."""
        deadline = time.monotonic() + decisions.CRASH_REPORT_SECONDS
        pause = 2.0
        while True:
            await super()._propose_crashed_state(flow_run, message, client)
            state, deleted = None, False
            try:
                state = (await self.client.read_flow_run(flow_run.id)).state
            except ObjectNotFound:
                deleted = True
            except Exception:  # the API is still away
                pass
            step = decisions.crash_report_next(state.type.value if state is not None else None, deleted=deleted,
                                               left_s=deadline - time.monotonic(), pause_s=pause)
            if step == "leave":
                return
            if step == "done":
                break
            self.get_flow_run_logger(flow_run).warning("mn: the crash report did not reach the API; trying again "
                                                       "in %.0f s", pause)
            await anyio.sleep(pause)
            pause = min(pause * 2, 10.0)
        if state is not None and state.is_crashed():
            notify.publish("OFFLINE", "mn.run.crashed", node=self._node.name, job_id=str(flow_run.id), reason=message)
