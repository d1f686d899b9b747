"""Coarse resource limits: percentages of each node's capacity that may be scheduled (docs/nodes.md)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from mn_prefect.model.issues import Issues

RESOURCES = ("cpu", "memory", "gpu", "disk")


class Limits(BaseModel):
    """Percentages 1..100 per resource, cluster-wide, with optional per-node overrides."""

    model_config = ConfigDict(frozen=True)

    cpu: int = Field(100, ge=1, le=100)
    memory: int = Field(100, ge=1, le=100)
    gpu: int = Field(100, ge=1, le=100)
    disk: int = Field(100, ge=1, le=100)
    per_node: dict[str, dict[str, int]] = Field(default_factory=dict)

    def for_node(self, name: str) -> dict[str, int]:
        values = {r: getattr(self, r) for r in RESOURCES}
        values.update(self.per_node.get(name, {}))
        return values

    @staticmethod
    def scale(capacity: float, percent: int) -> float:
        return capacity * percent / 100.0

    @staticmethod
    def scale_count(count: int, percent: int) -> int:
        # GPUs are whole devices: round down.
        return math.floor(count * percent / 100.0 + 1e-9)


def parse_limits(texts: str | list[str], path: str, issues: Issues) -> Limits | None:
    """``cpu=75,memory=75,gpu=100,disk=75`` -> Limits; several texts (a repeated ``--limits``) add up, and a text
    that starts with ``NODE:`` sets that node's overrides (``node-a:cpu=100,gpu=50``)."""
    values: dict[str, int] = {}
    per_node: dict[str, dict[str, int]] = {}
    for text in [texts] if isinstance(texts, str) else texts:
        node, colon, pairs = text.partition(":") if ":" in text.split("=", 1)[0] else ("", "", text)
        node = node.strip()
        if colon and not node:
            issues.add(path, f"a node override names its node before ':', got {text!r}")
            continue
        target = per_node.setdefault(node, {}) if node else values
        where = f"{path}.{node}" if node else path
        for part in (p.strip() for p in pairs.split(",")):
            if not part:
                continue
            key, sep, raw = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in RESOURCES:
                issues.add(where, f"expected resource=percent with resource in {', '.join(RESOURCES)}, got {part!r}")
                continue
            try:
                number = int(raw.strip())
            except ValueError:
                issues.add(f"{where}.{key}", f"must be an integer percentage, got {raw.strip()!r}")
                continue
            if not 1 <= number <= 100:
                issues.add(f"{where}.{key}", f"must be between 1 and 100, got {number}")
                continue
            target[key] = number
    return Limits.model_validate({**values, "per_node": per_node}) if not issues else None
