"""A pool's own rules for its runs (model/pool_policy.py): the deny-list and the default priority by tag, read from
the store's ``PoolPolicyRecord`` (``mn-prefect queue policy``) once per poll (``forget`` at its start)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mn_prefect.model.pool_policy import PoolPolicy
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import PoolPolicyRecord, get_record, pool_policy_id
from mn_prefect.worker.sweeps import InStore

FRESH_SECONDS = 5.0


class PoolRules:
    def __init__(self, *, store: ClusterStore, client: Callable[[], Any], in_store: InStore,
                 work_pool: Callable[[], Any]):
        self._store, self._client, self._in_store, self._work_pool = store, client, in_store, work_pool
        self._policy: tuple[float, PoolPolicy] | None = None
        self._names: dict[Any, str] = {}  # deployment or flow id -> its name

    def forget(self) -> None:
        """A poll begins: the policy is read again when it is next needed."""
        self._policy = None

    async def policy(self) -> PoolPolicy:
        if self._policy is None or time.monotonic() - self._policy[0] > FRESH_SECONDS:
            pool = self._work_pool()
            record = await self._in_store(get_record, self._store, pool_policy_id(pool.name), PoolPolicyRecord) \
                if pool is not None else None
            self._policy = (time.monotonic(), record.policy if record is not None else PoolPolicy())
        return self._policy[1]

    async def refusal(self, flow_run) -> str | None:
        """Why the pool refuses this run (its deny-list), or None; names are read only when a rule needs them."""
        policy = await self.policy()
        if not policy.deny:
            return None
        subjects = {rule.subject for rule in policy.deny}
        flow = await self._flow_name(flow_run.flow_id) if "flow" in subjects else None
        deployment = None
        if "deployment" in subjects and flow_run.deployment_id is not None:
            deployment = f"{flow or await self._flow_name(flow_run.flow_id)}/" \
                         f"{await self._deployment_name(flow_run.deployment_id)}"
        return policy.refusal(deployment=deployment, flow=flow, tags=flow_run.tags or ())

    async def tag_priority(self, flow_run) -> int | None:
        return (await self.policy()).priority_for(flow_run.tags or ())

    async def queue_of(self, flow_run) -> str | None:
        """The run's work queue by name (the worker's poll answers with its id only for some runs)."""
        name = getattr(flow_run, "work_queue_name", None)
        queue_id = getattr(flow_run, "work_queue_id", None)
        if name or queue_id is None:
            return name
        if queue_id not in self._names:
            self._names[queue_id] = (await self._client().read_work_queue(queue_id)).name
        return self._names[queue_id]

    async def _flow_name(self, flow_id) -> str:
        if flow_id not in self._names:
            self._names[flow_id] = (await self._client().read_flow(flow_id)).name
        return self._names[flow_id]

    async def _deployment_name(self, deployment_id) -> str:
        if deployment_id not in self._names:
            self._names[deployment_id] = (await self._client().read_deployment(deployment_id)).name
        return self._names[deployment_id]
