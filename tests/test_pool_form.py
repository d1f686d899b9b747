"""The mn pool's form, as the Prefect UI reads the base job template, and the rules the server applies to the
same schema (Prefect's own validator, the function its API runs; tests/test_worker_visibility.py asks a real
server)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from prefect.client.orchestration import PrefectClient
from prefect.utilities.schema_tools.validation import ValidationError, is_valid_schema, validate
from pydantic import ValidationError as ModelError

from mn_prefect.model.resources import RESOURCE_KEYS
from mn_prefect.worker import MNWorker
from mn_prefect.worker.variables import MNJobConfiguration, MNVariables

CANONICAL = ["cpu_cores", "memory_mb", "disk_mb", "gpu_count", "devices", "ports", "volumes", "runtime_driver"]
ALIASES = sorted(RESOURCE_KEYS - set(CANONICAL))


@pytest.fixture(scope="module")
def variables() -> dict:
    return MNWorker.get_default_base_job_template()["variables"]


def _as_the_ui_sees(prop: dict, definitions: dict) -> dict:
    """The Prefect UI's reading of a property: a ``#/definitions/NAME`` reference is looked up in the top-level
    definitions and its keys laid over the property's own."""
    ref = prop.get("$ref")
    if ref is None:
        return prop
    return {**{k: v for k, v in prop.items() if k != "$ref"}, **definitions[ref.rsplit("/", 1)[1]]}


def _server_accepts(variables: dict, job_variables: dict) -> str | None:
    try:
        validate(job_variables, variables, raise_on_error=True, preprocess=True, ignore_required=True,
                 allow_none_with_default=True)
    except ValidationError as error:
        return str(error)
    return None


def _properties(node) -> list[dict]:
    """Every ``properties`` object anywhere in the schema."""
    found = []
    if isinstance(node, dict):
        if isinstance(node.get("properties"), dict):
            found.append(node["properties"])
        for value in node.values():
            found += _properties(value)
    elif isinstance(node, list):
        for value in node:
            found += _properties(value)
    return found


def test_the_form_shows_the_canonical_resource_fields_only(variables):
    resources = variables["definitions"]["Resources"]
    assert list(resources["properties"]) == CANONICAL
    assert not any(alias in props for props in _properties(variables) for alias in ALIASES)


def test_the_form_names_no_python_classes_and_no_spec_sections(variables):
    text = json.dumps(variables)
    assert not re.search(r"[A-Za-z](Variable|Variables|Request)\b", text) and "SPEC" not in text
    assert all(d.get("title") for d in variables["definitions"].values() if d.get("type") == "object")


def test_every_resource_field_has_a_title_and_help_written_for_people(variables):
    for name, prop in variables["definitions"]["Resources"]["properties"].items():
        assert prop.get("title") and prop.get("description"), name
    assert all(variables["properties"][name].get("description") for name in ("resources", "strategy", "constraints",
                                                                              "preferred_node", "recovery_mode"))


@pytest.mark.parametrize("field, shown", [("cpu_cores", "number"), ("memory_mb", "number"), ("disk_mb", "number"),
                                          ("gpu_count", "integer")])
def test_quantities_are_plain_number_inputs_without_a_type_switch(variables, field, shown):
    prop = _as_the_ui_sees(variables["definitions"]["Resources"]["properties"][field], variables["definitions"])
    assert prop["type"] == shown and "anyOf" not in prop and "default" not in prop


def test_optional_fields_show_no_none_switch_and_no_none_default(variables):
    for props in _properties(variables):
        for name, prop in props.items():
            assert {"type": "null"} not in prop.get("anyOf", []), name
            assert prop.get("default", "absent") is not None, name


@pytest.mark.parametrize("field", ["devices", "ports", "volumes"])
def test_device_port_and_volume_editors_show_an_example(variables, field):
    prop = variables["definitions"]["Resources"]["properties"][field]
    example = prop["examples"][0]
    assert isinstance(example, list) and example and set(example[0]) <= set(prop["items"]["properties"])


