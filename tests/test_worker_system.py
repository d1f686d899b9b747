"""Deployments of job type system and sysbatch through real mn workers and a real Prefect server (docs/prefect.md): one
copy per eligible node of the pool's group, each holding and releasing its own node's part of the run's booking. The
fleet: two GPU nodes and a node without one, which no copy can go to."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import pytest
import servers
from builders import gpu
from lab import TERMINAL, Lab

from mn_prefect.model.placement import Placement, Plan
from mn_prefect.worker import system


def fleet() -> list[dict]:
    return [
        {"name": "sys-a", "cpu_cores": 4, "memory_mb": 8192, "dynamic_port_range": [26000, 26999],
         "devices": [gpu("GPU-SA", 0, 16384)]},
        {"name": "sys-b", "cpu_cores": 4, "memory_mb": 8192, "dynamic_port_range": [27000, 27999],
         "devices": [gpu("GPU-SB", 0, 16384)]},
        {"name": "sys-c", "cpu_cores": 4, "memory_mb": 8192, "dynamic_port_range": [28000, 28999]},  # no GPU
    ]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("system"), fleet=fleet())
    yield lab
    lab.stop()


def _copies(lab: Lab, run_id: str) -> list[dict]:
    body = {"flow_runs": {"tags": {"all_": [f"mn-copy-of:{run_id}"]}}}
    return lab.http.post("/flow_runs/filter", json=body).json()


def _parts(lab: Lab, run_id: str) -> list[str]:
    return sorted(p.node for p in lab.booked(run_id))


def _set_state(lab: Lab, run_id: str, kind: str) -> None:
    lab.http.post(f"/flow_runs/{run_id}/set_state",
                  json={"state": {"type": kind, "name": kind.title()}, "force": True}).raise_for_status()


@pytest.mark.lab
def test_a_sysbatch_run_runs_once_on_each_eligible_node_and_leaves_nothing_booked(lab):
    run_id = lab.run(lab.deploy({"job_type": "sysbatch", "resources": {"cpu": 1, "gpu_count": 1}}))
    assert lab.wait(run_id)["state"]["type"] == "COMPLETED"
    copies = servers.wait_for(lambda: (c := _copies(lab, run_id)) and all(r["state"]["type"] in TERMINAL for r in c)
                              and c, timeout=90, what="the copy to end", interval=0.5)
    assert len(copies) == 1 and copies[0]["state"]["type"] == "COMPLETED", copies
    copy = copies[0]
    envs = {r: lab.record(r)["env"] for r in (run_id, copy["id"])}
    # The run itself on the first eligible node, its copy on the other; none on the node without a GPU.
    assert envs[run_id]["MN_NODE"] == "sys-a" and envs[copy["id"]]["MN_NODE"] == "sys-b"
    assert envs[run_id]["CUDA_VISIBLE_DEVICES"] == envs[copy["id"]]["CUDA_VISIBLE_DEVICES"] == "0"
    assert envs[copy["id"]]["MN_ALLOCATED_DEVICE_IDS"] == "GPU-SB"
    assert json.loads(envs[copy["id"]]["MN_ALLOCATION_JSON"])["job_id"] == run_id  # a part of the run's booking
    run = lab.flow_run(run_id)
    assert copy["name"] == f"{run['name']}@sys-b" and "mn-system-copy" in copy["tags"]
    assert copy["job_variables"]["system_copy"] == {"job_id": run_id, "node": "sys-b", "agent_id": f"{run['name']}@sys-b"}
    lab.wait_for_log(run_id, "none on sys-c: insufficient gpu")
    # Each copy shows its own placement; every part is released, each by the copy that held it.
    for rid, node in ((run_id, "sys-a"), (copy["id"], "sys-b")):
        states = lab.http.get("/flow_run_states/", params={"flow_run_id": rid}).json()
        assert any(s["type"] == "PENDING" and (s["message"] or "").startswith(f"mn: placed on {node}") for s in states)
        servers.wait_for(lambda rid=rid: lab.events(rid, "mn.placement.released"), interval=0.5,
                         what=f"{rid}'s released event")
        assert lab.events(rid, "mn.placement.created")
    assert lab.booked(run_id) == []
    assert [r for r in _copies(lab, run_id)] == copies  # no copy was made twice


@pytest.mark.lab
def test_a_system_runs_copies_hold_their_parts_while_running_and_each_releases_its_own(lab):
    barrier = str(lab.out / f"never-{uuid.uuid4().hex}")  # the runs hold until cancelled
    deployment = lab.deploy({"job_type": "system", "resources": {"cpu": 1, "gpu_count": 1}})
    run_id = lab.run(deployment, hold_until=barrier)
    copy_id = servers.wait_for(lambda: (c := _copies(lab, run_id)) and c[0]["id"], timeout=90, interval=0.5,
                               what="the copy")
    for rid in (run_id, copy_id):
        servers.wait_for(lambda rid=rid: (lab.out / f"{rid}.started").exists(), timeout=90, what=f"{rid} to start")
    assert _parts(lab, run_id) == ["sys-a", "sys-b"]

    # Another system run fits on no node while both GPUs are held: it waits with the reason, booking nothing.
    waiting = lab.run(deployment, hold_until=barrier)
    run = servers.wait_for(lambda: "runnable_later" in ((r := lab.flow_run(waiting))["state"].get("message") or "")
                           and r, timeout=60, what="the waiting reason", interval=0.5)
    assert run["state"]["type"] == "SCHEDULED" and lab.booked(waiting) == [] and _copies(lab, waiting) == []
    _set_state(lab, waiting, "CANCELLED")

    _set_state(lab, copy_id, "CANCELLING")  # the copy ends: its node's part goes, the run's own stays
    assert lab.wait(copy_id, timeout=60)["state"]["type"] == "CANCELLED"
    servers.wait_for(lambda: _parts(lab, run_id) == ["sys-a"], timeout=30, what="the copy's part released")
    assert lab.flow_run(run_id)["state"]["type"] == "RUNNING"
    _set_state(lab, run_id, "CANCELLING")
    assert lab.wait(run_id, timeout=60)["state"]["type"] == "CANCELLED"
    servers.wait_for(lambda: lab.booked(run_id) == [], timeout=30, what="the whole booking gone")
    assert _copies(lab, waiting) == [] and lab.booked(waiting) == []


# -- the pure part -------------------------------------------------------------------------------------------

def _placement(node: str, name: str = "r") -> Placement:
    return Placement(agent_id=f"{name}@{node}", source_agent_id=name, node=node, locality="system", job_id="J")


def test_the_run_itself_takes_the_first_node_and_each_other_node_gets_one_marked_copy():
    placements = [_placement("n2"), _placement("n1"), _placement("n3")]
    assert system.is_system(placements) and system.origin_node(placements) == "n1"
    assert not system.is_system([_placement("n1").model_copy(update={"locality": "job_colocated"})])
    run = SimpleNamespace(id=uuid.UUID(int=7), name="r", deployment_id=uuid.UUID(int=1), parameters={"x": 1},
                          tags=["t", "mn-system-copy"], work_queue_name="default", job_variables={"env": {"A": "1"}})
    request = system.copy_request(run, placements[0])
    job_id = str(run.id)
    assert request["name"] == "r@n2" and request["idempotency_key"] == system.copy_key(job_id, "n2")
    assert request["tags"] == ["t", "mn-system-copy", f"mn-copy-of:{job_id}", "mn-node:n2"]
    assert request["parameters"] == {"x": 1} and request["deployment_id"] == run.deployment_id
    marker = request["job_variables"]["system_copy"]
    assert request["job_variables"]["env"] == {"A": "1"}
    assert marker == {"job_id": job_id, "node": "n2", "agent_id": "r@n2"}
    # The marker is read from the configuration or, on a pool that predates it, from the run's job variables.
    parsed = system.copy_marker(None, request["job_variables"])
    assert parsed is not None and system.copy_marker(marker, None) == parsed
    assert system.copy_marker(None, {"env": {}}) is None
    assert system.part(placements, parsed) == placements[0]
    assert system.part(placements[1:], parsed) is None  # released


def test_the_placed_runs_log_names_the_nodes_that_got_no_copy_and_why():
    placements = [_placement("n1"), _placement("n2")]
    plan = Plan(status="runnable_now", job_type="sysbatch", strategy="binpack", placements=tuple(placements),
                reason="", agents={"r": {"n3": "no GPU", "n1": "ignored: it has a copy"}})
    assert system.fan_out_message("sysbatch", placements, "n1", plan) == (
        "mn: sysbatch run: one copy per node; this run on n1, copies on n2; none on n3: no GPU")
