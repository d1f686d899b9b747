"""Booked GPUs that do nothing and shared GPUs over their booked memory (``lifecycle.device_use``), sampled through
the real pynvml on the fake NVML library, judged by the worker's device watch against the real store."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import anyio
import pytest
from builders import gpu, node
from cli_runner import run as run_cli
from harness import Harness
from prometheus_client import CollectorRegistry, generate_latest

from mn_prefect.lifecycle.device_use import Booked, DeviceWatch, Idle, OverMemory
from mn_prefect.model.device_use import DeviceUse
from mn_prefect.model.pool_policy import PoolPolicy
from mn_prefect.ops.metrics import cluster_registry
from mn_prefect.store.records import DeviceUseRecord, device_use_id, get_record
from mn_prefect.worker.device_watch import DeviceUseCollector, watch_once

QUIET, BUSY = DeviceUse(percent=1.0, memory_used_mb=100), DeviceUse(percent=80.0, memory_used_mb=100)


def test_a_booked_gpu_under_the_threshold_for_the_whole_period_is_said_idle_once():
    watch = DeviceWatch(threshold_percent=5, after_s=600)
    booked = {"GPU-a": Booked(("run-1",))}
    assert watch.observe(0, {"GPU-a": QUIET}, booked) == []
    assert watch.observe(599, {"GPU-a": QUIET}, booked) == []
    assert watch.observe(600, {"GPU-a": QUIET}, booked) == [Idle("GPU-a", "run-1", 1.0, 600)]
    assert watch.observe(900, {"GPU-a": QUIET}, booked) == []  # said once
    assert watch.observe(901, {"GPU-a": BUSY}, booked) == []  # busy again: the clock starts anew
    assert watch.observe(1000, {"GPU-a": QUIET}, booked) == []
    assert watch.observe(1600, {"GPU-a": QUIET}, booked) == [Idle("GPU-a", "run-1", 1.0, 600)]


def test_an_unbooked_gpu_a_slice_without_utilisation_and_a_new_booking_start_no_clock():
    watch = DeviceWatch(threshold_percent=5, after_s=60)
    assert watch.observe(0, {"GPU-a": QUIET}, {}) == []  # not booked: nobody wastes it
    slice_use = {"MIG-1": DeviceUse(percent=None, memory_used_mb=0)}
    assert watch.observe(0, slice_use, {"MIG-1": Booked(("run-1",))}) == []
    assert watch.observe(100, slice_use, {"MIG-1": Booked(("run-1",))}) == []  # NVML reports no utilisation
    assert watch.observe(100, {"GPU-a": QUIET}, {"GPU-a": Booked(("run-1",))}) == []
    assert watch.observe(150, {"GPU-a": QUIET}, {"GPU-a": Booked(("run-2",))}) == []  # another booking: anew
    assert watch.observe(210, {"GPU-a": QUIET}, {"GPU-a": Booked(("run-2",))}) == [Idle("GPU-a", "run-2", 1.0, 60)]


def test_a_shared_gpu_above_what_its_shares_booked_is_over_memory_once_until_it_is_under_again():
    watch = DeviceWatch()
    booked = {"GPU-a": Booked(("run-1", "run-2"), shared_mb=8192)}
    assert watch.observe(0, {"GPU-a": DeviceUse(90, 8000)}, booked) == []
    assert watch.observe(1, {"GPU-a": DeviceUse(90, 9000)}, booked) == [
        OverMemory("GPU-a", ("run-1", "run-2"), 9000, 8192)]
    assert watch.observe(2, {"GPU-a": DeviceUse(90, 9500)}, booked) == []
    assert watch.observe(3, {"GPU-a": DeviceUse(90, 100)}, booked) == []
    assert watch.observe(4, {"GPU-a": DeviceUse(90, 9000)}, booked)[0].used_mb == 9000


def test_nvml_reports_what_the_fake_library_is_told_a_gpu_does(fake_gpu_libs, tmp_path):
    """The real pynvml on the fake NVML: utilisation and memory in use, read again at each sample."""
    use = tmp_path / "use.txt"
    use.write_text("GPU-aaa,3,1024\n")
    script = textwrap.dedent(f"""
        import json, pathlib
        from mn_prefect.inventory.gpu_use import sample
        first = sample()
        pathlib.Path({str(use)!r}).write_text("GPU-aaa,97,30000\\n")
        second = sample()
        print(json.dumps([{{k: [v.percent, v.memory_used_mb] for k, v in s.items()}} for s in (first, second)]))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MN_", "FAKE_NVML_"))}
    env.update(LD_LIBRARY_PATH=str(fake_gpu_libs), FAKE_NVML_USE_FILE=str(use),
               FAKE_NVML_DEVICES="GPU-aaa,NVIDIA A100,40960,40000,8,0;GPU-bbb,Tesla T4,16384,16000,7,5")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    first, second = json.loads(result.stdout)
    assert first == {"GPU-aaa": [3.0, 1024.0], "GPU-bbb": [0.0, 384.0]}  # the other: 0% and its described use
    assert second["GPU-aaa"] == [97.0, 30000.0]


@pytest.fixture
def pool(tmp_path, monkeypatch):
    harness = Harness(tmp_path, [node("gpu-1", 16, 65536, devices=[gpu("GPU-1a", 0, 24576), gpu("GPU-1b", 1, 16384)])],
                      monkeypatch=monkeypatch)
    yield harness
    harness.close()


