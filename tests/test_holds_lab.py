"""Head-of-line holds through a real Prefect server and real workers: two mock nodes of 2 GPUs each, kept busy by a
stream of 1-GPU runs. With holds on (the default), a 2-GPU run that arrives behind the stream starts once the runs
on one node end, on the nodes its hold was booked on, within ENDS of the stream's ends. Counted in runs ended, not
in seconds: how many end before the hold is booked depends on when the workers poll, which load changes (eight once
on 2 busy cores, against two ahead of it and two per node), but that it starts does not. That the greedy order
(holds off) never starts it is a rule, tested in one process (tests/test_worker_rules.py).

The stream is paced by the test, not by timing: each 1-GPU run waits on a barrier file of its own, and the test ends
one run at a time, the next only once the GPU it freed was taken again (by a 1-GPU run, by the hold, or by the 2-GPU
run). So under the greedy order two GPUs of one node are never free at once, however loaded the machine."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import servers
from builders import gpu
from lab import Lab

from mn_prefect.local_lab import BIN

RUN_S = 20.0  # each 1-GPU run of the stream runs this long before the test ends it
WAITING = 2  # 1-GPU runs kept waiting behind the running ones
ENDS = 12  # the stream's runs ended before a test judges: three times the four running


def fleet(scratch) -> list[dict]:
    return [{"name": name, "cpu_cores": 8, "memory_mb": 32768, "host_paths": [str(scratch)],
             "devices": [gpu(f"GPU-{name}-0", 0), gpu(f"GPU-{name}-1", 1)]} for name in ("hold-a", "hold-b")]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    home = tmp_path_factory.mktemp("holds")
    lab = Lab(home, fleet=fleet(home / "scratch"))
    yield lab
    lab.stop()


def set_holds(lab: Lab, on: bool) -> None:
    result = subprocess.run([str(BIN / "mn-prefect"), "queue", "policy", "--pool", lab.pool, "--holds",
                             "on" if on else "off", "--store-url", lab.store_url, "--json"],
                            capture_output=True, text=True, timeout=120, env={**os.environ, **lab.server.env})
    assert result.returncode == 0, result.stderr


class Stream:
    """1-GPU runs of ``deployment``, each ended by the test through its own barrier file."""

    def __init__(self, lab: Lab, deployment: str, tag: str):
        self.lab, self.deployment, self.tag = lab, deployment, tag
        self.barriers: dict[str, Path] = {}  # run id -> its barrier file
        self.ended: list[str] = []

    def top_up(self) -> None:
        waiting = [r for r in self.barriers if not self.lab.started([r])]
        for _ in range(WAITING - len(waiting)):
            barrier = self.lab.out / f"{self.tag}-{len(self.barriers)}.end"
            self.barriers[self.lab.run(self.deployment, hold_until=str(barrier))] = barrier

    def running(self) -> list[str]:
        return [r for r in self.lab.started(list(self.barriers)) if r not in self.ended]

    def age(self, run_id: str) -> float:
        return time.time() - started_at(self.lab, run_id)

    def end(self, run_id: str) -> str:
        """End the run; the node it ran on."""
        [placement] = self.lab.booked(run_id)
        self.barriers[run_id].write_text("end")
        self.ended.append(run_id)
        servers.wait_for(lambda: not self.lab.booked(run_id), timeout=120, what=f"run {run_id} released")
        return placement.node

    def finish(self) -> None:
        for barrier in self.barriers.values():
            barrier.write_text("end")
        for run_id in self.barriers:
            self.lab.wait(run_id, timeout=300)


def retaken(lab: Lab, node: str, wide: str) -> bool:
    """The GPU freed on ``node`` is taken again: its two GPUs are booked to runs, or a hold stands there, or the
    2-GPU run started."""
    placements = lab.store.active_placements(node=node)
    if any(p.hold for p in placements) or lab.started([wide]):
        return True
    return sum(p.resources.gpu_count for p in placements if not p.hold) >= 2


def drive(lab: Lab, stream: Stream, wide: str, ends: int) -> None:
    """Keep the stream going until ``ends`` of its runs have ended or the 2-GPU run starts: the oldest running 1-GPU
    run is ended once it has run RUN_S, one at a time, the next once the GPU it freed is taken again."""
    while len(stream.ended) < ends and not lab.started([wide]):
        stream.top_up()
        oldest = max(stream.running(), key=stream.age, default=None)
        if oldest is None or stream.age(oldest) < RUN_S:
            time.sleep(0.5)
            continue
        freed_on = stream.end(oldest)

        def taken_again(node: str = freed_on) -> bool:
            stream.top_up()
            return retaken(lab, node, wide)

        servers.wait_for(taken_again, timeout=180, interval=0.5, what=f"the GPU freed on {freed_on} taken again")


def start_stream(lab: Lab, tag: str) -> tuple[Stream, str]:
    """Four 1-GPU runs on the four GPUs and two waiting; the 2-GPU deployment."""
    narrow, wide = lab.deploy({"resources": {"gpu": 1}}), lab.deploy({"resources": {"gpu": 2}})
    stream = Stream(lab, narrow, tag)
    servers.wait_for(lambda: (stream.top_up(), len(stream.running()) == 4)[1], timeout=300, interval=0.5,
                     what="four 1-GPU runs on the four GPUs")
    return stream, wide


def hold_events(lab: Lab, run_id: str, name: str) -> list[dict]:
    """The ``name`` events about the run (the held run is the event's resource)."""
    body = {"filter": {"any_resource": {"id": [f"prefect.flow-run.{run_id}"]}, "event": {"name": [name]},
                       "occurred": {"since": lab.since}}, "limit": 10}
    return lab.http.post("/events/filter", json=body).json().get("events", [])


def started_at(lab: Lab, run_id: str) -> float:
    return json.loads((lab.out / f"{run_id}.started").read_text())["start"]


@pytest.mark.lab
def test_with_holds_a_2_gpu_run_behind_a_stream_of_1_gpu_runs_starts_once_one_node_drains(lab):
    set_holds(lab, True)
    stream, wide_deployment = start_stream(lab, "on")
    wide = lab.run(wide_deployment)
    drive(lab, stream, wide, ends=ENDS)
    assert lab.started([wide]), f"the 2-GPU run did not start while {len(stream.ended)} of the stream's runs ended"
    booked = lab.booked(wide)
    stream.finish()
    assert lab.wait(wide, timeout=300)["state"]["type"] == "COMPLETED"
    [created] = servers.wait_for(lambda: hold_events(lab, wide, "mn.hold.created"), timeout=60,
                                 what="mn.hold.created")
    [covered] = servers.wait_for(lambda: hold_events(lab, wide, "mn.hold.covered"), timeout=60,
                                 what="mn.hold.covered")
    assert created["payload"]["nodes"] == covered["payload"]["nodes"]
    if booked:  # still booked when it started (a quick run may already be released)
        assert [p.node for p in booked] == created["payload"]["nodes"] and booked[0].resources.gpu_count == 2
    # every run has started: no hold is left (one made while another worker placed its run goes at the next sweep)
    servers.wait_for(lambda: not any(p.hold for p in lab.store.active_placements()), timeout=60,
                     what="every hold ended once its run started")
