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
