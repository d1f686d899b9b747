"""Planning a whole job: gang placement, system expansion, and refusals (docs/scheduling.md).

``plan_job`` is a pure function: (blueprint, nodes, active placements, strategy, limits) -> Plan.
"""

from __future__ import annotations

from collections.abc import Iterable

from mn_prefect.model.blueprint import Blueprint
from mn_prefect.model.bookings import copy_agent
from mn_prefect.model.hints import env_hints
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Allocation, PlacedResources, Placement, Plan, PlanStatus
from mn_prefect.scheduler.ask import Ask, asks_for_blueprint
from mn_prefect.scheduler.columns import FleetColumns, NodeColumns
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.quotas import Queues, RunQueue
from mn_prefect.scheduler.view import Choice, ClusterView

SYSTEM_JOB_TYPES = ("system", "sysbatch")

# What a placer returns: the choices (empty when the job does not fit), their locality, and per agent the
# reason each refused node gave.
PlacerResult = tuple[list[Choice], str | None, dict[str, dict[str, str]]]


def plan_job(
    blueprint: Blueprint,
    nodes: Iterable[NodeRecord] | NodeColumns | FleetColumns,
    active: Iterable[Placement] = (),
    *,
    strategy: str | None = None,
    limits: Limits | None = None,
    explain: bool = True,
    job_id: str | None = None,
    queue: RunQueue | None = None,
    queues: Queues | None = None,
) -> Plan:
    """Plan every agent of ``blueprint``; all of them are placed or none is (and, from ``queue``, within its
    quota). ``nodes``: node records, or columns (a store snapshot's ``columns``, which hold what is held there:
    ``active`` is then held on top)."""
    if not isinstance(nodes, (NodeColumns, FleetColumns)):
        nodes = list(nodes)
    return plan_asks(asks_for_blueprint(blueprint), nodes, active, job_type=blueprint.job_type,
                     strategy=strategy or blueprint.strategy, limits=limits, explain=explain, job_id=job_id,
                     queue=queue, queues=queues)


def plan_asks(
    asks: list[Ask],
    nodes: list[NodeRecord] | NodeColumns | FleetColumns,
    active: Iterable[Placement] = (),
    *,
    job_type: str = "batch",
    strategy: str = "binpack",
    limits: Limits | None = None,
    explain: bool = True,
    job_id: str | None = None,
    view: ClusterView | None = None,
    queue: RunQueue | None = None,
    queues: Queues | None = None,
) -> Plan:
    """Plan ``asks``. With ``view`` (a long-lived ClusterView), plan against it instead of building one from
    ``nodes``/``active``/``queues``; a successful plan stays booked in that view. With ``queue``, the run is
    charged to that queue: it is placed only within its quota (scheduler/quotas.py), and its placements say
    which queue, priority and preemptibility they were placed with."""
    if view is None:
        view = ClusterView(nodes, active, limits, queues)
    limits = view.limits
    placer = _place_system if job_type in SYSTEM_JOB_TYPES else _place_gang
    choices, locality, refusals = placer(view, asks, strategy, explain)
    if choices:
        assert locality is not None  # a placer names the locality whenever it places
        placements = tuple(_placement(view, c, locality, job_type, job_id) for c in choices)
        if queue is not None:
            placements = tuple(queue.stamp(p, view.queues) for p in placements)
            refused = _over_quota(view, queue.name, placements)
            if refused is not None:
                _unbook_all(view, choices)
                return Plan(status=refused[0], job_type=job_type, strategy=strategy, placements=(),
                            reason=refused[1], agents={})
        return Plan(status="runnable_now", job_type=job_type, strategy=strategy, placements=placements,
                    reason=_success_reason(view, choices, locality), agents=refusals if explain else {})
    # Would it fit the same nodes if they were empty? Then it only has to wait for capacity.
    empty = ClusterView(view.fleet.columns, (), limits)
    later, _, _ = placer(empty, asks, strategy, False)
    status: PlanStatus = "runnable_later" if later else "not_runnable"
    return Plan(status=status, job_type=job_type, strategy=strategy, placements=(),
                reason=_refusal_reason(status, refusals), agents=refusals)


def _over_quota(view: ClusterView, queue: str, placements: tuple[Placement, ...]) -> tuple[PlanStatus, str] | None:
    """The plan's status and reason when the queue's quota refuses it, else None (and the queue is charged)."""
    queues = view.queues
    if queues is None:
        return None
    amounts = queues.amounts(queue, placements)
    never = queues.never(queue, amounts)
    if never is not None:
        return "not_runnable", never
    why = queues.reason(queue, amounts)
    if why is not None:
        return "runnable_later", why
    queues.add(queue, amounts)
    return None


def _place_gang(view: ClusterView, asks: list[Ask], strategy: str, explain: bool) -> PlacerResult:
    """service/batch: all agents on one node if possible, else agent by agent; all or nothing."""
    refusals: dict[str, dict[str, str]] = {a.agent_id: {} for a in asks}
    if len(asks) > 1:
        together = _colocate(view, asks, strategy)
        if together is not None:
            if explain:
                _explain_all(view, asks, refusals, together)
            return together, "job_colocated", refusals
    choices: list[Choice] = []
    for ask in asks:
        choice, tried = view.place(ask, strategy)
        if choice is None:
            # Explain this agent against the bookings of the agents already placed: that is why it failed.
            refusals[ask.agent_id] = _node_reasons(view, ask)
            _unbook_all(view, choices)
            for other in asks:
                if other is not ask:
                    refusals[other.agent_id] = _node_reasons(view, other)
            return [], None, refusals
        choices.append(choice)
        for i, why in tried.items():
            refusals[ask.agent_id][view.nodes[i].name] = why
    if explain:
        _explain_all(view, asks, refusals, choices)
    return choices, "job_colocated" if len(asks) == 1 else "agent_spillover", refusals


