"""The cluster's numbers as Prometheus metrics (docs/operating.md, "Metrics for Prometheus and Grafana").

``ClusterCollector`` reads the store at each scrape and yields gauges, all prefixed ``mn_``: per node its
capacity, what the limits leave schedulable, what is allocated, what head-of-line holds book and what is
unallocated, per resource (cpu, memory, disk, gpu, gpu_memory; the numbers of ``resource list --store`` and the ``mn-cluster``
artifact: ``overview.node_usage``); per device what is booked of it (held whole, in fractional shares, MIG
slices); bookings by owner kind; node states; and, for the whole cluster, each queue's quota and use and the holds
standing per group and queue with the oldest one's age. Labels stay bounded: node, group, resource, UUID, owner
kind, state, queue; never a run or booking id.

Names follow what operators know where they overlap: per node what is ``allocated`` and ``unallocated`` as Nomad's
``nomad.client.allocated.*`` / ``unallocated.*``; a queue's ``nominal_quota``, ``resource_usage``, pending runs
and admission wait as Kueue's ``kueue_cluster_queue_*``, ``kueue_pending_workloads`` and
``kueue_admission_wait_time_seconds`` (the label ``resource`` as both name it); devices labelled ``UUID`` and
``GPU_I_PROFILE`` (a MIG slice's profile) as NVIDIA's DCGM exporter labels its series.

``mn-prefect metrics serve`` serves the whole cluster; each worker (``mn_prefect.worker.metrics``) serves its own
node's series beside its process's instruments, so summing the workers' series gives the cluster and a dashboard
that scrapes both takes ``max by (node, ...)``.

The cluster view is one address for the whole dashboard: at each scrape it also reads every worker's instruments
(placement and wake-up latencies, commit conflicts and retries, waiting runs: all its process counts) from the
endpoints the workers recorded in the store (``metrics targets``), at ``<url>/process`` (the instruments alone,
no store read on the worker), in parallel and each within ``WORKER_TIMEOUT_S``; every such sample carries the
worker's node as ``worker``, and ``mn_worker_up{node,pool}`` says which workers answered. Federation, not the
store: the instruments stay in the process that counts them (no store write per placement, no second copy to
keep consistent), and a stopped worker's counters leave with it, as they would from a direct scrape.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from mn_prefect.model.bookings import OWNER_KINDS
from mn_prefect.model.node_status import NODE_STATES
from mn_prefect.ops.accounting import COUNTER_KEYS, UsageCounters
from mn_prefect.ops.overview import node_usage
from mn_prefect.ops.preemption_losses import losses_by_queue
from mn_prefect.ops.usage import UsageReport
from mn_prefect.placement.bookings import classify
from mn_prefect.placement.estimates import held_seconds
from mn_prefect.placement.holding import holds_of
from mn_prefect.scheduler.quotas import borrowed
from mn_prefect.scheduler.usage import NodeUsage, gpu_use
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import DeviceUseRecord, MetricsEndpointRecord, list_records

log = logging.getLogger(__name__)

MB = 1024 * 1024  # the store's MB are MiB (memory_gb is 1024 MB): metrics are in bytes
# (dimension, unit, field of scheduler.usage.Amounts, scale to the unit)
DIMENSIONS = (("cpu", "cores", "cpu_cores", 1.0), ("memory", "bytes", "memory_mb", MB),
              ("disk", "bytes", "disk_mb", MB), ("gpu", "gpus", "gpu_count", 1.0))
OWNER_KIND_NAMES: tuple[str, ...] = tuple(kind.kind for kind in OWNER_KINDS)
NODE = ["node", "group"]
DIMENSION = [*NODE, "resource", "unit"]  # "resource" as Kueue and Nomad name it
DEVICE = ["node", "UUID", "kind", "parent", "GPU_I_PROFILE"]  # the device labels as NVIDIA's DCGM exporter names them
# What each worker's process counts (mn_prefect.worker.metrics.REGISTRY), served at <its url>/process and read by
# the cluster view at each scrape; labelled with ``WORKER_LABEL`` (the worker's node) there and on the worker.
WORKER_LABEL = "worker"
PROCESS_PATH = "/process"  # after a worker's metrics URL: its instruments alone
WORKER_TIMEOUT_S = 2.0


def _gauge(name: str, documentation: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=labels)


class ClusterCollector(Collector):
    """The store's cluster view at scrape time. ``store``: a store, or a function that opens one (called at the
    first scrape, and again after a failed one); with ``node``, only that node's series (a worker's own); with
    ``group``, only that group's nodes are read; ``queues``: the queues' quotas and use too. A scrape while the
    store is away answers ``mn_store_up 0`` instead of failing."""

    def __init__(self, store: ClusterStore | Callable[[], ClusterStore], *, node: str | None = None,
                 group: str | None = None, queues: bool = True, workers: bool = True):
        self._open: Callable[[], ClusterStore] | None = store if callable(store) else None
        self._store: ClusterStore | None = None if callable(store) else store
        self.node, self.group, self.queues = node, group, queues
        self.workers = workers and node is None  # the workers' instruments: the cluster's view only
        self._lock = threading.Lock()  # one scrape at a time: the store object is shared between them
        self._kinds: dict[str, str] = {}  # booking id -> owner kind (an id's owner never changes)
        self._usage = UsageCounters()  # all-time usage per queue and pool (the cluster's view only)

    def describe(self) -> Iterator[Any]:
        return iter(())  # nothing known before a scrape: the registry checks no names up front

    def collect(self) -> Iterator[Any]:
        with self._lock:
            started = time.monotonic()
            try:
                store = self._store_now()
                families = self.families(store)
                up = 1.0
            except Exception as error:  # the store is away (or answered nonsense): said as a metric
                log.warning("cluster metrics: could not read the store: %s", error)
                self._drop_store()
                families, up = [], 0.0
            yield from families
            yield GaugeMetricFamily("mn_store_up", "1 when the last scrape read the store, else 0.", value=up)
            yield GaugeMetricFamily("mn_store_read_seconds", "Seconds the last scrape took to read the store.",
                                    value=round(time.monotonic() - started, 6))

    def _store_now(self) -> ClusterStore:
        if self._store is None:
            assert self._open is not None
            self._store = self._open()
        return self._store

    def _drop_store(self) -> None:
        if self._open is not None and self._store is not None:
            try:
                self._store.close()
            except Exception:
                pass
            self._store = None

    def families(self, store: ClusterStore) -> list[Metric]:
        """Every family of this view, read from ``store`` now."""
        report = node_usage(store, group=self.group)
        nodes = [n for n in report.usage.nodes if self.node is None or n.name == self.node]
        out: list[Metric] = []
        out += _node_families(nodes, report, _heartbeats(store, self.node))
        out += _device_families(nodes)
        out += device_watch_families(seen_devices(store, {n.name for n in nodes}))
        out.append(self._bookings(store, nodes))
        if self.node is None:  # holds are the pool's, not a node's: only the cluster's view counts them
            out += _hold_families(store, report)
        if self.queues and self.node is None:
            out += _queue_families(store)
        if self.node is None:  # usage is the cluster's: a worker's own view leaves it out
            out += _usage_families(self._usage.read(store))
        if self.workers:  # a node no longer registered (removed) has no worker to wait for
            rows = [row for row in endpoints(store) if row["node_status"] != "unregistered"]
            out += worker_families(rows, skip={family.name for family in out})
        return out

    def _bookings(self, store: ClusterStore, nodes: list[NodeUsage]) -> GaugeMetricFamily:
        family = _gauge("mn_bookings", "Bookings with a placement on the node, by their owner's kind (flow_run, "
                                       "blueprint_job, system_copy, reservation, hold, step_attempt, unknown).",
                        [*NODE, "kind"])
        placements = store.active_placements(node=self.node)
        held = {(p.node, p.job_id) for p in placements if p.job_id}
        kinds = {job: self._kind(store, job) for job in {job for _, job in held}}
        self._kinds = {job: kind for job, kind in self._kinds.items() if job in kinds}  # only live ones kept
        counts: dict[tuple[str, str], int] = {}
        for node, job in held:
            counts[(node, kinds[job])] = counts.get((node, kinds[job]), 0) + 1
        for n in nodes:
            for kind in OWNER_KIND_NAMES:
                family.add_metric([n.name, n.group, kind], float(counts.get((n.name, kind), 0)))
        return family

    def _kind(self, store: ClusterStore, booking: str) -> str:
        kind = self._kinds.get(booking)
        if kind is None:
            kind = self._kinds[booking] = classify(store, booking).kind
        return kind


def _heartbeats(store: ClusterStore, node: str | None) -> dict[str, float | None]:
    if node is not None:
        stored = store.get_node(node)
        return {node: stored.last_heartbeat} if stored is not None else {}
    return {s.record.name: s.last_heartbeat for s in store.list_nodes()}


def _node_families(nodes: list[NodeUsage], report: UsageReport,
                   heartbeats: dict[str, float | None]) -> list[GaugeMetricFamily]:
    capacity = _gauge("mn_node_capacity", "What the node has, per resource (cpu in cores, memory, disk and "
                                          "gpu_memory in bytes, gpu in GPUs).", DIMENSION)
    schedulable = _gauge("mn_node_schedulable", "What the node offers after the coarse limits (resource set), per "
                                                "dimension; 0 for GPUs on a node that takes none.", DIMENSION)
    used = _gauge("mn_node_allocated", "What bookings hold on the node, per resource, holds aside (mn_node_held); a "
                                       "GPU counts 1 held whole, its shares when shared, its booked MIG slices over 7.",
                  DIMENSION)
    held = _gauge("mn_node_held", "What head-of-line holds book on the node for the runs they wait for, per "
                                  "dimension (cpu, memory, disk, gpu; a hold books whole GPUs, not their memory).",
                  DIMENSION)
    free = _gauge("mn_node_unallocated", "What is free on the node, per resource: neither booked nor held (never "
                                         "below 0); a GPU with any share or slice booked is not free.", DIMENSION)
    state = _gauge("mn_node_state", "1 for the node's state (healthy, joining, maintenance, draining, disconnected, "
                                    "offline, quarantined), 0 for the others.", [*NODE, "state"])
    eligible = _gauge("mn_node_eligible", "1 when the node is scheduling-eligible.", NODE)
    heartbeat = _gauge("mn_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat.", NODE)
    ports = _gauge("mn_node_ports_in_use", "Ports booked on the node.", NODE)
    now = time.time()
    gpu_memory_free = report.gpu_memory_free
    for n in nodes:
        booked = report.held(n.name)
        for dimension, unit, field, scale in DIMENSIONS:
            labels = [n.name, n.group, dimension, unit]
            capacity.add_metric(labels, getattr(n.total, field) * scale)
            schedulable.add_metric(labels, getattr(n.schedulable, field) * scale)
            used.add_metric(labels, getattr(n.used, field) * scale)
            held.add_metric(labels, getattr(booked, field) * scale)
            free.add_metric(labels, getattr(n.free, field) * scale)
        labels = [n.name, n.group, "gpu_memory", "bytes"]
        capacity.add_metric(labels, n.gpu_memory_total_mb * MB)
        schedulable.add_metric(labels, n.gpu_memory_total_mb * MB if n.schedulable.gpu_count > 0 else 0.0)
        used.add_metric(labels, sum((g.memory_booked_mb for g in gpu_use(n)), 0.0) * MB)
        free.add_metric(labels, gpu_memory_free.get(n.name, 0.0) * MB)
        for name in NODE_STATES:
            state.add_metric([n.name, n.group, name], 1.0 if n.status == name else 0.0)
        eligible.add_metric([n.name, n.group], 1.0 if n.scheduling_eligible else 0.0)
        beat = heartbeats.get(n.name)
        if beat is not None:
            heartbeat.add_metric([n.name, n.group], round(max(now - beat, 0.0), 3))
        ports.add_metric([n.name, n.group], float(len(n.ports_in_use)))
    return [capacity, schedulable, used, held, free, state, eligible, heartbeat, ports]


def _device_families(nodes: list[NodeUsage]) -> list[GaugeMetricFamily]:
    used = _gauge("mn_device_used", "What is booked of the device, 0 to 1: a GPU held whole 1, shared its shares, "
                                    "in MIG mode its booked slices' weight; a MIG slice (parent set) 1 when booked.",
                  DEVICE)
    free = _gauge("mn_device_free", "1 - mn_device_used: what is left of the device for fractions or slices.", DEVICE)
    memory_total = _gauge("mn_device_memory_bytes", "The device's memory (a MIG slice: its own).", DEVICE)
    memory_used = _gauge("mn_device_memory_used_bytes", "The device's memory booked: all of it held whole, the "
                                                        "fractions' memory when shared, its booked slices'.", DEVICE)
    slices = _gauge("mn_device_slices", "A GPU in MIG mode: its slices, booked or free.", [*DEVICE, "state"])
    info = _gauge("mn_device_info", "1 per device, with its model.", [*DEVICE, "model"])
    for n in nodes:
        gpus = {g.device.id: g for g in gpu_use(n)}
        children: dict[str, list[bool]] = {}
        for d in n.devices:
            labels = [n.name, d.id, d.kind, d.parent or "", d.mig_profile or ""]
            total = (d.memory_total_mb or 0.0) * MB
            gpu = gpus.get(d.id)
            if gpu is not None:
                share, booked = gpu.used, gpu.memory_booked_mb * MB
            else:  # a MIG slice, or a device of another kind: booked whole or not at all
                share, booked = (1.0, total) if d.held else (0.0, 0.0)
            if d.parent is not None:
                children.setdefault(d.parent, []).append(d.held)
            used.add_metric(labels, round(share, 6))
            free.add_metric(labels, round(1.0 - share, 6))
            memory_total.add_metric(labels, total)
            memory_used.add_metric(labels, booked)
            info.add_metric([*labels, d.model or ""], 1.0)
        for d in n.devices:
            if d.id in children:
                labels = [n.name, d.id, d.kind, "", d.mig_profile or ""]
                slices.add_metric([*labels, "booked"], float(sum(children[d.id])))
                slices.add_metric([*labels, "free"], float(len(children[d.id]) - sum(children[d.id])))
    return [used, free, memory_total, memory_used, slices, info]


def seen_devices(store: ClusterStore, nodes: set[str] | None = None,
                 now: float | None = None) -> list[DeviceUseRecord]:
    """What each node's device watch last wrote (``DeviceUseRecord``), of ``nodes`` (all when None): a record not
    rewritten for ``STALE_SAMPLES`` samples (and at least ``STALE_MIN_S``: its worker stopped) is left out."""
    now = time.time() if now is None else now
    out = []
    for record in list_records(store, DeviceUseRecord):
        if nodes is not None and record.node not in nodes:
            continue
        if now - record.sampled_at > max(STALE_SAMPLES * record.every_s, STALE_MIN_S):
            continue
        out.append(record)
    return sorted(out, key=lambda r: r.node)


STALE_SAMPLES, STALE_MIN_S = 3, 120.0


def device_watch_families(records: list[DeviceUseRecord]) -> list[GaugeMetricFamily]:
    """The booked GPUs the workers' device watch judged (worker/device_watch.py), per node and GPU, no booking
    label: the per-booking samples are the workers' ``mn_device_utilization_percent``."""
    labels = ["node", "UUID"]
    idle = _gauge("mn_device_booked_idle", "1 when a booking of the GPU has been under the pool's idle_gpu_percent "
                                           "for its idle_gpu_seconds (mn.device.idle), else 0.", labels)
    quiet = _gauge("mn_device_booked_idle_seconds", "Seconds the booked GPU has been under the pool's "
                                                    "idle_gpu_percent (0: busy at the last sample).", labels)
    over = _gauge("mn_device_over_memory_bytes", "A booked GPU's memory in use above what its bookings booked (a "
                                                 "GPU held whole: never; in shares: mn.device.over_memory).", labels)
    for record in records:
        for d in record.devices:
            at = [record.node, d.device]
            idle.add_metric(at, 1.0 if d.idle else 0.0)
            since = d.quiet_since
            quiet.add_metric(at, round(max(record.sampled_at - since, 0.0), 3) if since is not None else 0.0)
            booked = d.booked_mb if d.booked_mb is not None else float("inf")  # held whole: all of it booked
            over.add_metric(at, max(d.memory_used_mb - booked, 0.0) * MB)
    return [idle, quiet, over]


