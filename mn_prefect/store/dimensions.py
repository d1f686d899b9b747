"""The capacity dimensions and claim kinds a booking takes, in one table.

A commit books, on each node, an amount of every dimension (summed over the node's placements) and a set of
keys of every claim kind (a key is held by one job at a time). The admission rule
(``scheduler.view.admission_reason``)
decides whether a plan fits; the backends only apply what this table produces: add the amounts if each
node's usage stays under the ceiling the rule computed, and take the keys if none is held. A new dimension
is one row here (and its arithmetic in ClusterView); no backend script changes. Besides these fixed rows, a
placement takes per-device dimensions (a GPU's shares, its fractional memory, its MIG slices:
``scheduler.devices.device_amounts``), named after the device, which the backends apply the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from mn_prefect.model.placement import Placement
from mn_prefect.scheduler.devices import held_whole
from mn_prefect.scheduler.ports import family


def port_key(protocol: str, port: int) -> str:
    return f"{family(protocol)}:{port}"


# name -> what a placement takes, in the order of the rule's capacities (scheduler.view.node_capacity)
DIMENSIONS: dict[str, Callable[[Placement], float]] = {
    "cpu": lambda p: p.resources.cpu_cores,
    "mem": lambda p: p.resources.memory_mb,
    "disk": lambda p: p.resources.disk_mb,
    "gpu": lambda p: float(p.resources.gpu_count),
}

# kind -> the keys a placement claims
CLAIM_KINDS: dict[str, Callable[[Placement], list[str]]] = {
    "device": lambda p: held_whole(p.allocation),
    "port": lambda p: [port_key(x.protocol, x.port) for x in p.allocation.ports],
}
