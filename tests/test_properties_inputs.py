"""Property tests: no input makes the request grammar, the job configuration, plan or the bundle loader raise
anything but their named validation error (issues with paths, or a pydantic error naming its field)."""

import copy
import json
import shutil
import sys
from pathlib import Path

import anyio
import pytest
from builders import json_paths
from hypothesis import HealthCheck, example, given, settings, strategies as st
from pydantic import ValidationError
from test_properties import json_values

from mn_prefect.bundles.bundle import load_bundle
from mn_prefect.bundles.schedule import parse_schedule
from mn_prefect.bundles.services import parse_services
from mn_prefect.bundles.triggers import parse_triggers
from mn_prefect.cli.inputs import ask_for_run
from mn_prefect.model.constraints import OPERATORS, parse_constraints
from mn_prefect.model.issues import InvalidInput, Issues
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.resources import resource_request
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.worker.routing import invalid_configuration
from mn_prefect.worker.variables import MNJobConfiguration
from mn_prefect.worker.worker import MNWorker
from mn_prefect.workflow.manifest import parse_workflow

BUNDLES = sorted((Path(__file__).resolve().parents[1] / "examples" / "bundles").glob("*/manifest.json"))
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


# -- the bundle manifest ----------------------------------------------------------------------------------

@st.composite
def mutated_manifests(draw, named=False):
    source = draw(st.sampled_from(BUNDLES))
    doc = copy.deepcopy(json.loads(source.read_text()))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        where = draw(st.sampled_from([p for p in json_paths(doc) if p]))
        target = doc
        for key in where[:-1]:
            target = target[key]
        action = draw(st.sampled_from(["replace", "delete", "insert"]))
        if action == "delete" or (action == "insert" and not isinstance(target[where[-1]], (dict, list))):
            del target[where[-1]]
        elif action == "replace":
            target[where[-1]] = copy.deepcopy(draw(values))  # never the strategy's own list
        elif isinstance(target[where[-1]], dict):
            target[where[-1]][draw(st.text(max_size=6))] = copy.deepcopy(draw(values))
        else:
            target[where[-1]].insert(draw(st.integers(0, len(target[where[-1]]))), copy.deepcopy(draw(values)))
    return (source.parent.name, doc) if named else doc


MANIFEST_KEYS = {"agents": values | st.fixed_dictionaries({}, optional={"nodes": values, "edges": values,
                                                                         "entrypoints": values}),
                 "workflow": values | st.fixed_dictionaries({}, optional={
                     "steps": values | st.lists(st.dictionaries(st.sampled_from(
                         ["id", "agent_id", "run", "control", "trigger_rule", "join", "label"]), values, max_size=4),
                         max_size=3),
                     "edges": values, "mode": values, "execution": values, "source": values, "sink": values,
                     "dynamic": values}),
                 "nodes": values, "edges": values, "policies": values | st.fixed_dictionaries({}, optional={
                     "restart": st.dictionaries(st.sampled_from(["attempts", "delay_function", "delay_ms", "mode"]),
                                                values, max_size=3), "recovery_mode": values}),
                 "schedule": values | st.dictionaries(st.sampled_from(
                     ["kind", "crons", "cron", "timezone", "missed_policy", "enabled"]), values, max_size=3),
                 "triggers": values | st.lists(st.dictionaries(st.sampled_from(
                     ["name", "event_type", "trigger", "filters", "enabled"]), values, max_size=3), max_size=2),
                 "services": values | st.lists(st.dictionaries(st.sampled_from(
                     ["name", "id", "port", "tags", "checks", "address"]), values | st.lists(st.dictionaries(
                         st.sampled_from(["type", "port", "path", "interval_ms", "timeout_ms"]), values, max_size=3),
                         max_size=2), max_size=4), max_size=2), "runtime": values, "initial_inputs": values, "id": values, "version": values,
                 "job_name": values, "kind": values}
manifests = st.fixed_dictionaries({}, optional=MANIFEST_KEYS)


def _parse_manifest(doc) -> list:
    spec, problems = parse_workflow(doc)
    assert (spec is None) == bool(problems) and _named(problems) or not isinstance(doc, dict)
    scheduling = Issues()
    if isinstance(doc, dict):
        parse_schedule(doc, scheduling)
        parse_triggers(doc, scheduling)
        parse_services(doc, scheduling)
    assert _named(scheduling.items)
    return problems


@FAST
@given(mutated_manifests())
def test_a_mutated_example_manifest_parses_or_names_its_issues(doc):
    _parse_manifest(doc)


@pytest.mark.parametrize("edge_id", [[HUGE], {"x": HUGE}, ["e"]])
def test_an_edge_id_that_is_a_list_or_an_object_is_named(edge_id):
    """Found by the property test above: a list holding a 5,000-digit number where an edge's id belongs."""
    [path] = [p for p in BUNDLES if p.parent.name == "demo_canary_deployment"]
    doc = json.loads(path.read_text())
    doc["agents"]["edges"][0]["edge_id"] = edge_id
    problems = _parse_manifest(doc)
    assert any(str(p).startswith("agents.edges[0].edge_id") and "must be an id" in str(p) for p in problems), problems


def _one_agent(config=None, **doc):
    return {"nodes": [{"node_id": "a", "config": {"command": ["true"], **(config or {})}}], **doc}


