"""Property tests: no input makes the request grammar, the job configuration or plan raise anything but their
named validation error (issues with paths, or a pydantic error naming its field)."""


from hypothesis import HealthCheck, example, given, settings, strategies as st
from pydantic import ValidationError
from test_properties import json_values

from mn_prefect.cli.inputs import ask_for_run
from mn_prefect.model.constraints import OPERATORS, parse_constraints
from mn_prefect.model.issues import InvalidInput, Issues
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.resources import resource_request
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.worker.routing import invalid_configuration
from mn_prefect.worker.variables import MNJobConfiguration

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

HUGE = 10**5000  # str() and repr() of it raise past Python's digit limit
nasty_scalars = st.sampled_from([
    HUGE, -HUGE, 2**64, 10**13, -1, float("inf"), float("-inf"), float("nan"), -0.0, 1e-320, 1e308,
    "1_0_0", "١٢", "4G", "1e999", " 5 ", "0x10", "-1", "nan", "inf", "", " ", "1" + "0" * 5000, "abc", "1..2",
    "12.2", "x" * 5000, "\x00", True, None,
])
values = json_values | nasty_scalars | st.lists(nasty_scalars, max_size=3) | st.just([[[[[1]]]]])

DEVICE_KEYS = ["kind", "type", "vendor", "ids", "count", "min_memory_mb", "memory_operator", "capabilities",
               "min_api_version", "api_version_operator", "shares", "memory_mb", "mig_profile", "typo"]
devices = st.lists(st.dictionaries(st.sampled_from(DEVICE_KEYS), values, max_size=4) | values, max_size=2)
ports = st.lists(st.dictionaries(st.sampled_from(["label", "port", "protocol", "typo"]), values, max_size=3)
                 | values, max_size=2)
volumes = st.lists(st.dictionaries(st.sampled_from(["name", "source", "target", "mode", "type", "typo"]), values,
                                   max_size=4) | values, max_size=2)
SCALAR_KEYS = ["cpu", "cpu_cores", "cpu_millis", "memory_mb", "memory_gb", "disk_mb", "disk_gb", "gpu", "gpu_count",
               "gpus", "runtime_driver", "typo"]
resources = st.fixed_dictionaries({}, optional={
    **{key: values for key in SCALAR_KEYS}, "devices": devices | values, "ports": ports | values,
    "volumes": volumes | values})
ATTRIBUTES = ["capabilities", "node", "status", "role", "labels.zone", "os", "arch", "devices", "cpu_cores",
              "labels.cuda", "gpu.api_version"]
constraint = st.fixed_dictionaries({}, optional={
    "attribute": st.sampled_from(ATTRIBUTES) | values,
    "operator": st.sampled_from([*OPERATORS, "=", "is", "is_set", "~"]) | values, "value": values})
constraints = st.lists(constraint | values, max_size=3) | values


def _named(issues) -> bool:
    return all(isinstance(i.path, str) and i.path and i.message for i in issues)


# -- the request grammar ----------------------------------------------------------------------------------

@FAST
@given(resources)
@example({"runtime_driver": HUGE})
@example({"devices": [{"count": HUGE, "shares": 0.5}]})
@example({"ports": [{"label": "a", "port": HUGE}]})
@example({"ports": [{"label": "a", "protocol": HUGE}]})
@example({"volumes": [{"name": "v", "source": "/data", "mode": HUGE}]})
@example({"devices": [{"memory_operator": HUGE}]})
def test_a_resource_request_is_a_request_or_issues_naming_fields(raw):
    try:
        request = resource_request(raw)
    except InvalidInput as error:
        assert error.issues and _named(error.issues)
        assert all(i.path.startswith("resources") for i in error.issues)
    else:
        assert request.canonical() is not None


@FAST
@given(constraints)
@example([{"attribute": "node", "operator": HUGE}])
@example([{"attribute": "labels.cuda", "operator": ">=", "value": "1" + "0" * 5000}])
@example([{"attribute": "labels.cuda", "operator": "==", "value": HUGE}])
@example([{"attribute": "labels.cuda", "operator": "in", "value": [float("nan"), "12.2"]}])
def test_constraints_are_constraints_or_issues_naming_fields(raw):
    issues = Issues()
    parsed = parse_constraints(raw, "constraints", issues)
    assert _named(issues.items)
    for c in parsed:
        assert c.describe()


JOB_VARIABLES = {"resources": resources | values, "constraints": constraints,
                 "strategy": st.sampled_from(["binpack", "spread"]) | values, "image": values,
                 "job_type": values, "priority": values, "max_runtime_seconds": values,
                 "max_runtime_is_limit": values, "health": values | st.just({"port_label": "api"}),
                 "preferred_node": values, "booking": values, "min_runtime_seconds": values}


@FAST
@given(st.fixed_dictionaries({}, optional=JOB_VARIABLES))
@example({"max_runtime_seconds": HUGE})
@example({"max_runtime_seconds": [HUGE]})
def test_a_job_configuration_is_one_or_a_validation_error_naming_fields(variables):
    try:
        MNJobConfiguration.model_validate({"command": "true", **variables})
    except ValidationError as error:
        problems = error.errors(include_url=False)
        assert problems and all(p["loc"] or p["type"] == "resources" for p in problems)
        assert invalid_configuration(error).startswith("invalid resource request: ")


# -- plan, end to end ------------------------------------------------------------------------------------

NODES = [NodeRecord.model_validate(n) for n in [
    {"name": "gpu-1", "cpu_cores": 16, "memory_mb": 65536, "disk_mb": 100000, "capabilities": ["cuda", "fast"],
     "labels": {"zone": "a", "cuda": "12.2"}, "host_paths": ["/data"], "runtime_drivers": ["host_local", "docker"],
     "devices": [{"id": f"g{i}", "index": i, "vendor": "nvidia", "driver": "cuda", "memory_total_mb": 40000,
                  "api_version": "12.2", "capabilities": ["fp16"]} for i in range(2)]},
    {"name": "cpu-1", "cpu_cores": 4, "memory_mb": 8192, "labels": {"zone": "b"}, "os": "linux", "arch": "x86_64"},
]]


@FAST
@given(st.fixed_dictionaries({}, optional={"resources": resources, "constraints": constraints,
                                           "preferred_node": values, "strategy": values}))
@example({"preferred_node": ["gpu-1"]})
@example({"strategy": "fastest"})
@example({"strategy": ["spread"]})
@example({"constraints": [{"attribute": "labels.cuda", "operator": ">=", "value": "1" + "0" * 5000}]})
@example({"constraints": [{"attribute": "labels.cuda", "operator": "==", "value": HUGE}]})
@example({"constraints": [{"attribute": "labels.cuda", "operator": "<", "value": "12." + "9" * 5000}]})
def test_plan_of_any_run_is_a_plan_or_issues_naming_fields(variables):
    issues = Issues()
    run = ask_for_run("run", variables, "job_variables", issues)
    if run is None:
        assert issues and _named(issues.items)
        return
    plan = plan_asks([run.ask], NODES, strategy=run.strategy)
    assert plan.status in ("runnable_now", "runnable_later", "not_runnable", "invalid")
    assert plan.model_dump(mode="json") is not None
