"""Maintenance and scheduling eligibility (docs/operating.md), through `mn-prefect node ...` on a real SQLite store
and a real redis-server: maintenance makes a node ineligible; leaving it restores the eligibility from before."""

import json

import cli_runner
import pytest
from builders import gpu, node
from stores import store_url

from mn_prefect.lifecycle import set_maintenance
from mn_prefect.lifecycle.eligibility import KEPT
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store
from mn_prefect.store.base import Event


@pytest.fixture(params=["sqlite", "redis"])
def cluster(request, tmp_path):
    """A store with "g" (the only GPU) and "c" (CPU only); yields the store and its URL."""
    url = store_url(request.param, request, tmp_path)
    store = open_store(url)
    store.register_node(node("g", devices=[gpu("g0", 0)]))
    store.register_node(node("c"))
    yield store, url
    store.close()


def cli(url, *args):
    result = cli_runner.run(["node", *args, "--store-url", url, "--json"])
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def eligible(store, name):
    return store.get_node(name).record.scheduling_eligible


def gpu_job(store, job_id):
    """A job only "g" can take, with every node's reason explained."""
    return place_and_commit(store, job_id, [Ask(agent_id="w", request=resource_request({"gpu": 1}))], explain=True)


def test_maintenance_makes_an_eligible_node_ineligible_and_leaving_restores_it(cluster):
    store, url = cluster
    entered = cli(url, "maintenance", "g", "--enable", "--reason", "firmware")
    assert (entered["status"], entered["scheduling_eligible"]) == ("maintenance", False) and not eligible(store, "g")
    refused = gpu_job(store, "during")
    assert not refused.placed and refused.plan.agents["w"]["g"].startswith("node not ready")
    left = cli(url, "maintenance", "g", "--disable", "--reason", "done")
    assert (left["status"], left["scheduling_eligible"]) == ("healthy", True) and eligible(store, "g")
    assert gpu_job(store, "after").placed


def test_a_node_ineligible_before_maintenance_stays_ineligible_after(cluster):
    store, url = cluster
    store.set_node_status("g", "healthy", eligible=False)
    cli(url, "maintenance", "g", "--enable", "--reason", "firmware")
    left = cli(url, "maintenance", "g", "--disable", "--reason", "done")
    assert (left["status"], left["scheduling_eligible"]) == ("healthy", False)
    refused = gpu_job(store, "after")
    assert not refused.placed and refused.plan.agents["w"]["g"] == "scheduling ineligible: scheduling_eligible is false"


def test_a_worker_restart_during_maintenance_does_not_lose_the_eligibility_from_before(cluster):
    store, url = cluster
    cli(url, "maintenance", "g", "--enable", "--reason", "firmware")
    store.register_node(node("g", devices=[gpu("g0", 0)]))  # what a worker does when it starts again
    assert (store.get_node("g").record.status, eligible(store, "g")) == ("maintenance", False)
    assert cli(url, "maintenance", "g", "--disable", "--reason", "done")["scheduling_eligible"] is True


def test_a_drain_makes_the_node_ineligible_and_leaving_the_maintenance_it_ends_in_restores_it(cluster):
    store, url = cluster
    drained = cli(url, "drain", "g", "--reason", "disk swap")
    assert drained["status"] == "draining" and not eligible(store, "g")
    undrained = cli(url, "undrain", "g", "--reason", "later")
    assert (undrained["status"], undrained["scheduling_eligible"]) == ("maintenance", False)
    assert cli(url, "maintenance", "g", "--disable", "--reason", "done")["scheduling_eligible"] is True


def test_maintenance_after_a_drain_keeps_the_eligibility_from_before_the_drain(cluster):
    store, url = cluster
    store.set_node_status("c", "healthy", eligible=False)
    cli(url, "drain", "c", "--reason", "disk swap")
    cli(url, "undrain", "c", "--reason", "later")
    assert cli(url, "maintenance", "c", "--disable", "--reason", "done")["scheduling_eligible"] is False


def test_the_eligibility_before_is_kept_as_an_event_of_the_node(cluster):
    store, url = cluster
    cli(url, "maintenance", "g", "--enable", "--reason", "firmware")
    [kept] = [e for e in store.events(node="g") if e.kind == KEPT]
    assert kept.data == {"eligible": True, "from": "healthy"}


def test_a_node_whose_kept_eligibility_is_missing_keeps_the_one_it_has(cluster):
    """Maintenance entered without the event (before this existed): nothing to restore, so the node stays as it
    is, never made eligible by guess."""
    store, url = cluster
    store.transition_node("g", "maintenance", from_statuses=("healthy",), reason="old style", eligible=False)
    assert set_maintenance(store, "g", False, "done").to_status == "healthy" and eligible(store, "g") is False
    store.transition_node("c", "maintenance", from_statuses=("healthy",), reason="old style")
    assert set_maintenance(store, "c", False, "done") is not None and eligible(store, "c") is True


def test_the_kept_eligibility_is_found_behind_many_newer_events_of_the_node(cluster):
    store, url = cluster
    cli(url, "maintenance", "g", "--enable", "--reason", "firmware")
    for n in range(250):  # more than the first read of the node's newest events holds
        store.record_event(Event(kind="job.released", node="g", job_id=f"r{n}", reason="the run ended"))
    assert cli(url, "maintenance", "g", "--disable", "--reason", "done")["scheduling_eligible"] is True
