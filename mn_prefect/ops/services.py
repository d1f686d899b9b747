"""The services the nodes run, as a service catalog: what ``mn-prefect service list/resolve`` and MirrorNeuron's
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

UNREACHABLE = ("offline", "disconnected")
STATUSES = ("passing", "warning", "critical")


def instances(store: ClusterStore, *, name: str | None = None, node: str | None = None, status: str | None = None,
              tags: Iterable[str] = (), passing_only: bool = False) -> list[dict[str, Any]]:
    """Every service instance of the registered nodes that passes the filters, by name then node."""
    wanted_tags = set(tags)
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
            })
    return sorted(found, key=lambda s: (s["name"], s["node"]))


def check(store: ClusterStore, requirements: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether each required service (``{"name", "tags"}``) has a passing instance: ``ok`` when all do."""
    results = []
    for requirement in requirements:
        passing = instances(store, name=str(requirement.get("name") or ""), tags=requirement.get("tags") or [],
                            passing_only=True)
        results.append({"name": requirement.get("name"), "tags": requirement.get("tags") or [], "ok": bool(passing),
                        "passing": len(passing), "instances": passing})
    return {"ok": all(r["ok"] for r in results), "services": results}
