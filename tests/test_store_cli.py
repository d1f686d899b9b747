"""The store through the command line and the Prefect Block; passwords never leak."""

import json
import sys
from pathlib import Path

import cli_runner
import pytest
from builders import gpu, node
from stores import store_url

from mn_prefect.model.placement import Placement
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store, redact
from mn_prefect.store.base import StoreError

MN = str(Path(sys.executable).parent / "mn-prefect")
SECRET = "s3cr3t-pa55"


def run(*args, env=None):
    return cli_runner.run(args, env=env)


def test_store_check_reports_a_reachable_store(backend, request, tmp_path):
    url = store_url(backend, request, tmp_path)
    open_store(url).register_node(node("a"))
    result = run("store", "check", url, "--json")
    info = json.loads(result.stdout)
    assert result.returncode == 0 and info["reachable"] and info["counts"]["nodes"] == 1 and info["version"]
    assert "test-secret" not in result.stdout  # the fixtures' passwords


@pytest.mark.parametrize("url", [f"postgresql://mn:{SECRET}@127.0.0.1:1/mn", f"redis://:{SECRET}@127.0.0.1:1/0",
                                 f"redis+sentinel://:{SECRET}@127.0.0.1:1/mymaster/0"])
def test_an_unreachable_store_is_reported_without_its_password(url):
    result = run("store", "check", url, "--json")
    assert result.returncode == 1 and json.loads(result.stdout)["reachable"] is False
    assert SECRET not in result.stdout + result.stderr and "***" in result.stdout


def test_wrong_passwords_fail_without_echoing_them(redis_server, postgres_server):
    for url in (f"redis://:{SECRET}@127.0.0.1:{redis_server.port}/0",
                f"postgresql://mn:{SECRET}@127.0.0.1:{postgres_server.port}/postgres"):
        with pytest.raises(StoreError) as info:
            open_store(url).snapshot()
        assert SECRET not in str(info.value) and "***" in str(info.value)


def test_redaction_covers_every_url_form():
    for url in (f"postgresql://u:{SECRET}@h/db", f"rediss://user:{SECRET}@h:6380/1",
                f"redis+sentinel://:{SECRET}@h1:26379,h2:26379/m/0", f"postgresql://u@h/db?password={SECRET}"):
        assert SECRET not in redact(url)


