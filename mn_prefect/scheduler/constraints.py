"""Evaluating constraints against node records (docs/scheduling.md)."""

from __future__ import annotations

import re
from typing import Any

from mn_prefect.model.constraints import Constraint
from mn_prefect.model.node import NodeRecord

_DIRECT = {
    "node": "name", "node.name": "name", "name": "name",
    "status": "status", "role": "role", "node_role": "role", "node.role": "role",
    "capabilities": "capabilities", "os": "os", "arch": "arch",
    "scheduling_eligible": "scheduling_eligible",
}
# Attributes that are part of a node's class: constraints on anything else are evaluated per node.
CLASS_ATTRIBUTES = frozenset(("status", "role", "node_role", "node.role", "capabilities", "profiles", "os", "arch",
                              "scheduling_eligible"))
_MISSING = None


def is_class_attribute(attribute: str) -> bool:
    return attribute in CLASS_ATTRIBUTES or attribute.startswith("labels.")


def resolve(node: NodeRecord, attribute: str) -> Any:
    """The value of ``attribute`` on ``node``; None when absent."""
    field = _DIRECT.get(attribute)
    if field is not None:
        return getattr(node, field)
    if attribute == "profiles":
        return [p.name for p in node.profiles]
    if attribute.startswith("labels."):
        return node.labels.get(attribute[len("labels."):])
    value: Any = node.model_dump()
    for part in attribute.removeprefix("node.").split("."):
        if isinstance(value, dict):
            value = value.get(part, _MISSING)
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
        if value is _MISSING:
            return _MISSING
    return value


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


# A version part longer than this is no real version's: it compares as larger than any real one, and is never given
# to int() (which refuses past Python's digit limit with a ValueError that would fail every plan on the node).
_MAX_VERSION_DIGITS = 64
_PAST_ANY_VERSION = 10**_MAX_VERSION_DIGITS


def version_key(value: Any) -> tuple[int, ...]:
    """``value``'s digit runs as numbers (``"550.120"`` -> ``(550, 120)``), for comparing versions."""
    return tuple(int(x) if len(x) <= _MAX_VERSION_DIGITS else _PAST_ANY_VERSION
                 for x in re.findall(r"\d+", value if isinstance(value, str) else _text(value)))


def _text(value: Any) -> str:
    try:
        return str(value)
    except ValueError:  # an integer past the digit limit
        return str(_PAST_ANY_VERSION)


_DOTTED = re.compile(r"^\s*v?\d+(\.\d+)+")


def _versions(a: Any, b: Any) -> bool:
    """Compare as versions, not floats, when either side is text with a dot: ``550.120 >= 550.90`` and
    ``12.10 > 12.9`` (docs/scheduling.md). Two numbers (not text) compare as numbers."""
    return any(isinstance(x, str) and _DOTTED.match(x) for x in (a, b))


def _equal(a: Any, b: Any) -> bool:
    if _versions(a, b):
        left, right = version_key(a), version_key(b)
        return left == right if left and right else str(a).lower() == str(b).lower()
    na, nb = _number(a), _number(b)
    if na is not None and nb is not None:
        return na == nb
    if isinstance(a, bool) or isinstance(b, bool):
        return str(a).lower() == str(b).lower()
    return str(a).lower() == str(b).lower()


def _contains(container: Any, item: Any) -> bool:
    if isinstance(container, (list, tuple, set)):
        return any(_equal(x, item) for x in container)
    if isinstance(container, dict):
        return any(_equal(k, item) for k in container)
    if isinstance(container, str):
        return str(item).lower() in container.lower()
    return False


def _ordered(a: Any, b: Any, op: str) -> bool:
    na, nb = _number(a), _number(b)
    if na is not None and nb is not None and not _versions(a, b):
        return {">": na > nb, ">=": na >= nb, "<": na < nb, "<=": na <= nb}[op]
    left, right = version_key(a), version_key(b)
    if not left or not right:
        return False
    return {">": left > right, ">=": left >= right, "<": left < right, "<=": left <= right}[op]


def satisfied(constraint: Constraint, node: NodeRecord) -> bool:
    """Whether ``node`` meets ``constraint``."""
    value = resolve(node, constraint.attribute)
    op, want = constraint.operator, constraint.value
    if op == "exists":
        return value is not None
    if op == "not_exists":
        return value is None
    if value is None:
        return op == "!="
    if op == "==":
        return _contains(value, want) if isinstance(value, list) and not isinstance(want, list) else _equal(value, want)
    if op == "!=":
        return not (_contains(value, want) if isinstance(value, list) else _equal(value, want))
    if op == "contains":
        return _contains(value, want)
    if op == "contains_all":
        return all(_contains(value, w) for w in want)
    if op == "contains_any":
        return any(_contains(value, w) for w in want)
    if op == "in":
        if isinstance(value, list):
            return any(_contains(want, v) for v in value)
        return _contains(want, value)
    return _ordered(value, want, op)
