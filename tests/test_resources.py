"""docs/resources.md: the resource request, its aliases, units and strict keys."""

import pytest

from mn_prefect.model.issues import InvalidInput, Issues
from mn_prefect.model.resources import parse_resources, resource_request


def errors(raw):
    issues = Issues()
    assert parse_resources(raw, "resources", issues) is None
    return {i.path: i.message for i in issues.items}


@pytest.mark.parametrize("raw, cores", [
    ({"cpu_cores": 2}, 2), ({"cores": 3}, 3), ({"cpu": 4}, 4), ({"cpu": 64}, 64), ({"cpu": 500}, 0.5),
    ({"cpu_millis": 250}, 0.25), ({"cpu_mcores": 1500}, 1.5), ({"cpu_millis": 8}, 0.008), ({"cpu": "8.5"}, 8.5),
    ({"cpu_cores": 2, "cpu": 900}, 2),
])
def test_cpu_aliases_and_units(raw, cores):
    assert resource_request(raw).cpu_cores == pytest.approx(cores)


@pytest.mark.parametrize("raw, mb", [({"memory_mb": 512}, 512), ({"memory": 256}, 256), ({"memory_gb": 2}, 2048),
                                     ({"memory_gb": "0.5"}, 512)])
def test_memory_aliases_and_units(raw, mb):
    assert resource_request(raw).memory_mb == mb


@pytest.mark.parametrize("raw, mb", [({"disk_mb": 10}, 10), ({"disk": 20}, 20), ({"disk_gb": 1}, 1024)])
def test_disk_aliases_and_units(raw, mb):
    assert resource_request(raw).disk_mb == mb


@pytest.mark.parametrize("key", ["gpu_count", "gpus", "gpu"])
def test_legacy_gpu_count_becomes_one_generic_gpu_request(key):
    request = resource_request({key: 2})
    assert request.gpu_count == 2
    assert len(request.devices) == 1 and request.devices[0].kind == "gpu" and request.devices[0].count == 2


def test_gpu_count_must_agree_with_gpu_devices():
    assert "resources.gpu_count" in errors({"gpu_count": 1, "devices": [{"kind": "gpu", "count": 2}]})
    assert resource_request({"gpu_count": 2, "devices": [{"kind": "gpu", "count": 2}]}).gpu_count == 2


def test_vendor_qualified_type_sets_vendor_and_kind():
    device = resource_request({"devices": [{"type": "NVIDIA/gpu", "driver": "CUDA"}]}).devices[0]
    assert (device.kind, device.vendor, device.driver) == ("gpu", "nvidia", "cuda")


def test_vendor_disagreeing_with_type_is_an_error():
    assert "resources.devices[0].vendor" in errors({"devices": [{"type": "nvidia/gpu", "vendor": "amd"}]})


def test_unknown_keys_inside_resources_are_errors():
    found = errors({"cpus": 1, "devices": [{"kind": "gpu", "min_memroy_mb": 1}], "ports": [{"label": "a", "prot": 1}],
                    "volumes": [{"name": "v", "source": "/a", "sorce": "/b"}]})
    assert set(found) >= {"resources.cpus", "resources.devices[0].min_memroy_mb", "resources.ports[0].prot",
                          "resources.volumes[0].sorce"}


