"""The worker's wake-ups on Prefect's run events (mn_prefect/worker/run_events.py): the rule of when to poll, with
the event stream given as a plain async iterator (the lab test in test_wakeups.py uses a real server's stream)."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import anyio
import pytest

from mn_prefect.worker.run_events import SCHEDULED_EVENTS, RunEvents, pool_filter


class Stream:
    """Event streams handed out one after another: each a list of event names, or an exception raised on
    opening; after the last, a stream that stays open with nothing on it."""

    def __init__(self, *streams):
        self.streams = list(streams)
        self.opened = 0
        self.filters = []

    @contextlib.asynccontextmanager
    async def __call__(self, event_filter):
        self.filters.append(event_filter)
        self.opened += 1
        stream = self.streams.pop(0) if self.streams else None
        if isinstance(stream, Exception):
            raise stream

        async def events():
            for name in stream or ():
                yield SimpleNamespace(event=name)
            await anyio.sleep_forever()
        yield events()


def run_events(stream: Stream, polls: list, *, pool_id="pool-1", lines=None) -> RunEvents:
    async def poll():
        polls.append(anyio.current_time())
        return [f"run-{len(polls)}"]

    class RunLog:
        def __init__(self, run):
            self.run = run

        def info(self, message, *args):
            (lines if lines is not None else []).append((self.run, message % args))

    return RunEvents(pool_id=lambda: pool_id, poll=poll, stopping=lambda: False, logger=logging.getLogger("t"),
                     run_logger=RunLog, group="g", subscribe=stream)


async def _for(seconds: float, events: RunEvents) -> None:
    with anyio.move_on_after(seconds):
        await events.run(anyio.CancelScope())


@pytest.mark.anyio
async def test_a_burst_of_new_runs_is_one_poll_and_each_submitted_run_says_what_woke_it():
    polls, lines = [], []
    stream = Stream(["prefect.flow-run.Scheduled"] * 20 + ["prefect.flow-run.AwaitingRetry"])
    await _for(0.5, run_events(stream, polls, lines=lines))
    assert len(polls) == 1
    assert lines == [("run-1", "mn: submitted on Prefect's event (AwaitingRetry, Scheduled), before the next poll")]


@pytest.mark.anyio
async def test_a_broken_stream_is_opened_again_and_its_events_still_poll(caplog):
    polls = []
    stream = Stream(ConnectionError("refused"), ["prefect.flow-run.Scheduled"])
    with caplog.at_level(logging.INFO, logger="t"):
        await _for(2.5, run_events(stream, polls))
    assert stream.opened == 2 and len(polls) == 1
    assert "cannot follow Prefect's event stream (ConnectionError: refused)" in caplog.text
    assert "Prefect's event stream is back" in caplog.text


@pytest.mark.anyio
async def test_nothing_is_followed_until_the_pool_is_known():
    polls = []
    stream = Stream(["prefect.flow-run.Scheduled"])
    await _for(0.3, run_events(stream, polls, pool_id=None))
    assert stream.opened == 0 and polls == []


def test_the_subscription_is_the_pools_scheduled_runs():
    event_filter = pool_filter("0b5e")
    assert event_filter.event.name == list(SCHEDULED_EVENTS)
    assert event_filter.any_resource.id == ["prefect.work-pool.0b5e"]
    scheduled = SimpleNamespace(event="prefect.flow-run.Scheduled", resource=SimpleNamespace(id="x"))
    assert event_filter.event.includes(scheduled)
    assert not event_filter.event.includes(SimpleNamespace(event="prefect.flow-run.Running"))
