"""Port booking: static ports must be free, dynamic ones come from the node's range (docs/resources.md)."""

from __future__ import annotations

from mn_prefect.model.placement import PortAllocation
from mn_prefect.model.resources import PortRequest
from mn_prefect.scheduler import reasons


def family(protocol: str) -> str:
    """http and grpc run over TCP, so they share TCP's port numbers."""
    return "udp" if protocol == "udp" else "tcp"


def pick_ports(
    requests: tuple[PortRequest, ...], used: set[tuple[str, int]], port_range: tuple[int, int]
) -> tuple[list[PortAllocation] | None, str | None]:
    """Reserve each requested port; returns (allocations in request order, None) or (None, reason).

    Static ports are booked first so that a dynamic pick never takes a number another label asked for.
    """
    taken = set(used)
    chosen: dict[str, PortAllocation] = {}
    for request in requests:
        if request.dynamic:
            continue
        key = (family(request.protocol), request.port)
        if key in taken:
            return None, reasons.reason(reasons.PORT_IN_USE, f"{key[0]}:{key[1]} (label {request.label})")
        taken.add(key)
        chosen[request.label] = PortAllocation(label=request.label, port=request.port, protocol=request.protocol)
    low, high = port_range
    for request in requests:
        if not request.dynamic:
            continue
        fam = family(request.protocol)
        port = next((p for p in range(low, high + 1) if (fam, p) not in taken), None)
        if port is None:
            return None, reasons.reason(reasons.NO_DYNAMIC_PORT, f"{fam} {low}-{high} (label {request.label})")
        taken.add((fam, port))
        chosen[request.label] = PortAllocation(label=request.label, port=port, protocol=request.protocol, dynamic=True)
    return [chosen[r.label] for r in requests], None