@pytest.mark.parametrize("raw, path", [
    ({"cpu": -1}, "resources.cpu"), ({"memory_mb": -5}, "resources.memory_mb"), ({"disk_gb": -1}, "resources.disk_gb"),
    ({"cpu": "eight"}, "resources.cpu"), ({"cpu": True}, "resources.cpu"), ({"memory_mb": None, "memory": [1]}, "resources.memory"),
    ({"cpu": 1e400}, "resources.cpu"), ({"memory_mb": 10**30}, "resources.memory_mb"), ({"cpu": float("nan")}, "resources.cpu"),
    ({"devices": [{"count": 0}]}, "resources.devices[0].count"), ({"devices": [{"count": -1}]}, "resources.devices[0].count"),
    ({"devices": [{"count": 1.5}]}, "resources.devices[0].count"), ({"devices": [{"min_memory_mb": -1}]}, "resources.devices[0].min_memory_mb"),
    ({"devices": [{"memory_operator": "~"}]}, "resources.devices[0].memory_operator"),
    ({"devices": [{"api_version_operator": "!"}]}, "resources.devices[0].api_version_operator"),
    ({"devices": {"kind": "gpu"}}, "resources.devices"), ({"devices": ["gpu"]}, "resources.devices[0]"),
    ({"ports": [{"label": "a", "port": 99999}]}, "resources.ports[0].port"),
    ({"ports": [{"label": "a", "port": -1}]}, "resources.ports[0].port"),
    ({"ports": [{"label": "a", "protocol": "sctp"}]}, "resources.ports[0].protocol"),
    ({"ports": [{"port": 80}]}, "resources.ports[0].label"),
    ({"ports": [{"label": "a"}, {"label": "a"}]}, "resources.ports[1].label"),
    ({"ports": [{"label": "my-api"}, {"label": "my_api"}]}, "resources.ports[1].label"),
    ({"ports": [{"label": "---"}]}, "resources.ports[0].label"),
    ({"ports": "80"}, "resources.ports"),
    ({"volumes": [{"name": "v", "source": "relative"}]}, "resources.volumes[0].source"),
    ({"volumes": [{"name": "v", "source": "/a/../etc"}]}, "resources.volumes[0].source"),
    ({"volumes": [{"name": "v", "source": "/a", "target": "b"}]}, "resources.volumes[0].target"),
    ({"volumes": [{"name": "v", "source": "/a", "mode": "rwx"}]}, "resources.volumes[0].mode"),
    ({"volumes": [{"name": "v", "source": "/a", "type": "nfs"}]}, "resources.volumes[0].type"),
    ({"volumes": [{"name": "v", "source": "/a"}, {"name": "v", "source": "/b"}]}, "resources.volumes[1].name"),
    ({"runtime_driver": 3}, "resources.runtime_driver"), ({"runtime_driver": ""}, "resources.runtime_driver"),
])
def test_bad_values_name_their_path(raw, path):
    assert path in errors(raw)


def test_all_errors_are_reported_at_once():
    found = errors({"cpu": -1, "memory_mb": "x", "ports": [{"label": "a", "port": 0.5}]})
    assert len(found) == 3


def test_port_message_states_the_range():
    assert errors({"ports": [{"label": "x", "port": 99999}]})["resources.ports[0].port"].startswith(
        "must be between 1 and 65535")


def test_dynamic_ports_and_defaults():
    request = resource_request({"ports": [{"label": "api"}, {"label": "metrics", "port": 0, "protocol": "udp"}]})
    assert [(p.port, p.protocol, p.dynamic) for p in request.ports] == [(0, "tcp", True), (0, "udp", True)]


def test_volume_defaults_and_normalisation():
    volume = resource_request({"volumes": [{"name": "models", "source": "/mnt//models/"}]}).volumes[0]
    assert (volume.source, volume.target, volume.mode, volume.type) == ("/mnt/models", "/mnt/models", "ro", "host")


def test_resource_request_raises_with_every_issue():
    with pytest.raises(InvalidInput) as info:
        resource_request({"cpu": -1, "gpu": "x"})
    assert {i.path for i in info.value.issues} == {"resources.cpu", "resources.gpu"}


def test_keyword_aliases_for_the_python_api():
    request = resource_request(gpu=1, memory_gb=16, ports=[{"label": "api"}])
    assert (request.gpu_count, request.memory_mb, request.ports[0].label) == (1, 16384, "api")


def test_docker_worker_is_mirrorneurons_name_for_the_docker_driver_in_requests_and_inventories():
    from mn_prefect.model.node import NodeRecord

    issues = Issues()
    assert parse_resources({"runtime_driver": "docker_worker"}, "resources", issues).runtime_driver == "docker"
    assert not issues
    node = NodeRecord(name="n", runtime_drivers=["host_local", "docker_worker", "docker"])
    assert node.runtime_drivers == ["host_local", "docker"]
