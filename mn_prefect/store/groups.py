"""Resource groups (docs/operating.md): the name rule and the refusals every backend words the same way.

A group partitions the nodes of one store: a run of pool P is placed only on nodes of P's group (named like
the pool), so groups share the store but never each other's capacity.
"""

from __future__ import annotations

from collections.abc import Mapping

from mn_prefect.model.names import MAX_GROUP_NAME, name_issue
from mn_prefect.model.node import DEFAULT_GROUP, NodeRecord
from mn_prefect.store.base import GroupInUse, UnknownGroup

__all__ = ["DEFAULT_GROUP", "NODE_GROUP_VAR", "check_group_name", "group_in_use", "reported_group", "unknown_group"]


def check_group_name(name: object, field: str = "group") -> str:
    """``name`` when it is a valid group name; ValueError naming ``field`` otherwise."""
    # Prefect pool names are free text; a group named after one must still follow the name rule.
    why = name_issue(name, "group", MAX_GROUP_NAME)
    if why is not None or not isinstance(name, str):
        raise ValueError(f"{field}: {why}")
    return name


def unknown_group(name: str, node: str | None = None) -> UnknownGroup:
    """The refusal of a registration (``node``) or a command naming a group that does not exist."""
    who = f"node {node!r} reports group {name!r}, which does not exist" if node else f"group {name!r} does not exist"
    return UnknownGroup(f"{who}: create it with `mn-prefect group create {name}` (or create an mn work pool "
                        f"named {name})")


def group_in_use(name: str, nodes: list[str]) -> GroupInUse:
    shown = ", ".join(sorted(nodes)[:10]) + (f" and {len(nodes) - 10} more" if len(nodes) > 10 else "")
    return GroupInUse(f"group {name!r} still has {len(nodes)} node(s): {shown}; move them to another group "
                      "(their workers' MN_NODE_GROUP or pool) before deleting it")


def check_deletable(name: str) -> None:
    if name == DEFAULT_GROUP:
        raise ValueError(f"group: {DEFAULT_GROUP!r} always exists and cannot be deleted")


NODE_GROUP_VAR = "MN_NODE_GROUP"


def reported_group(record: NodeRecord, pool: str | None, environ: Mapping[str, str]) -> str:
    """The group a worker reports for its node: ``MN_NODE_GROUP``, else a ``group`` the inventory file names,
    else the worker's pool (``default`` without one). ValueError naming the variable for a bad name."""
    explicit = environ.get(NODE_GROUP_VAR, "").strip()
    if explicit:
        return check_group_name(explicit, NODE_GROUP_VAR)
    if "group" in record.model_fields_set:
        return check_group_name(record.group, "group (inventory file)")
    return check_group_name(pool, "work pool name (the default group of its nodes)") if pool else DEFAULT_GROUP
