"""Every release the worker does, in one place: ``Releaser`` gives back a run's booking, a system run's part on one
node, a run placed on a lost node before it started, and deallocates a running run whose health check failed.
Each says why (the one released event, a log line); the store's release calls of the worker are all here. A
completed run's release also teaches its deployment's runtime estimate how long the booking was held
(``mn_prefect.placement.estimates``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelling

from mn_prefect import events, notify
from mn_prefect.lifecycle import health
from mn_prefect.model.placement import Placement
from mn_prefect.placement import bookings, estimates
from mn_prefect.placement.bookings import Why
from mn_prefect.placement.placing import Placer
from mn_prefect.store.base import ClusterStore, Event
from mn_prefect.worker import decisions, visibility
from mn_prefect.worker.decisions import Deallocate
from mn_prefect.worker.sweeps import InStore
from mn_prefect.worker.variables import MNJobConfiguration, SystemCopyVariable


class Releaser:
    """The releases of the worker of node ``node``. ``client`` and ``work_pool`` are read at each use (as in
    ``Sweeps``); ``forget``: drops what the worker cached of a run (its configuration, when it was first seen)
    once its booking is released."""

    def __init__(self, *, store: ClusterStore, placer: Placer, node: str, in_store: InStore,
                 client: Callable[[], Any], work_pool: Callable[[], Any], logger: Any,
                 run_logger: Callable[[Any], Any], forget: Callable[[Any], None]):
        self._store, self._placer, self._node, self._in_store = store, placer, node, in_store
        self._client, self._work_pool = client, work_pool
        self._logger, self._run_logger, self._forget = logger, run_logger, forget

    async def release(self, flow_run_id, why: str, because: Why, *, run_name: str | None = None) -> None:
        """Release run ``flow_run_id``'s booking (a blueprint agent's is its job's, never released here), saying
        ``why``; ``because`` is what the owner's release rule is asked."""
        count = await self._in_store(self._placer.release, bookings.FlowRun(str(flow_run_id)), why=because)
        self._forget(flow_run_id)
        if count:  # this call released the booking: the one released event
            visibility.emit_placement(visibility.RELEASED, flow_run_id, self._node, {"reason": why},
                                      run_name=run_name, work_pool=self._work_pool())
            self._logger.info("released the booking of run %s on %s (%s)", flow_run_id, self._node, why)
            if because == "run_ended":
                await self.learn_runtime(flow_run_id, str(flow_run_id))

    async def release_run(self, flow_run, placement: Placement, copy: SystemCopyVariable | None, why: str,
                          because: Why) -> None:
        """A run is over: its booking is released, or for a system run or one of its copies its node's part."""
        if copy is None and placement.locality != "system":
            await self.release(flow_run.id, why, because, run_name=flow_run.name)
            return
        self._forget(flow_run.id)
        await self.release_part(copy.job_id if copy is not None else str(flow_run.id), placement.node, why, because,
                                run_id=flow_run.id, run_name=flow_run.name)

    async def release_part(self, job_id: str, node: str, why: str, because: Why, *, run_id,
                           run_name: str | None = None) -> None:
        """Release system run ``job_id``'s part on ``node``: the copies on other nodes keep theirs, and the
        booking is gone with its last part."""
        def release() -> int:
            count = bookings.release(self._store, bookings.FlowRun(job_id), because, node=node)
            if count:
                self._placer.refresh()  # the placer's view still holds the part (it releases whole bookings only)
            return count

        if await self._in_store(release):  # this call released it: the one released event
            visibility.emit_placement(visibility.RELEASED, run_id, node, {"reason": why, "booking": job_id},
                                      run_name=run_name, work_pool=self._work_pool())
            self._logger.info("released the part on %s of run %s's booking (%s)", node, job_id, why)
            if because == "run_ended":
                await self.learn_runtime(run_id, job_id)

    async def learn_runtime(self, flow_run_id, booking: str) -> float | None:
        """Run ``flow_run_id`` ended and this worker just released ``booking`` (its own, or its part of a system
        run's): when the run completed, how long the booking was held is recorded under its deployment's key (a
        failed, crashed or cancelled run is no sample). The seconds recorded, or None. Never raises: an estimate
        that misses a sample is still an estimate."""
        try:
            run = await self._client().read_flow_run(flow_run_id)
            key = estimates.run_key(run)
            if key is None or run.state is None or run.state.type != StateType.COMPLETED:
                return None
            return await self._in_store(estimates.record_held, self._store, key, booking)
        except Exception as error:
            self._logger.debug("did not record the runtime of run %s: %s", flow_run_id, error)
            return None

    async def release_off_lost_node(self, flow_run, node: str, status: str, why: str) -> None:
        """Release the booking of a still-Scheduled run placed on ``node``, lost (``status``) before the run
        started there; the caller places it again."""
        released = await self._in_store(self._placer.release, bookings.FlowRun(str(flow_run.id)), why="node_lost")
        if released:
            self._run_logger(flow_run).warning(
                "mn: this run was placed on %s, which is %s before the run started there: placing it again",
                node, status)
            events.placement("released", node, str(flow_run.id), reason=why, run_id=flow_run.id,
                             run_name=flow_run.name)

    async def watch_health(self, flow_run, configuration: MNJobConfiguration, placement: Placement,
                           copy: SystemCopyVariable | None, checks: anyio.CancelScope) -> None:
        """Probe the running run (``health.watch``) until it ends (``checks`` is cancelled) or fails its check
        ``failures_to_deallocate`` times in a row: then it is deallocated."""
        job_id, check = str(flow_run.id), configuration.health
        if check is None:
            return

        async def unhealthy(tally: health.Tally) -> None:
            if tally.failures == 1:  # said once per run of failures, not at every probe
                events.allocation("unhealthy", job_id, node_name=placement.node, reason=tally.last,
                                  held=visibility.summary(placement), data={"failures": tally.failures})
            self._run_logger(flow_run).warning("mn: health check failed (%d of %d): %s", tally.failures,
                                               tally.limit, tally.last)

        async def started() -> bool:
            try:
                state = (await self._client().read_flow_run(flow_run.id)).state
            except Exception:  # the API is away: the failure counts, as it would for a started run
                return True
            return state is not None and state.type != StateType.PENDING

        verdict = None
        with checks:
            verdict = await health.watch(check, placement.port(check.port_label), unhealthy, started)
        decision = decisions.deallocation(verdict, owned=not configuration.booking)
        if verdict is not None and isinstance(decision, Deallocate):
            with anyio.CancelScope(shield=True):  # the run's end (which this causes) must not cut it short
                await self._deallocate(flow_run, placement, copy, verdict, decision)

    async def _deallocate(self, flow_run, placement: Placement, copy: SystemCopyVariable | None, verdict: str,
                          decision: Deallocate) -> None:
        """A run that failed its health check: cancelled, its booking released (a blueprint agent's stays with its
        job), and said in the store's event log, as a Prefect event and as a DEALLOCATION notification."""
        job_id, message = str(flow_run.id), decision.message
        self._run_logger(flow_run).error("%s; cancelling the run and releasing its booking", message)
        try:
            await self._client().set_flow_run_state(flow_run.id, Cancelling(message=message[:5000]), force=True)
        except Exception as error:  # released all the same: the run's end releases nothing twice
            self._logger.warning("could not cancel unhealthy run %s: %s", job_id, error)
        if decision.release:
            await self.release_run(flow_run, placement, copy, verdict, "health_check")
        await self._in_store(self._store.record_event, Event(kind="allocation.deallocated", node=placement.node,
                                                             job_id=job_id, reason=verdict))
        events.allocation("deallocated", job_id, node_name=placement.node, reason=verdict,
                          held=visibility.summary(placement))
        notify.publish("DEALLOCATION", "mn.allocation.deallocated", node=placement.node, job_id=job_id,
                       reason=verdict)
