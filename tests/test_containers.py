"""The docker driver's pure half: a placement becomes exactly one set of container settings (no Docker here;
tests/test_docker_driver.py proves the same settings from inside real containers)."""

from __future__ import annotations

import pytest
from builders import gpu
from docker.types import DeviceRequest

from mn_prefect.drivers.container import NODE_LABEL, RUN_LABEL, ContainerRefused, container_name, container_spec
from mn_prefect.drivers.launchers import LAUNCHERS, advertised_drivers, refusal
from mn_prefect.model.node import Device, NodeRecord
from mn_prefect.model.placement import Allocation, PlacedResources, Placement, PortAllocation, VolumeAllocation

RUN = "6f1c1c6e-2f7e-4a8e-9a57-0c1d2e3f4a5b"


def _placement(*, cpu: float = 1.5, memory: float = 256, devices=(), volumes=(), ports=()) -> Placement:
    return Placement(agent_id="a", node="box", resources=PlacedResources(cpu_cores=cpu, memory_mb=memory,
                                                                         gpu_count=len(devices)),
                     allocation=Allocation(devices=tuple(Device.model_validate(d) for d in devices),
                                           volumes=tuple(volumes), ports=tuple(ports), runtime_driver="docker"))


def _spec(placement: Placement, **kwargs):
    return container_spec(placement, run_id=RUN, run_name="nightly train", image="mn-test:1",
                          command=["python", "-m", "prefect.engine"], **{"run_env": {"MY": "1"}, **kwargs})


def test_cpu_and_memory_become_a_quota_and_a_limit_with_no_swap():
    spec = _spec(_placement(cpu=1.5, memory=256), node_cpuset="0-1")
    assert spec.nano_cpus == 1_500_000_000 and spec.cpuset_cpus == "0-1"
    assert spec.mem_limit == spec.memswap_limit == 256 * 1024 * 1024
    kwargs = spec.create_kwargs()
    assert kwargs["nano_cpus"] == 1_500_000_000 and kwargs["mem_limit"] == kwargs["memswap_limit"]
    assert kwargs["init"] is True and kwargs["network_mode"] == "host" and kwargs["cpuset_cpus"] == "0-1"


def test_nothing_asked_means_no_limit_rather_than_a_zero_one():
    kwargs = _spec(_placement(cpu=0, memory=0)).create_kwargs()
    assert not {"nano_cpus", "mem_limit", "memswap_limit", "cpuset_cpus"} & set(kwargs)


def test_gpus_are_requested_by_their_exact_ids_never_by_count():
    spec = _spec(_placement(devices=[gpu("GPU-aaa", 3), gpu("GPU-bbb", 5)]))
    (request,) = spec.create_kwargs()["device_requests"]
    assert isinstance(request, DeviceRequest)
    assert request["DeviceIDs"] == ["GPU-aaa", "GPU-bbb"] and request["Count"] == 0 and request["Driver"] == "nvidia"
    # Inside the container the GPUs are renumbered from 0: the host indexes 3 and 5 would be wrong there.
    assert spec.environment["CUDA_VISIBLE_DEVICES"] == "GPU-aaa,GPU-bbb"
    assert spec.environment["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaa,GPU-bbb"


def test_a_run_with_no_gpu_gets_no_device_request_and_sees_no_gpu():
    spec = _spec(_placement())
    assert "device_requests" not in spec.create_kwargs()
    assert spec.environment["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert spec.environment["CUDA_VISIBLE_DEVICES"] == spec.environment["ROCR_VISIBLE_DEVICES"] == ""


def test_a_gpu_docker_cannot_pass_is_refused_naming_it():
    with pytest.raises(ContainerRefused, match="NVIDIA .cuda. GPUs only; device AMD-1 is amd"):
        _spec(_placement(devices=[gpu("AMD-1", 0, vendor="amd", driver="rocm")]))


def test_volumes_are_bind_mounts_with_their_mode_and_the_toolchain_is_read_only():
    volumes = [VolumeAllocation(name="models", source="/mnt/models", target="/models", mode="ro"),
               VolumeAllocation(name="out", source="/srv/out", target="/out", mode="rw")]
    spec = _spec(_placement(volumes=volumes), toolchain=["/opt/py", "/models"])
    mounts = {m["Target"]: (m["Source"], m["ReadOnly"], m["Type"]) for m in spec.create_kwargs()["mounts"]}
    assert mounts == {"/models": ("/mnt/models", True, "bind"), "/out": ("/srv/out", False, "bind"),
                      "/opt/py": ("/opt/py", True, "bind")}  # a booked target wins over a toolchain path
    assert "volumes" not in spec.create_kwargs()  # never -v, which creates a missing source as root


def test_the_environment_is_the_runs_own_plus_the_hints_and_the_labels_name_run_and_node():
    ports = [PortAllocation(label="api", port=24001)]
    spec = _spec(_placement(ports=ports), run_env={"MY": "1", "PREFECT__FLOW_RUN_ID": RUN, "UNSET": None,
                                                    "MN_NODE": "a user's"})
    env = spec.environment
    assert env["MY"] == "1" and env["PREFECT__FLOW_RUN_ID"] == RUN and "UNSET" not in env
    assert env["MN_NODE"] == "box" and env["MN_PORT_API"] == "24001" and "MN_ALLOCATION_JSON" in env
    assert "PATH" not in env and "HOME" not in env  # nothing from the worker's environment
    assert spec.labels[RUN_LABEL] == RUN and spec.labels[NODE_LABEL] == "box"
    assert spec.name == container_name("nightly train", RUN) == "mn-nightly-train-6f1c1c6e"


@pytest.mark.parametrize("declared, available, advertised", [
    (["host_local"], ["host_local", "docker"], ["host_local", "docker"]),
    (["host_local", "docker"], ["host_local"], ["host_local"]),  # no daemon: docker is not offered
    (["host_local", "podman"], ["host_local"], ["host_local", "podman"]),  # unknown: the inventory's word
])
def test_a_node_offers_the_drivers_its_worker_can_launch(declared, available, advertised):
    assert advertised_drivers(declared, available) == advertised


def test_a_driver_is_refused_with_why_and_the_table_is_the_one_place_drivers_are_named():
    assert set(LAUNCHERS) == {"host_local", "docker"}
    assert refusal("docker", {}) == "runtime driver 'docker' is not available on this node (its worker cannot launch it)"
    assert "has no launcher in mn-prefect (known: host_local, docker)" in refusal("podman", {})


@pytest.mark.parametrize("cpuset, says", [("0-7", "core 2 is outside this node's 2 cores (0-1)"),
                                          ("3-1", "runs backwards"), ("a", "must be core numbers")])
def test_a_node_cpuset_outside_its_cores_is_refused_naming_the_field(cpuset, says):
    with pytest.raises(ValueError, match="cpuset") as error:
        NodeRecord(name="n", cpu_cores=2, cpuset=cpuset)
    assert says in str(error.value)
