"""The request grammar is one table (model/resources.py's SCALAR_FIELDS): the pool schema (worker/variables.py)
lists exactly the fields and aliases the parser reads, with the same kind of number, and the parser applies each
alias's unit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from mn_prefect.model.amounts import SIZE_UNITS
from mn_prefect.model.issues import Issues
from mn_prefect.model.resources import (
    DEVICE_KEYS,
    LIST_FIELDS,
    MAX_DEVICE_COUNT,
    MEMORY_OPERATORS,
    PORT_KEYS,
    RESOURCE_KEYS,
    SCALAR_FIELDS,
    VERSION_OPERATORS,
    VOLUME_KEYS,
    DeviceInput,
    PortInput,
    VolumeInput,
    parse_resources,
    resource_request,
)
from mn_prefect.worker.variables import MNVariables, ResourcesVariable

CANONICAL = {*SCALAR_FIELDS, *LIST_FIELDS, "runtime_driver"}


@pytest.fixture(scope="module")
def resources() -> dict:
    return MNVariables.model_json_schema()["definitions"]["Resources"]


def _aliases_by_definition(resources: dict) -> dict[str, set[str]]:
    """Each alias the schema accepts (its pattern properties), by the definition it refers to."""
    found: dict[str, set[str]] = {}
    for pattern, target in resources["patternProperties"].items():
        match = re.fullmatch(r"\^\(([a-z_|]+)\)\$", pattern)
        assert match, pattern
        found.setdefault(target["$ref"].rsplit("/", 1)[1], set()).update(match.group(1).split("|"))
    return found


def test_the_form_shows_the_parser_s_canonical_fields(resources):
    assert set(resources["properties"]) == CANONICAL


def test_the_schema_accepts_exactly_the_parser_s_aliases_as_their_kind_of_number(resources):
    expected: dict[str, set[str]] = {"Quantity": set(), "Size": set(), "Count": set()}
    for name, (kind, keys) in SCALAR_FIELDS.items():
        for key, unit in keys.items():
            if key != name:
                expected["Count" if kind == "count" else "Size" if unit in SIZE_UNITS else "Quantity"].add(key)
    assert _aliases_by_definition(resources) == expected
    assert CANONICAL | expected["Quantity"] | expected["Size"] | expected["Count"] == RESOURCE_KEYS


def test_the_variables_model_takes_every_name_the_parser_reads():
    assert set(ResourcesVariable.model_fields) == RESOURCE_KEYS


@pytest.mark.parametrize("raw, field, value", [
    ({"cpu_cores": 3}, "cpu_cores", 3), ({"cores": 3}, "cpu_cores", 3), ({"cpu": 3}, "cpu_cores", 3),
    ({"cpu": 1500}, "cpu_cores", 1.5), ({"cpu_millis": 250}, "cpu_cores", 0.25), ({"cpu_mcores": 64}, "cpu_cores", 0.064),
    ({"memory": 512}, "memory_mb", 512), ({"memory_gb": 2}, "memory_mb", 2048), ({"disk_gb": 0.5}, "disk_mb", 512),
    ({"disk": 7}, "disk_mb", 7), ({"gpus": 2}, "gpu_count", 2), ({"gpu": 1}, "gpu_count", 1),
])
def test_each_alias_is_read_in_its_unit(raw, field, value):
    assert getattr(resource_request(raw), field) == value


def test_the_pool_schema_s_request_is_the_one_pinned(resources):
    """The server keeps the pool's template: the request's part of it (its form and the server's rules) changes only
    on purpose. After an intended change, write tests/golden/pool_resources.json anew (its ``Resources``,
    ``Quantity``, ``Size`` and ``Count`` definitions) and say the change in docs/changelog.md."""
    definitions = MNVariables.model_json_schema()["definitions"]
    shown = {name: definitions[name] for name in ("Resources", "Quantity", "Size", "Count")}
    pinned = json.loads((Path(__file__).parent / "golden" / "pool_resources.json").read_text())
    assert json.dumps(shown, indent=1) == json.dumps(pinned, indent=1)  # key order too: the UI shows that order


def test_the_form_s_words_for_the_request_are_the_grammar_s():
    """The parser reads exactly the keys the form shows, with the same words for each choice."""
    assert set(DeviceInput.model_fields) == DEVICE_KEYS and set(PortInput.model_fields) == PORT_KEYS
    assert set(VolumeInput.model_fields) == VOLUME_KEYS
    device = MNVariables.model_json_schema()["definitions"]["Resources"]["properties"]["devices"]["items"]
    assert device["properties"]["memory_operator"]["enum"] == [*MEMORY_OPERATORS, "="]
    assert set(device["properties"]["api_version_operator"]["enum"]) == {*VERSION_OPERATORS, "="}
    assert device["properties"]["count"]["maximum"] == MAX_DEVICE_COUNT


@pytest.mark.parametrize("field, raw", [
    ("memory_operator", "~"), ("api_version_operator", "=>"), ("count", MAX_DEVICE_COUNT + 1), ("shares", 0.005),
])
def test_a_device_key_the_form_refuses_the_parser_refuses_naming_it(field, raw):
    with pytest.raises(ValidationError):
        DeviceInput.model_validate({field: raw})
    issues = Issues()
    assert parse_resources({"devices": [{field: raw}]}, "resources", issues) is None
    assert [i.path for i in issues.items] == [f"resources.devices[0].{field}"]
