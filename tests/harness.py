"""The worker's parts in one process, for its rules: the real ``Router``, ``Releaser``, ``Sweeps`` and ``Preempter``
of each node over a real SQLite store file, with Prefect replaced at the lowest level the worker meets it, its
client (``FakePrefect``: a table of flow runs, deployments and the states proposed). A wait, a put-back, a sweep or
a release is tested here in milliseconds; each capability keeps an end-to-end test through a real Prefect server
and real worker processes (tests/lab.py).

What a poll does (``Node.poll``) is what ``MNWorker._submit_scheduled_flow_runs`` does: the pool's Scheduled runs in
Prefect's order, put in the pool's order, each placed or told to wait; the runs placed on the node are returned
(the worker would start them). Store calls run inline (the worker runs them in a thread, one at a time)."""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
from prefect.client.schemas.objects import FlowRun, State, StateType
from prefect.client.schemas.responses import OrchestrationResult, SetStateStatus, StateAcceptDetails
from prefect.exceptions import ObjectNotFound
from prefect.states import Completed, Pending, Running, Scheduled

from mn_prefect import events
from mn_prefect.model.node import NodeRecord
from mn_prefect.placement.placing import Placer
from mn_prefect.store import open_store
from mn_prefect.worker.releasing import Releaser
from mn_prefect.worker.routing import Remembered, Router
from mn_prefect.worker.sweeps import Sweeps
from mn_prefect.worker.worker import MNWorker

log = logging.getLogger("mn-test-harness")


