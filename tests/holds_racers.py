"""The racing processes of test_holds_race, in a module of their own: a spawned process imports only this (and the
builders), never a conftest, whose name another test directory's conftest may hold in that process's path."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from builders import gpu, node

from mn_prefect.model.placement import Allocation, PlacedResources, Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.holding import place_over, read_holds
from mn_prefect.placement.placing import Placer
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store

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
