"""``prefect server start`` as a lab on SQLite runs it: Prefect's own server, its garbage collector off the event loop.

Prefect's server reaches SQLite through aiosqlite: one thread per connection, the event loop waiting on them. A
cursor caught in a reference cycle is freed by the cyclic garbage collector wherever a collection runs, most often
on the event loop's thread, and freeing it resets its statement, which takes its connection's mutex. When that
connection's thread is waiting meanwhile for the database's write lock (SQLite keeps the mutex while it waits), the
event loop stops until the wait gives up: Prefect's busy timeout, 60 s. The transaction that holds the write lock
needs that same event loop to commit, so every request, heartbeat and background task of the server waits out the
60 s (seen as ``mark_work_queues_ready`` failing after 60 s with "database is locked", workers that do not register
in time, runs that start a minute late). Here automatic collection is off and a thread of its own collects: a
collection that has to wait for a connection waits there, and the event loop goes on (docs/prefect.md).

Usage: python -m mn_prefect.lab_server server start [prefect's options]
"""

from __future__ import annotations

import gc
import sys
import threading

COLLECT_EVERY_S = 0.25


def collect_off_the_loop(every: float = COLLECT_EVERY_S, stop: threading.Event | None = None) -> None:
    """Collect as the interpreter would (the oldest generation whose count passed its threshold), from this
    thread, until ``stop`` is set (forever without one)."""
    stop = stop or threading.Event()
    while not stop.wait(every):
        generation = due_generation(gc.get_count(), gc.get_threshold())
        if generation is not None:
            gc.collect(generation)


def due_generation(counts: tuple[int, int, int], thresholds: tuple[int, int, int]) -> int | None:
    """The generation a collection would take now: none until the youngest passed its threshold, then the oldest
    that passed its own."""
    if thresholds[0] == 0 or counts[0] <= thresholds[0]:
        return None
    return next(g for g in (2, 1, 0) if g == 0 or counts[g] > thresholds[g])


def main() -> None:
    gc.disable()
    threading.Thread(target=collect_off_the_loop, name="mn-gc", daemon=True).start()
    from prefect.cli import app

    sys.argv[0] = "prefect"
    app()


if __name__ == "__main__":
    main()
