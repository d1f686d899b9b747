"""The worker's Prometheus metrics (docs/operating.md, "Metrics for Prometheus and Grafana"): the instruments this
process updates as it places runs and wakes up, and, when ``MN_METRICS_PORT`` is set, ``/metrics`` served with them
and the worker's own node's series (``mn_prefect.ops.metrics.ClusterCollector``, read from the store at each scrape
on a connection of its own, so a scrape never waits for the worker's store lock nor holds it).

Instruments (process-wide, labelled by pool; ``node`` on the latency is where the run was placed):

* ``mn_admission_wait_time_seconds{pool,node}``: from a run's scheduled time to the commit this process made of it;
* ``mn_wakeup_latency_seconds{pool,change}``: from the change a wake-up heard of (a commit on this node:
  ``placed``; freed capacity: ``capacity``; Prefect's event of a run made Scheduled in the pool: ``run_event``)
  to the end of the poll it caused;
* ``mn_commit_conflicts_total{pool,kind}``: ``changed`` (the apply found the plan's nodes changed: the store decided
  again), ``taken`` (the commit refused what the plan took: someone booked first; the placer planned again),
  ``same_run`` (another worker booked this very run first);
* ``mn_commit_retries_total{pool,stage}``: rounds done again, ``store`` (a commit's read and decision after
  ``changed``) or ``placer`` (a plan after a refused commit, or after a refusal decided on a stale view);
* ``mn_queue_pending_runs{pool,queue,status,reason}``: the runs of the pool this worker's polls found no node for, by
  work queue, plan status and the reason's category (``reason_category``);
* ``mn_queue_pending_oldest_age_seconds{pool,queue}``: seconds since the oldest of them was scheduled to start;
* ``mn_worker_info{pool,node}``: 1.

Each sample served carries ``worker`` (this worker's node): the cluster view (``metrics serve``) reads them from
``<url>/process`` (the instruments alone) and serves them beside the cluster's series, and a Prometheus that
scrapes both tells the copies apart by it. The conflict and retry counters start at 0 for every kind and stage.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from mn_prefect.http_serving import serve_metrics
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Plan
from mn_prefect.ops.metrics import PROCESS_PATH, WORKER_LABEL, ClusterCollector, labelled, url_for
from mn_prefect.placement.placing import PlaceResult
from mn_prefect.scheduler import reasons
from mn_prefect.store import open_store
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import MetricsEndpointRecord, metrics_endpoint_id, put_record
from mn_prefect.worker import device_watch

METRICS_PORT_VAR = "MN_METRICS_PORT"  # unset or "off": no /metrics; 0: a free port, logged and recorded
METRICS_HOST_VAR = "MN_METRICS_HOST"
DEFAULT_HOST = "127.0.0.1"

REGISTRY = CollectorRegistry()  # this process's instruments (the node's series are added per server)

PLACEMENT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)
WAKEUP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

PLACEMENT_LATENCY = Histogram("mn_admission_wait_time_seconds", "From a run's scheduled time to the commit of its "
                              "booking by this worker (waiting for capacity included).", ["pool", "node"],
                              buckets=PLACEMENT_BUCKETS, registry=REGISTRY)
WAKEUP_LATENCY = Histogram("mn_wakeup_latency_seconds", "From a change a wake-up heard of to the end of the "
                           "poll it caused.", ["pool", "change"], buckets=WAKEUP_BUCKETS, registry=REGISTRY)
COMMIT_CONFLICTS = Counter("mn_commit_conflicts", "Commits of this worker that met another's: changed (the store "
                           "decided again), taken (planned again), same_run (another worker booked the run).",
                           ["pool", "kind"], registry=REGISTRY)
COMMIT_RETRIES = Counter("mn_commit_retries", "Rounds done again: store (a commit read and decided again), placer "
                         "(a run planned again).", ["pool", "stage"], registry=REGISTRY)
WORKER_INFO = Gauge("mn_worker_info", "1 per worker: its pool and node.", ["pool", "node"], registry=REGISTRY)

KNOWN_REASONS = frozenset({reasons.NODE_NOT_READY, reasons.NODE_INELIGIBLE, reasons.MISSING_PROFILE,
                           reasons.CONSTRAINT_NOT_MET, reasons.MISSING_SERVICE, reasons.MISSING_DRIVER,
                           reasons.PORT_IN_USE, reasons.NO_DYNAMIC_PORT, reasons.MISSING_HOST_PATH,
                           reasons.MISSING_DEVICES, reasons.UNKNOWN_NODE, reasons.OTHER_GROUP,
                           reasons.RESERVATION_ENDED, reasons.QUOTA,
                           *(f"{reasons.INSUFFICIENT} {d}" for d in ("cpu", "memory", "disk", "gpu"))})


def reason_category(plan: Plan) -> str:
    """A waiting run's reason, as a bounded label: ``quota`` when its queue's quota holds it back, else the
    refusal most of the nodes gave (a constant of scheduler/reasons.py, e.g. ``insufficient gpu``; ties by name),
    ``no nodes`` when the group has none, ``other`` for anything else."""
    if (plan.reason or "").startswith(reasons.QUOTA):
        return reasons.QUOTA
    counts: dict[str, int] = {}
    for per_node in (plan.agents or {}).values():
        for why in per_node.values():
            head = why.split(":", 1)[0].strip()
            head = head if head in KNOWN_REASONS else "other"
            counts[head] = counts.get(head, 0) + 1
    if not counts:
        return "no nodes" if (plan.reason or "").endswith("no nodes") else "other"
    return min(counts, key=lambda head: (-counts[head], head))


class _Waiting(Collector):
    """``mn_queue_pending_runs`` and ``mn_queue_pending_oldest_age_seconds``: per pool, the runs its last polls found waiting
    (run id -> labels, and when the run was scheduled), counted at scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, dict[str, tuple[tuple[str, str, str], float | None]]] = {}

    def put(self, pool: str, run_id: str, labels: tuple[str, str, str] | None, since: float | None = None) -> None:
        with self._lock:
            runs = self._runs.setdefault(pool, {})
            if labels is None:
                runs.pop(run_id, None)
            else:
                runs[run_id] = (labels, since)

    def keep(self, pool: str, run_ids: set[str]) -> None:
        with self._lock:
            runs = self._runs.setdefault(pool, {})
            for gone in set(runs) - run_ids:
                del runs[gone]

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        family = GaugeMetricFamily("mn_queue_pending_runs", "Runs of the pool no node takes yet, as this worker's last "
                                   "polls found them, by work queue, plan status and reason.",
                                   labels=["pool", "queue", "status", "reason"])
        oldest = GaugeMetricFamily("mn_queue_pending_oldest_age_seconds", "Seconds since the oldest of the queue's waiting "
                                   "runs was scheduled to start, as this worker's last polls found them.",
                                   labels=["pool", "queue"])
        now = time.time()
        with self._lock:
            counts: dict[tuple[str, ...], int] = {}
            ages: dict[tuple[str, str], float] = {}
            for pool, runs in self._runs.items():
                for labels, since in runs.values():
                    counts[(pool, *labels)] = counts.get((pool, *labels), 0) + 1
                    if since is not None:
                        at = (pool, labels[0])
                        ages[at] = max(ages.get(at, 0.0), max(now - since, 0.0))
        for key, count in sorted(counts.items()):
            family.add_metric(list(key), float(count))
        for (pool, queue), age in sorted(ages.items()):
            oldest.add_metric([pool, queue], round(age, 3))
        yield family
        yield oldest


