"""Wake-ups on Prefect's own events: a run made Scheduled in this worker's pool (created, retried, put back,
resumed) is polled for at once, not at the next poll (``PREFECT_WORKER_QUERY_SECONDS``, Prefect's default 10 s).

The worker subscribes to the server's event stream (the ``/events/out`` websocket, as Prefect's own workers do to
hear of cancellations), filtered to the state events of runs related to its pool. A burst of runs is one poll,
and the events that come during a poll are one more poll after it. A stream that breaks is opened again after a
pause that doubles up to ``RECONNECT_MAX_SECONDS``; until then, and always, the poll loop is the safety net.
Off with the store's wake-ups (``MN_WAKEUPS=off``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from mn_prefect.worker import metrics

# The states of Prefect's SCHEDULED type a run of a pool can enter, by the names its events carry.
SCHEDULED_EVENTS = ("prefect.flow-run.Scheduled", "prefect.flow-run.AwaitingRetry", "prefect.flow-run.Resuming",
                    "prefect.flow-run.AwaitingConcurrencySlot")
# After the first event of a burst, the rest is gathered this long into the same poll.
GATHER_SECONDS = 0.05
RECONNECT_MAX_SECONDS = 30.0
RUN_EVENT = "run_event"  # the wake-up's kind in the metrics (mn_wakeup_latency_seconds{change})


def pool_filter(pool_id: Any) -> Any:
    """The subscription: state events of the SCHEDULED type about runs related to work pool ``pool_id``."""
    from prefect.events.filters import EventAnyResourceFilter, EventFilter, EventNameFilter

    return EventFilter(event=EventNameFilter(name=list(SCHEDULED_EVENTS)),
                       any_resource=EventAnyResourceFilter(id=[f"prefect.work-pool.{pool_id}"]))


class RunEvents:
    """``pool_id()``: the pool's id once the worker synced with the server (None before); ``poll``: the worker's
    poll (its submitted runs); ``subscribe(filter)``: an async context manager iterating events (Prefect's
    ``get_events_subscriber`` by default)."""

    def __init__(self, *, pool_id: Callable[[], Any], poll: Callable[[], Awaitable[Any]],
                 stopping: Callable[[], bool], logger: Any, run_logger: Callable[[Any], Any], group: str,
                 subscribe: Callable[[Any], Any] | None = None):
        self._pool_id, self._poll, self._stopping = pool_id, poll, stopping
        self._logger, self._run_logger, self._group = logger, run_logger, group
        self._subscribe = subscribe or _prefect_subscriber
        self._heard = anyio.Event()
        self._first_heard = 0.0
        self._names: set[str] = set()

    async def run(self, scope: anyio.CancelScope) -> None:
        """Listen and poll until the worker stops (``scope`` is cancelled)."""
        with scope:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._listen)
                await self._poll_on_events()

    async def _listen(self) -> None:
        while self._pool_id() is None and not self._stopping():
            await anyio.sleep(1.0)  # the pool is known once the worker reached the server
        pause, failing = 1.0, False
        while not self._stopping():
            try:  # the pool's id as the worker last synced it (a pool made again has another)
                async with self._subscribe(pool_filter(self._pool_id())) as events:
                    if failing:
                        self._logger.info("Prefect's event stream is back: new runs are polled for at once")
                    failing, pause = False, 1.0
                    async for event in events:
                        self._hear(event.event)
            except Exception as error:  # a server restart, a proxy without websockets: polls carry on meanwhile
                if not failing:
                    self._logger.warning("cannot follow Prefect's event stream (%s: %s): new runs wait for the next "
                                         "poll until it is back", type(error).__name__, error)
                failing = True
            await anyio.sleep(pause)
            pause = min(pause * 2, RECONNECT_MAX_SECONDS)

    def _hear(self, name: str) -> None:
        if not self._heard.is_set():
            self._first_heard = time.monotonic()
            self._heard.set()
        self._names.add(name.removeprefix("prefect.flow-run."))

    async def _poll_on_events(self) -> None:
        while not self._stopping():
            await self._heard.wait()
            await anyio.sleep(GATHER_SECONDS)
            heard, names = self._first_heard, sorted(self._names)
            self._heard, self._names = anyio.Event(), set()  # what comes during the poll is one more poll
            if self._stopping():
                return
            await wake_poll(self._poll, f"Prefect's event ({', '.join(names)})", change=RUN_EVENT, group=self._group,
                            heard=heard, logger=self._logger, run_logger=self._run_logger)


async def wake_poll(poll: Callable[[], Awaitable[Any]], what: str, *, change: str, group: str, heard: float,
                    logger: Any, run_logger: Callable[[Any], Any]) -> list[Any] | None:
    """A wake-up's poll: its latency in the metrics (``change``), and on each run it submitted a line saying
    ``what`` woke it; a failed poll is a warning (the poll loop tries again). The runs it submitted; None when
    it failed."""
    try:
        submitted = await poll()
    except Exception as error:
        logger.warning("the poll on %s failed: %s", what, error)
        return None
    metrics.woke(group, change, time.monotonic() - heard)
    for flow_run in submitted or ():
        run_logger(flow_run).info("mn: submitted on %s, before the next poll", what)
    if submitted:
        logger.info("woke on %s: submitted %d run(s)", what, len(submitted))
    else:
        logger.debug("woke on %s: nothing of this node's to submit", what)
    return list(submitted or ())


def _prefect_subscriber(event_filter: Any) -> Any:
    from prefect.events.clients import get_events_subscriber

    return get_events_subscriber(filter=event_filter, reconnection_attempts=0)
