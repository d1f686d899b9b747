"""A hold under racing processes, on SQLite, Redis and PostgreSQL (real servers): eight OS processes, each with its
own store, start together; four place 1-GPU runs with plain commits, two place 1-GPU backfills over the hold, and two
release the runs that kept GPUs busy while the others place. The plain placers read their views before the hold is
booked, so their first plans take the held node's free GPU: the store's one commit rule, not the planner, must keep
them off it. And it must let through all it allows: every GPU outside the hold goes to a run, every held GPU to a
backfill over the hold, each to one run only."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from multiprocessing.connection import wait
from pathlib import Path

from holds_racers import (
    BACKFILLERS,
    HELD_GPUS,
    HOLD_ID,
    NODES,
    PLACERS,
    RELEASERS,
    TIMEOUT_S,
    busy_runs,
    place_until_full,
    release_busy,
    the_hold,
)
from stores import store_url

from mn_prefect.model.placement import Placement
from mn_prefect.store import open_store
from mn_prefect.store.audit import audit


def watch(processes, barrier) -> threading.Event:
    """Break the barrier as soon as a process ends with an error, so that the others and the test stop waiting for it
    at once and the test names it; returns the event that stops the watching."""
    done = threading.Event()

    def watching() -> None:
        alive = {p.sentinel: p for p in processes}
        while alive and not done.is_set():
            for sentinel in wait(list(alive), timeout=0.2):
                if alive.pop(sentinel).exitcode != 0:
                    barrier.abort()
                    return

    threading.Thread(target=watching, daemon=True).start()
    return done


def race(url: str, tmp_path: Path, store) -> list[dict]:
    """Start the eight processes, book the hold once each has read the store, let them go together, wait for each
    to exit, and return what each placing process wrote."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PLACERS + BACKFILLERS + RELEASERS + 1)
    changed = ctx.Condition()  # notified at every run placed
    placed, released = ctx.Value("i", 0, lock=False), ctx.Value("i", 0)  # placed: read and written under changed
    roles = ["plain"] * PLACERS + ["backfill"] * BACKFILLERS
    outs = [tmp_path / f"won-{i}.json" for i in range(len(roles))]
    shared = (barrier, changed, placed, released)
    processes = [ctx.Process(target=place_until_full, args=(url, role, f"{role}{i}", *shared, out))
                 for i, (role, out) in enumerate(zip(roles, outs, strict=True))]
    processes += [ctx.Process(target=release_busy, args=(url, i, *shared)) for i in range(RELEASERS)]
    for p in processes:
        p.start()
    watching = watch(processes, barrier)
    try:
        barrier.wait(TIMEOUT_S)
        assert store.commit_plan(HOLD_ID, [the_hold(time.time() + 3600)]).ok
        barrier.wait(TIMEOUT_S)
    except threading.BrokenBarrierError:
        for p in processes:
            p.join(5)
        raise AssertionError(f"a process ended before the race began: exit codes {[p.exitcode for p in processes]}"
                             " (its traceback is in the captured stderr)") from None
    finally:
        watching.set()
    deadline = time.monotonic() + TIMEOUT_S
    for p in processes:
        p.join(max(deadline - time.monotonic(), 0.0))
    hung = [p.name for p in processes if p.is_alive()]
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"still running after {TIMEOUT_S:.0f} s: {hung}"
    assert [p.exitcode for p in processes] == [0] * len(processes)
    return [{"role": role, **json.loads(out.read_text())} for role, out in zip(roles, outs, strict=True)]


def gpus_by_node(placements: list[Placement]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in placements:
        if p.resources.gpu_count:
            out[p.node] = out.get(p.node, 0) + p.resources.gpu_count
    return out


def test_racing_plain_commits_never_take_held_gpus_and_backfills_take_exactly_those(backend, request, tmp_path):
    url = store_url(backend, request, tmp_path)
    store = open_store(url)
    for n in NODES:
        store.register_node(n)
    for run in busy_runs():
        assert store.commit_plan(run.job_id, [run]).ok

    racers = race(url, tmp_path, store)

    won = [job for racer in racers for job in racer["won"]]
    placements = store.active_placements()
    hold = [p for p in placements if p.hold]
    over = [p for p in placements if p.over_hold]
    plain = [p for p in placements if not p.hold and not p.over_hold]
    assert sorted(p.job_id for p in over + plain) == sorted(won)  # each winner booked once; every busy run released
    capacity = {n.name: len(n.devices) for n in NODES}
    held, beside, inside = gpus_by_node(hold), gpus_by_node(plain), gpus_by_node(over)
    for name, gpus in capacity.items():
        assert beside.get(name, 0) + held.get(name, 0) <= gpus, name  # no plain run on held capacity
        assert inside.get(name, 0) <= held.get(name, 0), name  # backfills only where the hold is, within it
    assert (held, beside, inside) == ({"h": HELD_GPUS}, {"f1": 4, "f2": 4}, {"h": HELD_GPUS})
    assert all(p.over_hold == HOLD_ID and p.ends_by is not None for p in over)
    devices = [d.id for p in over + plain for d in p.allocation.devices]
    assert len(devices) == len(set(devices)) == sum(capacity.values())
    assert audit(store.consistent_view()) == []
    assert all("h" in racer["refused_on"] for racer in racers if racer["role"] == "plain")  # the store said no
    store.close()
