"""``MN_NODE_*`` environment overrides, applied last over detection and the mock file."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mn_prefect.model.issues import Issues


def _list(text: str) -> list[str]:
    return [item.strip() for item in text.replace(";", ",").split(",") if item.strip()]


def _bool(text: str) -> bool | None:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    return None


def _labels(text: str, var: str, issues: Issues) -> dict[str, str]:
    labels = {}
    for item in _list(text):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            issues.add(var, f"expected key=value pairs, got {item!r}")
            continue
        labels[key.strip()] = value.strip()
    return labels


OVERRIDES = {
    "MN_NODE_NAME": "name",
    "MN_NODE_STATUS": "status",
    "MN_NODE_ROLE": "role",
    "MN_NODE_GROUP": "group",
    "MN_NODE_CPU_CORES": "cpu_cores",
    "MN_NODE_MEMORY_MB": "memory_mb",
    "MN_NODE_DISK_MB": "disk_mb",
    "MN_NODE_SCHEDULING_ELIGIBLE": "scheduling_eligible",
    "MN_NODE_CAPABILITIES": "capabilities",
    "MN_NODE_HOST_PATHS": "host_paths",
    "MN_NODE_RUNTIME_DRIVERS": "runtime_drivers",
    "MN_NODE_PROFILES": "profiles",
    "MN_NODE_LABELS": "labels",
    "MN_NODE_DYNAMIC_PORT_RANGE": "dynamic_port_range",
    "MN_NODE_CPUSET": "cpuset",
}


def apply_overrides(record: dict[str, Any], environ: Mapping[str, str], issues: Issues) -> dict[str, Any]:
    """A copy of ``record`` with every set MN_NODE_* variable applied; bad values are issues naming the variable."""
    out = dict(record)
    for var, field in OVERRIDES.items():
        text = environ.get(var)
        if text is None or text == "":
            continue
        if field in ("cpu_cores", "memory_mb", "disk_mb"):
            try:
                out[field] = float(text)
            except ValueError:
                issues.add(var, f"must be a number, got {text!r}")
        elif field == "scheduling_eligible":
            value = _bool(text)
            if value is None:
                issues.add(var, f"must be true or false, got {text!r}")
            else:
                out[field] = value
        elif field == "capabilities":
            out[field] = list(out.get(field) or []) + _list(text)
        elif field in ("host_paths", "runtime_drivers", "profiles"):
            out[field] = _list(text)
        elif field == "labels":
            out[field] = {**(out.get(field) or {}), **_labels(text, var, issues)}
        else:
            out[field] = text.strip()
    return out