def _hold_families(store: ClusterStore, report: UsageReport) -> list[GaugeMetricFamily]:
    """The holds standing on the view's nodes (docs/scheduling.md, "Holds and backfill"), per group and queue (the
    held run's work queue; "" for a pool without queues): how many, and how long the oldest has stood."""
    labels = ["group", "queue"]
    count = _gauge("mn_holds", "Head-of-line holds standing, per group and queue of the runs they hold for.", labels)
    oldest = _gauge("mn_hold_oldest_age_seconds", "Seconds since the oldest standing hold of the group and queue "
                                                  "was booked.", labels)
    overdue = _gauge("mn_hold_overdue_seconds", "Seconds past its expected start of the group and queue's most "
                                                "overdue hold (negative: not due yet); holds of unknown expected "
                                                "start left out.", labels)
    group_of = {n.name: n.group for n in report.usage.nodes}
    counts: dict[tuple[str, str], int] = {}
    ages: dict[tuple[str, str], float] = {}
    late: dict[tuple[str, str], float] = {}
    now = time.time()
    for hold in holds_of(p for placed in report.holds.values() for p in placed).values():
        key = (group_of.get(hold.nodes[0], ""), hold.queue or "")
        counts[key] = counts.get(key, 0) + 1
        age = held_seconds(store, hold.hold_id, now=now)
        if age is not None:
            ages[key] = max(ages.get(key, 0.0), round(max(age, 0.0), 3))
        if hold.expected_start is not None:
            late[key] = max(late.get(key, float("-inf")), round(now - hold.expected_start, 3))
    for key, n in sorted(counts.items()):
        count.add_metric(list(key), float(n))
        if key in ages:
            oldest.add_metric(list(key), ages[key])
        if key in late:
            overdue.add_metric(list(key), late[key])
    return [count, oldest, overdue]


