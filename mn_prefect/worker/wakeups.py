"""Wake-ups: a store change, or Prefect's event of a new run in the pool, polls at once (the poll loop stays the
safety net). ``Wakeups`` watches the store on its own connection and polls when a run was committed onto this node,
or when capacity freed while runs wait; ``run_events.RunEvents`` follows Prefect's event stream.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread

from mn_prefect.placement.placing import Placer
from mn_prefect.settings import WAKEUPS_VAR, wakeups_enabled
from mn_prefect.store.base import CAPACITY, PLACED, ChangeWatcher, ClusterStore
from mn_prefect.worker.run_events import RunEvents, wake_poll

# A wake-up's watcher holds a thread at most this long per wait: a stop waits no longer for it.
WAKEUP_WAIT_SECONDS = 1.0
# After the first change of a burst (a release and the commits it lets through), its rest is gathered this long
# into the same poll.
WAKEUP_GATHER_SECONDS = 0.02
# A run committed onto this node that the wake-up's poll did not return is polled for once more after this long.
# Prefect's poll (on PostgreSQL) skips the runs whose rows another transaction holds (FOR UPDATE SKIP LOCKED), and
# the worker that placed the run may still be writing its tags and labels, or its copy's, when this one polls.
PLACED_REPOLL_SECONDS = 1.0


class Wakeups:
    """The wake-ups of node ``node``'s worker. ``poll``: the worker's poll (its submitted runs); ``stopping``
    and ``scheduled_seen`` (the Scheduled runs of the pool in the last poll) are read at each change; ``spawn``
    starts a side task, ``spawn(fn, *args)`` calling ``fn(*args, scope)``, that the worker's stop cancels."""

    def __init__(self, *, store: ClusterStore, placer: Placer, node: str, poll: Callable[[], Awaitable[Any]],
                 stopping: Callable[[], bool], scheduled_seen: Callable[[], int], spawn: Callable[..., None],
                 logger: Any, run_logger: Callable[[Any], Any], pool_id: Callable[[], Any] = lambda: None):
        self._store, self._placer, self._node, self._poll = store, placer, node, poll
        self._pool_id = pool_id
        self._stopping, self._scheduled_seen, self._spawn = stopping, scheduled_seen, spawn
        self._logger, self._run_logger = logger, run_logger

    async def start(self) -> None:
        """Unless MN_WAKEUPS is off: follow Prefect's events of runs made Scheduled in the pool (run_events.py), and
        watch the store (its own connection, outside the worker's store lock); a store that cannot be watched
        leaves the worker on polls and run events."""
        if not wakeups_enabled():
            self._logger.info("wake-ups are off (%s=off): runs are placed and started on polls only", WAKEUPS_VAR)
            return
        self._spawn(RunEvents(pool_id=self._pool_id, poll=self._poll, stopping=self._stopping, logger=self._logger,
                              run_logger=self._run_logger, group=self._placer.group or "").run)
        try:
            watcher = await anyio.to_thread.run_sync(functools.partial(self._store.changes, node=self._node))
        except Exception as error:
            self._logger.warning("cannot watch the store for changes (%s): runs are placed and started on polls "
                                 "and Prefect's run events only", error)
            return
        self._spawn(self._wake_on_changes, watcher)

    async def _wake_on_changes(self, watcher: ChangeWatcher, scope: anyio.CancelScope) -> None:
        """Poll at once when a run was committed onto this node, or when capacity freed while runs of the pool
        wait. One wake-up poll at a time: the changes that come during it are one more poll after it."""
        try:
            with scope:
                while not self._stopping():
                    try:
                        # Not abandoned on cancel: a stop waits for the wait (WAKEUP_WAIT_SECONDS), then closes it.
                        seen = await anyio.to_thread.run_sync(watcher.wait, WAKEUP_WAIT_SECONDS)
                        heard = time.monotonic()  # the wake-up latency (metrics) counts from here
                        if seen:
                            await anyio.sleep(WAKEUP_GATHER_SECONDS)
                            seen |= await anyio.to_thread.run_sync(watcher.wait, 0.0)
                    except Exception as error:  # watchers report lost connections; anything else ends the watch
                        self._logger.warning("stopped watching the store for changes (%s): runs are placed and "
                                             "started on polls only", error)
                        return
                    if CAPACITY in seen:
                        self._placer.invalidate()  # a refusal read before this change is no longer believed
                    if PLACED in seen or (seen and self._scheduled_seen()):  # freed capacity matters to waiting runs
                        await self._poll_on_change(seen, heard)
        finally:
            watcher.close()

    async def _poll_on_change(self, seen: frozenset[str], heard: float) -> None:
        if self._stopping():
            return
        what = f"a store change ({' and '.join(sorted(seen))})"
        change, group = PLACED if PLACED in seen else CAPACITY, self._placer.group or ""
        submitted = await wake_poll(self._poll, what, change=change, group=group, heard=heard, logger=self._logger,
                                    run_logger=self._run_logger)
        if PLACED in seen and submitted == [] and not self._stopping():  # its run may be locked (see above)
            await anyio.sleep(PLACED_REPOLL_SECONDS)
            if not self._stopping():
                await wake_poll(self._poll, f"{what}, polled again", change=change, group=group, heard=heard,
                                logger=self._logger, run_logger=self._run_logger)
