"""The worker's Prometheus metrics (docs/operating.md, "Metrics for Prometheus and Grafana"): the instruments this
process updates as it places runs and wakes up, and, when ``MN_METRICS_PORT`` is set, ``/metrics`` served with them
and the worker's own node's series (``mn_prefect.ops.metrics.ClusterCollector``, read from the store at each scrape
on a connection of its own, so a scrape never waits for the worker's store lock nor holds it).

Instruments (process-wide, labelled by pool; ``node`` on the latency is where the run was placed):

* ``mn_placement_latency_seconds{pool,node}``: from a run's scheduled time to the commit this process made of it;
* ``mn_wakeup_latency_seconds{pool,change}``: from the change a wake-up heard of (a commit on this node:
  ``placed``; freed capacity: ``capacity``; Prefect's event of a run made Scheduled in the pool: ``run_event``)
  to the end of the poll it caused;
* ``mn_commit_conflicts_total{pool,kind}``: ``changed`` (the apply found the plan's nodes changed: the store decided
  again), ``taken`` (the commit refused what the plan took: someone booked first; the placer planned again),
  ``same_run`` (another worker booked this very run first);
* ``mn_commit_retries_total{pool,stage}``: rounds done again, ``store`` (a commit's read and decision after
  ``changed``) or ``placer`` (a plan after a refused commit, or after a refusal decided on a stale view);
* ``mn_waiting_runs{pool,queue,status,reason}``: the runs of the pool this worker's polls found no node for, by
  work queue, plan status and the reason's category (``reason_category``);
* ``mn_worker_info{pool,node}``: 1.
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
from mn_prefect.ops.metrics import ClusterCollector, url_for
from mn_prefect.placement.placing import PlaceResult
from mn_prefect.scheduler import reasons
from mn_prefect.store import open_store
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import MetricsEndpointRecord, metrics_endpoint_id, put_record

METRICS_PORT_VAR = "MN_METRICS_PORT"  # unset or "off": no /metrics; 0: a free port, logged and recorded
METRICS_HOST_VAR = "MN_METRICS_HOST"
DEFAULT_HOST = "127.0.0.1"

REGISTRY = CollectorRegistry()  # this process's instruments (the node's series are added per server)

PLACEMENT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)
WAKEUP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

PLACEMENT_LATENCY = Histogram("mn_placement_latency_seconds", "From a run's scheduled time to the commit of its "
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
    """``mn_waiting_runs``: per pool, the runs its last polls found waiting (run id -> labels), counted at scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, dict[str, tuple[str, str, str]]] = {}

    def put(self, pool: str, run_id: str, labels: tuple[str, str, str] | None) -> None:
        with self._lock:
            runs = self._runs.setdefault(pool, {})
            if labels is None:
                runs.pop(run_id, None)
            else:
                runs[run_id] = labels

    def keep(self, pool: str, run_ids: set[str]) -> None:
        with self._lock:
            runs = self._runs.setdefault(pool, {})
            for gone in set(runs) - run_ids:
                del runs[gone]

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        family = GaugeMetricFamily("mn_waiting_runs", "Runs of the pool no node takes yet, as this worker's last "
                                   "polls found them, by work queue, plan status and reason.",
                                   labels=["pool", "queue", "status", "reason"])
        with self._lock:
            counts: dict[tuple[str, ...], int] = {}
            for pool, runs in self._runs.items():
                for labels in runs.values():
                    counts[(pool, *labels)] = counts.get((pool, *labels), 0) + 1
        for key, count in sorted(counts.items()):
            family.add_metric(list(key), float(count))
        yield family


WAITING = _Waiting()
REGISTRY.register(WAITING)


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
    WAITING.put(pool, str(flow_run.id), (queue, result.plan.status, reason_category(result.plan)))


def _since_scheduled(flow_run: Any) -> float:
    when = getattr(flow_run, "expected_start_time", None) or getattr(flow_run, "created", None)
    return max(time.time() - when.timestamp(), 0.0) if when is not None else 0.0


def woke(pool: str, change: str, seconds: float) -> None:
    WAKEUP_LATENCY.labels(pool=pool, change=change).observe(max(seconds, 0.0))


class _Both(Collector):
    """This process's instruments and the node's series, as one registry serves them."""

    def __init__(self, node: ClusterCollector):
        self._node = node

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        yield from REGISTRY.collect()
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
    registry = CollectorRegistry()
    registry.register(_Both(collector))
    try:
        server = serve_metrics(host, port, registry)
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
