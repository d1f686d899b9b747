"""How a placement shows up in Prefect: events with the run as a related resource, a table artifact named
``placement``, the run's logs, and the message of the run's Pending state.

Events go out through mn_prefect.events (queued, posted in batches, never waited on). A placement is one event,
under its name in docs/events.md (``mn.placement.created|released|refused``). A refusal is also said under the name
the worker used for it before that table was settled, unchanged, so Automations made on those names keep firing:
``mn.placement.waiting`` and ``mn.launch.refused`` (with refused). ``mn.placement.committed``, the old twin of
created, is no longer sent (docs/changelog.md).
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect.client.schemas.actions import ArtifactCreate

from mn_prefect import events
from mn_prefect.model.placement import Placement

CREATED = events.PLACEMENT_CREATED
RELEASED = events.PLACEMENT_RELEASED
WAITING = "mn.placement.waiting"
LAUNCH_REFUSED = "mn.launch.refused"
from mn_prefect.events import HOLD_BACKFILLED, HOLD_COVERED, HOLD_CREATED, HOLD_RELEASED  # noqa: E402, F401


def _pool(work_pool: Any) -> list[dict[str, str]]:
    if work_pool is None:
        return []
    return [{"prefect.resource.id": f"prefect.work-pool.{work_pool.id}", "prefect.resource.role": "work-pool",
             "prefect.resource.name": work_pool.name}]


def emit_placement(event: str, flow_run_id: UUID | str, node: str, payload: dict[str, Any], *,
                   run_name: str | None = None, work_pool: Any = None) -> None:
    """A committed (``CREATED``), released (``RELEASED``) or refused (``LAUNCH_REFUSED``) placement of the run
    on ``node``; ``payload`` is the placement's ``summary`` for a commit, else carries the reason."""
    run = events.flow_run(flow_run_id, run_name)
    booking = str(payload.get("booking") or flow_run_id)
    if event == LAUNCH_REFUSED:
        events.refused(booking, reason=payload.get("reason"), status="refused", stage="launch", node_name=node,
                       run_id=flow_run_id, run_name=run_name, related=_pool(work_pool),
                       details={"runtime_driver": payload.get("runtime_driver")})
    else:
        what = "created" if event == CREATED else "released"
        reason = f"placed on {node} (score {payload.get('score')})" if event == CREATED else payload.get("reason")
        events.placement(what, node, booking, reason=reason, allocation=payload if event == CREATED else None,
                         run_id=flow_run_id, run_name=run_name, related=_pool(work_pool))
        return
    # the name used before docs/events.md's, as it was
    events.emit(event, events.node(node), related=[run, *_pool(work_pool)], payload=payload)


def emit_waiting(flow_run: Any, payload: dict[str, Any], work_pool: Any = None) -> None:
    """A run that no node takes yet: ``mn.placement.refused`` about its job, and ``WAITING`` about the run itself
    (no node holds anything)."""
    events.refused(str(flow_run.id), reason=payload.get("reason"), status=payload.get("status") or "waiting",
                   stage="placement", run_id=flow_run.id, run_name=flow_run.name, related=_pool(work_pool),
                   details={"agents": payload.get("agents")})
    events.emit(WAITING, {"prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                          "prefect.resource.name": flow_run.name or str(flow_run.id)},
                related=_pool(work_pool), payload=payload)


def emit_hold(event: str, run_id: Any, run_name: str | None, hold: Any, work_pool: Any = None,
              **payload: Any) -> None:
    """One of the ``mn.hold.*`` events about the held run (``hold``: a placement.holding.StandingHold)."""
    events.emit(event, {"prefect.resource.id": f"prefect.flow-run.{run_id}",
                        "prefect.resource.name": run_name or str(run_id)},
                related=_pool(work_pool), payload={"hold": hold.hold_id, "nodes": list(hold.nodes),
                                                   "expected_start": hold.expected_start, **payload})


def summary(placement: Placement) -> dict[str, Any]:
    """The compact form written onto the run (job variables, event payload)."""
    return {
        "node": placement.node,
        "devices": placement.device_ids,
        "gpu_shares": {d.id: {"shares": d.shares, "memory_mb": d.memory_mb} for d in placement.allocation.shares},
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


def log_line(placement: Placement) -> str:
    """The first line of the run's logs: where it runs and with what, in words."""
    parts = [f"cpu {placement.resources.cpu_cores:g}", f"memory {placement.resources.memory_mb:g} MB"]
    for device in placement.allocation.devices:
        parts.append(f"device {device.id}" + (f" ({device.model})" if device.model else ""))
    for share in placement.allocation.shares:
        parts.append(f"{share.shares:g} of GPU {share.id} ({share.memory_mb:g} MB)")
    parts += [f"port {p.label}={p.port}" for p in placement.allocation.ports]
    parts += [f"volume {v.name}={v.source}" for v in placement.allocation.volumes]
    if placement.allocation.runtime_driver:
        parts.append(f"driver {placement.allocation.runtime_driver}")
    score = f", score {placement.score:.3g}" if placement.score is not None else ""
    return f"mn placed this run on {placement.node}: {', '.join(parts)} ({reason(placement)}{score})"


def reason(placement: Placement) -> str:
    """Why the run went where it did, in a line."""
    if placement.reservation:
        why = f"inside reservation {placement.reservation}"
    elif placement.preferred == "honored":
        why = "its preferred node"
    elif placement.preferred == "fallback":
        why = "its preferred node could not take it: the best-scored node that fits"
    else:
        why = "the best-scored node that fits"
    return why + (f" ({placement.locality})" if placement.locality else "")


def artifact(placement: Placement, flow_run_id: UUID) -> ArtifactCreate:
    """The ``placement`` table on the run: node, resources, devices (whole, shared or MIG slices), ports, volumes,
    runtime driver, score and reason."""
    rows = [{"what": "node", "value": placement.node},
            {"what": "cpu cores", "value": f"{placement.resources.cpu_cores:g}"},
            {"what": "memory MB", "value": f"{placement.resources.memory_mb:g}"}]
    for device in placement.allocation.devices:
        memory = f", {device.memory_total_mb:g} MB" if device.memory_total_mb is not None else ""
        slice_of = f", {device.mig_profile} slice of {device.parent}" if device.parent else ""
        rows.append({"what": f"device {device.index}", "value": f"{device.id} ({device.vendor}/{device.driver}"
                                                              f"{', ' + device.model if device.model else ''}{memory}"
                                                              f"{slice_of})"})
    for share in placement.allocation.shares:
        rows.append({"what": f"gpu share {share.id}", "value": f"{share.shares:g} of the GPU, {share.memory_mb:g} MB"})
    for port in placement.allocation.ports:
        rows.append({"what": f"port {port.label}", "value": f"{port.protocol}:{port.port}"})
    for volume in placement.allocation.volumes:
        rows.append({"what": f"volume {volume.name}", "value": f"{volume.source} -> {volume.target} ({volume.mode})"})
    rows.append({"what": "runtime driver", "value": placement.allocation.runtime_driver or "-"})
    rows.append({"what": "score", "value": f"{placement.score:g}" if placement.score is not None else "-"})
    rows.append({"what": "reason", "value": reason(placement)})
    return ArtifactCreate(key="placement", type="table", data=rows, flow_run_id=flow_run_id,
                          description=f"mn-prefect placement on {placement.node}")
