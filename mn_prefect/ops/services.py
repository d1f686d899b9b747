"""The services the nodes and the running bundles offer, as a service catalog: what ``mn-prefect service list/resolve`` and MirrorNeuron's
``mn service list/resolve/check`` show.

A service is declared in a node's inventory (``services``: name, tags, port, and optionally a check its worker
probes); its worker keeps the status current in the node's record. A service of a node that is offline or
disconnected counts as ``critical`` whatever its last status: nobody can reach it through that node.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mn_prefect.mn_api.names import host_of, mirror_neuron_id
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import ServiceRecord, list_records

UNREACHABLE = ("offline", "disconnected")
STATUSES = ("passing", "warning", "critical")


def instances(store: ClusterStore, *, name: str | None = None, node: str | None = None, status: str | None = None,
              tags: Iterable[str] = (), passing_only: bool = False, job_id: str | None = None) -> list[dict[str, Any]]:
    """Every service instance that passes the filters, by name then node: those the registered nodes declare, and
    those running bundles offer (``job_id``: only a run's, by its run or job id)."""
    wanted_tags = set(tags)
    found = [] if job_id is not None else _declared(store, name, node, status, wanted_tags, passing_only)
    nodes = {s.record.name: s.record for s in store.list_nodes()}
    for record in list_records(store, ServiceRecord):
        if record.status == "deregistered" or (name is not None and record.name != name):
            continue
        if job_id is not None and job_id not in (record.run_id, record.bundle_job_id):
            continue
        at = nodes.get(record.node or "")
        if node is not None and (at is None or node not in (at.name, mirror_neuron_id(at), host_of(at))):
            continue
        effective = "critical" if at is not None and at.status in UNREACHABLE else record.status
        if not wanted_tags.issubset(record.tags):
            continue
        if (status is not None and effective != status) or (passing_only and effective != "passing"):
            continue
        found.append({
            "id": f"{record.service_id}@{record.run_id}", "name": record.name, "node": record.node,
            "node_id": mirror_neuron_id(at) if at is not None else None,
            "node_status": at.status if at is not None else None, "address": record.address, "port": record.port,
            "tags": list(record.tags), "status": effective, "reported_status": record.status,
            "check": record.checks[0] if record.checks else None, "job_id": record.run_id,
            "origin": "bundle", "note": record.note,
        })
    return sorted(found, key=lambda s: (s["name"], s["node"] or "", s["id"]))


def _declared(store: ClusterStore, name: str | None, node: str | None, status: str | None, wanted_tags: set[str],
              passing_only: bool) -> list[dict[str, Any]]:
    found = []
    for stored in store.list_nodes():
        record = stored.record
        if node is not None and node not in (record.name, mirror_neuron_id(record), host_of(record)):
            continue
        for service in record.services:
            effective = "critical" if record.status in UNREACHABLE else service.status
            if name is not None and service.name != name:
                continue
            if not wanted_tags.issubset(service.tags):
                continue
            if (status is not None and effective != status) or (passing_only and effective != "passing"):
                continue
            found.append({
                "id": f"{service.name}@{record.name}", "name": service.name, "node": record.name,
                "node_id": mirror_neuron_id(record), "node_status": record.status, "address": host_of(record),
                "port": service.port, "tags": list(service.tags), "status": effective,
                "reported_status": service.status,
                "check": service.check.model_dump(exclude_defaults=True) if service.check else None,
                "job_id": None, "origin": "node",
            })
    return found


def check(store: ClusterStore, requirements: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether each required service (``{"name", "tags"}``) has a passing instance: ``ok`` when all do."""
    results = []
    for requirement in requirements:
        passing = instances(store, name=str(requirement.get("name") or ""), tags=requirement.get("tags") or [],
                            passing_only=True)
        results.append({"name": requirement.get("name"), "tags": requirement.get("tags") or [], "ok": bool(passing),
                        "passing": len(passing), "instances": passing})
    return {"ok": all(r["ok"] for r in results), "services": results}