def _colocate(view: ClusterView, asks: list[Ask], strategy: str) -> list[Choice] | None:
    idx, scores, _ = view.candidates(asks, strategy)
    if not len(idx):
        return None
    order = sorted(range(len(idx)), key=lambda p: (-scores[p], p))
    preferred = next((a.preferred_node for a in asks if a.preferred_node), None)
    preferred_i = view.index.get(preferred) if preferred else None
    order.sort(key=lambda p: idx[p] != preferred_i)  # stable: the preferred node first
    for pos in order:
        i = int(idx[pos])
        choices = _all_on_node(view, asks, i)
        if choices is not None:
            for choice in choices:
                choice.score = float(scores[pos])
                if choice.ask.preferred_node:
                    choice.preferred = "honored" if view.nodes[i].name == choice.ask.preferred_node else "fallback"
            return choices
    return None


def _all_on_node(view: ClusterView, asks: list[Ask], i: int) -> list[Choice] | None:
    """Book every ask on node ``i`` or nothing (bookings of a failed attempt are undone)."""
    choices: list[Choice] = []
    for ask in asks:
        info = view.static_info(ask)
        why = view.explain(i, ask) if not info.mask[i] else None
        choice = None
        if why is None:
            r = ask.request
            implied = int(info.implied_gpu[i])
            if view.capacity_reason(i, r.cpu_cores, r.memory_mb, r.disk_mb, r.gpu_count + implied) is None:
                choice, _ = view.try_node(i, ask, implied)
        if choice is None:
            _unbook_all(view, choices)
            return None
        view.book_choice(choice)
        choices.append(choice)
    return choices


def _place_system(view: ClusterView, asks: list[Ask], strategy: str, explain: bool) -> PlacerResult:
    """system/sysbatch: one copy of the whole group on every node where the group fits."""
    refusals: dict[str, dict[str, str]] = {a.agent_id: {} for a in asks}
    choices: list[Choice] = []
    for i, node in enumerate(view.nodes):
        copies = [Ask(agent_id=copy_agent(a.agent_id, node.name), source_agent_id=a.agent_id, request=a.request,
                      constraints=a.constraints, profile=a.profile, services=a.services) for a in asks]
        placed = _all_on_node(view, copies, i)
        if placed is not None:
            for choice in placed:
                choice.score = 1.0
            choices.extend(placed)
            continue
        for ask, copy in zip(asks, copies, strict=True):
            why = view.explain(i, copy)
            refusals[ask.agent_id][node.name] = why or "the agent group does not fit together"
    return choices, "system", refusals


def _node_reasons(view: ClusterView, ask: Ask) -> dict[str, str]:
    out = {}
    for i, node in enumerate(view.nodes):
        why = view.explain(i, ask)
        if why is not None:
            out[node.name] = why
    return out


def _unbook_all(view: ClusterView, choices: list[Choice]) -> None:
    for choice in reversed(choices):
        assert choice.token is not None  # every choice here was booked
        view.unbook(choice.token)


def _explain_all(view: ClusterView, asks: list[Ask], refusals: dict[str, dict[str, str]],
                 choices: list[Choice]) -> None:
    """After success, record why other nodes were not usable (against the state before this plan)."""
    _unbook_all(view, choices)
    for ask in asks:
        refusals[ask.agent_id].update(_node_reasons(view, ask))
    for choice in choices:
        view.book_choice(choice)


def _placement(view: ClusterView, choice: Choice, locality: str, job_type: str, job_id: str | None) -> Placement:
    request = choice.ask.request
    placement = Placement(
        agent_id=choice.ask.agent_id,
        source_agent_id=choice.ask.source_agent_id or choice.ask.agent_id,
        node=view.nodes[choice.node].name,
        resources=PlacedResources(cpu_cores=request.cpu_cores, memory_mb=request.memory_mb,
                                  disk_mb=request.disk_mb, gpu_count=choice.gpu),
        allocation=Allocation(devices=tuple(choice.devices), shares=tuple(choice.shares), ports=tuple(choice.ports),
                              volumes=tuple(choice.volumes), runtime_driver=choice.runtime_driver),
        locality=locality,
        score=round(choice.score, 6),
        preferred=choice.preferred,
        job_id=job_id,
    )
    return placement.model_copy(update={"env": env_hints(placement)})


def _success_reason(view: ClusterView, choices: list[Choice], locality: str) -> str:
    nodes = sorted({view.nodes[c.node].name for c in choices})
    return f"{len(choices)} placement(s) on {', '.join(nodes)} ({locality})"


def _refusal_reason(status: str, refusals: dict[str, dict[str, str]]) -> str:
    parts = []
    for agent_id, per_node in refusals.items():
        if per_node:
            detail = "; ".join(f"{node}: {why}" for node, why in sorted(per_node.items())[:5])
            more = f"; +{len(per_node) - 5} more" if len(per_node) > 5 else ""
            parts.append(f"{agent_id}: {detail}{more}")
    head = "waiting for capacity" if status == "runnable_later" else "no node can ever take this job"
    if not parts:
        return f"{head}: no nodes"
    return f"{head} ({' | '.join(parts)})"
