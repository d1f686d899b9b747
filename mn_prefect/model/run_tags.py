"""What a flow run carries about where it ran, for people in the Prefect UI: tags (shown in the run's header,
filterable in the runs list) and labels (key-value, in the run's details).

``mn-node:<node>`` and one ``mn-gpu:<device id>`` per whole device, MIG slice or GPU share the run holds; the
labels ``mn.node`` and ``mn.devices`` say the same. Runs of the lifecycle deployments (reconcile, drain) carry
``OPS_TAG``: the worker places them like any run but writes no placement table on them, so that the UI's
artifacts stay about the work people run.
"""

from __future__ import annotations

from collections.abc import Iterable

from mn_prefect.model.placement import Placement

OPS_TAG = "mn-ops"
NODE_TAG = "mn-node:"
GPU_TAG = "mn-gpu:"
NODE_LABEL = "mn.node"
DEVICES_LABEL = "mn.devices"


def devices(placement: Placement) -> list[str]:
    """Every device the placement holds (whole, MIG slices, then shares), each once, in order."""
    held = [*placement.device_ids, *(share.id for share in placement.allocation.shares)]
    return list(dict.fromkeys(held))


def location_tags(placement: Placement) -> list[str]:
    return [f"{NODE_TAG}{placement.node}", *(f"{GPU_TAG}{d}" for d in devices(placement))]


def with_location(tags: Iterable[str], placement: Placement) -> list[str]:
    """``tags`` with the location of ``placement`` in place of any location an earlier placement left (a run
    re-placed off a lost node says where it runs now, not where it ran first)."""
    kept = [t for t in tags if not t.startswith((NODE_TAG, GPU_TAG))]
    return list(dict.fromkeys([*kept, *location_tags(placement)]))


def location_labels(placement: Placement) -> dict[str, str]:
    return {NODE_LABEL: placement.node, DEVICES_LABEL: ",".join(devices(placement))}
