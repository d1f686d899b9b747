"""Waiting in a serving command (``mn-api serve``, ``metrics serve``) until Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import time

WAKE_SECONDS = 0.2


def wait_until_stopped() -> None:
    """Block until SIGINT or SIGTERM arrives. The handlers only note it: a handler that took a lock (an Event's)
    could wait on one this very thread holds. The main thread sleeps in short steps, not on a lock: the kernel may
    hand the signal to any thread (gRPC's, an event emitter's), and Python runs the handler only when the main
    thread next looks, which a wait on a lock never does (a server that ignored SIGTERM, rarely)."""
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    while not stopping:
        time.sleep(WAKE_SECONDS)
