"""The node's membership of the cluster, for its worker: ``Membership`` opens the store (waiting while it is away),
creates the pool's group, registers the node (or refuses to start), heartbeats, holds the pool's announcer lease,
stops on SIGTERM within a deadline, and leaves the cluster when the worker stops.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import anyio
import anyio.to_thread
from prefect.exceptions import ObjectNotFound

from mn_prefect import events, notify
from mn_prefect.lifecycle import health
from mn_prefect.lifecycle.leader import Leadership, default_owner
from mn_prefect.lifecycle.states import heartbeat
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.node_status import SCHEDULABLE_STATES
from mn_prefect.store import ClusterStore, open_store
from mn_prefect.store.base import StoreUnavailable, UnknownGroup
from mn_prefect.store.groups import reported_group
from mn_prefect.worker.sweeps import InStore

HEARTBEAT_SECONDS_VAR = "MN_HEARTBEAT_SECONDS"
STORE_BLOCK_VAR = "MN_STORE_BLOCK"
ANNOUNCER_LEASE_SECONDS = 30.0
# Each step of a stop (leaving the cluster, putting back one half-launched run) gets this long, so a store or
# API that does not answer cannot hold the process past what a supervisor's SIGTERM-to-SIGKILL window allows.
STOP_STEP_SECONDS = 5.0
# The whole stop after SIGTERM: well inside the 90 s a supervisor (systemd, docker stop -t) usually allows.
STOP_DEADLINE_SECONDS = 45.0
# A worker started while its store is away waits this long for it before it gives up.
STORE_START_WAIT_SECONDS = 60.0
STORE_START_WAIT_VAR = "MN_STORE_START_WAIT_SECONDS"


class Membership:
    """The membership of the node of a worker of pool ``pool``. ``store`` and ``node`` are None until
    ``open_store`` and ``register``; ``store_lock`` is the one ``in_store`` holds (the heartbeat thread takes it
    too); ``client`` and ``work_pool`` are read at each use."""

    def __init__(self, *, pool: str, logger: Any, store_lock: threading.Lock, in_store: InStore,
                 client: Callable[[], Any], work_pool: Callable[[], Any]):
        self._pool, self._logger, self._store_lock, self._in_store = pool, logger, store_lock, in_store
        self._client, self._work_pool = client, work_pool
        self.store: ClusterStore | None = None
        self.node: NodeRecord | None = None
        self._announcer: Leadership | None = None
        self._announcer_checked = (-float("inf"), False)
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._stopping_since: float | None = None

    @property
    def _cluster(self) -> ClusterStore:
        if self.store is None:
            raise RuntimeError("the mn worker has no store yet: setup() has not run")
        return self.store

    @property
    def _node(self) -> NodeRecord:
        if self.node is None:
            raise RuntimeError("the mn worker has no node yet: setup() has not run")
        return self.node

    def node_changed(self, record: NodeRecord) -> None:
        """This node's record as last written (its services' status)."""
        self.node = record

    # -- joining ----------------------------------------------------------------------------------------

    async def open_store(self) -> ClusterStore:
        """The store of block MN_STORE_BLOCK when it is set, else of the environment's URL."""
        block = os.environ.get(STORE_BLOCK_VAR)
        if block:
            from mn_prefect.blocks import MNClusterStore

            loaded: object = await MNClusterStore.aload(block)  # typed loosely: Prefect's decorator loses Self
            if not isinstance(loaded, MNClusterStore):
                raise TypeError(f"block {block!r} is a {type(loaded).__name__}, not an MNClusterStore")
            self.store = await self._open_store_waiting(loaded.open)
        else:
            self.store = await self._open_store_waiting(open_store)
        return self.store

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

    async def create_pool_group(self) -> None:
        """An ``mn`` pool has a group of its name (docs/operating.md, "Resource groups"); a pool created with ``prefect
        work-pool create`` gets it here, when its first worker starts. Only for a pool that exists on the server.
        A group already in the store needs no word from the API: a worker restarted while the API is away
        registers its node and heartbeats at once, rather than after the API calls' retries."""
        pool = self._pool
        if self._work_pool() is None:  # the base setup could not read it (the API did not answer yet)
            try:
                groups = await self._in_store(self._cluster.list_groups)
            except Exception as error:  # registration says what the store has
                self._logger.warning("could not read the store's groups: %s", error)
                groups = []
            if any(group.name == pool for group in groups):
                return
            try:
                await self._client().read_work_pool(pool)
            except ObjectNotFound:
                return
            except Exception as error:  # the group may exist already: registration says whether it does
                self._logger.warning("could not read work pool %s to create its group: %s", pool, error)
                return
        try:
            if await self._in_store(self._cluster.create_group, pool):
                self._logger.info("created resource group %s for work pool %s", pool, pool)
        except ValueError as error:
            await self.refuse_start(error)

    async def register(self, local: NodeRecord) -> NodeRecord:
        """Register this machine's node (in the group it reports, its services unproven until probed)."""
        store, pool = self._cluster, self._pool
        try:
            local = local.model_copy(update={"group": reported_group(local, pool, os.environ),
                                             "services": health.unproven(local.services)})
            self.node = node = await self._in_store(store.register_node, local)
        except (UnknownGroup, ValueError) as error:
            await self.refuse_start(error)
        self._logger.info("mn worker on node %s (group %s, %d devices, drivers %s), store %s", node.name, node.group,
                          len(node.devices), ", ".join(node.runtime_drivers), store.url.safe)
        if node.status == "healthy":
            notify.publish("ONLINE", "mn.node.healthy", node=node.name, reason="its worker started")
        if node.group != pool:
            self._logger.warning("node %s is in group %s, not in pool %s's group: this worker places runs of %s on "
                                 "that group's nodes, and none runs here", node.name, node.group, pool, pool)
        return node

    async def refuse_start(self, error: Exception) -> NoReturn:
        """End ``prefect worker start`` with exit 1 and the reason as its last line. Nothing has started yet
        (no run, no heartbeat). An exception cannot carry this out: raised inside the task group the base setup
        entered, it ends as a cancellation, which Prefect reports as a normal stop with exit 0."""
        self._logger.error("mn worker not started: %s", error)
        if self.store is not None:
            self.store.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def start(self) -> None:
        """Take part: the pool's announcer lease (taken at its first check) and the heartbeat thread."""
        self._announcer = Leadership(self._cluster, f"{self._node.name}:{default_owner()}",
                                     ttl_s=ANNOUNCER_LEASE_SECONDS, name=f"mn-announcer:{self._pool}")
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="mn-heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def _heartbeat_loop(self) -> None:
        interval = float(os.environ.get(HEARTBEAT_SECONDS_VAR, "10"))
        while not self._stop_heartbeat.wait(interval):
            try:
                with self._store_lock:
                    heartbeat(self._cluster, self._node.name)  # a beat that brings the node back is announced
            except Exception as error:  # the next beat may succeed; the lifecycle flows judge silence
                self._logger.warning("heartbeat failed: %s", error)

    async def is_announcer(self) -> bool:
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

    # -- stopping ---------------------------------------------------------------------------------------

    def stop_on_sigterm(self) -> None:
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

    async def leave(self) -> None:
        """No more heartbeats; a node that was registered leaves the cluster (within ``STOP_STEP_SECONDS``)."""
        self._stop_heartbeat.set()
        if self.store is not None and self.node is not None:
            with anyio.move_on_after(STOP_STEP_SECONDS, shield=True):
                await self._leave_cluster()

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
