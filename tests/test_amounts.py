"""Amounts as people write them (model/amounts.py): memory, disk and GPU memory as numbers in the key's unit or as
strings with units ("512M", "4G", "4GB", "4Gi", "4GiB", "1.5T", any case), CPU in millicores ("500m"), read by
the one grammar wherever a request is read: job variables (the pool's schema on the server, the variables model,
the worker's parse), ``@requires``, blueprints, ``plan --request``, ``reserve --resources``, queues' quotas. A
malformed unit is refused naming the field and the accepted forms."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError as ModelError
from test_bad_inputs import contents, json_error, mn, url as _url_fixture
from test_cli import bp
from test_pool_form import _server_accepts

from mn_prefect.decorators import requires
from mn_prefect.model.amounts import read_amount
from mn_prefect.model.blueprint import parse_blueprint
from mn_prefect.model.issues import InvalidInput, Issues
from mn_prefect.model.queues import parse_amounts, parse_queue
from mn_prefect.model.resources import resource_request
from mn_prefect.worker import MNWorker
from mn_prefect.worker.variables import MNJobConfiguration, MNVariables

GIB_MB = 1024
G_MB = 10**9 / 2**20  # a decimal gigabyte in the grammar's MB (2**20 bytes)


@pytest.mark.parametrize("text, mb", [
    ("512M", 512 * 10**6 / 2**20), ("512Mi", 512), ("512MiB", 512), ("4G", 4 * G_MB), ("4GB", 4 * G_MB),
    ("4Gi", 4 * GIB_MB), ("4GiB", 4 * GIB_MB), ("4 GB", 4 * G_MB), ("4g", 4 * G_MB), ("4gib", 4 * GIB_MB),
    ("1.5T", 1.5 * 10**12 / 2**20), ("1.5Ti", 1.5 * 2**20), ("2048Ki", 2), (" 16GB ", 16 * G_MB), ("8", 8),
    ("8.5", 8.5), (".5Gi", 512),
])
def test_a_size_with_a_unit_is_read_as_kubernetes_reads_it_in_mb(text, mb):
    issues = Issues()
    assert read_amount(text, "memory", issues, "mb") == pytest.approx(mb) and not issues


def test_a_bare_number_is_in_the_key_s_unit_and_a_unit_overrides_it():
    assert resource_request({"memory_gb": 4}).memory_mb == 4096
    assert resource_request({"memory_gb": "4Gi"}).memory_mb == 4096
    assert resource_request({"disk_gb": "512Mi"}).disk_mb == 512


@pytest.mark.parametrize("raw, cores", [({"cpu": "500m"}, 0.5), ({"cpu_cores": "1500m"}, 1.5),
                                        ({"cpu": 1500}, 1.5), ({"cpu": "2"}, 2), ({"cpu_millis": "250m"}, 0.25)])
def test_cpu_is_cores_or_kubernetes_millicores(raw, cores):
    assert resource_request(raw).cpu_cores == cores


@pytest.mark.parametrize("raw, path, words", [
    ({"memory": "4X"}, "resources.memory", "unknown unit 'X' in '4X'"),
    ({"memory_gb": "4Gx"}, "resources.memory_gb", "unknown unit 'Gx'"),
    ({"disk": "lots"}, "resources.disk", "must be a number, got the string 'lots'"),
    ({"memory": "-4G"}, "resources.memory", "must not be negative"),
    ({"cpu": "4G"}, "resources.cpu", "must be a number of cores or a string of millicores such as 500m"),
    ({"devices": [{"kind": "gpu", "min_memory_mb": "80Q"}]}, "resources.devices[0].min_memory_mb", "unknown unit"),
    ({"memory": "9999999P"}, "resources.memory", "is too large"),
])
def test_a_malformed_amount_is_refused_naming_the_field_and_the_forms(raw, path, words):
    with pytest.raises(InvalidInput) as raised:
        resource_request(raw)
    [issue] = raised.value.issues
    assert issue.path == path and words in issue.message, issue
    if "unknown unit" in words or "lots" in words:
        assert "512M, 4G, 4GB, 4Gi, 4GiB, 1.5T" in issue.message and "any case" in issue.message


def test_gpu_memory_of_a_device_and_of_a_fraction_take_units():
    request = resource_request({"devices": [{"kind": "gpu", "min_memory_mb": "40Gi"}]})
    assert request.devices[0].min_memory_mb == 40 * 1024
    shared = resource_request({"devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": "10GiB"}]})
    assert shared.devices[0].memory_mb == 10 * 1024


# -- the entry points ---------------------------------------------------------------------------------------------

def test_requires_takes_units():
    @requires(memory="4G", disk_gb="1Ti", cpu="500m")
    def work():
        return None

    with pytest.raises(InvalidInput, match="memory: has an unknown unit 'Q'"):
        requires(memory="4Q")


def test_a_blueprint_agent_takes_units():
    blueprint, issues = parse_blueprint(bp({"memory": "2Gi", "cpu": "250m"}))
    assert not issues and blueprint is not None
    [agent] = blueprint.agents
    assert (agent.resources.memory_mb, agent.resources.cpu_cores) == (2048, 0.25)
    _, issues = parse_blueprint(bp({"memory": "2Gz"}))
    assert [i.path for i in issues] == ["nodes[0].resources.memory"] and "unknown unit 'Gz'" in issues[0].message


@pytest.fixture(scope="module")
def variables() -> dict:
    return MNWorker.get_default_base_job_template()["variables"]


@pytest.mark.parametrize("resources", [{"memory_mb": "4G"}, {"memory": "512Mi"}, {"memory_gb": "16GB"},
                                       {"disk_mb": "1.5T"}, {"disk": "4 GiB"}, {"cpu": "500m"},
                                       {"cpu_cores": "1500m"},
                                       {"devices": [{"kind": "gpu", "min_memory_mb": "40Gi"}]},
                                       {"devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": "10G"}]}])
def test_job_variables_with_units_pass_the_server_the_model_and_the_worker(variables, resources):
    assert _server_accepts(variables, {"resources": resources}) is None
    MNVariables.model_validate({"resources": resources})
    config = MNJobConfiguration.model_validate({"command": "true", "resources": resources})
    assert config.resources.request() == resource_request(resources)


def test_the_variables_model_keeps_each_key_in_its_unit():
    model = MNVariables.model_validate({"resources": {"memory_gb": "2048Mi", "cpu_millis": "1", "memory_mb": "1Gi"}})
    assert (model.resources.memory_gb, model.resources.cpu_millis, model.resources.memory_mb) == (2, 1, 1024)


@pytest.mark.parametrize("resources", [{"memory": "4X"}, {"cpu": "4G"}, {"memory_mb": "4 G B"}])
def test_a_malformed_unit_is_refused_by_the_server_and_named_by_the_model(variables, resources):
    assert _server_accepts(variables, {"resources": resources}) is not None
    with pytest.raises(ModelError) as raised:
        MNVariables.model_validate({"resources": resources})
    [key] = resources
    said = str(raised.value)
    assert key in said and ("must be a number" in said or "unknown unit" in said), said


def test_queue_quotas_take_units():
    issues = Issues()
    assert parse_amounts("gpu=4,memory=64Gi,cpu=500m,gpu_memory_gb=80,disk=1Ti", "--quota", issues) == {
        "gpu": 4, "memory": 64 * 1024, "cpu": 0.5, "gpu_memory": 80 * 1024, "disk": 2**20}
    assert not issues
    queue = parse_queue("train", {"quota": {"memory": "1Ti"}, "borrow": {"gpu_memory": "80GiB"}}, "queues.train",
                        issues)
    assert not issues and queue is not None and queue.quota == {"memory": 2**20} and queue.borrow == {
        "gpu_memory": 80 * 1024}
    assert parse_amounts({"memory": "64Q"}, "--quota", issues) == {}
    assert issues.items[0].path == "--quota.memory" and "unknown unit 'Q'" in issues.items[0].message


url = _url_fixture  # a SQLite store file with a GPU node and a CPU node


def test_reserve_and_plan_take_units_and_name_a_bad_one(url):
    text = json.dumps({"cpu": 1, "memory": "4G"})
    planned = mn("plan", "--request", text, "--store-url", url)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert json.loads(planned.stdout)["placements"][0]["resources"]["memory_mb"] == pytest.approx(4 * G_MB)
    booked = mn("reserve", "--resources", json.dumps({"cpu": 1, "memory": "512Mi"}), "--for", "1h", "--json",
                "--store-url", url)
    assert booked.returncode == 0, booked.stdout + booked.stderr
    assert json.loads(booked.stdout)["reservation"]["resources"] == {"cpu": 1, "memory": "512Mi"}
    before = contents(url)
    refused = mn("reserve", "--resources", json.dumps({"memory": "4Q"}), "--for", "1h", "--json",
                 "--store-url", url)
    assert refused.returncode == 1
    error = json_error(refused)
    assert error["field"] == "--resources.memory" and "unknown unit 'Q'" in error["error"]
    assert contents(url) == before
