"""The capacity dimensions and claim kinds a booking takes, in one table.

A commit books, on each node, an amount of every dimension (summed over the node's placements) and a set of
keys of every claim kind (a key is held by one job at a time). The admission rule
(``scheduler.admission.admission_reason``)
decides whether a plan fits; the backends only apply what this table produces: add the amounts if each
node's usage stays under the ceiling the rule computed, and take the keys if none is held. A new dimension
is one row here (and its arithmetic in ClusterView); no backend script changes. Besides these fixed rows, a
placement takes per-device dimensions (a GPU's shares, its fractional memory, its MIG slices:
``scheduler.devices.device_amounts``), named after the device, which the backends apply the same way.

A reservation (docs/operating.md) is a booking like any other, whose placements (``reserves``) also claim the
reservation's id (kind ``reservation``) on their node. A run placed inside it takes nothing of the node: it
books the same dimensions and device keys in the reservation's own space (``rsv:<id>:cpu``, ``<id>/GPU-0``),
under the reservation's amounts as ceilings, and *needs* the reservation's key to be held when it lands: a
run never lands in a reservation that has ended.

A hold (docs/scheduling.md, "Holds and backfill") is a booking too: its placement (``hold``) books the held run's
request on its node even past what is free there (its ceilings are the node's capacity plus its own amounts), and
claims the hold's id (kind ``reservation``). Every other commit sees that capacity as booked. A placement allowed
on the hold's capacity (``over_hold``: the held run itself, or a backfilled run) is admitted against the node's
capacity plus the hold's amounts, under ceilings raised by as much, and *needs* the hold's key to be held when it
lands: nothing takes held capacity once the hold is gone.
"""

from __future__ import annotations

from collections.abc import Callable

from mn_prefect.model.placement import Placement
from mn_prefect.scheduler.devices import held_whole
from mn_prefect.scheduler.ports import family


def port_key(protocol: str, port: int) -> str:
    return f"{family(protocol)}:{port}"


# name -> what a placement takes, in the order of the rule's capacities (scheduler.admission.node_capacity)
DIMENSIONS: dict[str, Callable[[Placement], float]] = {
    "cpu": lambda p: p.resources.cpu_cores,
    "mem": lambda p: p.resources.memory_mb,
    "disk": lambda p: p.resources.disk_mb,
    "gpu": lambda p: float(p.resources.gpu_count),
}

INSIDE = "rsv:"


def inside(reservation: str) -> str:
    """The prefix of the dimensions a run inside ``reservation`` books (its own space on the node)."""
    return f"{INSIDE}{reservation}:"


def inside_key(reservation: str, key: str) -> str:
    """A device key as a run inside ``reservation`` claims it."""
    return f"{reservation}/{key}"


def _devices(p: Placement) -> list[str]:
    keys = held_whole(p.allocation)
    return [inside_key(p.reservation, k) for k in keys] if p.reservation else keys


# kind -> the keys a placement claims
CLAIM_KINDS: dict[str, Callable[[Placement], list[str]]] = {
    "device": _devices,
    "port": lambda p: [port_key(x.protocol, x.port) for x in p.allocation.ports],
    "reservation": lambda p: [p.reserves] if p.reserves else [p.hold] if p.hold else [],
}

# The kinds a planner's view reads (a snapshot): devices and ports keep other bookings off a node. The key a
# reservation holds matters only to a commit's check (a run lands in a live reservation), which reads it itself;
# a view that read them would grow with every reservation held.
VIEW_CLAIM_KINDS: tuple[str, ...] = ("device", "port")
