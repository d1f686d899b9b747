"""Attach a resource request to a flow, so deploying it carries the request into ``job_variables``.

    @requires(gpu=1, memory_gb=16, ports=[{"label": "api"}])
    @flow
    def train(): ...

    train.deploy("train", work_pool_name="lab")   # job_variables["resources"] = the request

The request is validated when the module is imported (a typo fails at once, naming the field).
With ``prefect deploy``, write the same request under ``job_variables.resources`` in prefect.yaml.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from mn_prefect.model.resources import resource_request

F = TypeVar("F")


def requires(resources: dict[str, Any] | None = None, **aliases: Any) -> Callable[[F], F]:
    raw = {**(resources or {}), **aliases}
    resource_request(raw)  # raises InvalidInput with every problem, each named by its path

    def attach(flow_obj: F) -> F:
        setattr(flow_obj, "mn_resources", raw)  # noqa: B010 (F declares no such attribute: mypy would refuse it)
        for method in ("deploy", "to_deployment"):
            original = getattr(flow_obj, method, None)
            if original is not None:
                setattr(flow_obj, method, _with_resources(original, raw))
        return flow_obj

    return attach


def _with_resources(method: Callable, raw: dict[str, Any]) -> Callable:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any):
        job_variables = dict(kwargs.get("job_variables") or {})
        job_variables.setdefault("resources", raw)
        kwargs["job_variables"] = job_variables
        return method(*args, **kwargs)

    return call
