"""Runs of system and sysbatch deployments (docs/prefect.md): one copy per eligible node of the pool's group.

The worker (``mn_prefect.worker.worker``) carries it out; what is decided here is pure:

* the worker that places such a run plans it with its job type (a copy of its ask on every node of the group
  where it fits, placements ``<run name>@<node>``) and commits every copy under the run's id, in one commit;
* the run itself is the copy of the first of those nodes by name (``origin_node``; the run's record keeps it);
  for each other node the committing worker creates a flow run of the same deployment (``copy_request``): the
  same parameters and job variables plus ``system_copy`` naming the run, the node and the placement, so no
  worker plans it again. Its idempotency key (``copy_key``) makes sending it twice create one run, and is how
  a node's sweep finds the copy that holds its part;
* each copy runs on its node and, when it ends, releases that node's part of the booking only; the booking is
  gone when every copy has ended.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mn_prefect.model.placement import Placement, Plan
from mn_prefect.worker.variables import SystemCopyVariable

COPY_VARIABLE = "system_copy"
COPY_TAG = "mn-system-copy"


def is_system(placements: Iterable[Placement]) -> bool:
    """Whether a booking is a system plan's per-node copies (a single node's placement of a gang is not)."""
    return any(p.locality == "system" for p in placements)


def origin_node(placements: Iterable[Placement]) -> str:
    """The node the placed run itself runs on: the first node of its booking by name, so every worker that
    reads the booking, before or after the run's record is written, names the same one."""
    return min(p.node for p in placements)


def copy_key(job_id: str, node: str) -> str:
    """The idempotency key of the copy of run ``job_id`` on ``node``: one such run, however often it is sent."""
    return f"mn-system-copy:{job_id}@{node}"


def copy_marker(configured: Mapping[str, Any] | None, job_variables: Mapping[str, Any] | None) -> SystemCopyVariable | None:
    """A run's ``system_copy`` marker: from its job configuration or, on a pool whose template predates the
    variable, from its own job variables (so a copy is never planned as a new system run). ValidationError
    when it is malformed."""
    value = configured if configured is not None else (job_variables or {}).get(COPY_VARIABLE)
    return None if value is None else SystemCopyVariable.model_validate(value)


def part(placements: Iterable[Placement], marker: SystemCopyVariable) -> Placement | None:
    """The copy's placement in its run's booking: on its node, as planned; None once it was released."""
    return next((p for p in placements if p.node == marker.node and p.agent_id == marker.agent_id), None)


def copy_request(flow_run: Any, placement: Placement) -> dict[str, Any]:
    """The keyword arguments of ``create_flow_run_from_deployment`` for the copy of ``flow_run`` (a run of a
    deployment) that ``placement`` books."""
    job_id = str(flow_run.id)
    marker = SystemCopyVariable(job_id=job_id, node=placement.node, agent_id=placement.agent_id)
    tags = [*(flow_run.tags or []), COPY_TAG, f"mn-copy-of:{job_id}", f"mn-node:{placement.node}"]
    return {"deployment_id": flow_run.deployment_id, "parameters": dict(flow_run.parameters or {}),
            "name": f"{flow_run.name or job_id}@{placement.node}", "tags": list(dict.fromkeys(tags)),
            "idempotency_key": copy_key(job_id, placement.node), "work_queue_name": flow_run.work_queue_name,
            "job_variables": {**(flow_run.job_variables or {}), COPY_VARIABLE: marker.model_dump()}}


def fan_out_message(job_type: str, placements: list[Placement], origin: str, plan: Plan) -> str:
    """What the placed run's logs say: where its copies run, and why the other nodes of the group got none."""
    copies = ", ".join(sorted(p.node for p in placements if p.node != origin)) or "none"
    reasons: dict[str, str] = next(iter(plan.agents.values()), {}) if plan.agents else {}
    placed = {p.node for p in placements}
    skipped = "; ".join(f"{node}: {why}" for node, why in sorted(reasons.items()) if node not in placed)
    return (f"mn: {job_type} run: one copy per node; this run on {origin}, copies on {copies}"
            + (f"; none on {skipped}" if skipped else ""))
