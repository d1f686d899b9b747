"""The lab's Prefect server on SQLite collects garbage off its event loop (mn_prefect/lab_server.py).

The stall it avoids, in miniature: a connection waits for the database's write lock in a thread of its own (as
aiosqlite runs each connection), holding its mutex, until the event loop commits the transaction that holds the
lock or its busy timeout passes; a cursor of that connection is garbage in a reference cycle, and freeing it takes
the mutex (SQLite's statement reset; here a lock, so that the timing is exact). A collection on the loop's thread
stops the loop until the wait gives up, and the commit it would have made never comes in time. Collected from a
thread of its own, the loop goes on and commits, and the wait ends with the commit. A lab server's stack during
such a stall (py-spy, native frames) showed exactly this: the loop's thread in ``pthread_mutex_lock`` under
``sqlite3_reset``, called from the collector, while a connection's thread slept in SQLite's busy handler."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from mn_prefect.lab_server import collect_off_the_loop, due_generation

BUSY_TIMEOUT_S = 2.0


@pytest.mark.parametrize("counts, thresholds, due", [
    ((0, 0, 0), (700, 10, 10), None),
    ((700, 9, 9), (700, 10, 10), None),  # the interpreter collects once the youngest passes its threshold
    ((701, 0, 0), (700, 10, 10), 0),
    ((701, 11, 0), (700, 10, 10), 1),
    ((701, 11, 11), (700, 10, 10), 2),
    ((701, 0, 11), (700, 10, 10), 2),
    ((5000, 50, 50), (0, 10, 10), None),  # a threshold of 0 turns collection off
])
def test_the_collector_takes_the_generation_the_interpreter_would(counts, thresholds, due):
    assert due_generation(counts, thresholds) == due


class _BusyConnection:
    """A SQLite connection waiting for the write lock, as one of aiosqlite's threads holds it: its mutex is taken
    until the lock comes free (``committed``, which only the event loop sets) or its busy timeout passes."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.committed = threading.Event()
        self.waited = 0.0
        self._taken = threading.Event()
        self._thread = threading.Thread(target=self._wait)
        self._thread.start()
        self._taken.wait()

    def _wait(self) -> None:
        with self.mutex:
            self._taken.set()
            start = time.monotonic()
            self.committed.wait(BUSY_TIMEOUT_S)
            self.waited = time.monotonic() - start

    def join(self) -> None:
        self._thread.join()


class _Cursor:
    """A cursor of that connection: freeing it resets its statement, which takes the connection's mutex."""

    def __init__(self, connection: _BusyConnection) -> None:
        self.connection = connection
        self.cycle = self  # garbage only the cyclic collector frees

    def __del__(self) -> None:
        with self.connection.mutex:
            pass


def _stall(collect_on_the_loop: bool) -> tuple[float, float]:
    """(the longest the event loop went without running, how long the connection waited for its lock)."""
    stop = threading.Event()
    thresholds = gc.get_threshold()
    gc.disable()  # nothing collects before the scenario says so
    collector = None
    try:
        connection = _BusyConnection()
        _Cursor(connection)

        async def scenario() -> float:
            longest, last = 0.0, time.monotonic()
            for tick in range(30):
                if tick == 2 and collect_on_the_loop:
                    gc.collect()
                if tick == 5:
                    connection.committed.set()  # what the loop does next: the holder commits, the lock is free
                await asyncio.sleep(0.02)
                now = time.monotonic()
                longest, last = max(longest, now - last), now
            return longest

        if not collect_on_the_loop:
            gc.set_threshold(1, 1, 1)  # so that the collector thread takes the garbage at once
            collector = threading.Thread(target=collect_off_the_loop, args=(0.05, stop))
            collector.start()
        longest = asyncio.run(scenario())
        connection.join()
    finally:
        stop.set()
        if collector is not None:
            collector.join()
        gc.set_threshold(*thresholds)
        gc.enable()
    return longest, connection.waited


def test_a_collection_on_the_event_loop_stalls_it_until_the_waiting_connection_gives_up():
    longest, waited = _stall(collect_on_the_loop=True)
    assert longest >= BUSY_TIMEOUT_S * 0.9 and waited >= BUSY_TIMEOUT_S * 0.9


def test_collected_off_the_event_loop_the_loop_goes_on_commits_and_the_wait_ends_with_the_commit():
    longest, waited = _stall(collect_on_the_loop=False)
    assert longest < BUSY_TIMEOUT_S / 2 and waited < BUSY_TIMEOUT_S / 2
