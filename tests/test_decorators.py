"""@requires carries a resource request into a deployment's job variables, validated at import."""

import pytest
from prefect import flow

from mn_prefect.decorators import requires
from mn_prefect.model.issues import InvalidInput


def test_requires_puts_the_request_into_job_variables():
    @requires(gpu=1, memory_gb=16, ports=[{"label": "api"}])
    @flow
    def train():
        return 1

    deployment = train.to_deployment(name="t", job_variables={"env": {"A": "1"}})
    assert deployment.job_variables == {"env": {"A": "1"}, "resources": {"gpu": 1, "memory_gb": 16,
                                                                          "ports": [{"label": "api"}]}}
    assert train.mn_resources["gpu"] == 1


def test_explicit_job_variable_resources_win():
    @requires(cpu=2)
    @flow
    def job():
        return 1

    assert job.to_deployment(name="t", job_variables={"resources": {"cpu": 4}}).job_variables["resources"] == {"cpu": 4}


def test_a_bad_request_fails_at_decoration_naming_the_field():
    with pytest.raises(InvalidInput, match=r"resources.ports\[0\].port"):
        requires(ports=[{"label": "a", "port": 70000}])


def test_requires_carries_the_declared_runtime_its_limit_and_the_flow_s_timeout():
    @requires(cpu=1, max_runtime_s=900, max_runtime_is_limit=True)
    @flow(timeout_seconds=1800)
    def train():
        return 1

    job_variables = train.to_deployment(name="t").job_variables
    assert job_variables == {"resources": {"cpu": 1}, "max_runtime_seconds": 900.0, "max_runtime_is_limit": True,
                             "flow_timeout_seconds": 1800.0}


def test_a_flow_without_a_declared_runtime_carries_none():
    @requires(cpu=1)
    @flow
    def job():
        return 1

    assert job.to_deployment(name="t").job_variables == {"resources": {"cpu": 1}}


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf"), "60", True, 1e9])
def test_a_declared_runtime_that_is_no_positive_finite_number_fails_at_decoration(seconds):
    with pytest.raises(InvalidInput, match=r"^max_runtime_s: "):
        requires(cpu=1, max_runtime_s=seconds)


def test_a_limit_without_its_runtime_fails_at_decoration_with_the_request_s_problems():
    with pytest.raises(InvalidInput) as refused:
        requires(ports=[{"label": "a", "port": 70000}], max_runtime_is_limit=True)
    assert [issue.path for issue in refused.value.issues] == ["resources.ports[0].port", "max_runtime_is_limit"]
