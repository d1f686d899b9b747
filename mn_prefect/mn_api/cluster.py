"""The cluster answers (``mirrorneuron.cluster.v1.ClusterService``), from the store every mn-prefect part uses.

Each function takes the store (and, where runs change, a Prefect client), returns the JSON document the
``mn`` command reads, and raises ApiError for a request it refuses; a refused request changes nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mn_prefect.lifecycle import NodeStateRefused, Transition, set_maintenance, undrain
from mn_prefect.lifecycle.drain import DrainRefused, active_drain, preview_drain, start_drain
from mn_prefect.mn_api import names
from mn_prefect.mn_api.errors import ApiError, invalid, refused
from mn_prefect.model.json_text import parse_json
from mn_prefect.ops.usage import usage_report
from mn_prefect.scheduler.limits import RESOURCES, Limits
from mn_prefect.scheduler.usage import Amounts, NodeUsage
from mn_prefect.store.base import ClusterStore, NodeNotRegistered, StoredNode

VERSION = {"version": 1}
# What the ``mn`` command sends when a reason is left out; mn-prefect records a reason with every change.
DEFAULT_REASONS = {"maintenance": "changed through the MirrorNeuron API", "undrain": "drain cancelled through the "
                   "MirrorNeuron API", "drain": "drained through the MirrorNeuron API"}


def node_name(store: ClusterStore, given: str, field: str = "node_name") -> str:
    return names.resolve(given, [n.record for n in store.list_nodes()], field)


def _node_view(stored: StoredNode, now: float) -> dict[str, Any]:
    r = stored.record
    gpus = [d for d in r.devices if d.kind == "gpu"]
    return {"name": r.name, "node_id": names.mirror_neuron_id(r), "host": names.host_of(r), "self": False,
            "status": r.status, "scheduling_eligible": r.scheduling_eligible, "group": r.group, "role": r.role,
            "maintenance": r.status == "maintenance", "drain": r.status == "draining",
            "last_heartbeat": stored.last_heartbeat,
            "heartbeat_age_s": None if stored.last_heartbeat is None else round(now - stored.last_heartbeat, 3),
            "cpu_cores": r.cpu_cores, "memory_gb": round(r.memory_mb / 1024, 2), "disk_gb": round(r.disk_mb / 1024, 2),
            "gpu_count": len(gpus), "gpu": sorted({d.model for d in gpus if d.model}),
            "gpu_memory_total_mb": sum(d.memory_total_mb or 0 for d in gpus),
            "devices": [{"id": d.id, "kind": d.kind, "model": d.model, "memory_mb": d.memory_total_mb} for d in r.devices],
            "capabilities": r.capabilities, "runtime_drivers": r.runtime_drivers, "host_paths": r.host_paths,
            "labels": r.labels}


def system_summary(store: ClusterStore, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """``GetSystemSummary`` (``mn node list``): every node with its MirrorNeuron id, the jobs, counts."""
    now = time.time()
    nodes = [_node_view(n, now) for n in store.list_nodes()]
    by_status: dict[str, int] = {}
    for node in nodes:
        by_status[node["status"]] = by_status.get(node["status"], 0) + 1
    job_status: dict[str, int] = {}
    for job in jobs:
        job_status[job["status"]] = job_status.get(job["status"], 0) + 1
    return {"nodes": nodes, "jobs": jobs,
            "metrics": {"nodes": {"total": len(nodes), "by_status": by_status},
                        "jobs": {"total": len(jobs), "by_status": job_status},
                        "runtime": {"name": "mn-prefect", "generated_at": iso(now)}}, **VERSION}


def _amounts(a: Amounts, gpu_total_mb: float, gpu_free_mb: float) -> dict[str, Any]:
    return {"cpu_cores": round(a.cpu_cores, 3), "memory_gb": round(a.memory_mb / 1024, 2),
            "memory_mb": a.memory_mb, "disk_gb": round(a.disk_mb / 1024, 2), "disk_mb": a.disk_mb,
            "gpu_count": a.gpu_count, "gpu_memory_total_mb": gpu_total_mb, "gpu_memory_free_mb": gpu_free_mb,
            "gpu_memory_total_gb": round(gpu_total_mb / 1024, 2), "gpu_memory_free_gb": round(gpu_free_mb / 1024, 2)}


def _node_resources(n: NodeUsage, gpu_free_mb: float, node_id: str) -> dict[str, Any]:
    return {"name": n.name, "node_id": node_id, "status": n.status, "scheduling_eligible": n.scheduling_eligible,
            "group": n.group, **_amounts(n.total, n.gpu_memory_total_mb, gpu_free_mb),
            "memory_total_gb": round(n.total.memory_mb / 1024, 2),
            "memory_available_gb": round(n.free.memory_mb / 1024, 2),
            "disk_available_gb": round(n.free.disk_mb / 1024, 2),
            "usable": _amounts(n.schedulable, n.gpu_memory_total_mb, gpu_free_mb),
            "used": _amounts(n.used, 0.0, 0.0), "free": _amounts(n.free, n.gpu_memory_total_mb, gpu_free_mb),
            "gpu": sorted({d.model for d in n.devices if d.kind == "gpu" and d.model}),
            "devices": [d.model_dump(mode="json") for d in n.devices], "runtime_drivers": n.runtime_drivers,
            "host_paths": n.host_paths, "capabilities": n.capabilities, "ports_in_use": n.ports_in_use}


def resources(store: ClusterStore) -> dict[str, Any]:
    """``GetResource`` (``mn resource list``): totals, usable (after the limits) and free capacity, per node and
    for the cluster, as the scheduler counts them."""
    from mn_prefect.placement.reservations import holdings

    snap = store.snapshot()
    report = usage_report(snap.nodes, snap.holds, snap.limits, [p for p in store.active_placements() if p.hold])
    usage, gpu_free = report.usage, report.gpu_memory_free
    ids = {n.name: names.mirror_neuron_id(n) for n in snap.nodes}
    free_mb = sum(gpu_free.values())
    # What MirrorNeuron's clients read of the cluster beside the amounts, summed from the nodes as each node shows it
    totals = {**_amounts(usage.total, usage.gpu_memory_total_mb, free_mb),
              "memory_total_gb": round(sum(n.total.memory_mb for n in usage.nodes) / 1024, 2),
              "memory_available_gb": round(sum(n.free.memory_mb for n in usage.nodes) / 1024, 2),
              "disk_available_gb": round(sum(n.free.disk_mb for n in usage.nodes) / 1024, 2)}
    return {"mode": "single_node" if len(usage.nodes) == 1 else "cluster", "node_count": len(usage.nodes),
            "limits": snap.limits.model_dump(), "totals": totals, "combined": totals,
            "usable": _amounts(usage.schedulable, usage.gpu_memory_total_mb, free_mb),
            "used": _amounts(usage.used, 0.0, 0.0), "free": _amounts(usage.free, usage.gpu_memory_total_mb, free_mb),
            "held": _amounts(report.held_total(), 0.0, 0.0),
            "nodes": [{**_node_resources(n, gpu_free[n.name], ids[n.name]), "held": _amounts(report.held(n.name), 0.0, 0.0)}
                      for n in usage.nodes],
            "reservations": holdings(store), **VERSION}


def set_resources(store: ClusterStore, resource_json: str) -> dict[str, Any]:
    """``SetResource`` (``mn resource set --cpu 75 ...``): the cluster-wide limits, in percent (1..100)."""
    given = json_object(resource_json, "resource_json")
    if not given:
        raise invalid("resource_json", "at least one of cpu, gpu, memory, or disk is required")
    for key, value in given.items():
        if key not in RESOURCES:
            raise invalid(key, "resource type must be one of cpu, gpu, memory, or disk")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
            raise invalid(key, f"must be a whole percent from 1 to 100, not {value!r}")
    current = store.get_limits()
    store.set_limits(Limits.model_validate({**current.model_dump(), **given}))
    return resources(store)


def _change(store: ClusterStore, node: str, apply: Callable[[], Transition | None],
            extra: dict[str, Any]) -> dict[str, Any]:
    """Apply one operator change of ``node`` (a refusal is FAILED_PRECONDITION) and say where the node stands."""
    try:
        change = apply()
    except NodeStateRefused as error:
        raise refused(str(error)) from None
    except NodeNotRegistered as error:
        raise ApiError("NOT_FOUND", str(error)) from None
    stored = store.get_node(node)
    assert stored is not None  # the change found it
    record = stored.record
    return {"node": node, "node_id": names.mirror_neuron_id(record), "status": record.status,
            "scheduling_eligible": record.scheduling_eligible, "changed": change is not None,
            "transition": change.model_dump() if change is not None else None, **extra, **VERSION}


def maintenance(store: ClusterStore, given: str, enabled: bool, reason: str) -> dict[str, Any]:
    """``SetNodeMaintenance`` (``mn node maintenance NODE --enable|--disable``)."""
    node = node_name(store, given)
    reason = reason.strip() or DEFAULT_REASONS["maintenance"]
    return _change(store, node, lambda: set_maintenance(store, node, enabled, reason),
                   {"maintenance": {"enabled": enabled, "reason": reason}})


def cancel_drain(store: ClusterStore, given: str, reason: str, mark_eligible: bool) -> dict[str, Any]:
    """``CancelNodeDrain`` (``mn node undrain NODE [--mark-eligible]``)."""
    node = node_name(store, given)
    reason = reason.strip() or DEFAULT_REASONS["undrain"]
    return _change(store, node, lambda: undrain(store, node, reason, mark_eligible),
                   {"reason": reason, "mark_eligible": mark_eligible, "drain": {"status": "cancelled"}})


def drain_status(store: ClusterStore, given: str) -> dict[str, Any]:
    """``GetNodeDrainStatus``: the node's status, its active drain (if any) and whether it is in maintenance."""
    node = node_name(store, given)
    stored = store.get_node(node)
    assert stored is not None
    drain = active_drain(store, node)
    return {"node": node, "node_id": names.mirror_neuron_id(stored.record), "status": stored.record.status,
            "scheduling_eligible": stored.record.scheduling_eligible,
            "drain": drain.model_dump(mode="json") if drain is not None else {},
            "maintenance": {"enabled": stored.record.status == "maintenance"}, **VERSION}