@FAST
@given(manifests | values)
@example({"agents": {"nodes": [], "entrypoints": 5}})
@example({"policies": {"restart": {"delay_function": HUGE, "mode": HUGE}}})
@example({"services": [{"name": "s", "port": float("inf")}]})
@example({"services": [{"name": "s", "port": 80, "checks": 5}]})
@example({"services": [{"name": "s", "id": HUGE}]})
@example({"services": [{"name": "s", "port": 80, "checks": [{"interval_ms": HUGE}]}]})
@example({"triggers": [{"trigger": 5}]})
@example({"schedule": {"kind": HUGE, "missed_policy": HUGE}})
@example({"workflow": {"source": []}})
@example({"nodes": [{"node_id": "a"}, {"node_id": "b"}], "edges": [{"from_node": "a", "to_node": HUGE}]})
@example(_one_agent(edges=[{"edge_id": HUGE, "from_node": "a", "to_node": "a"}]))
@example(_one_agent({"environment": {"SEED": HUGE}}))
@example(_one_agent({"retry_backoff_ms": HUGE}, workflow={"steps": [{"id": "a"}]}))
@example(_one_agent({"timeout_seconds": HUGE}))
@example(_one_agent({"timeout_seconds": float("nan")}))
@example(_one_agent(workflow={"steps": [{"id": "a", "control": {"failure_policy": []}}]}))
@example(_one_agent(workflow={"steps": [{"id": "a", "trigger_rule": HUGE}]}))
@example(_one_agent(workflow={"steps": [{"id": "a"}], "workflow_id": HUGE}))
@example(_one_agent(id=HUGE))
@example(_one_agent(version=HUGE))
@example(_one_agent(workflow={"steps": [{"id": "a"}], "mode": "dynamic_dag", "dynamic": {
    "enabled": True, "templates": [{"id": []}], "regions": [{"id": "r", "templates": 5, "strategy": 7}]}}))
def test_a_manifest_shaped_document_parses_or_names_its_issues(doc):
    _parse_manifest(doc)


@pytest.fixture(scope="module")
def bundle_copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundles")
    for manifest in BUNDLES:
        shutil.copytree(manifest.parent, root / manifest.parent.name)
    return root


def _dumps(doc) -> str:
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # the file may hold an integer of any length, as a person may write one
    try:
        return json.dumps(doc)
    finally:
        sys.set_int_max_str_digits(limit)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(mutated_manifests(named=True))
@example(("demo_dag_linear", {"agents": {"nodes": []}, "version": HUGE}))
def test_a_bundle_with_a_mutated_manifest_loads_or_names_its_issues(bundle_copies, named):
    name, doc = named
    folder = bundle_copies / name
    (folder / "manifest.json").write_text(_dumps(doc))
    try:
        load_bundle(folder)
    except InvalidInput as error:
        assert error.issues and _named(error.issues)


def test_a_manifest_nested_too_deeply_is_an_issue_naming_the_manifest(bundle_copies):
    folder = bundle_copies / BUNDLES[0].parent.name
    (folder / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InvalidInput) as raised:
        load_bundle(folder)
    assert [i.path for i in raised.value.issues] == ["manifest"] and "nested too deeply" in str(raised.value)


# -- Prefect's templating of the pool's job template ---------------------------------------------------------

TEMPLATE_VALUES = {**JOB_VARIABLES, "preemption_grace_seconds": values,
                   "env": values | st.dictionaries(st.text(max_size=8), values, max_size=3),
                   "working_dir": values, "labels": values,
                   # a value with a placeholder of its own: Prefect templates strings it finds in the job variables
                   "name": st.sampled_from(["{{ name }}", "{{ resources }}", "{{", "}}", "{{ missing }}",
                                            "{{ prefect.blocks.secret }}", "{{ prefect.blocks }}"]) | values,
                   # dotted names: Prefect nests them (env.A is env's A), and one may run through another's value
                   "env.A": values, "env.A.B": values, "resources.gpu": values}


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=TEMPLATE_VALUES))
@example({"env": []})  # Prefect's own env check raised AttributeError: the run's placement failed at every poll
@example({"env": None})
@example({"preemption_grace_seconds": HUGE})
@example({"name": "{{ resources }}", "resources": {"gpu": 1}})
@example({"env.A": 1, "env.A.B": 2})  # Prefect's set_in_dict raised TypeError: placement failed at every poll
@example({"name": "{{ prefect.blocks.secret }}"})  # a malformed block placeholder: Prefect raised ValueError
def test_the_pools_template_with_any_job_variables_is_a_configuration_or_a_validation_error(variables):
    """What the worker does with every run (``MNJobConfiguration.from_template_and_values``, Prefect's templating
    of the pool's base job template with the deployment's and the run's variables): a configuration, or a
    ValidationError the worker turns into the run's failure naming the fields; never another exception, which would
    fail the run's placement again at every poll."""
    template = MNWorker.get_default_base_job_template()

    async def configure():
        return await MNJobConfiguration.from_template_and_values(template, variables, client=object())

    try:
        config = anyio.run(configure)
    except ValidationError as error:
        assert invalid_configuration(error)
        return
    assert isinstance(config, MNJobConfiguration)


@pytest.mark.parametrize(("variables", "named"), [
    ({"env.A": 1, "env.A.B": 2}, ["job_variables.env.A: ", "job_variables.env.A.B: "]),
    ({"name": "{{ prefect.blocks.secret }}"}, ["job_variables.name: a Prefect placeholder"]),
])
def test_templating_prefect_cannot_do_is_a_validation_error_naming_the_job_variables(variables, named):
    template = MNWorker.get_default_base_job_template()

    async def configure():
        return await MNJobConfiguration.from_template_and_values(template, variables, client=object())

    with pytest.raises(ValidationError) as raised:
        anyio.run(configure)
    message = invalid_configuration(raised.value)
    assert all(part in message for part in named), message