def _queue_families(store: ClusterStore) -> list[Metric]:
    """Each queue with settings (docs/queues.md): quota, use, borrowing and lending, per resource it names."""
    labels = ["queue", "cohort", "resource"]
    quota = _gauge("mn_queue_nominal_quota", "The queue's quota, per resource (in the quota's own units).", labels)
    used = _gauge("mn_queue_resource_usage", "What the queue's runs hold, per resource.", labels)
    lent = _gauge("mn_queue_lent", "What others of its cohort use of the queue's unused quota.", labels)
    borrowed_ = _gauge("mn_queue_borrowed", "What the queue uses past its quota.", labels)
    queues = store.queues()
    for name, record in sorted(queues.queues.items()):
        cohort = record.spec.cohort or ""
        for dimension in sorted({*record.spec.quota, *record.used}):
            at = [name, cohort, dimension]
            if dimension in record.spec.quota:
                quota.add_metric(at, record.spec.quota[dimension])
            used.add_metric(at, record.used.get(dimension, 0.0))
        for dimension, amount in sorted(borrowed(record).items()):
            borrowed_.add_metric([name, cohort, dimension], amount)
        for dimension, amount in sorted(queues.lent(name).items()):
            lent.add_metric([name, cohort, dimension], amount)
    preempted = CounterMetricFamily("mn_queue_evicted_runs", "Runs of the queue preempted so far, by how they "
                                    "stopped (checkpointed in their grace, or killed at its end).",
                                    labels=["queue", "outcome"])
    lost = _gauge("mn_queue_preemption_lost_seconds", "Booked time whose work preempted runs of the queue had to do "
                                                      "again, in GPU-seconds (resource gpu) and CPU-seconds (cpu).",
                  ["queue", "resource"])
    for name, losses in sorted(losses_by_queue(store).items()):
        preempted.add_metric([name, "checkpointed"], float(losses.checkpointed))
        preempted.add_metric([name, "killed"], float(losses.killed))
        lost.add_metric([name, "gpu"], round(losses.lost_gpu_s, 3))
        lost.add_metric([name, "cpu"], round(losses.lost_cpu_s, 3))
    return [quota, used, lent, borrowed_, preempted, lost]


