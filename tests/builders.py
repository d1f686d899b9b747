"""Small builders for node records and blueprints used across the tests."""

from __future__ import annotations

from typing import Any

from mn_prefect.model.blueprint import Blueprint, parse_blueprint
from mn_prefect.model.node import NodeRecord


def gpu(id: str, index: int, memory: float = 16384, *, vendor: str = "nvidia", driver: str = "cuda",
        caps: tuple[str, ...] = ("fp16",), free: float | None = None, api: str | None = "12.4") -> dict:
    return {"id": id, "index": index, "kind": "gpu", "vendor": vendor, "driver": driver, "model": f"{vendor}-{memory:g}",
            "memory_total_mb": memory, "memory_free_mb": memory if free is None else free, "api_version": api,
            "capabilities": list(caps)}


def node(name: str, cpu: float = 8, memory: float = 16384, disk: float = 100_000, devices: list | None = None,
         **extra: Any) -> NodeRecord:
    return NodeRecord.model_validate({"name": name, "cpu_cores": cpu, "memory_mb": memory, "disk_mb": disk,
                                      "devices": devices or [], **extra})


def agent(node_id: str = "w", resources: dict | None = None, **extra: Any) -> dict:
    return {"node_id": node_id, "agent_type": "executor", "config": {"command": ["true"]},
            "resources": resources or {}, **extra}


def blueprint(*agents: dict, policies: dict | None = None, **top: Any) -> Blueprint:
    raw = {"job_name": "test", "nodes": list(agents) or [agent()], "edges": [], "policies": policies or {}, **top}
    parsed, issues = parse_blueprint(raw)
    assert not issues, issues
    assert parsed is not None
    return parsed


def one(resources: dict, **policies: Any) -> Blueprint:
    return blueprint(agent("w", resources), policies=policies)


def json_paths(obj: Any, prefix: tuple = ()):
    """Every path into a JSON value, the value itself (``()``) first: keys of objects, indexes of lists."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from json_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from json_paths(v, prefix + (i,))
