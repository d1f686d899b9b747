"""Attach a resource request to a flow, so deploying it carries the request into ``job_variables``.

    @requires(gpu=1, memory_gb=16, ports=[{"label": "api"}], max_runtime_s=3600)
    @flow(timeout_seconds=7200)
    def train(): ...

    train.deploy("train", work_pool_name="lab")   # job_variables["resources"] = the request

The request is validated when the module is imported (a typo fails at once, naming the field). ``max_runtime_s``
(seconds) becomes the job variable ``max_runtime_seconds``, the run's declared runtime estimate, and
``max_runtime_is_limit=True`` makes it a limit the worker stops the run at; ``preemption_grace_s`` is how long a
preempted run has to checkpoint (``preemption_grace_seconds``, mn_prefect.preemption). The flow's own ``timeout_seconds``
(Prefect keeps it on the flow object, where the worker cannot read it) travels as ``flow_timeout_seconds``: the
estimate when none is declared. With ``prefect deploy``, write the same under ``job_variables`` in prefect.yaml.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from mn_prefect.model.estimates import read_max_runtime
from mn_prefect.model.grace import read_grace
from mn_prefect.model.issues import InvalidInput, Issues
from mn_prefect.model.resources import resource_request
from mn_prefect.model.scalars import type_name

F = TypeVar("F")


def requires(resources: dict[str, Any] | None = None, *, max_runtime_s: Any = None, max_runtime_is_limit: Any = False,
             preemption_grace_s: Any = None, **aliases: Any) -> Callable[[F], F]:
    """The decorator: ``resources`` and ``aliases`` the request, ``max_runtime_s`` the declared runtime in seconds
    (a positive number of at most ten years), ``max_runtime_is_limit`` whether the run is stopped at it,
    ``preemption_grace_s`` how long a preempted run has to checkpoint (job variable ``preemption_grace_seconds``).
    Raises InvalidInput naming every bad field."""
    raw = {**(resources or {}), **aliases}
    issues = Issues()
    try:
        resource_request(raw)
    except InvalidInput as invalid:
        for issue in invalid.issues:
            issues.add(issue.path, issue.message)
    seconds = read_max_runtime(max_runtime_s, "max_runtime_s", issues)
    grace = read_grace(preemption_grace_s, "preemption_grace_s", issues)
    if not isinstance(max_runtime_is_limit, bool):
        issues.add("max_runtime_is_limit", f"must be true or false, got {type_name(max_runtime_is_limit)}")
    elif max_runtime_is_limit and max_runtime_s is None:
        issues.add("max_runtime_is_limit", "is true, but max_runtime_s is not set (the limit needs its seconds)")
    issues.raise_if_any()
    runtime: dict[str, Any] = {}
    if seconds is not None:
        runtime["max_runtime_seconds"] = seconds
    if max_runtime_is_limit:
        runtime["max_runtime_is_limit"] = True
    if grace is not None:
        runtime["preemption_grace_seconds"] = grace

    def attach(flow_obj: F) -> F:
        timeout = getattr(flow_obj, "timeout_seconds", None)
        flow_runtime = dict(runtime)
        if timeout is not None:  # Prefect's own flow option (a float, or None when unset)
            found = Issues()
            flow_runtime["flow_timeout_seconds"] = read_max_runtime(timeout, "timeout_seconds", found)
            found.raise_if_any()
        setattr(flow_obj, "mn_resources", raw)  # noqa: B010 (F declares no such attribute: mypy would refuse it)
        for method in ("deploy", "to_deployment"):
            original = getattr(flow_obj, method, None)
            if original is not None:
                setattr(flow_obj, method, _with_resources(original, raw, flow_runtime))
        return flow_obj

    return attach


def _with_resources(method: Callable, raw: dict[str, Any], runtime: dict[str, Any]) -> Callable:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any):
        job_variables = dict(kwargs.get("job_variables") or {})
        job_variables.setdefault("resources", raw)
        for name, value in runtime.items():
            job_variables.setdefault(name, value)
        kwargs["job_variables"] = job_variables
        return method(*args, **kwargs)

    return call