# (name, help, scale of the value: accounting's MB-seconds in byte-seconds)
USAGE_FAMILIES = (
    ("mn_usage_gpu_seconds", "GPU-seconds the bookings used, all time (a whole GPU for a second is 1, a MIG slice "
                             "its slices over 7, a fraction its shares); reservations and holds for their owner.", 1.0),
    ("mn_usage_gpu_memory_byte_seconds", "GPU memory the bookings held, in byte-seconds, all time.", MB),
    ("mn_usage_cpu_seconds", "CPU core-seconds the bookings held, all time.", 1.0),
    ("mn_usage_memory_byte_seconds", "Memory the bookings held, in byte-seconds, all time.", MB),
)


def _usage_families(usage: dict[tuple[str, ...], tuple[float, ...]]) -> list[CounterMetricFamily]:
    """Usage accounting (ops/accounting.py) per queue and pool, as counters."""
    out = []
    for i, (name, documentation, scale) in enumerate(USAGE_FAMILIES):
        family = CounterMetricFamily(name, documentation, labels=list(COUNTER_KEYS))
        for labels, values in sorted(usage.items()):
            family.add_metric(list(labels), round(values[i] * scale, 3))
        out.append(family)
    return out


def cluster_registry(store: ClusterStore | Callable[[], ClusterStore], **options: Any) -> CollectorRegistry:
    """A registry holding one ``ClusterCollector`` (what ``metrics serve`` and ``metrics show`` expose)."""
    registry = CollectorRegistry()
    registry.register(ClusterCollector(store, **options))
    return registry