class FakePrefect:
    """Prefect's client as the worker's parts call it: flow runs (real ``FlowRun`` objects) and deployments kept in
    dicts; every state the worker sets is kept, in order, in ``states``."""

    def __init__(self, pool: str):
        self.pool = pool
        self.work_pool = SimpleNamespace(id=uuid.uuid4(), name=pool,
                                         base_job_template=MNWorker.get_default_base_job_template())
        self.runs: dict[uuid.UUID, FlowRun] = {}
        self.deployments: dict[uuid.UUID, SimpleNamespace] = {}
        self.states: list[tuple[uuid.UUID, State]] = []
        self.artifacts: list[Any] = []
        self.flow_id = uuid.uuid4()

    # -- what a test does, as a user or as Prefect ----------------------------------------------------------

    def deploy(self, job_variables: dict | None = None, name: str | None = None) -> uuid.UUID:
        deployment_id = uuid.uuid4()
        self.deployments[deployment_id] = SimpleNamespace(id=deployment_id, name=name or f"d-{deployment_id.hex[:6]}",
                                                          job_variables=job_variables or {}, flow_id=self.flow_id)
        return deployment_id

    def run(self, deployment: uuid.UUID | None = None, *, job_variables: dict | None = None,
            state: State | None = None, name: str | None = None, tags: tuple[str, ...] = (),
            queue: str = "default", waited_s: float = 0.0, idempotency_key: str | None = None,
            infrastructure_pid: str | None = None) -> FlowRun:
        """A flow run of the pool (Scheduled unless ``state`` says otherwise), expected ``waited_s`` ago."""
        run_id = uuid.uuid4()
        now = datetime.now(UTC)
        run = FlowRun(id=run_id, name=name or f"run-{run_id.hex[:6]}", flow_id=self.flow_id, deployment_id=deployment,
                      job_variables=job_variables or {}, tags=list(tags), work_queue_name=queue,
                      work_pool_name=self.pool, expected_start_time=now - timedelta(seconds=waited_s), created=now,
                      idempotency_key=idempotency_key, infrastructure_pid=infrastructure_pid,
                      state=_stamped(state or Scheduled()))
        self.runs[run_id] = run
        return run

    def set(self, run_id: uuid.UUID, state: State, *, age_s: float | None = None) -> None:
        """The run moves to ``state`` (as its flow process or a user would move it), ``age_s`` ago if given."""
        if age_s is not None:
            state = state.model_copy(update={"timestamp": datetime.now(UTC) - timedelta(seconds=age_s)})
        self.runs[run_id] = self.runs[run_id].model_copy(update={"state": _stamped(state)})

    def patch(self, run_id: uuid.UUID, **fields: Any) -> None:
        """Fields of the run as a worker's update sets them (``infrastructure_pid``, ``tags``...)."""
        self.runs[run_id] = self.runs[run_id].model_copy(update=fields)

    def state(self, run_id: uuid.UUID) -> State:
        state = self.runs[run_id].state
        assert state is not None
        return state

    def said(self, run_id: uuid.UUID) -> list[State]:
        """The states the worker set on ``run_id``, in order."""
        return [state for rid, state in self.states if rid == run_id]

    def delete(self, run_id: uuid.UUID) -> None:
        del self.runs[run_id]

    def scheduled(self) -> list[SimpleNamespace]:
        """The pool's Scheduled runs as a poll lists them: the ones expected earliest first."""
        runs = [r for r in self.runs.values() if r.state is not None and r.state.type == StateType.SCHEDULED]
        return [SimpleNamespace(flow_run=r) for r in sorted(runs, key=lambda r: r.expected_start_time)]

    # -- the client's calls ----------------------------------------------------------------------------------

    async def read_flow_run(self, run_id) -> FlowRun:
        run = self.runs.get(uuid.UUID(str(run_id)))
        if run is None:
            raise ObjectNotFound(http_exc=Exception(f"flow run {run_id} not found"))
        return run

    async def set_flow_run_state(self, run_id, state: State, force: bool = False) -> OrchestrationResult:
        run_id = uuid.UUID(str(run_id))
        if run_id not in self.runs:
            raise ObjectNotFound(http_exc=Exception(f"flow run {run_id} not found"))
        self.states.append((run_id, state))
        self.set(run_id, state)
        return OrchestrationResult(state=state, status=SetStateStatus.ACCEPT, details=StateAcceptDetails())

    async def read_flow_runs(self, *, flow_run_filter=None, work_pool_filter=None, limit: int | None = None,
                             **_: Any) -> list[FlowRun]:
        runs = list(self.runs.values())
        if work_pool_filter is not None and work_pool_filter.name is not None:
            runs = [r for r in runs if r.work_pool_name in work_pool_filter.name.any_]
        if flow_run_filter is not None:
            if flow_run_filter.state is not None and flow_run_filter.state.type is not None:
                kinds = set(flow_run_filter.state.type.any_)
                runs = [r for r in runs if r.state is not None and r.state.type in kinds]
            if flow_run_filter.idempotency_key is not None:
                keys = set(flow_run_filter.idempotency_key.any_)
                runs = [r for r in runs if r.idempotency_key in keys]
            if flow_run_filter.id is not None and flow_run_filter.id.any_ is not None:
                ids = {uuid.UUID(str(i)) for i in flow_run_filter.id.any_}
                runs = [r for r in runs if r.id in ids]
        return runs[:limit] if limit else runs

    async def read_deployment(self, deployment_id) -> SimpleNamespace:
        found = self.deployments.get(uuid.UUID(str(deployment_id)))
        if found is None:
            raise ObjectNotFound(http_exc=Exception(f"deployment {deployment_id} not found"))
        return found

    async def read_work_pool(self, name: str) -> SimpleNamespace:
        if name != self.pool:
            raise ObjectNotFound(http_exc=Exception(f"work pool {name} not found"))
        return self.work_pool

    async def read_work_queue(self, queue_id) -> SimpleNamespace:
        return SimpleNamespace(id=queue_id, name="default")

    async def read_flow(self, flow_id) -> SimpleNamespace:
        return SimpleNamespace(id=flow_id, name="probe")

    async def create_flow_run_from_deployment(self, deployment_id, *, idempotency_key: str | None = None,
                                              job_variables: dict | None = None, name: str | None = None,
                                              tags=None, state: State | None = None, **_: Any) -> FlowRun:
        if idempotency_key is not None:
            for run in self.runs.values():
                if run.idempotency_key == idempotency_key:
                    return run
        return self.run(deployment_id, job_variables=job_variables, name=name, tags=tuple(tags or ()), state=state,
                        idempotency_key=idempotency_key)

    async def create_artifact(self, artifact) -> Any:
        self.artifacts.append(artifact)
        return artifact

    async def update_flow_run(self, flow_run_id, **fields: Any) -> None:
        run_id = uuid.UUID(str(flow_run_id))
        self.runs[run_id] = self.runs[run_id].model_copy(update={k: v for k, v in fields.items() if v is not None})

    async def update_flow_run_labels(self, flow_run_id, labels: dict) -> None:
        run_id = uuid.UUID(str(flow_run_id))
        run = self.runs[run_id]
        self.runs[run_id] = run.model_copy(update={"labels": {**(run.labels or {}), **labels}})


def _stamped(state: State) -> State:
    """``state`` with the time it was entered, as the server stamps it."""
    return state.model_copy(update={"timestamp": datetime.now(UTC)}) if state.timestamp is None else state


