"""A background queue: work handed off the caller's path (events.py's ``Emitter``, notify.py's ``Outbox``).

A bounded queue and daemon threads that take from it, started on first use: ``put`` never waits (a full queue
drops the new item and counts it), ``flush`` waits up to a deadline for everything queued to be handled or given
up (at exit: ``flush_at_exit``). A thread takes one item, or with ``batch`` > 1 gathers up to ``batch`` of them,
letting more arrive for ``linger_s`` after the first unless ``flush`` hurries it. A failing handler costs its
items, never the thread.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


class Background(Generic[T]):
    """Items waiting to be handled and the ``threads`` daemon threads (named ``name``, formatted with ``n``, the
    thread's number: ``"mn-notify-{n}"``) that hand them
    to ``handle``, ``batch`` at most at a time. ``on_drop(item)`` is told of each item dropped because the queue
    held ``capacity`` already; ``on_error(items, error)`` of each call of ``handle`` that raised. Counts what it
    ``dropped``; ``pending`` is what is queued or being handled."""

    def __init__(self, handle: Callable[[list[T]], None], *, name: str, capacity: int, threads: int = 1,
                 batch: int = 1, linger_s: float = 0.0, on_drop: Callable[[T], None] | None = None,
                 on_error: Callable[[list[T], Exception], None] | None = None):
        self._queue: queue.Queue[T] = queue.Queue(capacity)
        self._handle, self._on_drop, self._on_error = handle, on_drop, on_error
        self._name, self._threads = name, threads
        self._batch, self._linger_s = batch, linger_s
        self._hurry = threading.Event()  # set by flush: handle what is there now
        self._lock = threading.Condition()
        self._pending = 0  # queued or being handled
        self._started = False
        self.dropped = 0

    @property
    def capacity(self) -> int:
        return self._queue.maxsize

    @property
    def pending(self) -> int:
        """Items queued or being handled now."""
        return self._pending

    def put(self, item: T) -> bool:
        """Queue ``item``; False when the queue was full and it was dropped (counted, and ``on_drop`` told)."""
        with self._lock:
            if not self._started:
                for n in range(self._threads):
                    threading.Thread(target=self._run_forever, name=self._name.format(n=n), daemon=True).start()
                self._started = True
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.dropped += 1
                if self._on_drop is not None:
                    self._on_drop(item)
                return False
            self._pending += 1
        return True

    def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` seconds for everything queued to be handled or given up; how many are left."""
        deadline = time.monotonic() + timeout_s
        self._hurry.set()
        with self._lock:
            while self._pending and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)
            return self._pending

    def _take(self) -> list[T]:
        items = [self._queue.get()]
        if self._batch > 1:
            if self._queue.qsize() < self._batch - 1:
                # One wake-up per batch, not per item: a thread that runs Python between a caller's I/O calls
                # takes the interpreter lock from it each time, and the caller waits for it back.
                self._hurry.wait(self._linger_s)
            while len(items) < self._batch:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
        return items

    def _run_forever(self) -> None:
        while True:
            items = self._take()
            try:
                self._handle(items)
            except Exception as error:  # the thread outlives any one call
                if self._on_error is not None:
                    self._on_error(items, error)
                else:
                    log.warning("%s: %d item(s) not handled: %s: %s", self._name, len(items), type(error).__name__,
                                error)
            finally:
                with self._lock:
                    self._pending -= len(items)
                    if not self._pending:
                        self._hurry.clear()
                    self._lock.notify_all()


def flush_at_exit(flush: Callable[[float], int], wait_s: float, said: Callable[[int], None]) -> None:
    """At the process's exit, ``flush`` (a queue's) for up to ``wait_s`` seconds; ``said(left)`` tells of what
    was still left."""
    atexit.register(_flush, flush, wait_s, said)


def _flush(flush: Callable[[float], int], wait_s: float, said: Callable[[int], None]) -> None:
    left = flush(wait_s)
    if left:
        said(left)