def test_the_worker_says_an_idle_booked_gpu_with_its_run_and_exposes_what_each_booked_gpu_does(pool):
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"devices": [{"ids": ["GPU-1a"]}]}}))
    assert pool.poll() == {run.id: "gpu-1"}
    collector = DeviceUseCollector("gpu-1")
    rule = DeviceWatch()
    use = {"GPU-1a": DeviceUse(2.0, 512), "GPU-1b": DeviceUse(0.0, 0)}

    async def policy():
        return PoolPolicy(idle_gpu_percent=5, idle_gpu_seconds=120)

    async def in_store(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def once(now):
        return anyio.run(lambda: watch_once(store=pool.store, node="gpu-1", in_store=in_store, policy=policy,
                                            collector=collector, rule=rule, sample=lambda: use, logger=logging.getLogger("mn-test"),
                                            now=now))

    base = time.time() - 130  # the samples' times: the last one 10 s ago (a record older than 2 min is stale)
    assert once(base) == []
    assert once(base + 119) == []
    assert once(base + 120) == [Idle("GPU-1a", str(run.id), 2.0, 120.0)]  # GPU-1b is free: nobody wastes it
    [idle] = [e for e in pool.events if e[0] == "mn.device.idle"]
    assert idle[2]["booking"] == str(run.id) and idle[2]["device"] == "GPU-1a" and idle[2]["node"] == "gpu-1"
    registry = CollectorRegistry()
    registry.register(collector)
    scraped = generate_latest(registry).decode()
    assert f'mn_device_utilization_percent{{UUID="GPU-1a",booking="{run.id}",node="gpu-1"}} 2.0' in scraped
    assert 'UUID="GPU-1b"' not in scraped  # only booked GPUs
    # What the watch saw is in the store: the cluster's view and resource list --store show it, without the worker.
    record = get_record(pool.store, device_use_id("gpu-1"), DeviceUseRecord)
    assert record is not None and [(d.device, d.bookings, d.idle, d.percent) for d in record.devices] == [
        ("GPU-1a", [str(run.id)], True, 2.0)]
    cluster = generate_latest(cluster_registry(pool.store, workers=False)).decode()
    assert 'mn_device_booked_idle{UUID="GPU-1a",node="gpu-1"} 1.0' in cluster
    assert 'mn_device_booked_idle_seconds{UUID="GPU-1a",node="gpu-1"} 120.0' in cluster
    assert 'mn_device_over_memory_bytes{UUID="GPU-1a",node="gpu-1"} 0.0' in cluster  # held whole: never over
    listed = run_cli(["resource", "list", "--store", "--store-url", pool.store.url.raw, "--json"])
    assert listed.returncode == 0, listed.stderr
    [seen] = json.loads(listed.stdout)["booked_gpus"]
    assert (seen["node"], seen["device"], seen["bookings"], seen["state"], seen["idle_s"]) == (
        "gpu-1", "GPU-1a", [str(run.id)], "idle", 120.0)
    table = run_cli(["resource", "list", "--store", "--store-url", pool.store.url.raw], env={"COLUMNS": "250"})
    assert table.returncode == 0, table.stderr
    assert "booked GPUs (device watch)" in table.stdout and "idle" in table.stdout.split("booked GPUs")[1]
    # Busy again: the rule forgets its idle, and so do the store and the cluster's view.
    use["GPU-1a"] = DeviceUse(60.0, 512)
    assert once(base + 125) == []
    cluster = generate_latest(cluster_registry(pool.store, workers=False)).decode()
    assert 'mn_device_booked_idle{UUID="GPU-1a",node="gpu-1"} 0.0' in cluster
    assert 'mn_device_booked_idle_seconds{UUID="GPU-1a",node="gpu-1"} 0.0' in cluster


def test_a_shared_gpu_over_its_booked_memory_is_in_the_store_and_the_cluster_view(pool):
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"devices": [{"kind": "gpu", "shares": 0.5, "memory_mb": 4096}]}}))
    assert pool.poll() == {run.id: "gpu-1"}
    [placement] = pool.store.active_placements(node="gpu-1")
    [share] = placement.allocation.shares
    collector, rule = DeviceUseCollector("gpu-1"), DeviceWatch()

    async def policy():
        return PoolPolicy()

    async def in_store(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    use = {share.id: DeviceUse(70.0, 6144)}
    found = anyio.run(lambda: watch_once(store=pool.store, node="gpu-1", in_store=in_store, policy=policy,
                                         collector=collector, rule=rule, sample=lambda: use,
                                         logger=logging.getLogger("mn-test")))
    assert found == [OverMemory(share.id, (str(run.id),), 6144, 4096)]
    cluster = generate_latest(cluster_registry(pool.store, workers=False)).decode()
    assert f'mn_device_over_memory_bytes{{UUID="{share.id}",node="gpu-1"}} 2.147483648e+09' in cluster
    [seen] = json.loads(run_cli(["resource", "list", "--store", "--store-url", pool.store.url.raw,
                                 "--json"]).stdout)["booked_gpus"]
    assert (seen["state"], seen["memory_used_mb"], seen["booked_mb"]) == ("over memory", 6144, 4096)