def test_node_register_and_resource_list_from_the_store(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    inventory = tmp_path / "node.json"
    inventory.write_text(json.dumps({"name": "gpu-box", "cpu_cores": 8, "memory_mb": 16384,
                                     "devices": [gpu("G0", 0), gpu("G1", 1)]}))
    env = {"MN_INVENTORY_FILE": str(inventory)}
    assert run("node", "register", "--store-url", url, env=env).returncode == 0
    store = open_store(url)
    assert place_and_commit(store, "j", [Ask(agent_id="a", request=resource_request({"gpu": 1, "cpu_cores": 2}))]).placed
    assert run("resource", "set", "--cpu", "50", "--store-url", url).returncode == 0
    doc = json.loads(run("resource", "list", "--store-url", url, "--json").stdout)
    box = doc["nodes"][0]
    assert box["name"] == "gpu-box" and box["used"]["cpu_cores"] == 2 and box["schedulable"]["cpu_cores"] == 4
    assert [d["held"] for d in box["devices"]] == [True, False] and doc["limits"]["cpu"] == 50
    listed = json.loads(run("node", "list", "--store-url", url, "--json").stdout)
    assert [n["name"] for n in listed] == ["gpu-box"] and listed[0]["last_heartbeat"]
    audit = run("store", "audit", url, "--json")
    report = json.loads(audit.stdout)
    assert audit.returncode == 0 and report["sound"] and report["problems"] == [] and report["findings"] == []


def test_resource_set_refuses_a_node_the_store_does_not_know_and_stores_nothing(tmp_path):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    store.register_node(node("gpu-1"))
    before = store.get_limits()
    refused = run("resource", "set", "--cpu", "50", "--node", "nope", "--store-url", url)
    assert refused.returncode == 2 and "--node" in refused.stderr and "no node 'nope' in the store" in refused.stderr
    assert store.get_limits() == before and "nope" not in store.get_limits().per_node
    assert run("resource", "set", "--cpu", "50", "--node", "gpu-1", "--store-url", url).returncode == 0
    assert store.get_limits().per_node == {"gpu-1": {"cpu": 50}}


def test_store_url_comes_from_the_environment(tmp_path):
    url = f"sqlite:///{tmp_path / 'env.db'}"
    open_store(url).register_node(node("from-env"))
    result = run("store", "check", "--json", env={"MN_STORE_URL": url})
    assert json.loads(result.stdout)["counts"]["nodes"] == 1


def test_block_loads_the_store_by_name(tmp_path, postgres_server):
    from prefect.testing.utilities import prefect_test_harness

    from mn_prefect.blocks import MNClusterStore

    url = postgres_server.create_database("blocktest")
    bare = url.replace(f":{postgres_server.password}@", "@")
    with pytest.raises(ValueError, match="password field"):
        MNClusterStore(url=url)
    with prefect_test_harness(server_startup_timeout=600):  # a loaded machine starts it slowly
        MNClusterStore(url=bare, password=postgres_server.password).save("lab")
        loaded = MNClusterStore.load("lab")
        assert loaded.url == bare and loaded.password.get_secret_value() == postgres_server.password
        assert postgres_server.password not in repr(loaded)
        store = loaded.open()
        store.register_node(node("n1"))
        assert store.check().counts["nodes"] == 1


def test_resource_list_shows_fractions_and_slices_under_their_gpu(backend, request, tmp_path):
    url = store_url(backend, request, tmp_path)
    parent = {**gpu("GPU-m", 0, 81920), "mig_mode": True}
    cut = [{**gpu(f"MIG-m-{n}", 0, 9984), "parent": "GPU-m", "mig_profile": "1g.10gb"} for n in range(3)]
    store = open_store(url)
    store.register_node(node("box", devices=[parent, *cut, gpu("GPU-s", 1, 24576)]))
    for job, raw in (("slices", {"devices": [{"kind": "gpu", "mig_profile": "1g.10gb", "count": 2}]}),
                     ("quarter", {"devices": [{"kind": "gpu", "shares": 0.25}]}),
                     ("half", {"devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": 10000}]})):
        assert place_and_commit(store, job, [Ask(agent_id="a", request=resource_request(raw))]).placed, job
    refused = place_and_commit(store, "whole", [Ask(agent_id="a", request=resource_request({"gpu": 1}))])
    assert refused.plan.status == "runnable_later"  # GPU-m has slices booked, GPU-s fractions
    by_hand = Placement(agent_id="a", node="box", resources={"gpu_count": 1}, allocation={"devices": [parent]})
    conflict = store.commit_plan("by-hand", [by_hand]).conflict
    assert conflict is not None and "never both" in conflict.reason  # the store's own rule, not only the planner
    doc = json.loads(run("resource", "list", "--store-url", url, "--json").stdout)
    devices = {d["id"]: d for d in doc["nodes"][0]["devices"]}
    assert [d["id"] for d in doc["nodes"][0]["devices"]] == ["GPU-m", "MIG-m-0", "MIG-m-1", "MIG-m-2", "GPU-s"]
    assert devices["GPU-m"]["slices_booked"] == 2 and devices["MIG-m-0"]["held"] and not devices["MIG-m-2"]["held"]
    assert devices["GPU-s"]["shares_booked"] == 0.75 and devices["GPU-s"]["memory_booked_mb"] == 6144 + 10000
    # A GPU with slices or shares booked is not free: used counts its shares (0.75) and its slices over 7 (2/7).
    assert doc["nodes"][0]["used"]["gpu_count"] == pytest.approx(0.75 + 2 / 7)
    assert doc["nodes"][0]["free"]["gpu_count"] == 0
    table = run("resource", "list", "--store-url", url).stdout
    assert "2 of 3 slices" in table and "0.75 shares, 16144 MB" in table and "└ MIG-m-2 (1g.10gb)" in table
    audit = run("store", "audit", url, "--json")
    report = json.loads(audit.stdout)
    assert report["sound"] and report["problems"] == [] and report["findings"] == []
