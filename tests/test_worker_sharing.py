"""MIG slices and fractional GPUs through real mn workers and a real Prefect server (docs/resources.md, "Sharing GPUs"):
what each run sees, and that runs sharing a node never hold more of a GPU than it has."""

from __future__ import annotations

from collections import defaultdict

import pytest
import servers
from builders import gpu
from lab import Lab

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab


def fleet(scratch) -> list[dict]:
    parent = {**gpu("GPU-A100", 0, 81920), "mig_mode": True}
    cut = [{**gpu(f"MIG-A100-{n}", 0, 9984), "parent": "GPU-A100", "mig_profile": "1g.10gb"} for n in range(3)]
    return [
        {"name": "mig-1", "cpu_cores": 16, "memory_mb": 65536, "dynamic_port_range": [24000, 24999],
         "devices": [parent, *cut]},
        {"name": "l4-1", "cpu_cores": 16, "memory_mb": 65536, "dynamic_port_range": [25000, 25999],
         "devices": [gpu("GPU-L4a", 0, 24576), gpu("GPU-L4b", 1, 16384)]},
    ]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    home = tmp_path_factory.mktemp("sharing")
    lab = Lab(home, fleet=fleet(home / "scratch"))
    yield lab
    lab.stop()


def _overlap(a: dict, b: dict) -> bool:
    return not (a["end"] <= b["start"] or b["end"] <= a["start"])


def test_slices_and_fractions_run_side_by_side_within_each_gpu(lab):
    slices = lab.deploy({"resources": {"cpu": 1, "devices": [{"kind": "gpu", "mig_profile": "1g.10gb"}]}})
    halves = lab.deploy({"resources": {"cpu": 1, "devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": 8000}]}})
    barrier = lab.out / "sharing.barrier"
    slice_runs = [lab.run(slices, hold_until=str(barrier)) for _ in range(4)]
    half_runs = [lab.run(halves, hold_until=str(barrier)) for _ in range(5)]

    # Three slices exist: three slice runs start, the fourth waits. Two halves fit each L4: four start.
    servers.wait_for(lambda: len(lab.started(slice_runs)) == 3 and len(lab.started(half_runs)) == 4, timeout=300,
                     what="three slice runs and four half-GPU runs holding at the barrier")
    lab.told_to_wait([r for r in slice_runs + half_runs if r not in lab.started(slice_runs + half_runs)])
    assert len(lab.started(slice_runs)) == 3 and len(lab.started(half_runs)) == 4, "a run started beyond what the GPUs hold"
    barrier.write_text("go")
    for run_id in slice_runs + half_runs:
        assert lab.wait(run_id, timeout=300)["state"]["type"] == "COMPLETED"
    records = {r: lab.record(r) for r in slice_runs + half_runs}
    for r in slice_runs:
        env = records[r]["env"]
        assert env["MN_NODE"] == "mig-1" and env["CUDA_VISIBLE_DEVICES"].startswith("MIG-A100-")
        assert env["CUDA_VISIBLE_DEVICES"] == env["MN_ALLOCATED_DEVICE_IDS"]  # CUDA takes MIG UUIDs, not indices
    for r in half_runs:
        env = records[r]["env"]
        assert env["MN_NODE"] == "l4-1" and env["MN_GPU_SHARES"] == "0.5" and env["MN_GPU_MEMORY_MB"] == "8000"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{env['CUDA_VISIBLE_DEVICES']}=8000M"
    # Whatever ran at the same time never held more than one GPU's shares or memory, nor one slice twice.
    for rec in records.values():
        at_once = [o for o in records.values() if _overlap(rec, o)]
        shares, memory = defaultdict(float), defaultdict(float)
        held = [o["env"]["MN_ALLOCATED_DEVICE_IDS"] for o in at_once if "MN_GPU_SHARES" not in o["env"]]
        for o in at_once:
            if "MN_GPU_SHARES" in o["env"]:
                shares[o["env"]["MN_ALLOCATED_DEVICE_IDS"]] += float(o["env"]["MN_GPU_SHARES"])
                memory[o["env"]["MN_ALLOCATED_DEVICE_IDS"]] += float(o["env"]["MN_GPU_MEMORY_MB"])
        assert len(held) == len(set(held)), held
        assert all(v <= 1.0 for v in shares.values()) and memory.get("GPU-L4b", 0) <= 16384, (shares, memory)
    servers.wait_for(lambda: all(not lab.booked(r) for r in records), what="all released")


def test_a_whole_gpu_run_never_takes_a_gpu_in_mig_mode_only_its_slices_do(lab):
    """CUDA cannot hand a process a GPU in MIG mode whole: a whole-GPU run goes to a GPU outside MIG mode, and one
    only the A100 could hold fails, saying it can never run here, while runs of its slices are placed."""
    whole = lab.deploy({"resources": {"devices": [{"kind": "gpu", "min_memory_mb": 20000}]}})
    only_the_a100 = lab.deploy({"resources": {"devices": [{"kind": "gpu", "min_memory_mb": 60000}]}})
    slices = lab.deploy({"resources": {"devices": [{"kind": "gpu", "mig_profile": "1g.10gb", "count": 2}]}})
    placed, sliced = lab.run(whole), lab.run(slices)
    never = lab.run(only_the_a100)
    run = lab.wait(never)  # no node could ever take it: it fails at its first poll, each node's reason said
    assert run["state"]["type"] == "FAILED", run["state"]
    assert run["state"]["message"].startswith("mn: no node can ever take this run"), run["state"]
    assert "mig-1: missing devices" in run["state"]["message"], run["state"]
    assert lab.wait(placed)["state"]["type"] == "COMPLETED" and lab.wait(sliced)["state"]["type"] == "COMPLETED"
    assert lab.record(placed)["env"]["MN_ALLOCATED_DEVICE_IDS"] == "GPU-L4a"
    assert lab.record(sliced)["env"]["MN_ALLOCATED_DEVICE_IDS"].startswith("MIG-A100-")