def check_drain_options(store: ClusterStore, options: dict[str, Any]) -> tuple[str, str, float, bool]:
    """(node, reason, deadline seconds, dry run) from DrainNode's fields or a ``drain_node`` operation's options;
    INVALID_ARGUMENT naming the field for anything mn-prefect cannot honour."""
    node = node_name(store, str(options.get("node_name") or ""))
    deadline_ms = options.get("deadline_ms", 1_800_000)
    if isinstance(deadline_ms, bool) or not isinstance(deadline_ms, (int, float)) or deadline_ms <= 0:
        raise invalid("deadline_ms", f"must be a positive number of milliseconds, not {deadline_ms!r}")
    if options.get("ignore_system_jobs", True) is False:
        raise invalid("ignore_system_jobs", "mn-prefect drains leave system work on its node; drop "
                                            "--include-system-jobs")
    reason = str(options.get("reason") or "").strip() or DEFAULT_REASONS["drain"]
    return node, reason, deadline_ms / 1000, bool(options.get("dry_run"))


def begin_drain(store: ClusterStore, node: str, reason: str, deadline_s: float) -> dict[str, Any]:
    """Put ``node`` in draining (FAILED_PRECONDITION when it cannot be); what the next passes will do."""
    try:
        drain = start_drain(store, node, reason, deadline_s=deadline_s)
    except (DrainRefused, NodeStateRefused) as error:
        raise refused(f"the drain of {node} cannot proceed: {error}") from None
    return {"node": node, "status": "draining", "deadline": drain.deadline, "actions": preview_drain(store, node)}


def drain_preview(store: ClusterStore, node: str, deadline_s: float) -> dict[str, Any]:
    return {"node": node, "status": "dry_run", "dry_run": True, "deadline_s": deadline_s,
            "actions": preview_drain(store, node), **VERSION}


def json_object(text: str, field: str) -> dict[str, Any]:
    """``text`` as a JSON object; INVALID_ARGUMENT naming ``field`` when it is not one, or nests too deeply to read.
    An integer past Python's digit limit reads as infinity, which the field holding it refuses by name."""
    try:
        value = parse_json(text or "{}")
    except ValueError as error:
        raise invalid(field, f"not JSON: {error}") from None
    except RecursionError:
        raise invalid(field, "nested too deeply to read") from None
    if not isinstance(value, dict):
        raise invalid(field, "must be a JSON object")
    return value


def iso(ts: float | None) -> str | None:
    return None if ts is None else time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"
