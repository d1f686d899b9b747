"""The cluster overview the scheduled reconcile flow keeps (docs/events.md, "The cluster overview"): table
artifacts, ``mn-cluster`` (every node: state, used and free CPU, memory and GPUs, with shares and MIG slices, what holds
book there, ports in use, group), ``mn-waiting-runs`` (runs of ``mn`` pools that no node takes yet, with the reason), each row a markdown
link to what it names in the Prefect UI: a node's event feed, a run's page; and, once a queue has settings,
``mn-queues`` (each queue's quota, use, borrowing, lending and waiting runs, docs/queues.md).

A new version of an artifact is written only when its rows changed, so a quiet cluster does not add two
artifacts to Prefect's database every reconcile interval; the key's latest version is always the current view.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect.client.schemas.actions import ArtifactCreate
from prefect.client.schemas.filters import (
    ArtifactCollectionFilter,
    ArtifactCollectionFilterKey,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
    WorkPoolFilterType,
)
from prefect.client.schemas.objects import FlowRun, StateType

from mn_prefect import events
from mn_prefect.ops.usage import UsageReport, held_words, store_usage
from mn_prefect.scheduler.quotas import borrowed
from mn_prefect.scheduler.usage import DeviceUsage, NodeUsage
from mn_prefect.store.base import ClusterStore

CLUSTER_KEY = "mn-cluster"
WAITING_KEY = "mn-waiting-runs"
QUEUES_KEY = "mn-queues"
WORKER_TYPE = "mn"
# How the worker's announcer words a waiting run's Scheduled state (worker/routing.py, ``Router._wait_or_fail``).
WAITING_STATUSES = ("runnable_later", "not_runnable")
WAITING_LIMIT = 200  # runs listed at most (the oldest first)

Row = dict[str, str]


def _link(text: str, url: str | None) -> str:
    return f"[{text}]({url})" if url else text


def node_url(ui_url: str | None, node: str) -> str | None:
    """The node's event feed in the Prefect UI (events whose resource is ``mn.node.<name>``)."""
    return f"{ui_url}/events?resource={events.NODE}{node}" if ui_url else None


def run_url(ui_url: str | None, run_id: UUID | str) -> str | None:
    return f"{ui_url}/runs/flow-run/{run_id}" if ui_url else None


def _device(device: DeviceUsage, slices: int) -> str:
    """One GPU and what is booked of it: held whole, in fractions (shares and memory), or as MIG slices."""
    if device.held:
        booked = "held whole"
    elif device.shares_booked > 0:
        booked = f"{device.shares_booked:g} shares and {device.memory_booked_mb:g} MB booked"
    elif slices:
        booked = f"{device.slices_booked} of {slices} slices booked"
    else:
        booked = "free"
    return f"{device.id}: {booked}"


def _gpus(node: NodeUsage) -> str:
    slices = {d.id: sum(s.parent == d.id for s in node.devices) for d in node.devices if d.parent is None}
    return "; ".join(_device(d, slices[d.id]) for d in node.devices if d.parent is None and d.kind == "gpu") or "-"


def node_usage(store: ClusterStore, *, group: str | None = None) -> UsageReport:
    """Per node, as ``resource list --store`` computes it (``ops.usage.store_usage``; with ``group``, that group's
    nodes): capacity, schedulable, used and free, a GPU with any share or MIG slice booked counted as not free, each
    node's GPU memory not booked, and what the holds standing there book, counted apart from used and free. The
    metrics (``mn_prefect.ops.metrics``) show the same numbers."""
    return store_usage(store, group=group)


def cluster_rows(store: ClusterStore, ui_url: str | None) -> list[Row]:
    """One row per node, as ``resource list --store`` computes it (``node_usage``)."""
    report = node_usage(store)
    usage = report.usage
    rows = []
    for n in sorted(usage.nodes, key=lambda n: (n.group, n.name)):
        rows.append({
            "node": _link(n.name, node_url(ui_url, n.name)),
            "group": n.group,
            "state": n.status + ("" if n.scheduling_eligible else " (not eligible)"),
            "cpu used / free": f"{n.used.cpu_cores:g} / {n.free.cpu_cores:g}",
            "memory MB used / free": f"{n.used.memory_mb:g} / {n.free.memory_mb:g}",
            "gpus used / free": f"{n.used.gpu_count:g} / {n.free.gpu_count:g}",
            "held": held_words(report.holds.get(n.name, ())),
            "gpu devices": _gpus(n),
            "ports in use": ", ".join(n.ports_in_use) or "-",
        })
    return rows


