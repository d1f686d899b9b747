"""The background queue behind events' Emitter and notify's Outbox (mn_prefect/background.py)."""

from __future__ import annotations

import threading
import time

from mn_prefect.background import Background


def test_a_full_queue_drops_the_new_item_counts_it_and_says_so():
    told = []
    box = Background(lambda items: None, name="t", capacity=1, threads=0, on_drop=told.append)
    assert box.put("a") is True and box.put("b") is False
    assert (box.dropped, box.pending, told) == (1, 1, ["b"])


def test_flush_waits_for_everything_handled_and_gives_up_at_its_deadline():
    gate = threading.Event()
    handled: list[str] = []
    box = Background(lambda items: (gate.wait(), handled.extend(items)), name="t", capacity=10)
    box.put("a")
    box.put("b")
    started = time.monotonic()
    assert box.flush(0.2) == 2 and time.monotonic() - started < 2  # held: both still pending at the deadline
    gate.set()
    assert box.flush(10) == 0 and handled == ["a", "b"]


def test_a_batch_gathers_what_is_queued_and_flush_hurries_it():
    batches: list[list[int]] = []
    box = Background(batches.append, name="t", capacity=100, batch=10, linger_s=30)
    for n in range(3):
        box.put(n)
    assert box.flush(10) == 0  # it would linger 30 s for more without the flush
    assert sum(batches, []) == [0, 1, 2] and len(batches) <= 3


def test_a_failing_handler_costs_its_items_not_the_thread():
    errors: list[tuple[list[str], str]] = []
    handled: list[str] = []

    def handle(items: list[str]) -> None:
        if items == ["bad"]:
            raise RuntimeError("boom")
        handled.extend(items)

    box = Background(handle, name="t", capacity=10, on_error=lambda items, error: errors.append((items, str(error))))
    box.put("bad")
    assert box.flush(10) == 0
    box.put("good")
    assert box.flush(10) == 0
    assert errors == [(["bad"], "boom")] and handled == ["good"]


def test_the_threads_start_on_first_use_as_daemons_with_their_names():
    box = Background(lambda items: None, name="mn-test-bg-{n}", capacity=10, threads=2)
    assert not [t for t in threading.enumerate() if t.name.startswith("mn-test-bg-")]
    box.put(1)
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("mn-test-bg-"))
    assert names == ["mn-test-bg-0", "mn-test-bg-1"]
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("mn-test-bg-"))
