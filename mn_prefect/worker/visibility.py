"""How a placement shows up in Prefect: events with the run as a related resource, a table artifact named
``placement``, the run's logs, and the message of the run's Pending state."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect.client.schemas.actions import ArtifactCreate
from prefect.events import emit_event

from mn_prefect.model.placement import Placement

COMMITTED = "mn.placement.committed"
RELEASED = "mn.placement.released"
WAITING = "mn.placement.waiting"
LAUNCH_REFUSED = "mn.launch.refused"


def _pool(work_pool: Any) -> list[dict[str, str]]:
    if work_pool is None:
        return []
    return [{"prefect.resource.id": f"prefect.work-pool.{work_pool.id}", "prefect.resource.role": "work-pool",
             "prefect.resource.name": work_pool.name}]


def emit_placement(event: str, flow_run_id: UUID | str, node: str, payload: dict[str, Any], *,
                   run_name: str | None = None, work_pool: Any = None) -> None:
    """A committed or released placement: about the node, with the run (its event feed shows it) and the pool."""
    run = {"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"}
    if run_name:
        run["prefect.resource.name"] = run_name
    emit_event(
        event=event,
        resource={"prefect.resource.id": f"mn.node.{node}", "prefect.resource.name": node},
        related=[run, *_pool(work_pool)],
        payload=payload,
    )


def emit_waiting(flow_run: Any, payload: dict[str, Any], work_pool: Any = None) -> None:
    """A run that no node takes yet: the run itself is what the event is about (no node holds anything)."""
    emit_event(
        event=WAITING,
        resource={"prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                  "prefect.resource.name": flow_run.name or str(flow_run.id)},
        related=_pool(work_pool),
        payload=payload,
    )


def summary(placement: Placement) -> dict[str, Any]:
    """The compact form written onto the run (job variables, event payload)."""
    return {
        "node": placement.node,
        "devices": placement.device_ids,
        "cuda_visible_devices": placement.env.get("CUDA_VISIBLE_DEVICES"),
        "ports": {p.label: p.port for p in placement.allocation.ports},
        "volumes": {v.name: v.source for v in placement.allocation.volumes},
        "cpu_cores": placement.resources.cpu_cores,
        "memory_mb": placement.resources.memory_mb,
        "runtime_driver": placement.allocation.runtime_driver,
        "score": placement.score,
    }


def message(placement: Placement) -> str:
    """One line for the run's Pending state message."""
    parts = [f"mn: placed on {placement.node}"]
    if placement.device_ids:
        parts.append("devices " + ",".join(placement.device_ids))
    if placement.allocation.ports:
        parts.append("ports " + ",".join(f"{p.label}={p.port}" for p in placement.allocation.ports))
    if placement.allocation.volumes:
        parts.append("volumes " + ",".join(v.name for v in placement.allocation.volumes))
    return "; ".join(parts)


def artifact(placement: Placement, flow_run_id: UUID) -> ArtifactCreate:
    rows = [{"what": "node", "value": placement.node},
            {"what": "cpu cores", "value": f"{placement.resources.cpu_cores:g}"},
            {"what": "memory MB", "value": f"{placement.resources.memory_mb:g}"}]
    for device in placement.allocation.devices:
        memory = f", {device.memory_total_mb:g} MB" if device.memory_total_mb is not None else ""
        rows.append({"what": f"device {device.index}", "value": f"{device.id} ({device.vendor}/{device.driver}"
                                                              f"{', ' + device.model if device.model else ''}{memory})"})
    for port in placement.allocation.ports:
        rows.append({"what": f"port {port.label}", "value": f"{port.protocol}:{port.port}"})
    for volume in placement.allocation.volumes:
        rows.append({"what": f"volume {volume.name}", "value": f"{volume.source} -> {volume.target} ({volume.mode})"})
    rows.append({"what": "runtime driver", "value": placement.allocation.runtime_driver or "-"})
    return ArtifactCreate(key="placement", type="table", data=rows, flow_run_id=flow_run_id,
                          description=f"mn-prefect placement on {placement.node}")
