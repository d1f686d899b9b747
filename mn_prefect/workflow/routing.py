"""Routing an emitted message over agent edges (docs/bundles.md, "Routing over agent edges"): message type match, then
edge conditions.

Condition forms: ``{expr: "${a.b} OP value"}``, ``{path, op, value}``, ``{all: [...]}``, ``{any: [...]}``,
``{not: {...}}``, or a list (all must hold); operators ``== != > >= < <= contains in exists``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from mn_prefect.workflow.manifest import AgentEdge

_EXPR = re.compile(r"^\s*\$\{([^}]+)\}\s*(==|!=|>=|<=|>|<|contains|in|exists)?\s*(.*?)\s*$")
_MISSING = object()


def lookup(scope: Any, path: str) -> Any:
    value = scope
    for part in path.strip().split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def _literal(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text.strip().strip("'\"")


def _compare(left: Any, op: object, right: Any) -> bool:
    if op == "exists":
        return left is not _MISSING and left is not None
    if left is _MISSING:
        return op == "!="
    try:
        if op in ("==", "="):
            return left == right
        if op == "!=":
            return left != right
        if op == "contains":
            return right in left if isinstance(left, (str, list, dict)) else False
        if op == "in":
            return left in right if isinstance(right, (str, list, dict)) else False
        if op == ">":
            return left > right
        if op == ">=":
            return left >= right
        if op == "<":
            return left < right
        if op == "<=":
            return left <= right
    except TypeError:
        return False
    return False


def holds(condition: Any, scope: dict[str, Any]) -> bool:
    """Whether one condition (any of the forms above) holds in ``scope``; no condition always holds."""
    if condition is None:
        return True
    if isinstance(condition, list):
        return all(holds(c, scope) for c in condition)
    if isinstance(condition, str):
        condition = {"expr": condition}
    if not isinstance(condition, dict):
        return False
    if "all" in condition:
        return all(holds(c, scope) for c in condition["all"] or [])
    if "any" in condition:
        return any(holds(c, scope) for c in condition["any"] or [])
    if "not" in condition:
        return not holds(condition["not"], scope)
    if "expr" in condition:
        match = _EXPR.match(str(condition["expr"]))
        if not match:
            return False
        path, op, value = match.group(1), match.group(2) or "exists", match.group(3)
        return _compare(lookup(scope, path), op, _literal(value))
    if "path" in condition:
        path = str(condition["path"]).removeprefix("${").removesuffix("}")
        return _compare(lookup(scope, path), condition.get("op", condition.get("operator", "==")),
                        _literal(condition.get("value")))
    return False


def route(edges: Iterable[AgentEdge], source: str, message_type: str, scope: dict[str, Any]) -> list[AgentEdge]:
    """The edges an emit of ``message_type`` from ``source`` travels on: all matches, or the first one when
    any candidate asks for ``first_match``."""
    candidates = [e for e in edges if e.from_node == source and e.message_type in (message_type, "*")]
    first_match = any(e.routing_mode == "first_match" for e in candidates)
    chosen = []
    for edge in candidates:
        if holds(edge.conditions, scope):
            chosen.append(edge)
            if first_match:
                break
    return chosen