WAITING = _Waiting()
REGISTRY.register(WAITING)
REGISTRY.register(device_watch.COLLECTOR)  # the booked GPUs' last sample (worker/device_watch.py)


def poll_began(pool: str, flow_runs: list[Any]) -> None:
    """A poll of the pool's Scheduled runs began: a run it no longer lists waits no more (placed, cancelled)."""
    WAITING.keep(pool, {str(run.id) for run in flow_runs})


def settled(pool: str, flow_run: Any) -> None:
    """The run was placed (by any worker): it waits no more."""
    WAITING.put(pool, str(flow_run.id), None)


def placing(pool: str, flow_run: Any, result: PlaceResult | None) -> None:
    """What one placement attempt of ``flow_run`` by this worker did: its conflicts and retries, its latency when
    this call created the booking, and whether the run waits."""
    if result is None:
        return
    commit = result.commit
    if result.rereads:
        COMMIT_CONFLICTS.labels(pool=pool, kind="changed").inc(result.rereads)
        COMMIT_RETRIES.labels(pool=pool, stage="store").inc(result.rereads)
    if result.conflicts:
        COMMIT_CONFLICTS.labels(pool=pool, kind="taken").inc(result.conflicts)
    if result.attempts > 1:
        COMMIT_RETRIES.labels(pool=pool, stage="placer").inc(result.attempts - 1)
    if commit is not None and not commit.ok and commit.conflict is not None and commit.conflict.job_booked:
        COMMIT_CONFLICTS.labels(pool=pool, kind="same_run").inc()
        settled(pool, flow_run)
        return
    if commit is not None and commit.ok:
        if not commit.already_committed:
            node = commit.placements[0].node if commit.placements else ""
            PLACEMENT_LATENCY.labels(pool=pool, node=node).observe(_since_scheduled(flow_run))
        settled(pool, flow_run)
        return
    queue = getattr(flow_run, "work_queue_name", None) or "default"
    WAITING.put(pool, str(flow_run.id), (queue, result.plan.status, reason_category(result.plan)),
                _scheduled_at(flow_run))


