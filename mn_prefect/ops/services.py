"""The services the nodes and the running bundles offer, as a service catalog: what ``mn-prefect service
list/resolve`` and MirrorNeuron's ``mn service list/resolve/check`` show.

A node declares its services in its inventory (``services``: name, tags, port, and optionally a check its worker
probes); its worker keeps the status current in the node's record. A running bundle registers the services of its
manifest (``mn_prefect.bundles.services``), with the status its checks give them, until it ends (or, killed before
it could say so, until the lease it renews lapses). A service of a node that is lost (offline, disconnected) counts
as ``critical`` whatever it last reported: nobody can reach it through that node.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from mn_prefect.model.node import NodeRecord, ServiceInstance
from mn_prefect.model.node_ids import host_of, mirror_neuron_id
from mn_prefect.model.node_status import LOST
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import ServiceRecord, list_records

STATUSES = ("passing", "warning", "critical")


def status_problem(status: str | None) -> str | None:
    """Why ``status`` is no service status to filter on, or None."""
    return None if status is None or status in STATUSES else f"{status!r}: one of {', '.join(STATUSES)}"


def instances(store: ClusterStore, *, name: str | None = None, node: str | None = None, status: str | None = None,
              tags: Iterable[str] = (), passing_only: bool = False, job_id: str | None = None) -> list[dict[str, Any]]:
    """Every service instance that passes the filters, by name then node: those the registered nodes declare, and
    those running bundles offer (``job_id``: only a run's, by its run or job id)."""
    nodes = {s.record.name: s.record for s in store.list_nodes()}
    rows: list[tuple[NodeRecord | None, dict[str, Any]]] = [] if job_id is not None else [(record, _declared(record, service)) for record in nodes.values()
                                          for service in record.services]
    now = time.time()
    for record in list_records(store, ServiceRecord):
        lapsed = record.expires_at is not None and record.expires_at < now  # its run is gone without saying so
        if record.status != "deregistered" and not lapsed and (job_id is None or
                                                               job_id in (record.run_id, record.bundle_job_id)):
            at = nodes.get(record.node or "")
            rows.append((at, _offered(record, at)))
    wanted_tags = set(tags)
    found = [row for at, row in rows
             if (name is None or row["name"] == name) and wanted_tags.issubset(row["tags"])
             and (node is None or (at is not None and node in (at.name, mirror_neuron_id(at), host_of(at))))
             and (status is None or row["status"] == status) and (not passing_only or row["status"] == "passing")]
    return sorted(found, key=lambda s: (s["name"], s["node"] or "", s["id"]))


def _effective(node: NodeRecord | None, reported: str) -> str:
    """A service of a node that is lost (offline, disconnected) is critical whatever it last reported."""
    return "critical" if node is not None and node.status in LOST else reported


def _where(node: NodeRecord | None) -> dict[str, Any]:
    return {"node_id": mirror_neuron_id(node) if node is not None else None,
            "node_status": node.status if node is not None else None}


def _declared(node: NodeRecord, service: ServiceInstance) -> dict[str, Any]:
    return {"id": f"{service.name}@{node.name}", "name": service.name, "node": node.name, **_where(node),
            "address": host_of(node), "port": service.port, "tags": list(service.tags),
            "status": _effective(node, service.status), "reported_status": service.status,
            "check": service.check.model_dump(exclude_defaults=True) if service.check else None,
            "job_id": None, "origin": "node"}


def _offered(record: ServiceRecord, node: NodeRecord | None) -> dict[str, Any]:
    return {"id": f"{record.service_id}@{record.run_id}", "name": record.name, "node": record.node, **_where(node),
            "address": record.address, "port": record.port, "tags": list(record.tags),
            "status": _effective(node, record.status), "reported_status": record.status,
            "check": record.checks[0] if record.checks else None, "job_id": record.run_id, "origin": "bundle",
            "note": record.note}


def check(store: ClusterStore, requirements: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether each required service (``{"name", "tags"}``) has a passing instance: ``ok`` when all do."""
    results = []
    for requirement in requirements:
        passing = instances(store, name=str(requirement.get("name") or ""), tags=requirement.get("tags") or [],
                            passing_only=True)
        results.append({"name": requirement.get("name"), "tags": requirement.get("tags") or [], "ok": bool(passing),
                        "passing": len(passing), "instances": passing})
    return {"ok": all(r["ok"] for r in results), "services": results}
