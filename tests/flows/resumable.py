"""A preemptible flow of three tasks whose results persist (mn-prefect turns persistence on for a preemptible
run): each task appends a line to ``<out>/<run>.steps``; the third waits for a barrier, and if it is told it is
preempted meanwhile it says it checkpointed, then waits to be stopped."""

import time
from pathlib import Path

from prefect import flow, task
from prefect.runtime import flow_run

from mn_prefect import checkpointed, preemption


def _note(out_dir: str, line: str) -> None:
    with (Path(out_dir) / f"{flow_run.id}.steps").open("a") as steps:
        steps.write(line + "\n")


@task
def step(out_dir: str, n: int, barrier: str) -> int:
    _note(out_dir, f"step {n}")
    told = False
    while n == 3 and not Path(barrier).exists():
        if not told and preemption() is not None:
            told = True
            _note(out_dir, f"notice {preemption().seconds_left:.0f}")
            checkpointed()  # steps 1 and 2 are persisted: nothing more to keep
        time.sleep(0.1)
    return n


@flow(name="resumable")
def resumable(out_dir: str, barrier: str) -> list[int]:
    return [step(out_dir, n, barrier) for n in (1, 2, 3)]
