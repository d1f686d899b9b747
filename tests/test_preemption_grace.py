"""The preemption grace as input: the job variable, ``@requires(preemption_grace_s=...)`` and the pool's maximum
(``queue policy --max-preemption-grace``); a bad one is refused naming its field and changes nothing."""

import json
import math

import pytest
from pydantic import ValidationError
from test_cli import run

from mn_prefect.decorators import requires
from mn_prefect.model.issues import InvalidInput
from mn_prefect.worker.variables import MNVariables


@pytest.mark.parametrize("bad", [-1, math.inf, math.nan, "soon", True])
def test_a_bad_grace_in_requires_is_refused_naming_it(bad):
    with pytest.raises(InvalidInput) as raised:
        requires(gpu=1, preemption_grace_s=bad)
    assert [issue.path for issue in raised.value.issues] == ["preemption_grace_s"]


def test_a_grace_in_requires_becomes_the_job_variable():
    class Flow:
        def deploy(self, *args, **kwargs):
            return kwargs["job_variables"]

    assert requires(gpu=1, preemption_grace_s=90)(Flow()).deploy()["preemption_grace_seconds"] == 90


@pytest.mark.parametrize("bad", [-1, "inf", "nan", "soon", 86401])
def test_a_bad_grace_job_variable_is_refused_naming_it(bad):
    with pytest.raises(ValidationError) as raised:
        MNVariables.model_validate({"preemption_grace_seconds": float(bad) if bad in ("inf", "nan") else bad})
    assert raised.value.errors()[0]["loc"] == ("preemption_grace_seconds",)


def test_the_pools_maximum_grace_round_trips_and_a_bad_one_changes_nothing(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    shown = json.loads(run("queue", "policy", "--pool", "p", "--store-url", url, "--json").stdout)
    assert shown["max_preemption_grace_s"] == 600 and shown["holds"] is True
    set_ = run("queue", "policy", "--pool", "p", "--max-preemption-grace", "120", "--store-url", url, "--json")
    assert set_.returncode == 0, set_.stderr
    policy = json.loads(set_.stdout)
    assert policy["max_preemption_grace_s"] == 120 and policy["holds"] is True  # holds stay on when not named
    for bad in ("-5", "inf", "nan", "soon"):
        refused = run("queue", "policy", "--pool", "p", "--max-preemption-grace", bad, "--store-url", url)
        assert refused.returncode == 2 and "--max-preemption-grace" in refused.stdout + refused.stderr, bad
    after = json.loads(run("queue", "policy", "--pool", "p", "--store-url", url, "--json").stdout)
    assert after["max_preemption_grace_s"] == 120


def test_the_pools_idle_gpu_settings_round_trip_and_bad_ones_change_nothing(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    shown = json.loads(run("queue", "policy", "--pool", "p", "--store-url", url, "--json").stdout)
    assert (shown["idle_gpu_percent"], shown["idle_gpu_seconds"]) == (5, 1800)
    set_ = run("queue", "policy", "--pool", "p", "--idle-gpu-percent", "10", "--idle-gpu-minutes", "15",
               "--store-url", url, "--json")
    assert set_.returncode == 0, set_.stderr
    assert (json.loads(set_.stdout)["idle_gpu_percent"], json.loads(set_.stdout)["idle_gpu_seconds"]) == (10, 900)
    for option, bad in (("--idle-gpu-percent", "101"), ("--idle-gpu-percent", "nan"), ("--idle-gpu-percent", "-1"),
                        ("--idle-gpu-minutes", "0"), ("--idle-gpu-minutes", "inf"), ("--idle-gpu-minutes", "x")):
        refused = run("queue", "policy", "--pool", "p", option, bad, "--store-url", url)
        assert refused.returncode == 2 and option in refused.stdout + refused.stderr, (option, bad)
    after = json.loads(run("queue", "policy", "--pool", "p", "--store-url", url, "--json").stdout)
    assert (after["idle_gpu_percent"], after["idle_gpu_seconds"]) == (10, 900)