def _scheduled_at(flow_run: Any) -> float | None:
    when = getattr(flow_run, "expected_start_time", None) or getattr(flow_run, "created", None)
    return when.timestamp() if when is not None else None


def _since_scheduled(flow_run: Any) -> float:
    when = _scheduled_at(flow_run)
    return max(time.time() - when, 0.0) if when is not None else 0.0


def woke(pool: str, change: str, seconds: float) -> None:
    WAKEUP_LATENCY.labels(pool=pool, change=change).observe(max(seconds, 0.0))


CONFLICT_KINDS = ("changed", "taken", "same_run")
RETRY_STAGES = ("store", "placer")


class _Process(Collector):
    """This process's instruments, each sample labelled ``worker`` with this worker's node."""

    def __init__(self, worker: str):
        self._worker = worker

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        for metric in REGISTRY.collect():
            yield labelled(metric, WORKER_LABEL, self._worker)


class _Both(Collector):
    """This process's instruments and the node's series, as one registry serves them."""

    def __init__(self, process: _Process, node: ClusterCollector):
        self._process, self._node = process, node

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        yield from self._process.collect()
        yield from self._node.collect()


def metrics_port(environ: Any = os.environ) -> int | None:
    """The port ``MN_METRICS_PORT`` asks for (0: a free one); None when unset, empty or ``off``. ValueError naming
    the variable for anything else."""
    text = (environ.get(METRICS_PORT_VAR) or "").strip()
    if not text or text.lower() == "off":
        return None
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"{METRICS_PORT_VAR}={text!r} is not a port (0-65535, 0 for a free one, or off)")
    return port


async def serve(store: ClusterStore, node: NodeRecord, pool: str,
                in_store: Callable[..., Awaitable[Any]], logger: Any) -> str | None:
    """Serve ``/metrics`` when ``MN_METRICS_PORT`` asks for it (on ``MN_METRICS_HOST``, default 127.0.0.1): this
    process's instruments and ``node``'s series. The URL is logged and recorded in the store
    (``MetricsEndpointRecord``: ``mn-prefect metrics targets``); returned, or None when not served. A port that
    cannot be had is a warning: the worker places and runs without metrics."""
    WORKER_INFO.labels(pool=pool, node=node.name).set(1)
    for kind in CONFLICT_KINDS:  # every series there from the start: a rate of 0, not no data
        COMMIT_CONFLICTS.labels(pool=pool, kind=kind)
    for stage in RETRY_STAGES:
        COMMIT_RETRIES.labels(pool=pool, stage=stage)
    try:
        port = metrics_port()
    except ValueError as error:
        logger.warning("no metrics served: %s", error)
        return None
    if port is None:
        return None
    host = os.environ.get(METRICS_HOST_VAR, "").strip() or DEFAULT_HOST
    url_of_store = store.url.raw
    collector = ClusterCollector(lambda: open_store(url_of_store), node=node.name, group=node.group, queues=False)
    process = _Process(node.name)
    registry, alone = CollectorRegistry(), CollectorRegistry()
    registry.register(_Both(process, collector))
    alone.register(process)
    try:
        server = serve_metrics(host, port, registry, paths={f"/metrics{PROCESS_PATH}": alone})
    except OSError as error:
        logger.warning("no metrics served: cannot listen on %s port %s (%s=%s, %s=%s): %s", host, port,
                       METRICS_HOST_VAR, host, METRICS_PORT_VAR, port, error)
        return None
    url = url_for(host, server.server_port)
    logger.info("metrics for Prometheus at %s", url)
    record = MetricsEndpointRecord(job_id=metrics_endpoint_id(node.name), node=node.name, pool=pool, url=url,
                                   pid=os.getpid())
    try:
        await in_store(put_record, store, record)
    except Exception as error:  # tools cannot find the port; Prometheus configured with it still scrapes
        logger.warning("could not record the metrics address %s in the store: %s", url, error)
    return url
