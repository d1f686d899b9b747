"""The request grammar is one table (model/resources.py's SCALAR_FIELDS): the pool schema (worker/variables.py)
lists exactly the fields and aliases the parser reads, with the same kind of number, and the parser applies each
alias's unit."""

from __future__ import annotations

import re

import pytest

from mn_prefect.model.amounts import SIZE_UNITS
from mn_prefect.model.resources import LIST_FIELDS, RESOURCE_KEYS, SCALAR_FIELDS, resource_request
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
