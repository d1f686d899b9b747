"""What a commit writes: per-node totals of a plan, its fingerprint, and snapshots from aggregates.

Shared by every backend so that they book exactly the same things.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from mn_prefect.model.node import NODE_STATES, NodeRecord
from mn_prefect.model.placement import Allocation, Placement, PlacedResources
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.ports import family
from mn_prefect.scheduler.view import ClusterView
from mn_prefect.store.base import Event

ROUND = 6


def port_key(protocol: str, port: int) -> str:
    return f"{family(protocol)}:{port}"


@dataclass
class NodeDemand:
    """What one commit takes from one node."""

    cpu: float = 0.0
    mem: float = 0.0
    disk: float = 0.0
    gpu: int = 0
    devices: list[str] = field(default_factory=list)
    ports: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"cpu": self.cpu, "mem": self.mem, "disk": self.disk, "gpu": self.gpu, "devices": self.devices,
                "ports": self.ports}


def demand_by_node(placements: list[Placement]) -> dict[str, NodeDemand]:
    demands: dict[str, NodeDemand] = defaultdict(NodeDemand)
    for p in placements:
        d = demands[p.node]
        d.cpu += p.resources.cpu_cores
        d.mem += p.resources.memory_mb
        d.disk += p.resources.disk_mb
        d.gpu += p.resources.gpu_count
        d.devices += [dev.id for dev in p.allocation.devices]
        d.ports += [port_key(x.protocol, x.port) for x in p.allocation.ports]
    return dict(sorted(demands.items()))


def fingerprint(placements: list[Placement]) -> str:
    """Identifies a plan's bookings, so re-committing the same plan is recognised as a no-op."""
    body = json.dumps({n: d.as_json() for n, d in demand_by_node(placements).items()}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def rounded(value: float) -> float:
    return round(value, ROUND)


@dataclass
class NodeState:
    """A node as the store holds it: its record (with live status) and what is booked on it."""

    record: NodeRecord
    cpu: float = 0.0
    mem: float = 0.0
    disk: float = 0.0
    gpu: int = 0
    devices: set[str] = field(default_factory=set)
    ports: set[str] = field(default_factory=set)

    def hold(self) -> Placement:
        """One synthetic placement that holds everything booked on this node."""
        node_devices = {d.id: d for d in self.record.devices}
        ports = []
        for key in sorted(self.ports):
            fam, _, number = key.partition(":")
            ports.append({"label": key, "port": int(number), "protocol": fam})
        return Placement(
            agent_id=f"held@{self.record.name}", node=self.record.name,
            resources=PlacedResources(cpu_cores=max(self.cpu, 0.0), memory_mb=max(self.mem, 0.0),
                                      disk_mb=max(self.disk, 0.0), gpu_count=max(self.gpu, 0)),
            allocation=Allocation(devices=tuple(node_devices[d] for d in sorted(self.devices) if d in node_devices),
                                  ports=tuple(ports)),
        )


def admission_conflict(states: list[NodeState], limits: Limits, placements: list[Placement]) -> tuple[str, str] | None:
    """(node, reason) for the first placement that no longer fits the bookings held now; None if all fit."""
    view = ClusterView([s.record for s in states], [s.hold() for s in states], limits)
    for placement in placements:
        why = view.admit(placement)
        if why is not None:
            return placement.node, why
    return None


def snapshot_nodes(states: list[NodeState]) -> tuple[list[NodeRecord], list[Placement]]:
    return [s.record for s in states], [s.hold() for s in states if s.cpu or s.mem or s.disk or s.gpu or s.devices or s.ports]


_PARSED: dict[str, NodeRecord] = {}
_PARSED_LOCK = threading.Lock()


def parse_record(text: str, status: str, eligible: bool) -> NodeRecord:
    """A stored record with its live status; each distinct JSON text is parsed once (commits and snapshots
    re-read the same records constantly)."""
    record = _PARSED.get(text)
    if record is None:
        record = NodeRecord.model_validate_json(text)
        with _PARSED_LOCK:
            if len(_PARSED) > 4096:
                _PARSED.clear()
            _PARSED[text] = record
    if record.status == status and record.scheduling_eligible == bool(eligible):
        return record
    return record.model_copy(update={"status": status, "scheduling_eligible": bool(eligible)})


def heartbeat_status(current: str) -> str:
    """A heartbeat reconnects a disconnected/offline node; it never leaves maintenance, draining or quarantine."""
    if current in ("disconnected", "offline"):
        return "healthy"
    return current


def registered_status(new: NodeRecord, stored_status: str | None, stored_eligible: bool | None) -> tuple[str, bool]:
    """Re-registering (a worker restart) keeps an operator's maintenance/draining/quarantine and ineligibility."""
    if stored_status is None:
        return new.status, new.scheduling_eligible
    status = stored_status if stored_status in ("maintenance", "draining", "quarantined") else new.status
    return status, new.scheduling_eligible and stored_eligible is not False


def check_transition(to_status: str, from_statuses: tuple[str, ...]) -> None:
    """ValueError naming any state that is not a node state (before anything is written)."""
    unknown = [s for s in (to_status, *from_statuses) if s not in NODE_STATES]
    if unknown:
        raise ValueError(f"unknown node status {unknown[0]!r} (allowed: {', '.join(NODE_STATES)})")
    if not from_statuses:
        raise ValueError("from_statuses is empty: the transition could never apply")


def transition_applies(status: str, last_heartbeat: float | None, from_statuses: tuple[str, ...],
                       heartbeat_before: float | None) -> bool:
    """A conditional transition applies when the node is in one of ``from_statuses`` and, with
    ``heartbeat_before`` (seconds since the epoch), its last heartbeat is older than that (the Redis script
    TRANSITION_NODE applies the same rule)."""
    if status not in from_statuses:
        return False
    return heartbeat_before is None or last_heartbeat is None or last_heartbeat < heartbeat_before


def transition_event(name: str, from_status: str, to_status: str, at: float, reason: str | None) -> Event:
    return Event(kind=f"node.{to_status}", at=at, node=name, reason=reason, data={"from": from_status, "to": to_status})


def reconnect_event(name: str, from_status: str, at: float, last_heartbeat: float | None) -> Event:
    """The event of a heartbeat that brings a disconnected/offline node back (the Redis HEARTBEAT script
    writes the same reason)."""
    reason = f"heartbeat received while {from_status}"
    if last_heartbeat is not None:
        reason += f", {at - last_heartbeat:.0f} s after the last one"
    return Event(kind="node.reconnected", at=at, node=name, reason=reason,
                 data={"from": from_status, "to": heartbeat_status(from_status)})
