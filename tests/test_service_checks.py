"""Node services declared with a check (docs/scheduling.md, "Scheduling choices"): the node's own worker probes them,
their status in the store is live, and ``required_services`` placement follows it. A real Prefect server, one real
``mn`` worker whose mock inventory declares the service, a real listening socket, the real ``mn-prefect plan`` in a
subprocess."""

from __future__ import annotations

import json
import socket

import anyio
import pytest
import servers
from lab import Lab
from test_cli import run, write

from mn_prefect.lifecycle import health
from mn_prefect.model.issues import Issues
from mn_prefect.model.node import ServiceInstance, parse_node

NODE = "svc-1"


def _issues(service: dict) -> list[tuple[str, str]]:
    issues = Issues()
    parse_node({"name": NODE, "services": [service]}, "nodes[0]", issues)
    return [(i.path, i.message) for i in issues.items]


def test_a_check_without_a_port_is_refused_naming_the_port():
    assert _issues({"name": "db", "check": {"tcp": True}}) == [
        ("nodes[0].services[0].port", "port is required with a check")]


@pytest.mark.parametrize("check", [{}, {"tcp": True, "http": "/healthz"}])
def test_a_check_is_exactly_one_of_http_or_tcp(check):
    assert _issues({"name": "db", "port": 5432, "check": check}) == [
        ("nodes[0].services[0].check", "set exactly one of http (a path) or tcp: true")]


@pytest.mark.parametrize("field, value", [("interval_s", 0), ("timeout_s", -1), ("failures_to_critical", 0),
                                          ("port", 70000)])
def test_bad_check_settings_are_refused_naming_the_field(field, value):
    [(path, _)] = _issues({"name": "db", "port": 5432, "check": {"tcp": True}, field: value})
    assert path == f"nodes[0].services[0].{field}"


def test_a_service_without_a_check_keeps_the_inventory_status():
    static = ServiceInstance(name="db", status="passing")
    checked = ServiceInstance(name="api", status="passing", port=8080, check={"http": "/healthz"})
    assert [s.status for s in health.unproven([static, checked])] == ["passing", "critical"]


def test_a_pass_makes_a_service_passing_and_failures_in_a_row_make_it_critical():
    tally, status = health.Tally(limit=3), "critical"
    status = health.service_status(status, tally, None)
    assert status == "passing"
    for _ in range(2):
        status = health.service_status(status, tally, "ConnectionRefusedError")
    assert status == "passing"  # two failures are no verdict yet
    assert health.service_status(status, tally, "ConnectionRefusedError") == "critical"


def test_a_tcp_service_check_probes_its_port_on_this_machine():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        service = ServiceInstance(name="db", port=listener.getsockname()[1], check={"tcp": True})
        assert anyio.run(health.probe_service, service) is None
    assert anyio.run(health.probe_service, service) is not None  # closed: refused


# -- the node's own worker -----------------------------------------------------------------------------------

PORT = servers.free_port()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    service = {"name": "db", "port": PORT, "check": {"tcp": True}, "interval_s": 0.5, "failures_to_critical": 2}
    lab = Lab(tmp_path_factory.mktemp("services"),
              fleet=[{"name": NODE, "cpu_cores": 4, "memory_mb": 8192, "services": [service]}])
    yield lab
    lab.stop()


def _db_status(lab: Lab) -> str:
    [db] = lab.store.get_node(NODE).record.services
    return db.status


def _plan(lab: Lab, tmp_path) -> dict:
    blueprint = {"job_name": "needs-db", "required_services": [{"name": "db"}],
                 "nodes": [{"node_id": "w", "config": {"command": ["true"]}, "resources": {"cpu": 1}}]}
    return json.loads(run("plan", write(tmp_path, "b.json", blueprint), "--store-url", lab.store_url).stdout)


@pytest.mark.lab
def test_a_checked_service_follows_its_port_and_placement_follows_it(lab, tmp_path):
    assert _db_status(lab) == "critical"  # nothing listens yet: critical until the first pass
    refused = _plan(lab, tmp_path)
    assert refused["status"] != "runnable_now" and refused["agents"]["w"][NODE] == "required service not passing: db"

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", PORT))
        listener.listen()
        servers.wait_for(lambda: _db_status(lab) == "passing", timeout=10, what="db passing in the store")
        placed = _plan(lab, tmp_path)
        assert placed["status"] == "runnable_now" and placed["placements"][0]["node"] == NODE

    servers.wait_for(lambda: _db_status(lab) == "critical", timeout=10, what="db critical in the store")
    again = _plan(lab, tmp_path)
    assert again["status"] != "runnable_now" and again["agents"]["w"][NODE] == "required service not passing: db"
    node = lab.store.get_node(NODE).record
    assert node.status == "healthy" and node.scheduling_eligible  # re-registering kept the node's state

    def seen() -> list[tuple[str, str, str]]:
        body = {"filter": {"event": {"prefix": ["mn.service."]}, "any_resource": {"id": [f"mn.node.{NODE}"]},
                           "occurred": {"since": lab.since}}, "limit": 50}
        found = lab.http.post("/events/filter", json=body).json().get("events", [])
        return sorted((e["occurred"], e["event"], e["payload"]["service"]) for e in found)

    changes = servers.wait_for(lambda: len(seen()) >= 2 and seen(), timeout=30, interval=0.5, what="the service events")
    assert [(event, service) for _, event, service in changes] == [("mn.service.passing", "db"),
                                                                    ("mn.service.critical", "db")]