def test_the_internal_markers_are_not_in_the_form_yet_reach_the_run(variables):
    """``booking`` and ``system_copy`` are set by mn-prefect on the runs it creates: the pool's template (its form
    and schema) leaves them out, the server accepts them in a run's job variables, and the worker's configuration
    takes them from there, checked."""
    template = MNWorker.get_default_base_job_template()
    for internal in ("booking", "system_copy"):
        assert internal not in variables["properties"] and internal not in template["job_configuration"]
    assert not [d for d in variables["definitions"] if "booking" in d.lower() or "copy" in d.lower()]
    marker = {"job_id": "job-1", "agent_id": "worker"}
    assert _server_accepts(variables, {"booking": marker, "resources": {}}) is None
    def configured(job_variables: dict) -> MNJobConfiguration:  # as the worker builds it for a run
        # The worker passes its own client. No placeholder here asks the server for anything, and a client that
        # names an address keeps Prefect from starting a temporary server for the call.
        client = PrefectClient("http://127.0.0.1:9/api")
        return asyncio.run(MNJobConfiguration.from_template_and_values(template, job_variables, client=client))

    # A blueprint agent's health check names a port of its job's booking, not of its own request: allowed.
    check = {"tcp": True, "port_label": "http"}
    config = configured({"booking": marker, "health": check})
    assert config.booking == marker and config.system_copy is None and config.health is not None
    with pytest.raises(ValueError, match="port_label"):
        configured({"health": check})  # a run of its own must ask for the port it probes
    with pytest.raises(ValueError, match=r"system_copy\.node\s+Field required"):
        configured({"system_copy": {"job_id": "j", "agent_id": "a@n"}})


def test_image_is_a_described_job_variable_beside_the_resources(variables):
    image = variables["properties"]["image"]
    assert image["type"] == "string" and "docker" in image["description"]
    assert _server_accepts(variables, {"image": "python:3.11-slim", "resources": {"runtime_driver": "docker"}}) is None
    assert MNVariables.model_validate({"image": "python:3.11-slim"}).image == "python:3.11-slim"


@pytest.mark.parametrize("image", ["python 3.11", "python:3.11;rm -rf /", "$(whoami)", "Python:3.11"])
def test_the_server_refuses_an_image_that_is_not_an_image_reference(variables, image):
    assert "image" in _server_accepts(variables, {"image": image})


def test_the_schema_is_one_the_server_accepts(variables):
    is_valid_schema(variables, preprocess=False)


@pytest.mark.parametrize("resources", [{"cpu_cores": "8"}, {"cpu_cores": 8.5}, {"cpu": "2", "memory_gb": "0.5"},
                                       {"cores": 1}, {"cpu_millis": 500}, {"disk_gb": 1}, {"gpus": 1}, {"gpu": "2"},
                                       {"devices": [{"kind": "gpu", "min_memory_mb": "20000"}]}, {"cpu_cores": None}])
def test_the_server_accepts_aliases_and_numbers_written_as_strings(variables, resources):
    assert _server_accepts(variables, {"resources": resources}) is None
    MNVariables.model_validate({"resources": resources})


@pytest.mark.parametrize("resources, where", [({"cpu_cores": "lots"}, "resources.cpu_cores"),
                                              ({"memory_gb": "lots"}, "resources.memory_gb"),
                                              ({"devices": [{"min_memory_mb": "lots"}]},
                                               "resources.devices[0].min_memory_mb")])
def test_a_word_where_a_number_belongs_is_not_a_number_to_the_server(variables, resources, where):
    message = _server_accepts(variables, {"resources": resources})
    assert message is not None and where in message and "is not of type 'number'" in message
    assert "\\d" not in message  # says what is wrong, not which regular expression failed


@pytest.mark.parametrize("resources", [{"cpu_cores": "lots"}, {"cpu": "lots"}, {"devices": [{"min_memory_mb": "x"}]}])
def test_a_word_where_a_number_belongs_must_be_a_number_to_the_model(resources):
    with pytest.raises(ModelError, match="must be a number"):
        MNVariables.model_validate({"resources": resources})


@pytest.mark.parametrize("resources, says", [({"min_memroy_mb": 1}, "'min_memroy_mb' was unexpected"),
                                             ({"cpu_cores": -1}, "less than the minimum of 0"),
                                             ({"gpu_count": 1.5}, "is not of type 'integer'"),
                                             ({"ports": [{"label": "a", "port": 70000}]}, "greater than the maximum")])
def test_the_server_still_refuses_typos_and_bad_values(variables, resources, says):
    message = _server_accepts(variables, {"resources": resources})
    assert message is not None and says in message