def waiting_runs(client: Any) -> list[FlowRun]:
    """Scheduled runs of every ``mn`` pool whose state message says why no node takes them yet."""
    pools = client.read_work_pools(work_pool_filter=WorkPoolFilter(type=WorkPoolFilterType(any_=[WORKER_TYPE])))
    if not pools:
        return []
    runs = client.read_flow_runs(
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[p.name for p in pools])),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))),
        limit=WAITING_LIMIT)
    return [r for r in runs if _waiting(r) is not None]


def _waiting(run: FlowRun) -> tuple[str, str] | None:
    """(status, reason) from a waiting run's state message ``mn <status>: <reason>``; None for any other run."""
    message = (run.state.message if run.state is not None else None) or ""
    for status in WAITING_STATUSES:
        if message.startswith(f"mn {status}"):
            return status, message[len(f"mn {status}"):].lstrip(": ")
    return None


def waiting_rows(runs: list[FlowRun], ui_url: str | None) -> list[Row]:
    rows = []
    for run in sorted(runs, key=lambda r: (r.expected_start_time is None, r.expected_start_time, str(r.id))):
        status, reason = _waiting(run) or ("", "")
        rows.append({
            "run": _link(run.name or str(run.id), run_url(ui_url, run.id)),
            "pool": run.work_pool_name or "-",
            "status": status,
            "reason": reason,
            "expected start": run.expected_start_time.isoformat(timespec="seconds") if run.expected_start_time else "-",
        })
    return rows


def queue_rows(store: ClusterStore, runs: list[FlowRun]) -> list[Row]:
    """One row per queue with settings (docs/queues.md): quota, use, borrowing and lending, and its waiting runs."""
    queues = store.queues()
    waiting: dict[str, int] = {}
    for run in runs:
        waiting[run.work_queue_name or "default"] = waiting.get(run.work_queue_name or "default", 0) + 1
    rows = []
    for name, record in sorted(queues.queues.items()):
        spec = record.spec
        rows.append({"queue": name, "cohort": spec.cohort or "-", "quota": _amounts(spec.quota),
                     "used": _amounts(record.used), "borrowed": _amounts(borrowed(record)),
                     "lent": _amounts(queues.lent(name)), "weight": f"{spec.weight:g}", "priority": str(spec.priority),
                     "waiting runs": str(waiting.get(name, 0))})
    return rows


def _amounts(amounts: dict[str, float]) -> str:
    return ", ".join(f"{d}={v:g}" for d, v in sorted(amounts.items()) if v) or "-"


def publish(store: ClusterStore, client: Any, *, flow_run_id: UUID | str | None, ui_url: str | None) -> dict[str, Any]:
    """Write the artifacts (a new version of each only when its rows changed), attached to ``flow_run_id``;
    the row counts and which artifacts were written. The queues' artifact is written once a queue has settings."""
    cluster = cluster_rows(store, ui_url)
    runs = waiting_runs(client)
    waiting = waiting_rows(runs, ui_url)
    queues = queue_rows(store, runs)
    artifacts = [(CLUSTER_KEY, cluster, f"mn-prefect cluster: {len(cluster)} node(s)"),
                 (WAITING_KEY, waiting, f"mn-prefect: {len(waiting)} run(s) waiting for a node")]
    if queues:
        artifacts.append((QUEUES_KEY, queues, f"mn-prefect: {len(queues)} queue(s) with quotas"))
    written = [key for key, rows, what in artifacts if _write_if_changed(client, key, rows, what, flow_run_id)]
    return {"nodes": len(cluster), "waiting": len(waiting), "queues": len(queues), "written": written}


def _write_if_changed(client: Any, key: str, rows: list[Row], description: str, flow_run_id: UUID | str | None) -> bool:
    latest = client.read_latest_artifacts(artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(
        any_=[key])), limit=1)
    if latest and latest[0].data == rows:
        return False
    client.create_artifact(ArtifactCreate(key=key, type="table", data=rows, description=description,
                                          flow_run_id=UUID(str(flow_run_id)) if flow_run_id else None))
    return True