class Node:
    """One node's worker parts, as ``MNWorker._set_up_parts`` wires them. ``announcer``: whether this worker holds
    the pool's announcer lease; ``busy``: the run ids it is submitting or running (no sweep judges them)."""

    def __init__(self, harness: Harness, name: str, *, announcer: bool = False):
        self.name, self.harness, self.announcer = name, harness, announcer
        self.busy: set[str] = set()
        store, prefect = harness.store, harness.prefect
        self.placer = Placer(store, group=harness.pool, reread="on_invalidate")
        self.remembered = Remembered()
        self._side: list[tuple[Any, tuple]] = []
        common: dict[str, Any] = dict(store=store, placer=self.placer, node=name, in_store=_inline,
                                      client=lambda: prefect, work_pool=lambda: prefect.work_pool, logger=log,
                                      run_logger=lambda run: log)
        self.releaser = Releaser(forget=self.remembered.forget, **common)
        self.router = Router(remembered=self.remembered, releaser=self.releaser,
                             template=lambda: prefect.work_pool.base_job_template,
                             start_soon=lambda fn, *args: self._side.append((fn, args)),
                             is_announcer=self._is_announcer, **common)
        self.sweeps = Sweeps(pool=harness.pool, busy=lambda: self.busy, release=self.releaser.release,
                             release_part=self.releaser.release_part, **common)

    async def _is_announcer(self) -> bool:
        return self.announcer

    def poll(self, *, start: bool = True) -> list[uuid.UUID]:
        """One poll: the runs it placed (or found placed) on this node, which the worker starts: with ``start``
        they are Running (their flow process has begun), else left Pending."""
        async def poll() -> list[uuid.UUID]:
            self.placer.invalidate()
            mine = []
            for entry in await self.router.in_order(self.harness.prefect.scheduled()):
                if await self.router.placement_node(entry.flow_run) == self.name:
                    mine.append(entry.flow_run.id)
            await self._side_tasks()
            return mine
        placed = anyio.run(poll)
        for run_id in placed:
            self.harness.prefect.set(run_id, Running() if start else Pending())
        return placed

    def sweep(self) -> None:
        """One pass of this node's sweeps (``Sweeps.every_few_seconds`` does it every few seconds)."""
        async def sweep() -> None:
            await self.sweeps.bookings(set(self.harness.scheduled_ids()))
            await self.sweeps.crash_lost_running()
            await self.router.preempter.node_pass(self.name)
        anyio.run(sweep)

    def pool_pass(self) -> None:
        """The pool announcer's pass (``Sweeps.every_few_seconds`` makes it every few seconds while this worker is
        the announcer; no other makes it): silent nodes, runs left Pending with no booking, fair share, the holds."""
        async def pool_pass() -> None:
            if not await self._is_announcer():
                return
            await self.sweeps.silent_nodes()
            await self.sweeps.crash_unreported_ends()
            await self.sweeps.fair_share()
            await self.sweeps.holds()
            await self.router.preempter.pool_pass()
        anyio.run(pool_pass)

    def strays(self) -> None:
        """One pass of the sweep of this node's stray flow-run processes (real processes of this machine)."""
        anyio.run(self.sweeps.stray_processes)

    def ended(self, run: FlowRun, state: State, why: str = "the run ended") -> None:
        """The run's flow process ended in ``state``: Prefect has it, and the worker releases its booking (as
        ``MNWorker.run`` does when the launch returns)."""
        self.harness.prefect.set(run.id, state)

        async def release() -> None:
            placement = (await self.router.own_placement(run, self.remembered.configs.get(run.id)))
            assert placement is not None, f"run {run.id} has no booking on {self.name}"
            await self.releaser.release_run(run, placement, None, why, "run_ended")
        anyio.run(release)

    async def _side_tasks(self) -> None:
        while self._side:
            fn, args = self._side.pop(0)
            await fn(*args)


async def _inline(fn, *args, **kwargs):
    return fn(*args, **kwargs)


class Harness:
    """A pool of ``nodes`` (node records) registered in a real SQLite store under ``home``, each with its worker's
    parts (``self.nodes[name]``); the first node's worker is the pool's announcer. Events the parts emit are kept
    in ``self.events`` as ``(event, resource id, payload)``."""

    def __init__(self, home: Path, nodes: list[NodeRecord], *, pool: str = "pool", monkeypatch=None):
        self.pool = pool
        self.store = open_store(f"sqlite:///{home / 'state.db'}")
        self.store.create_group(pool)
        for record in nodes:
            self.store.register_node(record.model_copy(update={"group": pool}))
        self.prefect = FakePrefect(pool)
        self.nodes = {record.name: Node(self, record.name, announcer=i == 0) for i, record in enumerate(nodes)}
        self.events: list[tuple[str, str, dict]] = []
        if monkeypatch is not None:
            monkeypatch.setattr(events, "emit", self._emit)

    def _emit(self, event: str, resource, related=(), payload=None) -> bool:
        self.events.append((event, resource["prefect.resource.id"], dict(payload or {})))
        return True

    def scheduled_ids(self) -> list[str]:
        return [str(e.flow_run.id) for e in self.prefect.scheduled()]

    def poll(self, *, start: bool = True) -> dict[uuid.UUID, str]:
        """Every node's worker polls once, in order: the runs placed, by the node that starts them."""
        return {run_id: name for name, node in self.nodes.items() for run_id in node.poll(start=start)}

    def end(self, run_id: uuid.UUID, state: State | None = None) -> None:
        """Run ``run_id`` ends (Completed unless ``state`` says otherwise) on the node it is booked on."""
        [placement] = self.booked(str(run_id))
        self.nodes[placement.node].ended(self.prefect.runs[run_id], state or Completed())

    def booked(self, run: FlowRun | str) -> list:
        return self.store.active_placements(job_id=str(run.id if isinstance(run, FlowRun) else run))

    def close(self) -> None:
        self.store.close()
