"""Where a polled run goes: ``Router`` reads the run's job configuration, places it (on any node of the pool's
group, inside its reservation, or a system run on every node where it fits, with a copy for each), or finds the
node it was placed or booked on; a run that fits nowhere waits or fails (``decisions.wait_or_fail``). The worker
that created a booking announces it. ``put_back``: a run whose worker stopped while launching it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prefect.states import Failed, Scheduled
from pydantic import ValidationError

from mn_prefect.model import run_tags
from mn_prefect.model.constraints import parse_constraints
from mn_prefect.model.estimates import Estimate, duration_words
from mn_prefect.model.grace import above_pool_maximum
from mn_prefect.model.issues import Issues
from mn_prefect.model.placement import Placement, Plan
from mn_prefect.model.states import TERMINAL_RUN_STATES
from mn_prefect.placement.estimates import deployment_key, estimate_for
from mn_prefect.placement.fair_share import read_usage
from mn_prefect.placement.holding import (
    StandingHold,
    end_hold,
    hold_message,
    hold_needed,
    make_hold,
    place_over,
    read_holds,
    running_of,
)
from mn_prefect.placement.placing import Placer, PlaceResult
from mn_prefect.placement.reservations import ReservationError, place_inside
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.fairshare import capacity_of, precedence, standings
from mn_prefect.scheduler.plan import SYSTEM_JOB_TYPES
from mn_prefect.scheduler.quotas import RunQueue
from mn_prefect.store.base import ClusterStore, placed_topic
from mn_prefect.store.records import FlowRunRecord, get_record, put_record
from mn_prefect.worker import decisions, metrics, system, visibility
from mn_prefect.worker.api_retries import call_with_retries
from mn_prefect.worker.decisions import Fail, Release
from mn_prefect.worker.pool_rules import PoolRules
from mn_prefect.worker.preempting import Preempter
from mn_prefect.worker.releasing import Releaser
from mn_prefect.worker.route import Backfill, HoldFacts, MakeHold, PlaceOver, capacity_wait, route
from mn_prefect.worker.sweeps import InStore
from mn_prefect.worker.variables import MNJobConfiguration, SystemCopyVariable


def invalid_configuration(error: ValidationError) -> str:
    """The failure message of a run whose job variables do not make a job configuration, every problem named."""
    problems = []
    for item in error.errors(include_url=False):
        where = ".".join(str(part) for part in item["loc"])
        problems.append(item["msg"] if item["type"] == "resources" else f"job_variables.{where}: {item['msg']}")
    return "invalid resource request: " + "; ".join(problems)


def _remember_run(store, flow_run, config: MNJobConfiguration, placement: Placement) -> None:
    """What the reconciler needs to know of a placed run after its node is lost; reschedules so far are kept."""
    job_id = str(flow_run.id)
    earlier = get_record(store, job_id, FlowRunRecord)
    deployment, flow = (getattr(flow_run, key, None) for key in ("deployment_id", "flow_id"))  # usage's labels
    put_record(store, FlowRunRecord(job_id=job_id, name=flow_run.name, job_type=config.job_type,
                                    recovery_mode=config.recovery_mode, node=placement.node, status="placed",
                                    reschedules_ms=earlier.reschedules_ms if earlier else [],
                                    queue=placement.queue,
                                    deployment_id=str(deployment) if deployment else None,
                                    flow_id=str(flow) if flow else None,
                                    tags=sorted(getattr(flow_run, "tags", None) or ()),
                                    preemption_grace_s=config.preemption_grace_seconds if config.preemptible else None,
                                    lost_gpu_s=earlier.lost_gpu_s if earlier else 0.0,
                                    lost_cpu_s=earlier.lost_cpu_s if earlier else 0.0,
                                    preempted_checkpointed=earlier.preempted_checkpointed if earlier else 0,
                                    preempted_killed=earlier.preempted_killed if earlier else 0))


def run_queue(name: str | None, config: MNJobConfiguration, tag_priority: int | None = None) -> RunQueue | None:
    """The work queue ``name`` the run came from, with its priority (its own, else its tags' in the pool's policy,
    else the queue's) and preemptibility: the queue is charged for it."""
    if not name:
        return None
    priority = config.priority if config.priority is not None else tag_priority
    return RunQueue(name=name, priority=priority, preemptible=config.preemptible,
                    min_runtime_s=config.min_runtime_seconds)


def copy_of(flow_run, config: MNJobConfiguration | None) -> SystemCopyVariable | None:
    """What makes a run the copy of a system run on one node (None for any other run). Read from the run's
    job variables too: a worker that did not place the run may hold no configuration of it."""
    return system.copy_marker(config.system_copy if config is not None else None, flow_run.job_variables)


@dataclass
class Remembered:
    """What the worker keeps of the runs it places, by run id: the job configuration, when it was first seen
    waiting, and the waiting reason last reported."""

    configs: dict[Any, MNJobConfiguration] = field(default_factory=dict)
    first_seen: dict[Any, float] = field(default_factory=dict)
    waiting_reason: dict[Any, str] = field(default_factory=dict)
    failed_placing: dict[Any, str] = field(default_factory=dict)  # the last placement error said of a run

    def forget(self, run_id) -> None:
        """A run whose booking is released: its configuration and first sight are forgotten."""
        self.configs.pop(run_id, None)
        self.first_seen.pop(run_id, None)
        self.failed_placing.pop(run_id, None)


class Router:
    """Places the pool's runs from node ``node``'s worker. ``client``, ``work_pool`` and ``template`` (the pool's
    base job template) are read at each use; ``start_soon`` starts a side task in the worker's task group;
    ``is_announcer``: whether this worker holds the pool's announcer lease."""

    def __init__(self, *, store: ClusterStore, placer: Placer, node: str, in_store: InStore, remembered: Remembered,
                 releaser: Releaser, client: Callable[[], Any], work_pool: Callable[[], Any],
                 template: Callable[[], dict], start_soon: Callable[..., Any],
                 is_announcer: Callable[[], Awaitable[bool]], logger: Any, run_logger: Callable[[Any], Any]):
        self._store, self._placer, self._node, self._in_store = store, placer, node, in_store
        self._remembered, self._releaser = remembered, releaser
        self._client, self._work_pool, self._template = client, work_pool, template
        self._start_soon, self._is_announcer = start_soon, is_announcer
        self._logger, self._run_logger = logger, run_logger
        self._deployments: dict[Any, tuple[float, dict]] = {}
        self._heads: set[str | None] = set()  # this poll: the queues (None: the pool) whose head did not fit
        self._holds: dict[str, StandingHold] | None = None  # this poll: the holds standing, by held run
        self._put_back_ids: set[Any] = set()
        self.preempter = Preempter(store=store, placer=placer, client=client, in_store=in_store, logger=logger,
                                   run_logger=run_logger)
        self.rules = PoolRules(store=store, client=client, in_store=in_store, work_pool=work_pool)

    async def _deployment_variables(self, deployment_id) -> dict:
        cached = self._deployments.get(deployment_id)
        if cached is None or time.monotonic() - cached[0] > 10:
            deployment = await self._client().read_deployment(deployment_id)
            cached = (time.monotonic(), deployment.job_variables or {})
            self._deployments[deployment_id] = cached
        return cached[1]

    async def _configuration(self, flow_run) -> MNJobConfiguration:
        """The run's job configuration for placement: the pool template with the deployment's and the run's
        job variables (deployments are cached briefly: one read per deployment, not per run)."""
        config = self._remembered.configs.get(flow_run.id)
        if config is None:
            values = dict(await self._deployment_variables(flow_run.deployment_id)) if flow_run.deployment_id else {}
            values.update(flow_run.job_variables or {})
            config = await MNJobConfiguration.from_template_and_values(
                base_job_template=self._template(), values=values, client=self._client())
            self._remembered.configs[flow_run.id] = config
        return config

    async def in_order(self, entries: list) -> list:
        """The polled runs in the order they are offered capacity (scheduler/fairshare.py): priority (the run's,
        else its queue's), then its queue's fair-share standing, then how long it has waited. Every worker sorts
        the same runs alike, so whichever places them, the run that should go next does."""
        self.rules.forget()  # a poll begins: the pool's policy as it is now
        self._heads, self._holds = set(), None  # and the heads of its lines, the holds standing, found anew
        metrics.poll_began(self._placer.group or "", [entry.flow_run for entry in entries])
        if len(entries) < 2:
            return entries
        try:
            queues, shares = await self._in_store(self._standings)
            keys = {entry.flow_run.id: await self._precedence(entry.flow_run, queues, shares) for entry in entries}
        except Exception as error:  # the store or the API is away (the pool's policy, a run's queue, read on the
            # way): Prefect's order, and placement reports the outage; raised, it would end the worker
            self._logger.warning("could not order the runs (Prefect's order this poll): %s: %s",
                                 type(error).__name__, error)
            return entries
        return sorted(entries, key=lambda e: keys[e.flow_run.id])

    async def _precedence(self, run, queues, shares) -> tuple[int, float, float, str]:
        try:
            priority = (await self._configuration(run)).priority
        except ValidationError:
            priority = None  # placement fails it with the reason
        if priority is None:
            priority = await self.rules.tag_priority(run)
        since = run.expected_start_time or run.created
        return precedence(str(run.id), await self.rules.queue_of(run), priority, since.timestamp() if since else 0.0,
                          queues, shares)

    def _standings(self):
        queues = self._store.queues()
        if not queues.queues:
            return queues, {}
        view = self._placer.view
        return queues, standings(queues, capacity_of(view.nodes), read_usage(self._store))

    async def _run_queue(self, flow_run, config: MNJobConfiguration) -> RunQueue | None:
        return run_queue(await self.rules.queue_of(flow_run), config, await self.rules.tag_priority(flow_run))

    async def placement_node(self, flow_run) -> str | None:
        """The node this run is placed on, placing it now if nobody has; None while it waits."""
        job_id = str(flow_run.id)
        existing = await self._in_store(self._store.active_placements, job_id=job_id)
        if existing and not await self._placed_on_lost_node(flow_run, existing):
            self._remembered.waiting_reason.pop(flow_run.id, None)  # placed (by any worker): nothing more to report
            self._remembered.first_seen.pop(flow_run.id, None)
            metrics.settled(self._placer.group or "", flow_run)
            return await self._system_run_node(flow_run, existing) if system.is_system(existing) else existing[0].node
        try:
            config = await self._configuration(flow_run)
        except ValidationError as error:  # what the server's schema cannot say (e.g. gpu disagreeing with devices)
            message = invalid_configuration(error)
            self._run_logger(flow_run).error(message)
            await self._client().set_flow_run_state(flow_run.id, Failed(message=message), force=True)
            return None
        if config.booking:
            return await self._booked_node(flow_run, config.booking)
        refused = await self.rules.refusal(flow_run)
        if refused is None and config.preemptible:
            refused = above_pool_maximum(config.preemption_grace_seconds,
                                         (await self.rules.policy()).max_preemption_grace_s)
        if refused is not None:  # the pool's deny-list, a grace above its maximum: nothing is booked
            return await self._unless_failed(flow_run, Fail(f"mn: {refused}"))
        copy = copy_of(flow_run, config)
        if copy is not None:
            return await self._copy_node(flow_run, copy)
        issues = Issues()
        # The image is for the runtime driver that starts the run, not a placement criterion.
        request = config.resources.request()
        constraints = parse_constraints(config.constraints, "job_variables.constraints", issues)
        logger = self._run_logger(flow_run)
        if issues:
            message = "invalid resource request: " + "; ".join(str(i) for i in issues.items)
            logger.error(message)
            await self._client().set_flow_run_state(flow_run.id, Failed(message=message), force=True)
            return None
        ask = Ask(agent_id=flow_run.name or job_id, source_agent_id=flow_run.name, request=request,
                  constraints=tuple(constraints), preferred_node=config.preferred_node)
        if config.reservation:
            result = await self._place_inside(flow_run, config, ask)
            if result is None:
                return None
        elif config.job_type in SYSTEM_JOB_TYPES:
            return await self._place_system(flow_run, config, ask)
        else:
            queue = await self._run_queue(flow_run, config)
            estimate = await self._estimate(flow_run, config)
            ends_by = time.time() + estimate.seconds if estimate.seconds is not None else None
            result = await self._in_store(self._placer.place, job_id, [ask], strategy=config.strategy, queue=queue,
                                          update={"ends_by": ends_by} if ends_by is not None else None)
            if not result.placed and not (result.commit is not None and result.commit.conflict is not None
                                          and result.commit.conflict.job_booked):
                result = await self._head_of_line(flow_run, config, ask, queue, result, estimate.seconds, ends_by)
        metrics.placing(self._placer.group or "", flow_run, result)  # latency, conflicts, whether it waits
        commit = result.commit
        if commit is not None and commit.ok:  # result.placed
            placement = commit.placements[0]
            if not commit.already_committed:  # this call created the booking: announce it, once
                await self._end_own_hold(flow_run, placement)
                await self._in_store(_remember_run, self._store, flow_run, config, placement)
                self._start_soon(self._announce, flow_run, placement)  # off the placement path
            return placement.node
        if commit is not None and commit.conflict is not None and commit.conflict.job_booked:
            existing = await self._in_store(self._store.active_placements, job_id=job_id)
            return existing[0].node if existing else None
        queue = await self._run_queue(flow_run, config)
        if queue is not None and result.plan.status == "runnable_later" and await self._is_announcer():
            await self.preempter.make_room(flow_run, ask, queue, config.strategy)  # it starts once they stopped
        await self._wait_or_fail(flow_run, config, result.plan)
        return None

    # -- head-of-line holds and backfill (docs/scheduling.md, "Holds and backfill") ---------------------------

    async def _estimate(self, flow_run, config: MNJobConfiguration) -> Estimate:
        """The run's runtime estimate: declared, else its flow's timeout, else learned from its deployment's runs."""
        key = deployment_key(flow_run.deployment_id) if flow_run.deployment_id else None
        try:
            return await self._in_store(estimate_for, self._store, key, declared=config.max_runtime_seconds,
                                        timeout=config.flow_timeout_seconds, is_limit=config.max_runtime_is_limit)
        except Exception as error:  # the store is away: no estimate (it never takes held capacity)
            self._logger.warning("could not read run %s's runtime estimate: %s", flow_run.id, error)
            return Estimate(seconds=None, source="unknown")

    async def _standing_holds(self) -> dict[str, StandingHold]:
        if self._holds is None:
            self._holds = await self._in_store(read_holds, self._store, self._placer.group)
        return self._holds

    async def _head_of_line(self, flow_run, config: MNJobConfiguration, ask: Ask, queue: RunQueue | None,
                            result: PlaceResult, estimate_s: float | None, ends_by: float | None) -> PlaceResult:
        """A run that did not fit: the route's answer (worker/route.py) carried out. It may land over its own hold
        or as a backfill (the result then is that placement), get a hold, or wait; a held run's plan says its hold."""
        job_id, scope = str(flow_run.id), queue.name if queue is not None else None
        policy = await self.rules.policy()
        # a run that never fits, or waits for its quota or a port, is no head: no hold, and the next one may be
        head = scope not in self._heads and result.plan.status != "not_runnable" and capacity_wait(result.plan.reason)
        if head:
            self._heads.add(scope)
        if not policy.holds:
            return result
        holds = await self._standing_holds()
        now = time.time()
        facts = HoldFacts(plan_status=result.plan.status, estimate_s=estimate_s, now=now, own=holds.get(job_id),
                          standing=tuple(h for run, h in holds.items() if run != job_id and h.queue == scope),
                          head=head, decider=await self._is_announcer(), max_holds=policy.max_holds,
                          reason=result.plan.reason)
        step = route(facts)
        pool = self._work_pool()
        if isinstance(step, PlaceOver):
            over = await self._in_store(place_over, self._placer, job_id, [ask], step.hold, strategy=config.strategy,
                                        queue=queue, ends_by=ends_by)
            if over.placed:
                await self._end_hold(step.hold, "covered")
                visibility.emit_hold(visibility.HOLD_COVERED, flow_run.id, flow_run.name, step.hold, pool)
                return over
            return await self._held(result, step.hold)
        if isinstance(step, Backfill):
            for hold in step.holds:
                over = await self._in_store(place_over, self._placer, job_id, [ask], hold, strategy=config.strategy,
                                            queue=queue, ends_by=ends_by)
                if over.placed:
                    visibility.emit_hold(visibility.HOLD_BACKFILLED, hold.run_id, None, hold, pool,
                                         backfilled_run=job_id, ends_by=ends_by)
                    return over
            step = step.then
        if isinstance(step, MakeHold) and not await self._in_store(hold_needed, self._placer, [ask]):
            self._heads.discard(scope)  # it starts when one booking ends: the next run that did not fit is the head
            return result
        if isinstance(step, MakeHold):
            for old in step.replacing:
                await self._end_hold(old, "lost the head of the line")
                visibility.emit_hold(visibility.HOLD_RELEASED, old.run_id, None, old, pool,
                                     why=f"run {job_id} is ahead of it in line")
            made = await self._in_store(make_hold, self._placer, job_id, [ask], queue=scope)
            if made is not None:
                holds[job_id] = made
                start = "unknown" if made.expected_start is None else \
                    f"in about {duration_words(max(0.0, made.expected_start - now))}"
                self._run_logger(flow_run).info("mn: holding capacity on %s for this run (expected start %s)",
                                                ", ".join(made.nodes), start)
                visibility.emit_hold(visibility.HOLD_CREATED, flow_run.id, flow_run.name, made, pool)
                return await self._held(result, made)
        return result

    async def _held(self, result: PlaceResult, hold: StandingHold) -> PlaceResult:
        """The result of a run that waits on its hold, its plan's reason saying so."""
        def words() -> str:
            self._placer.refresh()
            return hold_message(hold, self._placer.view, running_of(self._store.active_placements()), time.time())
        reason = await self._in_store(words)
        if result.plan.reason:  # and why it does not fit now, as a run without a hold says it
            reason = f"{reason} (now: {result.plan.reason})"
        return dataclasses.replace(result, plan=result.plan.model_copy(update={"status": "runnable_later",
                                                                               "reason": reason}))

    async def _end_own_hold(self, flow_run, placement: Placement) -> None:
        """A held run that was placed past its hold (capacity freed elsewhere first) gives the hold up at once: held
        capacity would otherwise stay booked for a run that runs, until the next sweep."""
        if placement.over_hold is not None:
            return  # placed over a hold: that path ends it
        own = (await self._standing_holds()).get(str(flow_run.id))
        if own is not None:
            await self._end_hold(own, f"the run was placed on {placement.node}")
            visibility.emit_hold(visibility.HOLD_RELEASED, flow_run.id, flow_run.name, own, self._work_pool(),
                                 why=f"the run was placed on {placement.node}")

    async def _end_hold(self, hold: StandingHold, why: str) -> None:
        await self._in_store(end_hold, self._placer, hold)
        if self._holds is not None:
            self._holds.pop(hold.run_id, None)
        self._logger.info("hold %s for run %s ended: %s", hold.hold_id, hold.run_id, why)

    async def _placed_on_lost_node(self, flow_run, existing: list[Placement]) -> bool:
        """Whether this still-Scheduled run was placed on a node that was lost before it started there (its worker
        died between the commit and the start): then its booking is released here, and the caller places it
        again. A system run's parts, and a run inside a reservation, stay where they are: they belong there."""
        placement = existing[0]
        if not decisions.movable(len(existing), placement.node, self._node,
                                 in_reservation=bool(placement.reservation), system_run=system.is_system(existing)):
            return False
        stored = await self._in_store(self._store.get_node, placement.node)
        status = stored.record.status if stored is not None else "offline"
        decision = decisions.off_lost_node(status)
        if not isinstance(decision, Release):
            return False
        await self._releaser.release_off_lost_node(flow_run, placement.node, status, decision.why)
        return True

    async def _place_inside(self, flow_run, config: MNJobConfiguration, ask: Ask) -> PlaceResult | None:
        """Place the run inside its reservation (docs/operating.md, "Reservations with expiry"); None when the run was
        failed: the reservation cannot be used (unknown, wrong key, ended), or the run could never fit in what it
        holds."""
        rid, system_run = config.reservation or "", config.job_type in SYSTEM_JOB_TYPES
        result, error = None, None
        if not system_run:
            try:
                result = await self._in_store(place_inside, self._store, str(flow_run.id), [ask], rid,
                                              config.reservation_key, strategy=config.strategy,
                                              group=self._placer.group)
            except ReservationError as refused:
                error = str(refused)
        refusal = decisions.inside_reservation(rid, config.job_type, system_run=system_run, error=error,
                                               plan=result.plan if result is not None else None)
        if refusal is None:
            return result
        await self._unless_failed(flow_run, refusal)
        return None

    async def booked(self, booking: dict[str, str]) -> Placement | None:
        """The placement a blueprint job booked for one of its agents (the store is the source of truth)."""
        placements = await self._in_store(self._store.active_placements, job_id=booking["job_id"])
        return next((p for p in placements if p.agent_id == booking["agent_id"]), None)

    async def _booked_node(self, flow_run, booking: dict[str, str]) -> str | None:
        placement = await self.booked(booking)
        return await self._unless_failed(flow_run, decisions.booked_node(
            placement.node if placement is not None else None, booking["job_id"], booking["agent_id"]))

    async def _unless_failed(self, flow_run, decision: str | Fail) -> str | None:
        """The node a rule chose; or, when it failed the run, None once the run is Failed with its message."""
        if not isinstance(decision, Fail):
            return decision
        self._run_logger(flow_run).error(decision.message)
        await self._client().set_flow_run_state(flow_run.id, Failed(message=decision.message), force=True)
        return None

    async def _announce(self, flow_run, placement: Placement) -> None:
        """The booking this worker created: the committed event, then what people read on the run."""
        summary = visibility.summary(placement)
        visibility.emit_placement(visibility.CREATED, flow_run.id, placement.node, summary, run_name=flow_run.name,
                                  work_pool=self._work_pool())
        self._remembered.waiting_reason.pop(flow_run.id, None)
        await self.show(flow_run, placement)

    async def show(self, flow_run, placement: Placement) -> None:
        """The placement on the run itself: one line in its logs, its location as tags and labels, and the
        ``placement`` table artifact (not on the lifecycle flows' runs: run_tags.OPS_TAG)."""
        self._run_logger(flow_run).info("%s", visibility.log_line(placement))
        client = self._client()
        try:
            await client.update_flow_run(flow_run.id, tags=run_tags.with_location(flow_run.tags or [], placement))
            await client.update_flow_run_labels(flow_run.id, run_tags.location_labels(placement))
            if run_tags.OPS_TAG not in (flow_run.tags or []):
                await client.create_artifact(visibility.artifact(placement, flow_run.id))
        except Exception as error:  # visibility must not block the run
            self._logger.warning("could not show run %s's placement on it: %s", flow_run.id, error)

    # -- system and sysbatch runs: one copy per node (mn_prefect.worker.system) ----------------------------

    async def own_placement(self, flow_run, config: MNJobConfiguration | None) -> Placement | None:
        """The placement this worker runs the run with: a copy's part of its system run's booking, else the
        run's own placement on this node."""
        copy = copy_of(flow_run, config)
        held = await self._in_store(self._store.active_placements,
                                    job_id=copy.job_id if copy is not None else str(flow_run.id))
        if copy is not None:
            return system.part(held, copy)
        return next((p for p in held if p.node == self._node), None)

    async def _place_system(self, flow_run, config: MNJobConfiguration, ask: Ask) -> str | None:
        """Book one copy of the run on every node of the group where it fits, in one commit under the run's id;
        the run itself runs on the first of them (``system.origin_node``), and the copies for the others are
        created after (``_fan_out``). Where none fits now, the run waits like any other."""
        job_id = str(flow_run.id)
        await self._in_store(self._placer.refresh)  # a stale view would leave out a node that has room by now
        result = await self._in_store(self._placer.place, job_id, [ask], job_type=config.job_type,
                                      strategy=config.strategy, explain=True,
                                      queue=await self._run_queue(flow_run, config))
        metrics.placing(self._placer.group or "", flow_run, result)
        commit = result.commit
        if commit is not None and commit.ok:  # result.placed
            placements = commit.placements or list(result.plan.placements)
            origin = system.origin_node(placements)
            if not commit.already_committed:  # this call created the booking: record it, make the copies, once
                try:
                    own = next(p for p in placements if p.node == origin)
                    await self._in_store(_remember_run, self._store, flow_run, config, own)
                finally:  # the copies are made even when the record could not be written (the sweep copes)
                    self._start_soon(self._fan_out, flow_run, config, placements, result.plan)
            return origin
        if commit is not None and commit.conflict is not None and commit.conflict.job_booked:
            existing = await self._in_store(self._store.active_placements, job_id=job_id)
            return await self._system_run_node(flow_run, existing) if existing else None
        await self._wait_or_fail(flow_run, config, result.plan)
        return None

    async def _fan_out(self, flow_run, config: MNJobConfiguration, placements: list[Placement], plan: Plan) -> None:
        """After this worker committed a system run's booking: create the copy for each other node, and announce
        the run's own part and each copy's (beside, so that a slow artifact never delays a copy). A copy that
        cannot be created gives its part back at once."""
        job_id, origin = str(flow_run.id), system.origin_node(placements)
        logger = self._run_logger(flow_run)
        created: list[str] = []
        try:
            logger.info("%s", system.fan_out_message(config.job_type, placements, origin, plan))
            self._start_soon(self._announce, flow_run, next(p for p in placements if p.node == origin))
            for placement in sorted((p for p in placements if p.node != origin), key=lambda p: p.node):
                create = functools.partial(self._client().create_flow_run_from_deployment,
                                           **system.copy_request(flow_run, placement))
                try:  # sent again after a transient error: the idempotency key makes it one run
                    copy = await call_with_retries(create, what="create_flow_run_from_deployment", logger=self._logger)
                except Exception as error:
                    logger.error("mn: could not create the copy for %s (%s); its part of the booking is released",
                                 placement.node, error)
                    await self._releaser.release_part(job_id, placement.node,
                                                      f"its copy could not be created: {error}", "not_started",
                                                      run_id=flow_run.id, run_name=flow_run.name)
                    continue
                if copy.state is not None and copy.state.type in TERMINAL_RUN_STATES:  # made for an earlier booking
                    await self._releaser.release_part(job_id, placement.node, f"its copy {copy.id} ran already",
                                                      "run_ended", run_id=copy.id, run_name=copy.name)
                    continue
                logger.info("mn: copy %s (%s) runs on %s", copy.name, copy.id, placement.node)
                self._start_soon(self._announce, copy, placement)
                created.append(placement.node)
        except Exception as error:  # the sweep releases a part whose copy was never made
            self._logger.warning("could not make every copy of system run %s: %s", job_id, error)
        if created:  # booked before they existed: wake their nodes' workers now, not at their next poll
            await self._in_store(self._store.announce, [placed_topic(node) for node in created])

    async def _system_run_node(self, flow_run, existing: list[Placement]) -> str | None:
        """The node a placed system run itself runs on (its copies run on the others): the one its record names,
        else the first of its booking's nodes. None, and the run fails, once its part there was released."""
        record = await self._in_store(get_record, self._store, str(flow_run.id), FlowRunRecord)
        node = record.node if record is not None else system.origin_node(existing)
        return await self._unless_failed(flow_run, decisions.system_run_node(node, [p.node for p in existing]))

    async def _copy_node(self, flow_run, copy: SystemCopyVariable) -> str | None:
        """A copy runs on the node its marker names while its system run's booking still holds its part there."""
        placements = await self._in_store(self._store.active_placements, job_id=copy.job_id)
        return await self._unless_failed(flow_run, decisions.copy_node(
            copy.node, copy.job_id, part_held=system.part(placements, copy) is not None))

    async def _wait_or_fail(self, flow_run, config: MNJobConfiguration, plan) -> None:
        """A run that fits nowhere stays Scheduled with the reason as its state message; the pool's announcer
        reports each distinct reason once (a log line, a waiting event) and fails runs no node can ever take
        (at once, or after ``not_runnable_timeout_seconds`` with ``wait_for_new_nodes``: decisions.wait_or_fail).
        Every other worker stays quiet."""
        if not await self._is_announcer():
            return
        remembered = self._remembered
        first = remembered.first_seen.setdefault(flow_run.id, time.monotonic())
        decision = decisions.wait_or_fail(plan, waited_s=time.monotonic() - first,
                                          timeout_s=config.not_runnable_timeout_seconds,
                                          wait_for_new_nodes=config.wait_for_new_nodes,
                                          last_reason=remembered.waiting_reason.get(flow_run.id),
                                          shown_message=flow_run.state.message if flow_run.state is not None else None)
        if isinstance(decision, Fail):
            self._run_logger(flow_run).error(decision.message)
            await self._client().set_flow_run_state(
                flow_run.id, Failed(message=decision.message[:decisions.STATE_MESSAGE_LIMIT]), force=True)
            remembered.waiting_reason.pop(flow_run.id, None)
            remembered.first_seen.pop(flow_run.id, None)
            return
        remembered.waiting_reason[flow_run.id] = decision.reason
        if decision.announce:
            self._run_logger(flow_run).warning("mn: waiting to be placed (%s)", decision.reason)
            visibility.emit_waiting(flow_run, {"status": plan.status, "reason": plan.reason,
                                               "agents": plan.agents}, work_pool=self._work_pool())
        if not decision.show:
            return
        # Said once in the logs and events, but kept on the state: Prefect's Late transition drops the message, so
        # it is set again, under the state's own name (a Late run stays Late).
        name: Any = flow_run.state.name if flow_run.state is not None and flow_run.state.is_scheduled() else None
        name = decision.state_name or name  # a never-fitting run: "Never fits", which Prefect never marks Late
        try:
            await self._client().set_flow_run_state(
                flow_run.id, Scheduled(scheduled_time=flow_run.next_scheduled_start_time or flow_run.expected_start_time,
                                       message=decision.state_message, **({"name": name} if name else {})),
                force=True)
        except Exception as error:
            self._logger.warning("could not set the waiting message on run %s: %s", flow_run.id, error)

    async def placement_failed(self, flow_run, error: BaseException) -> None:
        """Placing the run raised (a request no check caught, the store away): the run stays Scheduled and is tried
        again at the next poll, with the error as its state message; its traceback is logged once per distinct
        error, a line each poll after, and the worker goes on with the other runs."""
        message = f"mn: placement failed, tried again at each poll: {type(error).__name__}: {error}"
        message = message[:decisions.STATE_MESSAGE_LIMIT]
        logger = self._run_logger(flow_run)
        if self._remembered.failed_placing.get(flow_run.id) == message:
            logger.warning("%s", message[:500])
            return
        self._remembered.failed_placing[flow_run.id] = message
        logger.error("%s", message, exc_info=error)
        shown = flow_run.state.message if flow_run.state is not None else None
        if shown == message or flow_run.state is None or not flow_run.state.is_scheduled():
            return
        try:
            await self._client().set_flow_run_state(
                flow_run.id, Scheduled(scheduled_time=flow_run.next_scheduled_start_time or flow_run.expected_start_time,
                                       message=message, name=flow_run.state.name), force=True)
        except Exception as failure:  # the API is away: the next poll says it again
            self._logger.warning("could not set the placement error on run %s: %s", flow_run.id, failure)

    # -- a stop while launching -------------------------------------------------------------------------

    async def put_back(self, flow_run) -> None:
        """The worker stopped while launching this run. Never Running (no flow code ran): back to Scheduled
        for any worker, its booking released (a blueprint agent's booking belongs to its job, which keeps
        it; a system run's part, or its copy's, waits for its node). Already over: only released. Running: left
        alone (the worker's teardown says why)."""
        if flow_run.id in self._put_back_ids:
            return  # both the submission and the launch task may be stopped mid-way: judge the run once
        self._put_back_ids.add(flow_run.id)
        try:
            run = await self._client().read_flow_run(flow_run.id)
            state = run.state.type if run.state is not None else None
            config = self._remembered.configs.get(flow_run.id)
            agent = config is not None and bool(config.booking)
            copy, placement = (None, None) if agent else (copy_of(flow_run, config),
                                                          await self.own_placement(flow_run, config))
            decision = decisions.stopped_launch(
                state, node=self._node, agent=agent,
                system_part=placement is not None and (copy is not None or placement.locality == "system"))
            if decision.schedule is not None:
                await self._client().set_flow_run_state(flow_run.id, Scheduled(message=decision.schedule), force=True)
                self._logger.info("put run %s back to Scheduled: its worker stopped before starting it", flow_run.id)
            if decision.release_part is not None and placement is not None:
                await self._releaser.release_run(flow_run, placement, copy, decision.release_part.why,
                                                 decision.release_part.because)
            elif decision.release is not None:
                await self._releaser.release(flow_run.id, decision.release.why, decision.release.because,
                                             run_name=flow_run.name)
        except Exception as error:
            self._logger.warning("could not put run %s back to Scheduled: %s", flow_run.id, error)
