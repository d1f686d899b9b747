"""The worker's wake-ups on store changes (mn_prefect/worker/wakeups.py): a run committed onto this node that the
wake-up's poll did not return is polled for once more. Prefect's poll on PostgreSQL skips the runs whose rows
another transaction holds (FOR UPDATE SKIP LOCKED), as when the worker that placed the run is still writing its
tags; the lab test in test_wakeups.py meets that on a real server. Here the watcher and the poll are plain objects."""

from __future__ import annotations

import logging
import threading

import anyio
import pytest

from mn_prefect.store.base import CAPACITY, PLACED
from mn_prefect.worker import wakeups
from mn_prefect.worker.wakeups import Wakeups


class Watcher:
    """Hands out the given change sets one per wait, then nothing (each empty wait takes its timeout)."""

    def __init__(self, *changes: frozenset[str]):
        self.changes = list(changes)
        self.closed = threading.Event()

    def wait(self, timeout: float) -> frozenset[str]:
        if self.changes:
            return self.changes.pop(0)
        self.closed.wait(timeout)
        return frozenset()

    def close(self) -> None:
        self.closed.set()


class Placer:
    group = "g"

    def invalidate(self) -> None:
        pass


async def _wake(watcher: Watcher, answers: list[list[str]], seconds: float = 0.6, *,
                waiting: int = 0) -> tuple[list[float], list]:
    """Run the store-change wake-ups for ``seconds``; each poll answers the next of ``answers`` (then []).
    ``waiting``: the Scheduled runs the worker's last poll saw."""
    polls: list[float] = []
    lines: list[tuple[str, str]] = []

    async def poll():
        polls.append(anyio.current_time())
        return answers.pop(0) if answers else []

    class RunLog:
        def __init__(self, run):
            self.run = run

        def info(self, message, *args):
            lines.append((self.run, message % args))

    waking = Wakeups(store=None, placer=Placer(), node="n1", poll=poll, stopping=lambda: False,
                     scheduled_seen=lambda: waiting, spawn=lambda *a: None, logger=logging.getLogger("t"),
                     run_logger=RunLog)
    with anyio.move_on_after(seconds):
        await waking._wake_on_changes(watcher, anyio.CancelScope())
    return polls, lines


@pytest.fixture(autouse=True)
def short_repoll(monkeypatch):
    monkeypatch.setattr(wakeups, "PLACED_REPOLL_SECONDS", 0.1)
    monkeypatch.setattr(wakeups, "WAKEUP_WAIT_SECONDS", 0.05)


@pytest.mark.anyio
async def test_a_placed_change_whose_poll_finds_nothing_polls_once_more_and_the_run_says_so():
    polls, lines = await _wake(Watcher(frozenset({PLACED})), [[], ["copy"]])
    assert len(polls) == 2 and polls[1] - polls[0] >= 0.1
    assert lines == [("copy", "mn: submitted on a store change (placed), polled again, before the next poll")]


@pytest.mark.anyio
async def test_a_placed_change_whose_poll_submits_is_not_polled_again():
    polls, lines = await _wake(Watcher(frozenset({PLACED})), [["run"], ["other"]])
    assert len(polls) == 1
    assert lines == [("run", "mn: submitted on a store change (placed), before the next poll")]


@pytest.mark.anyio
async def test_a_placed_change_polled_again_finds_nothing_and_stops_there():
    polls, lines = await _wake(Watcher(frozenset({PLACED})), [])
    assert len(polls) == 2 and lines == []


@pytest.mark.anyio
async def test_freed_capacity_whose_poll_finds_nothing_is_not_polled_again():
    """Capacity freed elsewhere wakes every worker with waiting runs: most have nothing to start, and polling
    them all twice would double the server's work for nothing."""
    polls, lines = await _wake(Watcher(frozenset({CAPACITY})), [], waiting=3)
    assert len(polls) == 1 and lines == []
    polls, _ = await _wake(Watcher(frozenset({CAPACITY, PLACED})), [], waiting=3)
    assert len(polls) == 2  # a placed change in the same burst still gets its second look
