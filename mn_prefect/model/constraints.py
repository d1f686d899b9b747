"""Placement constraints: a capability string or ``{attribute, operator, value}`` (docs/scheduling.md)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mn_prefect.model.issues import Issues, child
from mn_prefect.model.scalars import shown, too_long_digits, type_name

OPERATORS = ("==", "!=", "contains", "contains_all", "contains_any", "in", "exists", "not_exists",
             ">", ">=", "<", "<=")
_ALIASES = {"=": "==", "is": "==", "not": "!=", "is_set": "exists", "is_not_set": "not_exists"}
NO_VALUE = ("exists", "not_exists")
LIST_VALUE = ("contains_all", "contains_any", "in")
ORDERED = (">", ">=", "<", "<=")


class Constraint(BaseModel):
    """One node requirement; evaluated by the scheduler against a node record."""

    model_config = ConfigDict(frozen=True)

    attribute: str = Field(description="capabilities, node, status, role, profiles, os, arch, labels.<key>, or a dotted path.")
    operator: str = Field("==", description="==, !=, contains, contains_all, contains_any, in, exists, not_exists, >, >=, <, <=")
    value: Any = Field(None, description="What the attribute is compared with.")

    def describe(self) -> str:
        if self.operator in NO_VALUE:
            return f"{self.attribute} {self.operator}"
        return f"{self.attribute} {self.operator} {self.value!r}"

    def key(self) -> tuple[str, str, Any]:
        value = tuple(self.value) if isinstance(self.value, list) else self.value
        return (self.attribute, self.operator, value)


def parse_constraints(raw: Any, path: str, issues: Issues) -> list[Constraint]:
    """Parse a list of constraints; malformed entries are reported with their path."""
    if raw is None:
        return []
    if isinstance(raw, (str, dict)):
        raw = [raw]
    if not isinstance(raw, list):
        issues.add(path, f"must be a list of constraints, got {type_name(raw)}")
        return []
    out = []
    for i, item in enumerate(raw):
        parsed = parse_constraint(item, child(path, i), issues)
        if parsed is not None:
            out.append(parsed)
    return out


def _unbounded(value: Any) -> bool:
    """A value the scheduler could not compare: an infinite or NaN number, or an integer or a run of digits past any
    real version part (reading one past Python's digit limit raises); inside a list or object too."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, list):
        return any(_unbounded(v) for v in value)
    if isinstance(value, dict):
        return any(_unbounded(k) or _unbounded(v) for k, v in value.items())
    return too_long_digits(value)


def parse_constraint(raw: Any, path: str, issues: Issues) -> Constraint | None:
    if isinstance(raw, str):
        if not raw.strip():
            issues.add(path, "a capability constraint must not be empty")
            return None
        return Constraint(attribute="capabilities", operator="contains", value=raw.strip().lower())
    if not isinstance(raw, dict):
        issues.add(path, f"must be a capability string or an object, got {type_name(raw)}")
        return None
    ok = True
    attribute = raw.get("attribute")
    if not isinstance(attribute, str) or not attribute.strip():
        issues.add(child(path, "attribute"), "is required and must be a non-empty string")
        ok = False
    operator = raw.get("operator", "==")
    operator = _ALIASES.get(operator, operator) if isinstance(operator, str) else operator
    if operator not in OPERATORS:
        issues.add(child(path, "operator"), f"unknown operator {shown(raw.get('operator'))} (allowed: {', '.join(OPERATORS)})")
        ok = False
    value = raw.get("value")
    if ok and operator not in NO_VALUE:
        if "value" not in raw or value is None:
            issues.add(child(path, "value"), f"is required for operator {operator!r}")
            ok = False
        elif operator in LIST_VALUE:
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list) or not value:
                issues.add(child(path, "value"), f"must be a non-empty list for operator {operator!r}")
                ok = False
        elif isinstance(value, (dict, list)) and operator != "==" and operator != "!=":
            issues.add(child(path, "value"), f"must be a string or number for operator {operator!r}")
            ok = False
        elif operator in ORDERED and (isinstance(value, bool) or not isinstance(value, (int, float, str))):
            issues.add(child(path, "value"), f"must be a number or version for operator {operator!r}")
            ok = False
        if ok and operator not in NO_VALUE and _unbounded(value):
            issues.add(child(path, "value"), "must hold finite numbers and versions of at most 64 digits a part "
                                             "(numbers and versions are compared as such)")
            ok = False
    if not ok:
        return None
    assert isinstance(attribute, str)  # ok is False otherwise
    return Constraint(attribute=attribute.strip(), operator=operator, value=value)