def endpoints(store: ClusterStore) -> list[dict[str, Any]]:
    """Where each node's worker serves its metrics (``MetricsEndpointRecord``), with the node's state now: the
    last one each worker wrote (a stopped worker's stays until the next start rewrites it)."""
    nodes = {s.record.name: s.record for s in store.list_nodes()}
    rows = []
    for record in list_records(store, MetricsEndpointRecord):
        node = nodes.get(record.node)
        rows.append({"node": record.node, "pool": record.pool, "url": record.url, "pid": record.pid,
                     "since": record.updated_at, "node_status": node.status if node is not None else "unregistered"})
    return sorted(rows, key=lambda r: r["node"])


def file_sd(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prometheus ``file_sd_configs`` targets for ``rows`` (``endpoints``): one group per worker, labelled with
    its node and pool (the path is /metrics, Prometheus' default)."""
    out = []
    for row in rows:
        address = row["url"].split("://", 1)[-1].split("/", 1)[0]
        out.append({"targets": [address], "labels": {"mn_node": row["node"], "mn_pool": row["pool"] or ""}})
    return out


def labelled(metric: Metric, name: str, value: str) -> Metric:
    """A copy of ``metric`` with label ``name`` set to ``value`` on each sample."""
    out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
    out.samples = [s._replace(labels={**s.labels, name: value}) for s in metric.samples]
    return out


def _read_worker(url: str, timeout: float) -> list[Metric]:
    """The families a worker serves at ``url``/process, its counters' and histograms' ``_created`` aside."""
    with urllib.request.urlopen(url.rstrip("/") + PROCESS_PATH, timeout=timeout) as response:
        text = response.read().decode("utf-8")
    families = list(text_string_to_metric_families(text))
    names = {family.name for family in families}
    return [f for f in families if not (f.name.endswith("_created") and f.name.removesuffix("_created") in names)]


def worker_families(rows: list[dict[str, Any]], timeout: float = WORKER_TIMEOUT_S,
                    skip: set[str] | frozenset[str] = frozenset()) -> list[Metric]:
    """The workers' instruments read from ``rows`` (``endpoints``) now, merged per family (each sample labelled
    ``worker`` by its worker; a family named as one of ``skip``, the view's own, left out), and
    ``mn_worker_up{node,pool}``: 1 for a worker that answered within ``timeout`` as the node its record names, 0
    for one that did not (stopped, unreachable, or its port now another's: none of its samples are kept)."""
    up = _gauge("mn_worker_up", "1 when the node's worker answered the cluster view's last read of its "
                                "instruments (at the address it recorded in the store), else 0.", ["node", "pool"])
    merged: dict[str, Metric] = {}
    if rows:
        def read(row: dict[str, Any]) -> list[Metric] | None:
            try:
                return _read_worker(row["url"], timeout)
            except Exception as error:
                log.debug("cluster metrics: worker of %s at %s: %s", row["node"], row["url"], error)
                return None

        with ThreadPoolExecutor(max_workers=min(len(rows), 16), thread_name_prefix="mn-metrics-read") as pool:
            answers = list(pool.map(read, rows))
        for row, families in zip(rows, answers, strict=True):
            ok = families is not None and _is_worker_of(families, row["node"])
            up.add_metric([row["node"], row["pool"] or ""], 1.0 if ok else 0.0)
            if not ok:
                continue
            for family in families or []:
                if family.name in skip:
                    continue
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
                into.samples += family.samples
    return [*(merged[name] for name in sorted(merged)), up]


def _is_worker_of(families: Iterable[Metric], node: str) -> bool:
    """Whether the instruments read are ``node``'s worker's (a stopped worker's port may now be another's)."""
    return any(s.labels.get(WORKER_LABEL) == node for family in families for s in family.samples)


def url_for(host: str, port: int) -> str:
    """The address others reach a server bound to ``host`` at (a wildcard bind: this machine's name)."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"
