"""docs/resources.md, "Environment hints": env hints from an allocation, and mn_prefect.allocation() reading them
back."""

import json
import os
import subprocess
import sys

import pytest
from builders import gpu, node, one

from mn_prefect import allocation
from mn_prefect.model.envnames import env_suffix
from mn_prefect.model.hints import env_hints, merge_env
from mn_prefect.scheduler import plan_job


@pytest.mark.parametrize("name, suffix", [("my-api.v2", "MY_API_V2"), ("api", "API"), ("--x--y__", "X_Y"),
                                          ("Web UI", "WEB_UI"), ("ünïcode", "N_CODE")])
def test_env_suffix_rule(name, suffix):
    assert env_suffix(name) == suffix


def full_placement():
    n = node("gpu-1", devices=[gpu("GPU-a", 0, 16384), gpu("GPU-b", 1, 40960)], host_paths=["/mnt"])
    bp = one({"devices": [{"count": 2, "driver": "cuda"}], "ports": [{"label": "my-api.v2", "port": 8080}, {"label": "dyn"}],
              "volumes": [{"name": "model-cache", "source": "/mnt/cache", "target": "/cache", "mode": "rw"}]})
    return plan_job(bp, [n]).placements[0]


def test_hints_cover_every_variable():
    p = full_placement()
    env = p.env
    assert env["MN_NODE"] == "gpu-1"
    assert env["MN_ALLOCATED_DEVICE_IDS"] == "GPU-a,GPU-b"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["MN_GPU_DRIVER"] == "cuda"
    assert env["MN_PORT_MY_API_V2"] == "8080"
    assert int(env["MN_PORT_DYN"]) >= 20000
    assert env["MN_VOLUME_MODEL_CACHE"] == "/mnt/cache" and env["MN_VOLUME_MODEL_CACHE_TARGET"] == "/cache"
    assert env["ROCR_VISIBLE_DEVICES"] == env["HIP_VISIBLE_DEVICES"] == ""  # no AMD GPU booked: none visible
    assert json.loads(env["MN_ALLOCATION_JSON"])["devices"][1]["id"] == "GPU-b"  # MirrorNeuron's shape: top level


def test_a_run_with_no_gpu_sees_no_gpu():
    env = plan_job(one({"cpu": 1}), [node("a")]).placements[0].env
    assert env["CUDA_VISIBLE_DEVICES"] == env["ROCR_VISIBLE_DEVICES"] == env["HIP_VISIBLE_DEVICES"] == ""
    assert env["MN_ALLOCATED_DEVICE_IDS"] == ""


def test_in_a_container_cuda_devices_are_named_by_uuid():
    env = env_hints(full_placement(), in_container=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"  # renumbered from 0 inside: the index would be wrong


def test_hints_never_override_a_users_variable_but_mn_and_gpu_visibility_ones_are_mn_prefects():
    hints = env_hints(full_placement())
    merged = merge_env({"CUDA_VISIBLE_DEVICES": "7", "MN_NODE": "user-value", "OTHER": "x"}, hints)
    assert merged["CUDA_VISIBLE_DEVICES"] == "0,1"  # a user's value could show a GPU the run did not book
    assert merged["MN_NODE"] == "gpu-1"  # MN_ variables belong to mn-prefect
    assert merged["OTHER"] == "x" and merged["MN_PORT_MY_API_V2"] == "8080"


def test_allocation_reads_the_hints_back_into_a_typed_object():
    p = full_placement()
    back = allocation(p.env)
    assert back.node == "gpu-1" and back.device_ids == ["GPU-a", "GPU-b"]
    assert back.port("my-api.v2") == 8080 and back.volume("model-cache").target == "/cache"
    with pytest.raises(KeyError):
        back.port("missing")


def test_allocation_inside_a_real_subprocess():
    p = full_placement()
    code = "import mn_prefect; a = mn_prefect.allocation(); print(a.node, a.port('dyn'), ','.join(a.device_ids))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **p.env}, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["gpu-1", p.env["MN_PORT_DYN"], "GPU-a,GPU-b"]


def test_allocation_outside_a_placed_run():
    with pytest.raises(RuntimeError, match="MN_ALLOCATION_JSON"):
        allocation({})
    assert allocation({}, required=False) is None


def test_the_allocation_json_is_the_placement_beside_its_allocation_at_the_top_level():
    p = full_placement()
    doc = json.loads(p.env["MN_ALLOCATION_JSON"])
    expected = {k: v for k, v in p.model_dump(mode="json").items() if k not in ("env", "allocation", "queue",
                                                                                  "priority", "preemptible",
                                                                                  "min_runtime_s", "preempts")}
    expected.update(p.allocation.model_dump(mode="json"))
    assert doc == expected and list(doc) == list(expected)  # the same fields, in the same order
    queued = p.model_copy(update={"queue": "team-ä", "priority": 7, "node": "nöde"})
    doc = json.loads(env_hints(queued)["MN_ALLOCATION_JSON"])
    assert (doc["queue"], doc["priority"], doc["node"]) == ("team-ä", 7, "nöde")  # queued: its queue fields too
    assert doc["devices"][0]["id"] == "GPU-a" and "env" not in doc and "allocation" not in doc
