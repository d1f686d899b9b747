"""``scripts/gpu-check`` on a machine of fake NVIDIA GPUs: the fake libnvidia-ml and libcuda (tests/fake_nvml) stand
in for the driver, and everything above them is real: the worker's NVML detection, a Prefect server, the ``mn``
worker, flow-run processes that read CUDA and NVML through ctypes and pynvml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mn_prefect.gpucheck.check import MISMATCH, OK, REFUSED, SKIPPED, problems
from mn_prefect.gpucheck.visibility import format_uuid

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check"
T4 = "GPU-11111111-1111-1111-1111-111111111111"
A100 = "GPU-22222222-2222-2222-2222-222222222222"
MIG_GPU = "GPU-33333333-3333-3333-3333-333333333333"
SLICE_0 = "MIG-44444444-4444-4444-4444-444444444444"
SLICE_1 = "MIG-55555555-5555-5555-5555-555555555555"
# NVML (PCI bus) order: a T4 before an A100, so CUDA's own order (fastest first) differs from NVML's; then an
# A100 in MIG mode with two 1g.10gb slices.
MIXED = f"{T4},Tesla T4,16384,16000,7,5,off;{A100},NVIDIA A100,40960,40000,8,0,off;" \
        f"{MIG_GPU},NVIDIA A100,40960,40000,8,0,on"
SLICES = f"{MIG_GPU},0,{SLICE_0},1,9984,9856,9800;{MIG_GPU},1,{SLICE_1},1,9984,9856,9800"


def machine_env(libs: Path, **fake: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MN_", "FAKE_", "CUDA_"))}
    env.pop("PYTHONPATH", None)
    return {**env, "LD_LIBRARY_PATH": str(libs), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
            **fake}


def gpu_check(env: dict[str, str], home: Path, *args: str) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--home", str(home), "--json", *args], env=env,
                          capture_output=True, text=True, timeout=420)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {}, proc.stderr


def results(report: dict) -> dict[str, str]:
    return {row["check"].split(" (")[0]: row["result"] for row in report["checks"]}


# ------------------------------------------------------------------------------------------------ pure rules


def record(booked, cuda, nvml=None, node="n1", visible="0") -> dict:
    return {"node": node, "booked": booked, "env": {"CUDA_VISIBLE_DEVICES": visible},
            "cuda": cuda if isinstance(cuda, dict) else {"uuids": cuda},
            "nvml": {"devices": [{"uuid": u} for u in (nvml if nvml is not None else [T4, A100])]}}


@pytest.mark.parametrize(("seen", "count", "needle"), [
    (record([T4], [T4]), 1, None),
    (record([T4, A100], [A100, T4]), 2, None),  # CUDA's order is its own: the set is what counts
    (record([T4], [A100]), 1, "CUDA shows"),
    (record([T4], [T4, A100]), 1, "CUDA shows"),
    (record([T4], []), 1, "CUDA shows"),
    (record([T4], [T4]), 2, "booked 1 GPU(s), asked for 2"),
    (record([T4], {"error": "cannot load libcuda.so.1"}), 1, "CUDA could not be read"),
    (record([SLICE_0], [SLICE_0]), 1, "NVML does not know"),
    (record([T4], [T4], node="n2"), 1, "ran on 'n2'"),
    (record([], [T4], visible=""), 0, "CUDA shows"),  # a run that booked none sees one
])
def test_a_run_must_see_exactly_what_it_booked(seen, count, needle):
    found = problems(seen, count, "n1")
    assert (found == []) if needle is None else any(needle in p for p in found), found


def test_cuda_uuids_are_written_as_nvml_writes_them():
    raw = bytes.fromhex("5c0d9e2a14b3467f8e21aa00bb11cc22")
    assert format_uuid(raw) == "GPU-5c0d9e2a-14b3-467f-8e21-aa00bb11cc22"
    assert format_uuid(raw, "MIG").startswith("MIG-5c0d9e2a-")


def test_a_machine_without_nvidia_gpus_fails_the_check_before_starting_anything(fake_gpu_libs, tmp_path):
    code, report, _ = gpu_check(machine_env(fake_gpu_libs), tmp_path)
    assert code == 1
    assert report["gpus"] == [] and report["checks"][0]["result"] == MISMATCH
    assert "no GPU" in report["checks"][0]["detail"]
    assert not (tmp_path / "prefect").exists()


# --------------------------------------------------------------------------------------------------- the lab


@pytest.mark.lab
def test_every_run_sees_exactly_its_gpus_on_a_machine_of_mixed_gpus(fake_gpu_libs, tmp_path, prefect_server):
    env = machine_env(fake_gpu_libs, FAKE_NVML_DEVICES=MIXED, FAKE_NVML_MIG_DEVICES=SLICES)
    code, report, stderr = gpu_check(env, tmp_path, "--api-url", prefect_server.api_url,
                                     "--markdown", str(tmp_path / "report.md"))
    assert code == 0, (report, stderr)
    assert results(report) == {"worker registered the GPUs NVML reports": OK, "no GPU booked, none seen": OK,
                               "one GPU per run": OK,
                               "two GPUs in one run": OK, "half a GPU per run": OK, "one MIG slice": OK}
    gpus = {g["uuid"]: g for g in report["gpus"]}
    assert gpus[T4]["compute_capability"] == "7.5" and gpus[A100]["memory_mb"] == 40960
    assert gpus[MIG_GPU]["mig"] == "on" and len(gpus[MIG_GPU]["slices"]) == 2
    rows = {row["check"].split(" (")[0]: row["detail"] for row in report["checks"]}
    assert "the extra run waited" in rows["one GPU per run"] and "waiting for capacity" in rows["one GPU per run"]
    assert SLICE_0 in rows["one MIG slice"] or SLICE_1 in rows["one MIG slice"]
    assert "| one MIG slice (1g.10gb) | ok |" in (tmp_path / "report.md").read_text()


@pytest.mark.lab
def test_a_gpu_cuda_cannot_reach_is_a_mismatch_and_fails_the_check(fake_gpu_libs, tmp_path, prefect_server):
    """NVML lists the GPU, so the worker books it, but CUDA no longer enumerates it (fallen off the bus): the
    run does not get what it booked, and the check says so."""
    env = machine_env(fake_gpu_libs, FAKE_NVML_DEVICES=f"{A100},NVIDIA A100,40960,40000,8,0", FAKE_CUDA_LOST=A100)
    code, report, stderr = gpu_check(env, tmp_path, "--api-url", prefect_server.api_url)
    assert code == 1, (report, stderr)
    by_check = results(report)
    assert by_check["one GPU per run"] == MISMATCH and by_check["two GPUs in one run"] == REFUSED
    assert by_check["one MIG slice"] == SKIPPED and by_check["no GPU booked, none seen"] == OK
    detail = next(r["detail"] for r in report["checks"] if r["check"].startswith("one GPU per run"))
    assert f"CUDA shows [] (CUDA_VISIBLE_DEVICES='0'), booked ['{A100}']" in detail