@pytest.mark.parametrize("values, says", [
    ({"resources": {"runtime_driver": "docker"}}, "job_variables.image: is required with runtime_driver docker"),
    ({"image": "python:3.11", "resources": {"runtime_driver": "docker", "memory_mb": 4}},
     "job_variables.resources.memory_mb: must be at least 6 MB under runtime_driver docker"),
    ({"image": "python 3.11", "resources": {"runtime_driver": "docker"}}, "job_variables.image: 'python 3.11' is not"),
])
def test_a_docker_run_the_container_could_not_enforce_is_refused_naming_the_field(values, says):
    with pytest.raises(ModelError, match=re.escape(says)):
        MNJobConfiguration.model_validate({"command": "true", **values})


def test_a_docker_run_with_an_image_and_enough_memory_is_a_configuration():
    config = MNJobConfiguration.model_validate({"image": "mn-test:1", "resources": {"runtime_driver": "docker",
                                                                                   "memory_mb": 64}})
    assert config.image == "mn-test:1" and config.resources.request().runtime_driver == "docker"


# -- the runtime a run declares ------------------------------------------------------------------------------

def test_the_declared_runtime_and_its_limit_are_described_fields_of_the_form(variables):
    runtime, limit = variables["properties"]["max_runtime_seconds"], variables["properties"]["max_runtime_is_limit"]
    assert runtime["type"] == "number" and runtime["exclusiveMinimum"] == 0 and "anyOf" not in runtime
    assert limit["type"] == "boolean" and limit["default"] is False
    for prop in (runtime, limit):
        assert prop["title"][0].isupper() and "seconds" in (prop["title"] + prop["description"]).lower()
    assert "flow_timeout_seconds" not in variables["properties"]  # set by @requires from the flow, not by people


@pytest.mark.parametrize("seconds, says", [(0, "less than or equal to the minimum of 0"),
                                           (-5, "less than or equal to the minimum of 0"),
                                           ("60", "is not valid under any of the given schemas"),
                                           (True, "is not valid under any of the given schemas"),
                                           (10 * 365 * 86400 + 1, "greater than the maximum")])
def test_the_server_refuses_a_declared_runtime_that_is_no_positive_number(variables, seconds, says):
    message = _server_accepts(variables, {"max_runtime_seconds": seconds})
    assert message is not None and says in message


def test_the_server_accepts_a_declared_runtime_and_its_limit(variables):
    assert _server_accepts(variables, {"max_runtime_seconds": 3600, "max_runtime_is_limit": True}) is None


def _configured(job_variables: dict) -> MNJobConfiguration:
    template = MNWorker.get_default_base_job_template()
    client = PrefectClient("http://127.0.0.1:9/api")  # names an address: no temporary server for the call
    return asyncio.run(MNJobConfiguration.from_template_and_values(template, job_variables, client=client))


@pytest.mark.parametrize("seconds, says", [(0, "must be more than 0 seconds"), (-1, "must be more than 0 seconds"),
                                           (float("nan"), "finite"), (float("inf"), "finite"),
                                           ("60", "must be a number of seconds, got string"),
                                           (True, "must be a number of seconds, got boolean"),
                                           (4e8, "ten years")])
def test_the_worker_refuses_a_declared_runtime_that_is_no_positive_finite_number_naming_the_field(seconds, says):
    from mn_prefect.worker.routing import invalid_configuration

    with pytest.raises(ModelError) as refused:
        _configured({"max_runtime_seconds": seconds})
    message = invalid_configuration(refused.value)
    assert "job_variables.max_runtime_seconds: " in message and says in message


def test_a_limit_without_its_seconds_is_refused():
    with pytest.raises(ModelError, match=r"job_variables\.max_runtime_is_limit: is true, but "
                                         r"job_variables\.max_runtime_seconds is not set"):
        _configured({"max_runtime_is_limit": True})


def test_the_declared_runtime_its_limit_and_the_flow_s_timeout_reach_the_run():
    config = _configured({"max_runtime_seconds": 90, "max_runtime_is_limit": True, "flow_timeout_seconds": 600})
    assert (config.max_runtime_seconds, config.max_runtime_is_limit, config.flow_timeout_seconds) == (90, True, 600)
    plain = _configured({})
    assert (plain.max_runtime_seconds, plain.max_runtime_is_limit, plain.flow_timeout_seconds) == (None, False, None)
