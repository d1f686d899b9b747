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

What to do with a run or a booking is decided by the pure rules of ``mn_prefect.worker.decisions`` (wait or fail,
release or keep, put back, crash, cancel, deallocate); this module gathers their facts from Prefect and the
store and carries their answers out. The sweeps of this node's bookings, and of the pool's runs whose end never
reached the server, are ``mn_prefect.worker.sweeps.Sweeps``.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn, ParamSpec, TypeVar

import anyio
import anyio.to_thread
from prefect.client.schemas.objects import StateType
from prefect.exceptions import Abort, InfrastructureNotFound, ObjectNotFound, Pause
from prefect.states import Cancelling, Crashed, Failed, Pending, Scheduled
from prefect.utilities.engine import propose_state
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker, ProcessWorkerResult
from pydantic import ValidationError

from mn_prefect import events, notify
from mn_prefect.blocks import readme_url
from mn_prefect.drivers import docker as docker_io
from mn_prefect.drivers.launchers import (
    DOCKER_PID_PREFIX,
    HOST_LOCAL,
    Launch,
    Launcher,
    LaunchRefused,
    refusal,
    this_node,
)
from mn_prefect.inventory.hostpaths import volume_escapes
from mn_prefect.lifecycle.leader import Leadership, default_owner
from mn_prefect.lifecycle.states import heartbeat
from mn_prefect.model.constraints import parse_constraints
from mn_prefect.model.hints import env_hints, merge_env
from mn_prefect.model.issues import Issues
from mn_prefect.model.node import NodeRecord, ServiceInstance
from mn_prefect.model.node_status import SCHEDULABLE_STATES
from mn_prefect.model.placement import Placement, Plan
from mn_prefect.model.scalars import is_uuid
from mn_prefect.model.states import TERMINAL_RUN_STATES
from mn_prefect.placement.placing import Placer, PlaceResult
from mn_prefect.placement.reservations import ReservationError, place_inside
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.plan import SYSTEM_JOB_TYPES
from mn_prefect.settings import WAKEUPS_VAR, wakeups_enabled
from mn_prefect.store import ClusterStore, open_store
from mn_prefect.store.base import (
    CAPACITY,
    PLACED,
    ChangeWatcher,
    Event,
    StoreUnavailable,
    UnknownGroup,
    placed_topic,
)
from mn_prefect.store.groups import reported_group
from mn_prefect.store.records import FlowRunRecord, get_record, put_record
from mn_prefect.store.urls import STORE_URL_VAR
from mn_prefect.worker import decisions, health, system, visibility
from mn_prefect.worker.api_retries import RetryingClient, call_with_retries
from mn_prefect.worker.decisions import Deallocate, Fail, Release
from mn_prefect.worker.sweeps import Sweeps
from mn_prefect.worker.variables import MNJobConfiguration, MNVariables, SystemCopyVariable

HEARTBEAT_SECONDS_VAR = "MN_HEARTBEAT_SECONDS"
STORE_BLOCK_VAR = "MN_STORE_BLOCK"
ANNOUNCER_LEASE_SECONDS = 30.0
# Each step of a stop (leaving the cluster, putting back one half-launched run) gets this long, so a store or
# API that does not answer cannot hold the process past what a supervisor's SIGTERM-to-SIGKILL window allows.
STOP_STEP_SECONDS = 5.0
# The whole stop after SIGTERM: well inside the 90 s a supervisor (systemd, docker stop -t) usually allows.
STOP_DEADLINE_SECONDS = 45.0
# A wake-up's watcher holds a thread at most this long per wait: a stop waits no longer for it.
WAKEUP_WAIT_SECONDS = 1.0
# After the first change of a burst (a release and the commits it lets through), its rest is gathered this long
# into the same poll.
WAKEUP_GATHER_SECONDS = 0.02
# How often the pool's announcer judges silent nodes (the heartbeat timeout itself is MN_HEARTBEAT_TIMEOUT_SECONDS).
NODE_SWEEP_SECONDS = 10.0
# A worker started while its store is away waits this long for it before it gives up.
STORE_START_WAIT_SECONDS = 60.0
STORE_START_WAIT_VAR = "MN_STORE_START_WAIT_SECONDS"

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _invalid_configuration(error: ValidationError) -> str:
    """The failure message of a run whose job variables do not make a job configuration, every problem named."""
    problems = []
    for item in error.errors(include_url=False):
        where = ".".join(str(part) for part in item["loc"])
        problems.append(item["msg"] if item["type"] == "resources" else f"job_variables.{where}: {item['msg']}")
    return "invalid resource request: " + "; ".join(problems)


async def propose_pending(client, flow_run_id, message: str | None, logger) -> Any:
    """Propose Pending for a run about to be submitted: the state the server answered, or None when the run
    may not be submitted. The server refuses with a signal, not an error, when the run moved on since it was
    read: ``Abort`` (it is no longer Scheduled) or ``Pause`` (the reconcile paused it, its node lost). Either
    raised here would end the worker's task group, and the worker with it."""
    try:
        return await propose_state(client, Pending(message=message), flow_run_id=flow_run_id)
    except (Abort, Pause) as signal:
        logger.info("Aborted submission of flow run '%s': %s", flow_run_id, signal)
    except Exception:
        logger.exception("Failed to update state of flow run '%s'", flow_run_id)
    return None


