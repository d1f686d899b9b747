"""Numbers read out of raw JSON: numeric strings are numbers, words and negatives are errors naming the path."""

import pytest

from mn_prefect.model.issues import Issues
from mn_prefect.model.resources import parse_resources
from mn_prefect.model.scalars import read_int, read_number


@pytest.mark.parametrize("text, number", [("8", 8.0), ("8.5", 8.5), (" 16 ", 16.0)])
def test_numeric_strings_are_numbers(text, number):
    issues = Issues()
    assert read_number(text, "cpu", issues) == number and not issues


@pytest.mark.parametrize("raw, path", [({"cpu": "lots"}, "resources.cpu"), ({"memory_mb": "x"}, "resources.memory_mb"),
                                       ({"disk_gb": "big"}, "resources.disk_gb")])
def test_a_word_where_a_number_belongs_is_must_be_a_number_at_its_path(raw, path):
    issues = Issues()
    assert parse_resources(raw, "resources", issues) is None
    [issue] = issues.items
    assert issue.path == path and issue.message.startswith("must be a number") and "got the string" in issue.message


@pytest.mark.parametrize("value", [-1, "-1", "-0.5"])
def test_negative_amounts_are_refused(value):
    issues = Issues()
    assert read_number(value, "memory_mb", issues) is None
    assert issues.items[0].message.startswith("must not be negative")


def test_an_integral_numeric_string_is_an_integer_and_a_fraction_is_not():
    issues = Issues()
    assert read_int("2.0", "gpu", issues, maximum=1024) == 2 and not issues
    assert read_int("2.5", "gpu", issues, maximum=1024) is None
    assert issues.items[0].message == "must be an integer, got '2.5'"
