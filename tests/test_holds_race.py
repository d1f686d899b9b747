"""A hold under racing processes, on SQLite, Redis and PostgreSQL (real servers): eight OS processes, each with its
own store, start together; four place 1-GPU runs with plain commits, two place 1-GPU backfills over the hold, and two
release the runs that kept GPUs busy while the others place. The plain placers read their views before the hold is
booked, so their first plans take the held node's free GPU: the store's one commit rule, not the planner, must keep
them off it. And it must let through all it allows: every GPU outside the hold goes to a run, every held GPU to a
backfill over the hold, each to one run only."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import time
from pathlib import Path

from builders import gpu, node
from conftest import store_url

from mn_prefect.model.placement import Allocation, PlacedResources, Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.holding import place_over, read_holds
from mn_prefect.placement.placing import Placer
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store
from mn_prefect.store.audit import audit

# h: the held node, the busiest (binpack plans there first); f1, f2: free of holds. 4 GPUs each.
NODES = [node(name, cpu=16, memory=65536, devices=[gpu(f"{name}-{i}", i) for i in range(4)])
         for name in ("h", "f1", "f2")]
BUSY = {"h": 3, "f1": 2, "f2": 2}  # GPUs taken by runs when the race starts
HOLD_ID = "hold-00000000000000aa"
HELD_GPUS = 4  # the whole of h: 3 more than is free there when it is booked
PLACERS, BACKFILLERS, RELEASERS = 4, 2, 2
TIMEOUT_S = 120.0  # a process still waiting by then has hung: the test fails instead of waiting for ever


def one_gpu(job_id: str) -> Ask:
    return Ask(agent_id=job_id, request=resource_request({"gpu": 1, "cpu": 1}))


def busy_runs() -> list[Placement]:
    return [Placement(agent_id=f"busy-{n.name}-{i}", job_id=f"busy-{n.name}-{i}", node=n.name,
                      resources=PlacedResources(cpu_cores=1, gpu_count=1), allocation=Allocation(devices=(n.devices[i],)))
            for n in NODES for i in range(BUSY[n.name])]


def the_hold(start: float) -> Placement:
    return Placement(agent_id="hold:wide", node="h", job_id=HOLD_ID, hold=HOLD_ID, hold_for="wide", hold_start=start,
                     resources=PlacedResources(cpu_cores=4, gpu_count=HELD_GPUS))


def place_until_full(url: str, role: str, name: str, barrier, changed, placed, released, out: Path) -> None:
    """One racing process: place 1-GPU runs (plain commits, or backfills over the hold) until a plan made on a view
    read after every release is refused; writes to ``out`` the ids it placed and the nodes of the commits the store
    refused it."""
    store = open_store(url)
    refused_on: list[str] = []
    commit_plan = store.commit_plan

    def noting_refusals(job_id, placements, **options):
        result = commit_plan(job_id, placements, **options)
        if result.conflict is not None and result.conflict.node:
            refused_on.append(result.conflict.node)
        return result

    store.commit_plan = noting_refusals
    # Before the hold is booked: the store's read cache knows h (a commit decided on it goes straight to the apply,
    # whose check alone must then refuse), and a plain placer's first plan takes h's free GPU.
    warm = Placement(agent_id=f"{name}-warm", job_id=f"{name}-warm", node="h", resources=PlacedResources(cpu_cores=1))
    assert store.commit_plan(warm.job_id, [warm]).ok and store.release(warm.job_id) == 1
    placer = Placer(store)
    placer.refresh()
    barrier.wait(TIMEOUT_S)  # every view read
    barrier.wait(TIMEOUT_S)  # the hold booked: go
    hold = read_holds(store)["wide"]
    assert hold.expected_start is not None
    won: list[str] = []
    for n in itertools.count():
        settled = released.value == RELEASERS  # read before the attempt: a refusal after it is final
        job = f"{name}-{n}"
        if role == "plain":
            result = placer.place(job, [one_gpu(job)])
        else:
            result = place_over(placer, job, [one_gpu(job)], hold, ends_by=hold.expected_start - 60)
        if result.placed:
            won.append(job)
            with changed:
                placed.value += 1
                changed.notify_all()
        elif result.commit is None and settled:
            break  # refused by the plan itself, not beaten to a commit: nothing is left for this kind of run
    out.write_text(json.dumps({"won": won, "refused_on": refused_on}))
    store.close()


def release_busy(url: str, index: int, barrier, changed, placed, released) -> None:
    """One releasing process: release every RELEASERS-th busy run, the j-th of them once j + 1 runs are placed (the
    racers can always place that many: one more than the releases before it), so releases land amid the placing."""
    store = open_store(url)
    barrier.wait(TIMEOUT_S)
    barrier.wait(TIMEOUT_S)
    for j, run in list(enumerate(busy_runs()))[index::RELEASERS]:
        with changed:
            assert changed.wait_for(lambda j=j: placed.value > j, timeout=TIMEOUT_S)
        assert store.release(run.job_id) == 1
    with released.get_lock():
        released.value += 1
    store.close()


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
    barrier.wait(TIMEOUT_S)
    assert store.commit_plan(HOLD_ID, [the_hold(time.time() + 3600)]).ok
    barrier.wait(TIMEOUT_S)
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
