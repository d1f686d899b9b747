"""The probes of a node's services declared with a check (``ServiceInstance.check``): ``ServiceProbes`` probes
each at its interval and writes the node's record when a status changes (``health.service_status`` is the rule).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio

from mn_prefect import events
from mn_prefect.lifecycle import health
from mn_prefect.model.node import NodeRecord, ServiceInstance
from mn_prefect.store.base import ClusterStore
from mn_prefect.worker.sweeps import InStore


class ServiceProbes:
    """The service probes of ``node`` (its record as registered); ``published``: told each record written."""

    def __init__(self, *, store: ClusterStore, node: NodeRecord, in_store: InStore, logger: Any,
                 published: Callable[[NodeRecord], None]):
        self._store, self._node, self._in_store = store, node, in_store
        self._logger, self._published = logger, published

    async def run(self, scope: anyio.CancelScope) -> None:
        """Probe each of this node's services declared with a check every ``interval_s`` (the first probe at once)
        and, when a status changes, write the node's record with the new ``services`` (``health.service_status``
        is the rule). The record is re-registered from the store's own copy, so the node's state and eligibility,
        which others change, are kept."""
        services = list(self._node.services)
        name = self._node.name
        checked = [i for i, service in enumerate(services) if service.check is not None]
        tallies = {i: health.Tally(limit=services[i].failures_to_critical) for i in checked}
        due = dict.fromkeys(checked, time.monotonic())
        failures: dict[int, str | None] = {}  # the last probe's, by index in services

        async def one(i: int) -> None:
            failures[i] = await health.probe_service(services[i])

        unsaved = False
        with scope:
            while True:
                await anyio.sleep(max(0.0, min(due.values()) - time.monotonic()))
                now = time.monotonic()
                ready = [i for i in checked if due[i] <= now]
                async with anyio.create_task_group() as probes:  # a slow service does not delay the others
                    for i in ready:
                        probes.start_soon(one, i)
                for i in ready:
                    due[i] = now + services[i].interval_s
                    status = health.service_status(services[i].status, tallies[i], failures[i])
                    if status != services[i].status:
                        events.service_state(name, services[i].name, status, from_status=services[i].status,
                                             reason=failures[i])
                        services[i] = services[i].model_copy(update={"status": status})
                        unsaved = True
                        self._logger.info("service %s on node %s is %s%s", services[i].name, name, status,
                                          f" ({failures[i]})" if failures[i] is not None else "")
                if unsaved:
                    unsaved = not await self.publish(services)

    async def publish(self, services: list[ServiceInstance]) -> bool:
        """Write this node's record with ``services``; whether it was written (a store that did not answer is
        tried again after the next probe)."""
        name = self._node.name

        def publish() -> NodeRecord | None:
            stored = self._store.get_node(name)
            if stored is None:
                return None
            return self._store.register_node(stored.record.model_copy(update={"services": services}))

        try:
            record = await self._in_store(publish)
        except Exception as error:
            self._logger.warning("could not write node %s's service status: %s", name, error)
            return False
        if record is not None:
            self._published(record)
        return True