def _remember_run(store, flow_run, config: MNJobConfiguration, placement: Placement) -> None:
    """What the reconciler needs to know of a placed run after its node is lost; reschedules so far are kept."""
    job_id = str(flow_run.id)
    earlier = get_record(store, job_id, FlowRunRecord)
    put_record(store, FlowRunRecord(job_id=job_id, name=flow_run.name, job_type=config.job_type,
                                    recovery_mode=config.recovery_mode, node=placement.node, status="placed",
                                    reschedules_ms=earlier.reschedules_ms if earlier else []))


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
    # The README's section on the worker, once pyproject declares the project's URL; "" (Prefect's own default
    # for both) until then. No logo: the project has none, and Prefect's would say this worker is Prefect's.
    _documentation_url = readme_url("using-it-with-prefect") or ""
    _logo_url = ""

    def __init__(self, *args: Any, **kwargs: Any):
        self._api: RetryingClient | None = None
        super().__init__(*args, **kwargs)
        self.node: NodeRecord | None = None
        self.store: ClusterStore | None = None
        self._placer: Placer | None = None
        self._store_lock = threading.Lock()
        self._configs: dict[Any, MNJobConfiguration] = {}
        self._deployments: dict[Any, tuple[float, dict]] = {}
        self._first_seen: dict[Any, float] = {}
        self._waiting_reason: dict[Any, str] = {}
        self._running: set[str] = set()
        self._handed_over: set[Any] = set()
        self._put_back_ids: set[Any] = set()
        self._stopping = False
        self._announcer: Leadership | None = None
        self._announcer_checked = (-float("inf"), False)
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._last_sweep = 0.0
        self._last_node_sweep = 0.0
        self._store_env: dict[str, str] = {}
        self._launchers: dict[str, Launcher] = {}
        self._stopping_since: float | None = None
        self._sweeps: Sweeps | None = None
        self._poll_lock: anyio.Lock | None = None  # one poll at a time, the loop's or a wake-up's (setup makes it)
        self._scheduled_seen = 0  # Scheduled runs of the pool in the last poll

    @property
    def _cluster(self) -> ClusterStore:
        """The cluster store; opened by setup()."""
        if self.store is None:
            raise RuntimeError("the mn worker has no store yet: setup() has not run")
        return self.store

    @property
    def _node(self) -> NodeRecord:
        """This worker's node, as registered in the store by setup()."""
        if self.node is None:
            raise RuntimeError("the mn worker has no node yet: setup() has not run")
        return self.node

    @property
    def _place(self) -> Placer:
        if self._placer is None:
            raise RuntimeError("the mn worker has no placer yet: setup() has not run")
        return self._placer

    @property
    def _sweeper(self) -> Sweeps:
        if self._sweeps is None:
            raise RuntimeError("the mn worker has no sweeps yet: setup() has not run")
        return self._sweeps

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
        self._stop_on_sigterm()  # first: once the node is registered, a SIGTERM must stop it
        await super().setup()
        local, self._launchers = await anyio.to_thread.run_sync(this_node, self._logger)
        block = os.environ.get(STORE_BLOCK_VAR)
        if block:
            from mn_prefect.blocks import MNClusterStore

            loaded: object = await MNClusterStore.aload(block)  # typed loosely: Prefect's decorator loses Self
            if not isinstance(loaded, MNClusterStore):
                raise TypeError(f"block {block!r} is a {type(loaded).__name__}, not an MNClusterStore")
            self.store = store = await self._open_store_waiting(loaded.open)
        else:
            self.store = store = await self._open_store_waiting(open_store)
        pool = self._work_pool_name
        await self._create_pool_group(store, pool)
        # Runs of this pool go to nodes of its group only; each poll invalidates the view before it refuses.
        self._placer = Placer(store, group=pool, reread="on_invalidate")
        url = store.url
        # Runs (blueprint coordinators above all) open the worker's own store, even when it came from a block.
        self._store_env = {STORE_URL_VAR: url.raw}
        try:
            local = local.model_copy(update={"group": reported_group(local, pool, os.environ),
                                             "services": health.unproven(local.services)})
            self.node = node = await self._in_store(store.register_node, local)
        except (UnknownGroup, ValueError) as error:
            await self._refuse_start(error)
        self._logger.info("mn worker on node %s (group %s, %d devices, drivers %s), store %s", node.name, node.group,
                          len(node.devices), ", ".join(node.runtime_drivers), url.safe)
        if node.status == "healthy":
            notify.publish("ONLINE", "mn.node.healthy", node=node.name, reason="its worker started")
        if node.group != pool:
            self._logger.warning("node %s is in group %s, not in pool %s's group: this worker places runs of %s on "
                                 "that group's nodes, and none runs here", node.name, node.group, pool, pool)
        self._sweeps = Sweeps(store=store, placer=self._placer, node=node.name, pool=pool, client=lambda: self.client,
                              work_pool=lambda: self._work_pool, in_store=self._in_store, logger=self._logger,
                              run_logger=self.get_flow_run_logger, busy=self._busy, release=self._release,
                              release_part=self._release_part)
        if "docker" in self._launchers:
            await self._sweep_orphaned_containers()
        self._announcer = Leadership(store, f"{node.name}:{default_owner()}", ttl_s=ANNOUNCER_LEASE_SECONDS,
                                     name=f"mn-announcer:{self._work_pool_name}")
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="mn-heartbeat", daemon=True)
        self._heartbeat_thread.start()
        await self._start_wakeups()
        if any(service.check is not None for service in node.services):
            scope = anyio.CancelScope()
            self._scheduled_task_scopes.add(scope)  # Prefect's teardown cancels it before closing the task group
            self._task_group.start_soon(self._probe_services, scope)

    async def _open_store_waiting(self, opener: Callable[[], ClusterStore]) -> ClusterStore:
        """A worker started while its store is briefly away (restarting, failing over) waits for it, for up to
        MN_STORE_START_WAIT_SECONDS (60), rather than exiting; a wrong URL or password fails at once."""
        deadline = time.monotonic() + float(os.environ.get(STORE_START_WAIT_VAR, STORE_START_WAIT_SECONDS))
        while True:
            try:
                return await anyio.to_thread.run_sync(opener)
            except StoreUnavailable as error:
                if time.monotonic() >= deadline or "password" in str(error).lower():
                    raise
                self._logger.warning("the store is not reachable yet (%s): trying again", error)
                await anyio.sleep(1.0)

    async def _probe_services(self, scope: anyio.CancelScope) -> None:
        """Probe each of this node's services declared with a check every ``interval_s`` (the first probe at once)
        and, when a status changes, write the node's record with the new ``services`` (``health.service_status``
        is the rule). The record is re-registered from the store's own copy, so the node's state and eligibility,
        which others change, are kept."""
        services = list(self._node.services)
        checked = [i for i, service in enumerate(services) if service.check is not None]
        tallies = {i: health.Tally(limit=services[i].failures_to_critical) for i in checked}
        due = dict.fromkeys(checked, time.monotonic())
        failures: dict[int, str | None] = {}  # the last probe's, by index in services

        async def one(i: int) -> None:
            failures[i] = await health.probe_service(services[i])

        unsaved = False
        with scope:
            while True:
                await anyio.sleep(max(0.0, min(due.values()) - time.monotonic()))
                now = time.monotonic()
                ready = [i for i in checked if due[i] <= now]
                async with anyio.create_task_group() as probes:  # a slow service does not delay the others
                    for i in ready:
                        probes.start_soon(one, i)
                for i in ready:
                    due[i] = now + services[i].interval_s
                    status = health.service_status(services[i].status, tallies[i], failures[i])
                    if status != services[i].status:
                        events.service_state(self._node.name, services[i].name, status, from_status=services[i].status,
                                             reason=failures[i])
                        services[i] = services[i].model_copy(update={"status": status})
                        unsaved = True
                        self._logger.info("service %s on node %s is %s%s", services[i].name, self._node.name, status,
                                          f" ({failures[i]})" if failures[i] is not None else "")
                if unsaved:
                    unsaved = not await self._publish_services(services)

    async def _publish_services(self, services: list[ServiceInstance]) -> bool:
        """Write this node's record with ``services``; whether it was written (a store that did not answer is
        tried again after the next probe)."""
        def publish() -> NodeRecord | None:
            stored = self._cluster.get_node(self._node.name)
            if stored is None:
                return None
            return self._cluster.register_node(stored.record.model_copy(update={"services": services}))

        try:
            record = await self._in_store(publish)
        except Exception as error:
            self._logger.warning("could not write node %s's service status: %s", self._node.name, error)
            return False
        if record is not None:
            self.node = record
        return True

    async def _create_pool_group(self, store: ClusterStore, pool: str) -> None:
        """An ``mn`` pool has a group of its name (docs/operating.md, "Resource groups"); a pool created with ``prefect
        work-pool create`` gets it here, when its first worker starts. Only for a pool that exists on the server."""
        if self._work_pool is None:  # the base setup could not read it (the API did not answer yet)
            try:
                await self.client.read_work_pool(pool)
            except ObjectNotFound:
                return
            except Exception as error:  # the group may exist already: registration says whether it does
                self._logger.warning("could not read work pool %s to create its group: %s", pool, error)
                return
        try:
            if await self._in_store(store.create_group, pool):
                self._logger.info("created resource group %s for work pool %s", pool, pool)
        except ValueError as error:
            await self._refuse_start(error)

    async def _refuse_start(self, error: Exception) -> NoReturn:
        """End ``prefect worker start`` with exit 1 and the reason as its last line. Nothing has started yet
        (no run, no heartbeat). An exception cannot carry this out: raised inside the task group the base setup
        entered, it ends as a cancellation, which Prefect reports as a normal stop with exit 0."""
        self._logger.error("mn worker not started: %s", error)
        if self.store is not None:
            self.store.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def _stop_on_sigterm(self) -> None:
        """SIGTERM cancels the worker's main task at once, in its event loop. ``prefect worker start`` turns
        SIGTERM into a SIGINT to itself, which a process that inherited SIGINT as ignored never acts on (a
        supervisor may start it that way): this does not depend on it. A stop that has not ended the process
        within ``STOP_DEADLINE_SECONDS`` ends it outright, before a supervisor's SIGKILL would."""
        import asyncio
        import signal

        main = asyncio.current_task()
        if main is None or threading.current_thread() is not threading.main_thread():
            return  # not started by `prefect worker start` (a test harness): Prefect's own handling applies

        def on_sigterm() -> None:
            if self._stopping_since is None:
                self._stopping_since = time.monotonic()
                self._logger.info("SIGTERM: stopping the mn worker%s", f" on {self.node.name}" if self.node else "")
                threading.Thread(target=self._exit_after_deadline, name="mn-stop-deadline", daemon=True).start()
            main.cancel()

        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
        except (NotImplementedError, RuntimeError, ValueError) as error:
            self._logger.debug("SIGTERM stays with Prefect's handler: %s", error)

    def _exit_after_deadline(self) -> None:
        time.sleep(STOP_DEADLINE_SECONDS)
        self._logger.error("the mn worker did not stop within %s s of SIGTERM: exiting now", STOP_DEADLINE_SECONDS)
        os._exit(1)

    async def teardown(self, *exc_info: Any) -> None:
        """The stop (SIGTERM or SIGINT: ``prefect worker start`` turns both into cancelling the worker): no more
        polls or heartbeats, the node leaves the cluster, then Prefect's teardown cancels what is in flight.

        A run this worker was launching that never reached Running goes back to Scheduled, unbooked
        (``_put_back``). Runs that reached Running keep their bookings and their Running state: Prefect
        ends those processes with the worker, and a stopped worker is a lost node to the cluster, so
        reconcile applies each run's recovery_mode once the node is offline (or this node's sweep, when its
        worker is back, releases what ended). Releasing here could hand a GPU to the next run while a
        process that ignores SIGTERM still holds it.
        """
        self._stopping = True
        self._stop_heartbeat.set()
        if self.store is not None and self.node is not None:
            with anyio.move_on_after(STOP_STEP_SECONDS, shield=True):
                await self._leave_cluster()
        await super().teardown(*exc_info)

    async def _leave_cluster(self) -> None:
        """Say at once that this node has no worker, rather than after the heartbeat timeout: placers stop
        choosing it (a heartbeat, when the worker is back, makes it healthy again)."""
        if self._heartbeat_thread is not None:
            await anyio.to_thread.run_sync(self._heartbeat_thread.join, STOP_STEP_SECONDS)  # no beat after this
        try:
            left = await self._in_store(self._cluster.transition_node, self._node.name, "disconnected",
                                        from_statuses=tuple(SCHEDULABLE_STATES), reason="its worker stopped")
            if left is not None:
                events.node_state(self._node.name, "disconnected", reason="its worker stopped",
                                  eligible=left.scheduling_eligible)
            if self._announcer is not None and self._announcer.lease is not None:
                await self._in_store(self._announcer.release)
        except Exception as error:  # the heartbeat timeout says the same, only later
            self._logger.warning("could not mark node %s disconnected: %s", self._node.name, error)

    def _heartbeat_loop(self) -> None:
        interval = float(os.environ.get(HEARTBEAT_SECONDS_VAR, "10"))
        while not self._stop_heartbeat.wait(interval):
            try:
                with self._store_lock:
                    heartbeat(self._cluster, self._node.name)  # a beat that brings the node back is announced
            except Exception as error:  # the next beat may succeed; the lifecycle flows judge silence
                self._logger.warning("heartbeat failed: %s", error)

    def _busy(self) -> set[str]:
        """The ids of the runs this worker is submitting or running now: no sweep judges them."""
        return self._running | {str(i) for i in self._submitting_flow_run_ids}

    async def _in_store(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Store calls are blocking: run them in a thread, one at a time (the Placer is not thread-safe)."""
        def call() -> _T:
            with self._store_lock:
                return fn(*args, **kwargs)
        return await anyio.to_thread.run_sync(call)

    # -- wake-ups: a store change polls at once (the poll loop stays the safety net) ---------------------

    async def _start_wakeups(self) -> None:
        """Watch the store (its own connection, outside ``_store_lock``) unless MN_WAKEUPS is off; a store that
        cannot be watched leaves the worker on polls alone."""
        self._poll_lock = anyio.Lock()
        if not wakeups_enabled():
            self._logger.info("wake-ups are off (%s=off): runs are placed and started on polls only", WAKEUPS_VAR)
            return
        try:
            watcher = await anyio.to_thread.run_sync(functools.partial(self._cluster.changes, node=self._node.name))
        except Exception as error:
            self._logger.warning("cannot watch the store for changes (%s): runs are placed and started on polls "
                                 "only", error)
            return
        scope = anyio.CancelScope()
        self._scheduled_task_scopes.add(scope)  # Prefect's teardown cancels it before closing the task group
        self._task_group.start_soon(self._wake_on_changes, watcher, scope)

    async def _wake_on_changes(self, watcher: ChangeWatcher, scope: anyio.CancelScope) -> None:
        """Poll at once when a run was committed onto this node, or when capacity freed while runs of the pool
        wait. One wake-up poll at a time: the changes that come during it are one more poll after it."""
        try:
            with scope:
                while not self._stopping:
                    try:
                        # Not abandoned on cancel: a stop waits for the wait (WAKEUP_WAIT_SECONDS), then closes it.
                        seen = await anyio.to_thread.run_sync(watcher.wait, WAKEUP_WAIT_SECONDS)
                        if seen:
                            await anyio.sleep(WAKEUP_GATHER_SECONDS)
                            seen |= await anyio.to_thread.run_sync(watcher.wait, 0.0)
                    except Exception as error:  # watchers report lost connections; anything else ends the watch
                        self._logger.warning("stopped watching the store for changes (%s): runs are placed and "
                                             "started on polls only", error)
                        return
                    if CAPACITY in seen:
                        self._place.invalidate()  # a refusal read before this change is no longer believed
                    if PLACED in seen or (seen and self._scheduled_seen):  # freed capacity matters to waiting runs
                        await self._poll_on_change(seen)
        finally:
            watcher.close()

    async def _poll_on_change(self, seen: frozenset[str]) -> None:
        if self._stopping:
            return
        try:
            submitted = await self.get_and_submit_flow_runs()
        except Exception as error:  # the poll loop tries again
            self._logger.warning("the poll on a store change failed: %s", error)
            return
        why = " and ".join(sorted(seen))
        for flow_run in submitted:
            self.get_flow_run_logger(flow_run).info("mn: submitted on a store change (%s), before the next poll", why)
        if submitted:
            self._logger.info("woke on a store change (%s): submitted %d run(s)", why, len(submitted))

    async def get_and_submit_flow_runs(self):
        """One poll at a time, the loop's or a wake-up's: two at once would place the same runs twice over."""
        if self._poll_lock is None:
            return await super().get_and_submit_flow_runs()
        async with self._poll_lock:
            return await super().get_and_submit_flow_runs()

    async def _get_scheduled_flow_runs(self):
        runs = await super()._get_scheduled_flow_runs()
        self._scheduled_seen = len(runs)
        return runs

    # -- placement --------------------------------------------------------------------------------------

    async def _submit_scheduled_flow_runs(self, flow_run_response):
        submitted = []
        if self._stopping:
            return submitted  # a poll that was under way when the stop began places and starts nothing
        # Anything may have changed since the last poll (another process released, a reservation ended, a node
        # came back): this poll's first refusal re-reads the store before the run is told to wait or failed.
        self._place.invalidate()
        for entry in flow_run_response:
            if self._stopping:
                break
            flow_run = entry.flow_run
            # Prefect 3.8 does not skip runs this worker is already submitting: do it here.
            if flow_run.id in self._submitting_flow_run_ids:
                continue
            try:
                node = await self._placement_node(flow_run)
            except Exception:
                self.get_flow_run_logger(flow_run).exception("mn placement failed; will retry on the next poll")
                continue
            if node == self._node.name:
                # Submit at once rather than after placing the whole batch: placement must not delay starts.
                submitted += await super()._submit_scheduled_flow_runs([entry])
        if time.monotonic() - self._last_sweep > 5:
            self._last_sweep = time.monotonic()
            try:
                await self._sweeper.bookings(scheduled={str(e.flow_run.id) for e in flow_run_response})
                await self._sweeper.crash_lost_running()
            except Exception as error:  # a store or API outage: raised, it would end the worker; the next poll retries
                self._logger.warning("sweep of this node's bookings skipped: %s: %s", type(error).__name__, error)
        if time.monotonic() - self._last_node_sweep > NODE_SWEEP_SECONDS and await self._is_announcer():
            self._last_node_sweep = time.monotonic()
            await self._sweeper.silent_nodes()
            await self._sweeper.crash_unreported_ends()
        return submitted

    async def _propose_pending_state(self, flow_run) -> bool:
        """Pending, with the placement as the state message: visible on the run at no extra API call."""
        logger = self.get_flow_run_logger(flow_run)
        config = self._configs.get(flow_run.id)
        booking = config.booking if config is not None else None
        if booking:
            placement = await self._booked(booking)
        else:
            placement = await self._own_placement(flow_run, config)
        message = visibility.message(placement) if placement is not None else None
        state = await propose_pending(self.client, flow_run.id, message, logger)
        if state is None:
            return False
        if state.is_pending() and booking and placement is not None:
            # The job booked this agent, not a worker: the one worker that wins the agent run's Pending shows it.
            self._task_group.start_soon(self._show, flow_run, placement)
        return state.is_pending()

    async def _submit_run(self, flow_run) -> None:
        try:
            await super()._submit_run(flow_run)
        except anyio.get_cancelled_exc_class():
            if flow_run.id not in self._handed_over:  # stopped before the launch task began: nothing else will
                with anyio.move_on_after(STOP_STEP_SECONDS, shield=True):
                    await self._put_back(flow_run)
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

    async def _submit_run_and_capture_errors(self, flow_run, task_status=None):
        self._handed_over.add(flow_run.id)
        try:
            return await super()._submit_run_and_capture_errors(flow_run, task_status)
        except anyio.get_cancelled_exc_class():
            # Unwinding has ended the flow process (Prefect's process manager): judge the run now.
            with anyio.move_on_after(STOP_STEP_SECONDS, shield=True):
                await self._put_back(flow_run)
            raise
        finally:
            self._handed_over.discard(flow_run.id)

    async def _put_back(self, flow_run) -> None:
        """The worker stopped while launching this run. Never Running (no flow code ran): back to Scheduled
        for any worker, its booking released (a blueprint agent's booking belongs to its job, which keeps
        it; a system run's part, or its copy's, waits for its node). Already over: only released. Running: left
        alone (see teardown)."""
        if flow_run.id in self._put_back_ids:
            return  # both the submission and the launch task may be stopped mid-way: judge the run once
        self._put_back_ids.add(flow_run.id)
        try:
            run = await self.client.read_flow_run(flow_run.id)
            state = run.state.type if run.state is not None else None
            if state in (StateType.PENDING, StateType.SCHEDULED):
                await self.client.set_flow_run_state(flow_run.id, Scheduled(
                    message=f"mn: the worker on {self._node.name} stopped before starting this run; it waits to "
                            "be placed again"), force=True)
                self._logger.info("put run %s back to Scheduled: its worker stopped before starting it", flow_run.id)
            elif state not in TERMINAL_RUN_STATES:
                return
            config = self._configs.get(flow_run.id)
            if config is not None and config.booking:
                return
            copy, placement = self._copy_of(flow_run, config), await self._own_placement(flow_run, config)
            if placement is not None and (copy is not None or placement.locality == "system"):
                # A system run's part waits for its node: only a run that is over gives it back.
                if state in TERMINAL_RUN_STATES:
                    await self._release_run(flow_run, placement, copy, "the run is over")
                return
            await self._release(flow_run.id, "its worker stopped before starting it", run_name=flow_run.name)
        except Exception as error:
            self._logger.warning("could not put run %s back to Scheduled: %s", flow_run.id, error)

    async def _deployment_variables(self, deployment_id) -> dict:
        cached = self._deployments.get(deployment_id)
        if cached is None or time.monotonic() - cached[0] > 10:
            deployment = await self.client.read_deployment(deployment_id)
            cached = (time.monotonic(), deployment.job_variables or {})
            self._deployments[deployment_id] = cached
        return cached[1]

    async def _configuration(self, flow_run) -> MNJobConfiguration:
        """The run's job configuration for placement: the pool template with the deployment's and the run's
        job variables (deployments are cached briefly: one read per deployment, not per run)."""
        config = self._configs.get(flow_run.id)
        if config is None:
            values = dict(await self._deployment_variables(flow_run.deployment_id)) if flow_run.deployment_id else {}
            values.update(flow_run.job_variables or {})
            config = await self.job_configuration.from_template_and_values(
                base_job_template=self.work_pool.base_job_template, values=values, client=self.client)
            self._configs[flow_run.id] = config
        return config

    async def _placement_node(self, flow_run) -> str | None:
        """The node this run is placed on, placing it now if nobody has; None while it waits."""
        job_id = str(flow_run.id)
        existing = await self._in_store(self._cluster.active_placements, job_id=job_id)
        if existing and not await self._placed_on_lost_node(flow_run, existing):
            self._waiting_reason.pop(flow_run.id, None)  # placed (by any worker): nothing more to report
            self._first_seen.pop(flow_run.id, None)
            return await self._system_run_node(flow_run, existing) if system.is_system(existing) else existing[0].node
        try:
            config = await self._configuration(flow_run)
        except ValidationError as error:  # what the server's schema cannot say (e.g. gpu disagreeing with devices)
            message = _invalid_configuration(error)
            self.get_flow_run_logger(flow_run).error(message)
            await self.client.set_flow_run_state(flow_run.id, Failed(message=message), force=True)
            return None
        if config.booking:
            return await self._booked_node(flow_run, config.booking)
        copy = self._copy_of(flow_run, config)
        if copy is not None:
            return await self._copy_node(flow_run, copy)
        issues = Issues()
        # The image is for the runtime driver that starts the run, not a placement criterion.
        request = config.resources.request()
        constraints = parse_constraints(config.constraints, "job_variables.constraints", issues)
        logger = self.get_flow_run_logger(flow_run)
        if issues:
            message = "invalid resource request: " + "; ".join(str(i) for i in issues.items)
            logger.error(message)
            await self.client.set_flow_run_state(flow_run.id, Failed(message=message), force=True)
            return None
        ask = Ask(agent_id=flow_run.name or job_id, source_agent_id=flow_run.name, request=request,
                  constraints=tuple(constraints), preferred_node=config.preferred_node)
        if config.reservation:
            result = await self._place_inside(flow_run, config, ask)
            if result is None:
                return None
        elif config.job_type in SYSTEM_JOB_TYPES:
            return await self._place_system(flow_run, config, ask)
        else:
            result = await self._in_store(self._place.place, job_id, [ask], strategy=config.strategy)
        commit = result.commit
        if commit is not None and commit.ok:  # result.placed
            placement = commit.placements[0]
            if not commit.already_committed:  # this call created the booking: announce it, once
                await self._in_store(_remember_run, self._cluster, flow_run, config, placement)
                self._task_group.start_soon(self._announce, flow_run, placement)  # off the placement path
            return placement.node
        if commit is not None and commit.conflict is not None and commit.conflict.job_booked:
            existing = await self._in_store(self._cluster.active_placements, job_id=job_id)
            return existing[0].node if existing else None
        await self._wait_or_fail(flow_run, config, result.plan)
        return None

    async def _placed_on_lost_node(self, flow_run, existing: list[Placement]) -> bool:
        """Whether this still-Scheduled run was placed on a node that was lost before it started there (its worker
        died between the commit and the start): then its booking is released here, and the caller places it
        again. A system run's parts, and a run inside a reservation, stay where they are: they belong there."""
        placement = existing[0]
        if not decisions.movable(len(existing), placement.node, self._node.name,
                                 in_reservation=bool(placement.reservation), system_run=system.is_system(existing)):
            return False
        stored = await self._in_store(self._cluster.get_node, placement.node)
        status = stored.record.status if stored is not None else "offline"
        decision = decisions.off_lost_node(status)
        if not isinstance(decision, Release):
            return False
        released = await self._in_store(self._place.release, str(flow_run.id))
        if released:
            self.get_flow_run_logger(flow_run).warning(
                "mn: this run was placed on %s, which is %s before the run started there: placing it again",
                placement.node, status)
            events.placement("released", placement.node, str(flow_run.id), reason=decision.why,
                             run_id=flow_run.id, run_name=flow_run.name)
        return True

    async def _place_inside(self, flow_run, config: MNJobConfiguration, ask: Ask) -> PlaceResult | None:
        """Place the run inside its reservation (docs/operating.md, "Reservations with expiry"); None when the run was
        failed: the reservation cannot be used (unknown, wrong key, ended), or the run could never fit in what it
        holds."""
        rid, system_run = config.reservation or "", config.job_type in SYSTEM_JOB_TYPES
        result, error = None, None
        if not system_run:
            try:
                result = await self._in_store(place_inside, self._cluster, str(flow_run.id), [ask], rid,
                                              config.reservation_key, strategy=config.strategy, group=self._place.group)
            except ReservationError as refused:
                error = str(refused)
        refusal = decisions.inside_reservation(rid, config.job_type, system_run=system_run, error=error,
                                               plan=result.plan if result is not None else None)
        if refusal is None:
            return result
        await self._unless_failed(flow_run, refusal)
        return None

    async def _booked(self, booking: dict[str, str]) -> Placement | None:
        """The placement a blueprint job booked for one of its agents (the store is the source of truth)."""
        placements = await self._in_store(self._cluster.active_placements, job_id=booking["job_id"])
        return next((p for p in placements if p.agent_id == booking["agent_id"]), None)

    async def _booked_node(self, flow_run, booking: dict[str, str]) -> str | None:
        placement = await self._booked(booking)
        return await self._unless_failed(flow_run, decisions.booked_node(
            placement.node if placement is not None else None, booking["job_id"], booking["agent_id"]))

    async def _unless_failed(self, flow_run, decision: str | Fail) -> str | None:
        """The node a rule chose; or, when it failed the run, None once the run is Failed with its message."""
        if not isinstance(decision, Fail):
            return decision
        self.get_flow_run_logger(flow_run).error(decision.message)
        await self.client.set_flow_run_state(flow_run.id, Failed(message=decision.message), force=True)
        return None

    async def _announce(self, flow_run, placement: Placement) -> None:
        """The booking this worker created: the committed event, then what people read on the run."""
        summary = visibility.summary(placement)
        visibility.emit_placement(visibility.COMMITTED, flow_run.id, placement.node, summary, run_name=flow_run.name,
                                  work_pool=self._work_pool)
        self._waiting_reason.pop(flow_run.id, None)
        await self._show(flow_run, placement)

    async def _show(self, flow_run, placement: Placement) -> None:
        """The placement on the run itself: one line in its logs and the ``placement`` table artifact."""
        summary = visibility.summary(placement)
        self.get_flow_run_logger(flow_run).info(
            "mn placed this run on %s: devices %s, ports %s, volumes %s (score %s)", placement.node,
            summary["devices"] or "-", summary["ports"] or "-", summary["volumes"] or "-", placement.score)
        try:
            await self.client.create_artifact(visibility.artifact(placement, flow_run.id))
        except Exception as error:  # visibility must not block the run
            self._logger.warning("could not attach the placement artifact to run %s: %s", flow_run.id, error)

    # -- system and sysbatch runs: one copy per node (mn_prefect.worker.system) ----------------------------

    @staticmethod
    def _copy_of(flow_run, config: MNJobConfiguration | None) -> SystemCopyVariable | None:
        """What makes a run the copy of a system run on one node (None for any other run). Read from the run's
        job variables too: a worker that did not place the run may hold no configuration of it."""
        return system.copy_marker(config.system_copy if config is not None else None, flow_run.job_variables)

    async def _own_placement(self, flow_run, config: MNJobConfiguration | None) -> Placement | None:
        """The placement this worker runs the run with: a copy's part of its system run's booking, else the
        run's own placement on this node."""
        copy = self._copy_of(flow_run, config)
        held = await self._in_store(self._cluster.active_placements,
                                    job_id=copy.job_id if copy is not None else str(flow_run.id))
        if copy is not None:
            return system.part(held, copy)
        return next((p for p in held if p.node == self._node.name), None)

    async def _place_system(self, flow_run, config: MNJobConfiguration, ask: Ask) -> str | None:
        """Book one copy of the run on every node of the group where it fits, in one commit under the run's id;
        the run itself runs on the first of them (``system.origin_node``), and the copies for the others are
        created after (``_fan_out``). Where none fits now, the run waits like any other."""
        job_id = str(flow_run.id)
        await self._in_store(self._place.refresh)  # a stale view would leave out a node that has room by now
        result = await self._in_store(self._place.place, job_id, [ask], job_type=config.job_type,
                                      strategy=config.strategy, explain=True)
        commit = result.commit
        if commit is not None and commit.ok:  # result.placed
            placements = commit.placements or list(result.plan.placements)
            origin = system.origin_node(placements)
            if not commit.already_committed:  # this call created the booking: record it, make the copies, once
                try:
                    own = next(p for p in placements if p.node == origin)
                    await self._in_store(_remember_run, self._cluster, flow_run, config, own)
                finally:  # the copies are made even when the record could not be written (the sweep copes)
                    self._task_group.start_soon(self._fan_out, flow_run, config, placements, result.plan)
            return origin
        if commit is not None and commit.conflict is not None and commit.conflict.job_booked:
            existing = await self._in_store(self._cluster.active_placements, job_id=job_id)
            return await self._system_run_node(flow_run, existing) if existing else None
        await self._wait_or_fail(flow_run, config, result.plan)
        return None

    async def _fan_out(self, flow_run, config: MNJobConfiguration, placements: list[Placement], plan: Plan) -> None:
        """After this worker committed a system run's booking: create the copy for each other node, and announce
        the run's own part and each copy's (beside, so that a slow artifact never delays a copy). A copy that
        cannot be created gives its part back at once."""
        job_id, origin = str(flow_run.id), system.origin_node(placements)
        logger = self.get_flow_run_logger(flow_run)
        created: list[str] = []
        try:
            logger.info("%s", system.fan_out_message(config.job_type, placements, origin, plan))
            self._task_group.start_soon(self._announce, flow_run, next(p for p in placements if p.node == origin))
            for placement in sorted((p for p in placements if p.node != origin), key=lambda p: p.node):
                create = functools.partial(self.client.create_flow_run_from_deployment,
                                           **system.copy_request(flow_run, placement))
                try:  # sent again after a transient error: the idempotency key makes it one run
                    copy = await call_with_retries(create, what="create_flow_run_from_deployment", logger=self._logger)
                except Exception as error:
                    logger.error("mn: could not create the copy for %s (%s); its part of the booking is released",
                                 placement.node, error)
                    await self._release_part(job_id, placement.node, f"its copy could not be created: {error}",
                                             run_id=flow_run.id, run_name=flow_run.name)
                    continue
                if copy.state is not None and copy.state.type in TERMINAL_RUN_STATES:  # made for an earlier booking
                    await self._release_part(job_id, placement.node, f"its copy {copy.id} ran already",
                                             run_id=copy.id, run_name=copy.name)
                    continue
                logger.info("mn: copy %s (%s) runs on %s", copy.name, copy.id, placement.node)
                self._task_group.start_soon(self._announce, copy, placement)
                created.append(placement.node)
        except Exception as error:  # the sweep releases a part whose copy was never made
            self._logger.warning("could not make every copy of system run %s: %s", job_id, error)
        if created:  # booked before they existed: wake their nodes' workers now, not at their next poll
            await self._in_store(self._cluster.announce, [placed_topic(node) for node in created])

    async def _system_run_node(self, flow_run, existing: list[Placement]) -> str | None:
        """The node a placed system run itself runs on (its copies run on the others): the one its record names,
        else the first of its booking's nodes. None, and the run fails, once its part there was released."""
        record = await self._in_store(get_record, self._cluster, str(flow_run.id), FlowRunRecord)
        node = record.node if record is not None else system.origin_node(existing)
        return await self._unless_failed(flow_run, decisions.system_run_node(node, [p.node for p in existing]))

    async def _copy_node(self, flow_run, copy: SystemCopyVariable) -> str | None:
        """A copy runs on the node its marker names while its system run's booking still holds its part there."""
        placements = await self._in_store(self._cluster.active_placements, job_id=copy.job_id)
        return await self._unless_failed(flow_run, decisions.copy_node(
            copy.node, copy.job_id, part_held=system.part(placements, copy) is not None))

    async def _is_announcer(self) -> bool:
        """Whether this worker speaks for the pool's waiting runs (the lease is renewed at most every third of
        its TTL, so polling does not write to the store every second)."""
        checked_at, leading = self._announcer_checked
        if time.monotonic() - checked_at < ANNOUNCER_LEASE_SECONDS / 3:
            return leading
        try:
            if self._announcer is None:
                raise RuntimeError("no announcer lease: setup() has not run")
            leading = await self._in_store(self._announcer.keep) is not None
        except Exception as error:  # say nothing rather than twice; the next check tries again
            self._logger.warning("could not check the announcer lease: %s", error)
            leading = False
        self._announcer_checked = (time.monotonic(), leading)
        return leading

    async def _wait_or_fail(self, flow_run, config: MNJobConfiguration, plan) -> None:
        """A run that fits nowhere stays Scheduled with the reason as its state message; the pool's announcer
        reports each distinct reason once (a log line, a waiting event) and fails runs no node can ever take
        after ``not_runnable_timeout_seconds``. Every other worker stays quiet."""
        if not await self._is_announcer():
            return
        first = self._first_seen.setdefault(flow_run.id, time.monotonic())
        decision = decisions.wait_or_fail(plan, waited_s=time.monotonic() - first,
                                          timeout_s=config.not_runnable_timeout_seconds,
                                          last_reason=self._waiting_reason.get(flow_run.id),
                                          shown_message=flow_run.state.message if flow_run.state is not None else None)
        if isinstance(decision, Fail):
            self.get_flow_run_logger(flow_run).error(decision.message)
            await self.client.set_flow_run_state(
                flow_run.id, Failed(message=decision.message[:decisions.STATE_MESSAGE_LIMIT]), force=True)
            self._waiting_reason.pop(flow_run.id, None)
            self._first_seen.pop(flow_run.id, None)
            return
        self._waiting_reason[flow_run.id] = decision.reason
        if decision.announce:
            self.get_flow_run_logger(flow_run).warning("mn: waiting to be placed (%s)", decision.reason)
            visibility.emit_waiting(flow_run, {"status": plan.status, "reason": plan.reason,
                                               "agents": plan.agents}, work_pool=self._work_pool)
        if not decision.show:
            return
        # Said once in the logs and events, but kept on the state: Prefect's Late transition drops the message, so
        # it is set again, under the state's own name (a Late run stays Late).
        name = flow_run.state.name if flow_run.state is not None and flow_run.state.is_scheduled() else None
        try:
            await self.client.set_flow_run_state(
                flow_run.id, Scheduled(scheduled_time=flow_run.next_scheduled_start_time or flow_run.expected_start_time,
                                       message=decision.state_message, **({"name": name} if name else {})),
                force=True)
        except Exception as error:
            self._logger.warning("could not set the waiting message on run %s: %s", flow_run.id, error)

    # -- running and releasing --------------------------------------------------------------------------

    async def run(self, flow_run, configuration: ProcessJobConfiguration, task_status=None) -> ProcessWorkerResult:
        if not isinstance(configuration, MNJobConfiguration):  # the base worker builds it from job_configuration
            raise TypeError(f"an mn worker runs an MNJobConfiguration, not a {type(configuration).__name__}")
        job_id = str(flow_run.id)
        booking = configuration.booking
        copy = self._copy_of(flow_run, configuration)
        if booking:  # an agent of a blueprint job: the job owns the booking and releases it
            found = await self._booked(booking)
        else:  # a run's own booking; a system copy's part of its run's booking, which it releases
            found = await self._own_placement(flow_run, configuration)
        if found is None or found.node != self._node.name:
            held = f"part of run {copy.job_id}'s booking" if copy is not None else "booking"
            raise RuntimeError(f"run {job_id} has no {held} on node {self._node.name}; refusing to start it")
        placement = found
        configuration.env = {**configuration.env, **merge_env(configuration._user_env, env_hints(placement)),
                             **self._store_env}
        self._running.add(job_id)
        stopping = False
        checks = anyio.CancelScope()
        try:
            notify.publish("ONLINE", "mn.run.started", node=placement.node, job_id=job_id,
                           reason=f"run {flow_run.name} starting on {placement.node}",
                           allocation=visibility.summary(placement))
            if configuration.health is not None:
                self._task_group.start_soon(self._watch_health, flow_run, configuration, placement, copy, checks)
            return await self._launch(flow_run, configuration, placement, task_status)
        except LaunchRefused as refused:
            await self._refuse_launch(flow_run, placement, str(refused), task_status)
            return ProcessWorkerResult(status_code=0, identifier="refused")
        except anyio.get_cancelled_exc_class():
            stopping = True  # the worker stops: the run's fate is decided by _put_back and teardown, not here
            raise
        finally:
            checks.cancel()  # the run is over: no more probes
            self._running.discard(job_id)
            if not stopping and not booking:
                await self._release_run(flow_run, placement, copy, "the run ended")

    async def _watch_health(self, flow_run, configuration: MNJobConfiguration, placement: Placement,
                            copy: SystemCopyVariable | None, checks: anyio.CancelScope) -> None:
        """Probe the running run (``health.watch``) until it ends (``checks`` is cancelled) or fails its check
        ``failures_to_deallocate`` times in a row: then it is deallocated."""
        job_id, check = str(flow_run.id), configuration.health
        if check is None:
            return

        async def unhealthy(tally: health.Tally) -> None:
            if tally.failures == 1:  # said once per run of failures, not at every probe
                events.allocation("unhealthy", job_id, node_name=placement.node, reason=tally.last,
                                  held=visibility.summary(placement), data={"failures": tally.failures})
            self.get_flow_run_logger(flow_run).warning("mn: health check failed (%d of %d): %s", tally.failures,
                                                       tally.limit, tally.last)

        async def started() -> bool:
            try:
                state = (await self.client.read_flow_run(flow_run.id)).state
            except Exception:  # the API is away: the failure counts, as it would for a started run
                return True
            return state is not None and state.type != StateType.PENDING

        verdict = None
        with checks:
            verdict = await health.watch(check, placement.port(check.port_label), unhealthy, started)
        decision = decisions.deallocation(verdict, owned=not configuration.booking)
        if verdict is not None and isinstance(decision, Deallocate):
            with anyio.CancelScope(shield=True):  # the run's end (which this causes) must not cut it short
                await self._deallocate(flow_run, placement, copy, verdict, decision)

    async def _deallocate(self, flow_run, placement: Placement, copy: SystemCopyVariable | None, verdict: str,
                          decision: Deallocate) -> None:
        """A run that failed its health check: cancelled, its booking released (a blueprint agent's stays with its
        job), and said in the store's event log, as a Prefect event and as a DEALLOCATION notification."""
        job_id, message = str(flow_run.id), decision.message
        self.get_flow_run_logger(flow_run).error("%s; cancelling the run and releasing its booking", message)
        try:
            await self.client.set_flow_run_state(flow_run.id, Cancelling(message=message[:5000]), force=True)
        except Exception as error:  # released all the same: the run's end releases nothing twice
            self._logger.warning("could not cancel unhealthy run %s: %s", job_id, error)
        if decision.release:
            await self._release_run(flow_run, placement, copy, verdict)
        await self._in_store(self._cluster.record_event, Event(kind="allocation.deallocated", node=placement.node,
                                                               job_id=job_id, reason=verdict))
        events.allocation("deallocated", job_id, node_name=placement.node, reason=verdict,
                          held=visibility.summary(placement))
        notify.publish("DEALLOCATION", "mn.allocation.deallocated", node=placement.node, job_id=job_id,
                       reason=verdict)

    async def _launch(self, flow_run, configuration: MNJobConfiguration, placement: Placement,
                      task_status) -> ProcessWorkerResult:
        """Start the run with the driver its placement names, after checking again what placement could only
        check from afar: that this worker can launch the driver, and that every volume source still resolves
        inside the node's host paths (a symlink swapped in since would escape them). Raises LaunchRefused."""
        driver = placement.allocation.runtime_driver or HOST_LOCAL
        launcher = self._launchers.get(driver)
        if launcher is None:
            raise LaunchRefused(refusal(driver, self._launchers))
        escapes = await anyio.to_thread.run_sync(volume_escapes, placement.allocation.volumes, self._node.host_paths)
        if escapes:
            raise LaunchRefused("; ".join(escapes))
        if task_status is None:
            task_status = anyio.TASK_STATUS_IGNORED
        launch = Launch(flow_run=flow_run, placement=placement, node=self._node, image=configuration.image,
                        command=configuration.command or "", run_env={**configuration.run_env, **self._store_env},
                        working_dir=str(configuration.working_dir) if configuration.working_dir else None,
                        client=self.client, log=self.get_flow_run_logger(flow_run),
                        run_process=lambda status: super(MNWorker, self).run(flow_run, configuration, status))
        return await launcher.launch(launch, task_status)

    async def _refuse_launch(self, flow_run, placement: Placement, reason: str, task_status) -> None:
        """A run its node cannot start as placed: it fails (never started some other way), with the reason and
        an event; the booking of a flow run is released by run()'s cleanup, a blueprint agent's by its job."""
        message = f"mn: not started on {placement.node}: {reason}"
        self.get_flow_run_logger(flow_run).error(message)
        visibility.emit_placement(visibility.LAUNCH_REFUSED, flow_run.id, placement.node,
                                  {"reason": reason, "runtime_driver": placement.allocation.runtime_driver},
                                  run_name=flow_run.name, work_pool=self._work_pool)
        await self.client.set_flow_run_state(flow_run.id, Failed(message=message[:5000]), force=True)
        if task_status is not None:
            task_status.started(LaunchRefused(reason))

    async def kill_infrastructure(self, infrastructure_pid: str, configuration, grace_seconds: int = 30) -> None:
        """Stop a run's container (Prefect calls this for a run cancelled before its flow started); a host
        process is the process worker's to end."""
        if not infrastructure_pid.startswith(DOCKER_PID_PREFIX):
            return await super().kill_infrastructure(infrastructure_pid, configuration, grace_seconds)
        container_id = infrastructure_pid[len(DOCKER_PID_PREFIX):]
        if not await anyio.to_thread.run_sync(docker_io.stop_container, container_id, grace_seconds):
            raise InfrastructureNotFound(f"container {container_id} not found")

    async def _sweep_orphaned_containers(self) -> None:
        """Containers of this node left by a worker that stopped without removing them (killed, say): removed,
        and their runs, which no worker watches any more, marked Crashed (the sweep then releases them)."""
        try:
            removed = await anyio.to_thread.run_sync(docker_io.sweep_orphans, self._node.name, (), self._logger)
        except Exception as error:
            self._logger.warning("could not sweep this node's orphaned containers: %s", error)
            return
        for run_id in removed:
            if not is_uuid(run_id):
                continue
            try:
                run = await self.client.read_flow_run(uuid.UUID(run_id))
                if run.state is None or run.state.type not in TERMINAL_RUN_STATES:
                    await self.client.set_flow_run_state(run.id, Crashed(
                        message=f"mn: its container on {self._node.name} outlived its worker and was removed"),
                        force=True)
                    notify.publish("OFFLINE", "mn.run.crashed", node=self._node.name, job_id=run_id,
                                   reason="its container outlived its worker")
            except ObjectNotFound:
                continue

    async def _propose_crashed_state(self, flow_run, message: str, client=None) -> None:
        """Prefect's crash report, then an OFFLINE notification when the run did end Crashed (a run that already
        failed is not crashed again)."""
        await super()._propose_crashed_state(flow_run, message, client)
        try:
            state = (await self.client.read_flow_run(flow_run.id)).state
        except Exception:  # deleted meanwhile, or the API is away: nothing to tell
            return
        if state is not None and state.is_crashed():
            notify.publish("OFFLINE", "mn.run.crashed", node=self._node.name, job_id=str(flow_run.id), reason=message)

    async def _release(self, flow_run_id, why: str, *, run_name: str | None = None) -> None:
        count = await self._in_store(self._place.release, str(flow_run_id))
        self._configs.pop(flow_run_id, None)
        self._first_seen.pop(flow_run_id, None)
        if count:  # this call released the booking: the one released event
            visibility.emit_placement(visibility.RELEASED, flow_run_id, self._node.name, {"reason": why},
                                      run_name=run_name, work_pool=self._work_pool)
            self._logger.info("released the booking of run %s on %s (%s)", flow_run_id, self._node.name, why)

    async def _release_run(self, flow_run, placement: Placement, copy: SystemCopyVariable | None, why: str) -> None:
        """A run is over: its booking is released, or for a system run or one of its copies its node's part."""
        if copy is None and placement.locality != "system":
            await self._release(flow_run.id, why, run_name=flow_run.name)
            return
        self._configs.pop(flow_run.id, None)
        self._first_seen.pop(flow_run.id, None)
        await self._release_part(copy.job_id if copy is not None else str(flow_run.id), placement.node, why,
                                 run_id=flow_run.id, run_name=flow_run.name)

    async def _release_part(self, job_id: str, node: str, why: str, *, run_id, run_name: str | None = None) -> None:
        """Release system run ``job_id``'s part on ``node``: the copies on other nodes keep theirs, and the
        booking is gone with its last part."""
        def release() -> int:
            count = self._cluster.release(job_id, node=node)
            if count:
                self._place.refresh()  # the placer's view still holds the part (it releases whole bookings only)
            return count

        if await self._in_store(release):  # this call released it: the one released event
            visibility.emit_placement(visibility.RELEASED, run_id, node, {"reason": why, "booking": job_id},
                                      run_name=run_name, work_pool=self._work_pool)
            self._logger.info("released the part on %s of run %s's booking (%s)", node, job_id, why)

