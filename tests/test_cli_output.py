"""Output that reads (`mn-prefect` for people): a dry-run drain says in a sentence what it would do, a drain says how
to bring the node back, `reserve` prints the one line docs/operating.md shows (its tables under --verbose), `queue
set` warns when no mn pool has that work queue (or creates it with --create), and `resource list --store` fits 120
columns with sizes in MB/GB/TB (every column under --wide). Against a real SQLite store; the work-queue check against
a real Prefect server."""

from __future__ import annotations

import json
import re
import uuid

import cli_runner
import pytest
from builders import gpu, node

from mn_prefect.model.resources import resource_request
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store

NO_API = {"PREFECT_API_URL": ""}


@pytest.fixture
def url(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    store.register_node(node("gpu-1", cpu=16, memory=65536, disk=1_200_000,
                             devices=[gpu("GPU-1a", 0, 24576), gpu("GPU-1b", 1, 16384)], host_paths=["/mnt/models"]))
    store.register_node(node("cpu-1", cpu=8, memory=32768))
    store.close()
    return url


def mn(url: str, *args: str, env: dict | None = None):
    return cli_runner.run([*args, "--store-url", url], env={**NO_API, **(env or {})})


def test_a_dry_run_drain_of_an_idle_node_says_in_a_sentence_what_it_would_do(url):
    result = mn(url, "node", "drain", "cpu-1", "--reason", "kernel", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cpu-1 has no runs; draining it would put it in maintenance at once."
    assert open_store(url).get_node("cpu-1").record.status == "healthy"  # a dry run changes nothing


def test_a_dry_run_drain_of_a_busy_node_counts_what_it_would_do(url):
    store = open_store(url)
    booked = place_and_commit(store, "someone", [Ask(agent_id="a", request=resource_request({"gpu": 1}))])
    assert booked.placed and booked.plan.placements[0].node == "gpu-1"
    result = mn(url, "node", "drain", "gpu-1", "--reason", "kernel", "--dry-run", "--deadline", "30m")
    assert result.returncode == 0, result.stderr
    assert "someone" in result.stdout  # the table of what it would do with each booking
    assert "Draining gpu-1 would pause 1 run for review, then put it in maintenance." in result.stdout, result.stdout
    doc = json.loads(mn(url, "node", "drain", "gpu-1", "--reason", "kernel", "--dry-run", "--json").stdout)
    assert doc["summary"].startswith("Draining gpu-1 would ") and doc["dry_run"] is True


def test_a_drain_says_how_to_bring_the_node_back(url):
    result = mn(url, "node", "drain", "cpu-1", "--reason", "disk swap")
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stdout.split())
    assert "To bring cpu-1 back: mn-prefect node maintenance cpu-1 --disable --reason" in said, result.stdout
    assert "mn-prefect node undrain cpu-1 --reason '...' --mark-eligible" in said
    assert open_store(url).get_node("cpu-1").record.status == "draining"
    # What it says works: undrain, then out of maintenance.
    assert mn(url, "node", "undrain", "cpu-1", "--reason", "done", "--mark-eligible").returncode == 0
    assert open_store(url).get_node("cpu-1").record.status == "healthy"


def test_reserve_prints_one_line_and_its_tables_only_under_verbose(url):
    made = mn(url, "reserve", "--resources", '{"cpu": 2, "memory": "4G"}', "--for", "2h", "--name", "eval")
    assert made.returncode == 0, made.stderr
    [line] = made.stdout.splitlines()
    assert re.fullmatch(r"reserved rsv-[0-9a-f]+ on (gpu-1|cpu-1), until \d\d:\d\d:\d\d \(in 1h59m\)", line), line
    verbose = mn(url, "reserve", "--resources", '{"cpu": 1}', "--for", "1h", "--verbose")
    assert verbose.returncode == 0 and "reserved" in verbose.stdout and len(verbose.stdout.splitlines()) > 3
    never = mn(url, "reserve", "--resources", '{"gpu": 9}', "--for", "1h")
    assert never.returncode == 3 and never.stdout.startswith("not reserved: not_runnable: "), never.stdout
    assert len(never.stdout.splitlines()) == 1


def test_queue_set_without_a_prefect_server_says_the_work_queue_was_not_checked(url):
    result = mn(url, "queue", "set", "train", "--quota", "gpu=1")
    assert result.returncode == 0 and result.stdout.startswith("set queue train:"), result.stderr
    assert "not checked that a work queue train exists" in " ".join(result.stderr.split())


def test_resource_list_fits_120_columns_with_units_and_shows_every_column_wide(url):
    narrow = mn(url, "resource", "list", "--store")
    assert narrow.returncode == 0, narrow.stderr
    widest = max(len(line.rstrip()) for line in narrow.stdout.splitlines())
    assert widest <= 120, narrow.stdout
    assert "1.14 TB" in narrow.stdout and "64 GB" in narrow.stdout and "e+06" not in narrow.stdout  # disk, memory
    assert "24 GB" in narrow.stdout  # a device's memory
    wide = mn(url, "resource", "list", "--store", "--wide")
    assert wide.returncode == 0 and "host paths" in wide.stdout and "/mnt/models" in wide.stdout
    assert "host paths" not in narrow.stdout and "all columns: --wide" in narrow.stdout


@pytest.mark.lab
def test_queue_set_warns_when_no_mn_pool_has_the_work_queue_and_creates_it_with_create(url, prefect_server):
    import httpx

    from mn_prefect.worker import MNWorker

    pool = f"mn-out-{uuid.uuid4().hex[:6]}"
    api = httpx.Client(base_url=prefect_server.api_url, timeout=60)
    assert api.post("/work_pools/", json={"name": pool, "type": "mn",
                                          "base_job_template": MNWorker.get_default_base_job_template()}
                    ).status_code == 201
    env = {"PREFECT_API_URL": prefect_server.api_url}
    try:
        warned = cli_runner.run(["queue", "set", "train", "--quota", "gpu=1", "--pool", pool, "--store-url", url],
                                env=env)
        assert warned.returncode == 0, warned.stderr
        said = " ".join(warned.stderr.split())
        assert f"pool {pool} has no work queue train" in said, warned.stderr
        assert f"prefect work-queue create train --pool {pool}" in said and "--create" in said
        created = cli_runner.run(["queue", "set", "train", "--quota", "gpu=1", "--pool", pool, "--create",
                                  "--store-url", url, "--json"], env=env)
        assert created.returncode == 0, created.stderr
        assert json.loads(created.stdout)["work_queue"] == {"pools": [pool], "created": pool, "warning": None}
        assert api.get(f"/work_pools/{pool}/queues/train").status_code == 200
        again = cli_runner.run(["queue", "set", "train", "--quota", "gpu=2", "--pool", pool, "--store-url", url],
                               env=env)
        assert again.returncode == 0 and "warning" not in again.stderr, again.stderr
    finally:
        api.delete(f"/work_pools/{pool}")
