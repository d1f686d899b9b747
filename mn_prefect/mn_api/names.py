"""Node names across the two worlds (the ids: model/node_ids.py): either spelling finds the node, and so does any
``<prefix>@<host>`` with the same host."""

from __future__ import annotations

from mn_prefect.mn_api.errors import ApiError, invalid, not_found
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.node_ids import ADDRESS_LABEL, PREFIX, host_of, mirror_neuron_id

__all__ = ["ADDRESS_LABEL", "PREFIX", "host_of", "mirror_neuron_id", "resolve"]


def resolve(given: str, nodes: list[NodeRecord], field: str = "node_name") -> str:
    """The mn-prefect name of the node ``given`` names; NOT_FOUND naming the known nodes when none does,
    INVALID_ARGUMENT when the name is empty or its host fits several nodes."""
    given = given.strip()
    if not given:
        raise invalid(field, "a node name is required (an mn-prefect node name or mirror_neuron@HOST)")
    for node in nodes:
        if node.name == given:
            return node.name
    if "@" in given:
        host = given.rsplit("@", 1)[1]
        matches = sorted({n.name for n in nodes if host in (host_of(n), n.name)})
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise ApiError("INVALID_ARGUMENT", f"{field}: {given!r} fits several nodes ({', '.join(matches)}); "
                                               f"name one of them")
    known = ", ".join(sorted(n.name for n in nodes)) or "none registered"
    raise not_found(f"unknown node {given!r} (known: {known})")
