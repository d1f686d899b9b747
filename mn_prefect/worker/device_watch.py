"""The worker's device watch: every ``MN_DEVICE_SAMPLE_SECONDS`` (30) it samples its node's NVIDIA GPUs through NVML
(``inventory.gpu_use``), exposes what each booked one does on the worker's metrics endpoint, labelled with the
booking, and carries out ``lifecycle.device_use``: ``mn.device.idle`` for a booked GPU that does nothing (the pool's
``idle_gpu_percent`` for ``idle_gpu_seconds``), ``mn.device.over_memory`` for a GPU booked in shares whose memory in
use is above what its shares booked. A node without NVML samples nothing and says nothing."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import anyio.to_thread
from prometheus_client.core import GaugeMetricFamily

from mn_prefect import events
from mn_prefect.inventory import gpu_use
from mn_prefect.lifecycle.device_use import Booked, DeviceWatch, Idle, OverMemory, booked_devices
from mn_prefect.model.device_use import DeviceUse
from mn_prefect.model.estimates import duration_words
from mn_prefect.model.pool_policy import PoolPolicy
from mn_prefect.model.scalars import is_uuid
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import (
    BookedDeviceUse,
    DeviceUseRecord,
    FlowRunRecord,
    device_use_id,
    get_record,
    put_record,
)

MB = 1024 * 1024


class DeviceUseCollector:
    """The last sample of this node's booked GPUs, as Prometheus gauges (``mn_device_utilization_percent``,
    ``mn_device_memory_in_use_bytes``), labelled ``node``, ``UUID`` (as DCGM labels a GPU) and ``booking``."""

    def __init__(self, node: str):
        self.node = node
        self.use: dict[str, DeviceUse] = {}
        self.booked: dict[str, Booked] = {}

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        labels = ["node", "UUID", "booking"]
        percent = GaugeMetricFamily("mn_device_utilization_percent", "A booked GPU's utilisation at the last sample "
                                    "(NVML, percent of the sample period a kernel ran), per booking.", labels=labels)
        memory = GaugeMetricFamily("mn_device_memory_in_use_bytes", "A booked GPU's memory in use at the last "
                                   "sample (NVML), per booking (every booking of a shared GPU sees all of it).",
                                   labels=labels)
        for device, held in sorted(self.booked.items()):
            seen = self.use.get(device)
            if seen is None:
                continue
            for booking in held.bookings:
                if seen.percent is not None:
                    percent.add_metric([self.node, device, booking], seen.percent)
                memory.add_metric([self.node, device, booking], seen.memory_used_mb * MB)
        yield percent
        yield memory


COLLECTOR = DeviceUseCollector("")  # this process's: the worker's metrics registry holds it (worker/metrics.py)


def collector_for(node: str) -> DeviceUseCollector:
    """This process's collector, now for ``node``."""
    COLLECTOR.node = node
    return COLLECTOR


async def watch(scope: anyio.CancelScope, *, store: ClusterStore, node: str, in_store: Callable[..., Awaitable[Any]],
                policy: Callable[[], Awaitable[PoolPolicy]], collector: DeviceUseCollector, every_s: float,
                stopping: Callable[[], bool], logger: Any,
                sample: Callable[[], dict[str, DeviceUse]] = gpu_use.sample) -> None:
    """Until the worker stops: sample, judge, tell (a pass that fails is logged and tried at the next)."""
    rule = DeviceWatch()
    with scope:
        while not stopping():
            try:
                await watch_once(store=store, node=node, in_store=in_store, policy=policy, collector=collector,
                                 rule=rule, sample=sample, logger=logger, every_s=every_s)
            except Exception as error:  # the store or the API is away: the next pass looks again
                logger.warning("device watch skipped: %s: %s", type(error).__name__, error)
            await anyio.sleep(every_s)


async def watch_once(*, store: ClusterStore, node: str, in_store: Callable[..., Awaitable[Any]],
                     policy: Callable[[], Awaitable[PoolPolicy]], collector: DeviceUseCollector, rule: DeviceWatch,
                     sample: Callable[[], dict[str, DeviceUse]], logger: Any, now: float | None = None,
                     every_s: float = 30.0) -> list:
    """One pass; what it said. What it saw of the booked GPUs is written to the store (``DeviceUseRecord``)."""
    use = await anyio.to_thread.run_sync(sample)
    if not use:
        return []
    settings = await policy()
    rule.threshold_percent, rule.after_s = settings.idle_gpu_percent, settings.idle_gpu_seconds
    booked = booked_devices(await in_store(store.active_placements, node=node))
    before = collector.booked
    collector.use, collector.booked = use, booked
    at = time.time() if now is None else now
    found = rule.observe(at, use, booked)
    if booked or before:  # a node whose GPUs nobody books writes nothing at each sample
        await in_store(put_record, store, seen_record(node, at, use, booked, rule, every_s))
    for finding in found:
        await _tell(finding, store, node, in_store, logger)
    return found


def seen_record(node: str, at: float, use: dict[str, DeviceUse], booked: dict[str, Booked], rule: DeviceWatch,
                every_s: float) -> DeviceUseRecord:
    """What ``resource list --store`` and the cluster's metrics read of this sample: each booked GPU sampled, what
    it did and what the rule made of it."""
    rows = []
    for device, held in sorted(booked.items()):
        seen = use.get(device)
        if seen is None:
            continue
        quiet = [q for q in (rule.quiet_since(device, b) for b in held.bookings) if q is not None]
        rows.append(BookedDeviceUse(device=device, bookings=list(held.bookings), percent=seen.percent,
                                    memory_used_mb=seen.memory_used_mb, booked_mb=held.shared_mb,
                                    quiet_since=min(quiet) if quiet else None,
                                    idle=any(rule.is_idle(device, b) for b in held.bookings),
                                    over_memory=held.shared_mb is not None
                                    and rule.is_over_memory(device, held.bookings)))
    return DeviceUseRecord(job_id=device_use_id(node), node=node, sampled_at=at, every_s=every_s,
                           idle_percent=rule.threshold_percent, idle_after_s=rule.after_s, devices=rows)


async def _tell(finding: Idle | OverMemory, store: ClusterStore, node: str, in_store: Callable[..., Awaitable[Any]],
                logger: Any) -> None:
    bookings = [finding.booking] if isinstance(finding, Idle) else list(finding.bookings)
    records = [await in_store(get_record, store, b, FlowRunRecord) for b in bookings]
    related = [events.flow_run(b, None) for b in bookings if is_uuid(b)]
    deployments = sorted({r.deployment_id for r in records if r is not None and r.deployment_id})
    if isinstance(finding, Idle):
        logger.warning("GPU %s on %s, booked by %s, has been under %.0f%% for %s (mn.device.idle)", finding.device,
                       node, finding.booking, finding.percent, duration_words(finding.idle_s))
        events.emit("mn.device.idle", events.node(node), related=related,
                    payload={"node": node, "device": finding.device, "booking": finding.booking,
                             "percent": finding.percent, "idle_s": round(finding.idle_s, 1),
                             "deployment_ids": deployments})
    else:
        logger.warning("GPU %s on %s uses %.0f MB, above the %.0f MB its shares booked (%s) (mn.device.over_memory)",
                       finding.device, node, finding.used_mb, finding.booked_mb, ", ".join(finding.bookings))
        events.emit("mn.device.over_memory", events.node(node), related=related,
                    payload={"node": node, "device": finding.device, "bookings": list(finding.bookings),
                             "used_mb": round(finding.used_mb, 1), "booked_mb": round(finding.booked_mb, 1),
                             "deployment_ids": deployments})
