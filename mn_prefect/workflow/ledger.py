"""The step ledger (docs/bundles.md, "The step ledger" and the sections after it): which step is ready, what an
attempt's outcome means under its trigger rule and failure policy, retries with backoff, branch, scatter, dynamic graph
patches, and when every step is done. Pure: times are numbers handed in, messages are opaque values, decisions come back
as return values and as events appended to ``events``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from mn_prefect.workflow.manifest import PATCH_ID, StepSpec, WorkflowEdge, WorkflowSpec, find_cycle

SUCCESS = frozenset({"completed", "partial", "skipped"})
TERMINAL = SUCCESS | {"failed"}
OPEN = frozenset({"pending", "blocked"})
OPTIONAL_POLICIES = ("continue_partial", "skip")


@dataclass
class AttemptContext:
    """The workflow context a run carries (the ``mn.workflow.*`` headers of its message)."""

    step_id: str
    attempt: int | None = None
    attempt_id: str | None = None
    deadline_at: float | None = None
    idempotency_key: str | None = None
    timeout_seconds: float | None = None
    template_id: str | None = None
    region_id: str | None = None


@dataclass
class StepState:
    spec: StepSpec
    status: str = "pending"
    attempt_count: int = 0
    attempts: list[dict[str, Any]] = field(default_factory=list)
    current: AttemptContext | None = None
    retry_at: float | None = None
    last_message: Any = None
    output: Any = None
    terminal_outcome: str | None = None
    terminal_reason: str | None = None
    map_index: int | None = None
    map_item: Any = None
    inputs: Any = None  # a dynamic step's ``with``
    base: str | None = None  # the step a mapped instance was expanded from

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def succeeded(self) -> bool:
        return self.terminal_outcome == "success" or self.status == "completed"

    @property
    def failed(self) -> bool:
        return self.terminal_outcome == "failed" or self.status == "failed"

    def aliases(self) -> set[str]:
        """The outcome names an edge's ``accepts`` can match (``completed`` counts as ``done``)."""
        if self.status == "completed":
            return {"done", "completed", "success"}
        if self.status == "partial":
            return {"partial", "failed"} if self.terminal_outcome == "failed" else {"partial", "done"}
        if self.status == "skipped":
            return {"skipped", self.terminal_outcome or "skipped"}
        return {self.status}

    def as_json(self) -> dict[str, Any]:
        return {"status": self.status, "attempts": self.attempt_count, "outcome": self.terminal_outcome,
                "reason": self.terminal_reason, "output": self.output, "agent_id": self.spec.agent_id,
                **({"map_index": self.map_index} if self.map_index is not None else {}),
                **({"dynamic": True} if self.spec.dynamic else {})}


class Ledger:
    """Step states of one workflow run; ``events`` collects what happened, in order."""

    def __init__(self, spec: WorkflowSpec, run_id: str):
        self.spec = spec
        self.run_id = run_id
        self.steps: dict[str, StepState] = {s.id: StepState(s) for s in spec.steps.values()}
        self.edges: list[WorkflowEdge] = list(spec.edges)
        self.agent_to_step: dict[str, str] = {}
        for s in spec.steps.values():
            for agent_id in (s.agent_id, *s.members):  # an expanded step owns every node of its graph
                self.agent_to_step.setdefault(agent_id, s.id)
        self.events: list[dict[str, Any]] = []
        self.failure: dict[str, Any] | None = None
        self.graph_revision = 0
        self.patches: dict[str, str] = {}
        self.added_edges: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.steps)

    # -- graph ----------------------------------------------------------------------------------------

    def parents(self, step_id: str) -> list[tuple[WorkflowEdge, StepState]]:
        return [(e, self.steps[e.source]) for e in self.edges if e.target == step_id and e.source in self.steps]

    def children(self, step_id: str) -> list[str]:
        return [e.target for e in self.edges if e.source == step_id and e.target in self.steps]

    def step_for(self, agent_id: str, headers: dict[str, Any]) -> str | None:
        """The step a message to ``agent_id`` is for: its ``step_id`` header, else the agent's step."""
        named = headers.get("mn.workflow.step_id")
        if isinstance(named, str) and named in self.steps and self.owns(named, agent_id):
            return named
        return self.agent_to_step.get(agent_id)

    def owns(self, step_id: str, agent_id: str) -> bool:
        """Whether ``agent_id`` runs (part of) ``step_id``: its agent, or a node of its expanded graph."""
        spec = self.steps[step_id].spec
        return agent_id == spec.agent_id or agent_id in spec.members

    def completes(self, step_id: str, agent_id: str) -> bool:
        """Whether a successful run of ``agent_id`` may complete ``step_id`` by itself: an expanded step completes
        only at its end node (docs/bundles.md, "Steps expanded from the source format")."""
        end = self.steps[step_id].spec.end_agent_id
        return end is None or agent_id == end

    def _event(self, kind: str, step: StepState | None, now: float, **payload: Any) -> None:
        event = {"type": kind, "timestamp": now, **payload}
        if step is not None:
            event.update({"step": step.id, "step_id": step.id, "agent_id": step.spec.agent_id,
                          "status": step.status})
            if step.current is not None:
                event.update({"attempt": step.current.attempt, "attempt_id": step.current.attempt_id})
        self.events.append(event)

    # -- trigger rules --------------------------------------------------------------------------------

    def verdict(self, step: StepState) -> str:
        """``satisfied``, ``impossible`` (the step will be skipped) or ``waiting`` (the table in docs/bundles.md, "The
        step ledger")."""
        parents = self.parents(step.id)
        if not parents:
            return "satisfied"
        rule = step.spec.trigger_rule
        ps = [p for _, p in parents]
        all_terminal = all(p.terminal for p in ps)
        if rule == "all_success":
            needed = [(e, p) for e, p in parents if e.required] or parents
            ok = all(p.status in SUCCESS and p.aliases() & set(e.accepts) for e, p in needed)
            return "satisfied" if ok else "impossible" if all(p.terminal for _, p in needed) else "waiting"
        if rule == "all_done":
            return "satisfied" if all_terminal else "waiting"
        if rule == "one_done":
            return "satisfied" if any(p.terminal for p in ps) else "waiting"
        if rule == "one_success":
            ok = any(p.succeeded for p in ps)
        elif rule == "one_failed":
            ok = any(p.failed for p in ps)
        elif rule == "none_failed_min_one_success":
            ok = all_terminal and not any(p.failed for p in ps) and any(p.succeeded for p in ps)
        else:  # quorum_success
            successes = sum(p.succeeded for p in ps)
            if successes >= (step.spec.quorum or 1):
                return "satisfied"
            pending = sum(not p.terminal for p in ps)
            return "impossible" if successes + pending < (step.spec.quorum or 1) else "waiting"
        return "satisfied" if ok else "impossible" if all_terminal else "waiting"

    def trigger_body(self, step: StepState) -> dict[str, Any]:
        body = {"trigger_rule": step.spec.trigger_rule,
                "parents": [{"step_id": p.id, "status": p.status, "outcome": p.terminal_outcome, "output": p.output}
                            for _, p in self.parents(step.id)]}
        if step.inputs is not None:
            body["with"] = step.inputs
        return body

    # -- messages and attempts ------------------------------------------------------------------------

    def receive(self, step_id: str, message_id: str, message: Any, now: float, *, agent_id: str | None = None,
                attempt_id: str | None = None) -> AttemptContext | None:
        """A message for ``step_id`` is taken by ``agent_id`` (the step's agent when not named). Returns the context
        the run carries, or None when the run must not happen (the step is already over: a duplicate; or the message
        belongs to an attempt of an expanded step that is no longer current: ``attempt_id``, its sender's)."""
        step = self.steps[step_id]
        if step.terminal:
            self._event("workflow_step_duplicate_ignored", step, now, message_id=message_id)
            return None
        inner = agent_id is not None and agent_id != step.spec.agent_id
        if inner and (step.status != "running" or step.current is None
                      or attempt_id is not None and attempt_id != step.current.attempt_id):
            # A node inside an expanded step runs only within the attempt its start node opened.
            self._event("workflow_step_stale_output_ignored", step, now, message_id=message_id, agent=agent_id,
                        attempt_id=attempt_id)
            return None
        if step.status == "running" and step.current is not None:
            return step.current  # the agent runs on every message; this one does not open a new attempt
        step.last_message = message
        verdict = self.verdict(step)
        if verdict == "impossible":
            self._resolve(step, "skipped", "skipped", f"trigger rule {step.spec.trigger_rule} cannot be satisfied", now)
            return None
        if verdict == "waiting" or step.status == "retry_wait":
            if step.status != "retry_wait":
                step.status = "blocked"
                self._event("workflow_step_blocked", step, now, reason="dependencies not satisfied")
            return AttemptContext(step_id=step.id, template_id=step.spec.template_id, region_id=step.spec.region_id)
        return self._start_attempt(step, message_id, now)

    def _start_attempt(self, step: StepState, message_id: str, now: float) -> AttemptContext:
        step.attempt_count += 1
        n = step.attempt_count
        step.status, step.retry_at = "running", None
        step.current = AttemptContext(
            step_id=step.id, attempt=n, attempt_id=f"{step.id}:attempt:{n}", deadline_at=now + step.spec.timeout_seconds,
            idempotency_key=f"{self.run_id}:{step.id}:{n}:{message_id}", timeout_seconds=step.spec.timeout_seconds,
            template_id=step.spec.template_id, region_id=step.spec.region_id)
        step.attempts.append({"attempt": n, "attempt_id": step.current.attempt_id, "started_at": now,
                              "outcome": None})
        self._event("workflow_step_attempt_started", step, now)
        return step.current

    def is_current(self, step_id: str, ctx: AttemptContext | None) -> bool:
        step = self.steps.get(step_id)
        return (step is not None and ctx is not None and ctx.attempt is not None and step.status == "running"
                and step.current is not None and step.current.attempt_id == ctx.attempt_id)

    def complete(self, step_id: str, ctx: AttemptContext | None, output: Any, now: float) -> bool:
        """The attempt in ``ctx`` completed its step; stale output (another attempt) is ignored."""
        step = self.steps[step_id]
        if not self.is_current(step_id, ctx):
            self._event("workflow_step_stale_output_ignored", step, now,
                        attempt_id=ctx.attempt_id if ctx else None)
            return False
        step.output = output
        self._finish_attempt(step, "completed", now)
        self._resolve(step, "completed", "success", None, now)
        return True

    def fail_attempt(self, step_id: str, ctx: AttemptContext | None, reason: str, now: float) -> bool:
        """The attempt failed. Retries with backoff while attempts remain; then the failure policy decides.
        Returns True when the whole workflow fails."""
        step = self.steps[step_id]
        if not self.is_current(step_id, ctx):
            self._event("workflow_step_stale_output_ignored", step, now, reason=reason)
            return False
        self._finish_attempt(step, "failed", now, reason)
        spec = step.spec
        if step.attempt_count < spec.max_attempts:
            delay_ms = spec.backoff_ms * spec.backoff_multiplier ** (step.attempt_count - 1)
            step.status, step.retry_at = "retry_wait", now + delay_ms / 1000
            self._event("workflow_step_attempt_retry_scheduled", step, now, reason=reason, delay_ms=delay_ms)
            return False
        if not spec.required or spec.failure_policy in OPTIONAL_POLICIES:
            status = "skipped" if spec.failure_policy == "skip" else "partial"
            self._resolve(step, status, "failed", reason, now, handled=True)
            return False
        self._resolve(step, "failed", "failed", reason, now)
        self.failure = {"step_id": step.id, "error": reason}
        return True

    def partial(self, step_id: str, ctx: AttemptContext | None, reason: str | None, now: float) -> None:
        if self.is_current(step_id, ctx):
            self._finish_attempt(self.steps[step_id], "partial", now, reason)
            self._resolve(self.steps[step_id], "partial", "partial", reason, now)

    def skip(self, step_id: str, reason: str, now: float, *, downstream: bool = False) -> None:
        step = self.steps[step_id]
        if not step.terminal:
            self._resolve(step, "skipped", "skipped", reason, now)
        if downstream:
            for child_id in self._descendants(step_id):
                if not self.steps[child_id].terminal:
                    self._resolve(self.steps[child_id], "skipped", "skipped", f"skipped downstream of {step_id}", now)

    def _finish_attempt(self, step: StepState, outcome: str, now: float, reason: str | None = None) -> None:
        if step.attempts:
            step.attempts[-1].update({"outcome": outcome, "ended_at": now, **({"reason": reason} if reason else {})})

    def _resolve(self, step: StepState, status: str, outcome: str, reason: str | None, now: float,
                 **extra: Any) -> None:
        step.status, step.terminal_outcome, step.terminal_reason = status, outcome, reason
        step.retry_at = None
        kind = {"completed": "workflow_step_completed", "partial": "workflow_step_partial",
                "skipped": "workflow_step_skipped", "failed": "workflow_step_failed"}[status]
        self._event(kind, step, now, outcome=outcome, **({"reason": reason} if reason else {}), **extra)

    def _descendants(self, step_id: str) -> list[str]:
        seen: list[str] = []
        todo = self.children(step_id)
        while todo:
            s = todo.pop(0)
            if s not in seen:
                seen.append(s)
                todo.extend(self.children(s))
        return seen

    # -- the ledger's own deliveries --------------------------------------------------------------------

    def due(self, now: float) -> list[tuple[str, str]]:
        """Steps whose state changed by itself: ``(step_id, why)`` with why ``redeliver`` (a retry that is
        due, or a blocked step whose dependencies are now met) or ``ready`` (ready with no message yet).
        Steps that can never run are skipped here, in cascade."""
        out: list[tuple[str, str]] = []
        changed = True
        while changed:
            changed = False
            for step in self.steps.values():
                if step.status in OPEN:
                    verdict = self.verdict(step)
                    if verdict == "impossible":
                        self._resolve(step, "skipped", "skipped",
                                      f"trigger rule {step.spec.trigger_rule} cannot be satisfied", now)
                        changed = True
        for step in self.steps.values():
            if step.status == "retry_wait" and step.retry_at is not None and step.retry_at <= now:
                step.status = "queued"
                out.append((step.id, "redeliver"))
            elif step.status in OPEN and self.verdict(step) == "satisfied":
                if step.last_message is not None:
                    step.status = "queued"
                    out.append((step.id, "redeliver"))
                else:
                    out.append((step.id, "ready"))
        return out

    def queue(self, step_id: str) -> None:
        """The engine delivered ``step_id``'s synthetic trigger."""
        self.steps[step_id].status = "queued"

    def next_timer(self) -> float | None:
        times = [s.retry_at for s in self.steps.values() if s.status == "retry_wait" and s.retry_at is not None]
        times += [s.current.deadline_at for s in self.steps.values()
                  if s.status == "running" and s.current is not None and s.current.deadline_at is not None]
        return min(times) if times else None

    def expired(self, now: float) -> list[str]:
        return [s.id for s in self.steps.values() if s.status == "running" and s.current is not None
                and s.current.deadline_at is not None and s.current.deadline_at <= now]

    def all_succeeded(self) -> bool:
        return all(s.status in SUCCESS for s in self.steps.values())

    def open_steps(self) -> list[str]:
        return [s.id for s in self.steps.values() if not s.terminal]

    # -- branch, scatter, dynamic patches ---------------------------------------------------------------

    def branch(self, step_id: str, payload: dict[str, Any], now: float) -> None:
        selected = payload.get("branches", payload.get("branch"))
        selected = [selected] if isinstance(selected, str) else [s for s in selected or [] if isinstance(s, str)]
        skipped = []
        for child_id in self.children(step_id):
            if child_id not in selected and not self.steps[child_id].terminal:
                self._resolve(self.steps[child_id], "skipped", "skipped", f"not selected by branch {step_id}", now)
                skipped.append(child_id)
        # A step further down is skipped only when every one of its parents was skipped.
        frontier = list(skipped)
        while frontier:
            for grandchild in self.children(frontier.pop(0)):
                g = self.steps[grandchild]
                if not g.terminal and all(p.status == "skipped" for _, p in self.parents(grandchild)):
                    self._resolve(g, "skipped", "skipped", f"every parent was skipped (branch {step_id})", now)
                    frontier.append(grandchild)
        self._event("workflow_branch_selected", self.steps[step_id], now, selected=selected, skipped=skipped)

    def scatter(self, step_id: str, payload: dict[str, Any], now: float) -> list[tuple[str, dict[str, Any]]]:
        """Expand the target step into one mapped instance per item; returns ``(instance_id, body)`` to deliver."""
        source = self.steps[step_id]
        targets = payload.get("targets") or ([payload["target"]] if payload.get("target") else [])
        items = payload.get("items")
        limit = payload.get("max_items", 1000)
        reason = None
        if not targets or not all(isinstance(t, str) for t in targets):
            reason = "no target"
        elif not isinstance(items, list):
            reason = "items is not a list"
        elif isinstance(limit, int) and len(items) > limit:
            reason = f"{len(items)} items is more than max_items {limit}"
        elif any(t not in self.steps for t in targets):
            reason = f"unknown target {next(t for t in targets if t not in self.steps)!r}"
        elif any(self.steps[t].terminal for t in targets):
            reason = "the target step is already over"
        if reason:
            self._event("workflow_step_scatter_rejected", source, now, reason=reason)
            return []
        assert isinstance(items, list)  # reason is set otherwise
        deliveries: list[tuple[str, dict[str, Any]]] = []
        instances: dict[str, list[str]] = {t: [] for t in targets}
        for i, item in enumerate(items):
            target = self.steps[targets[i % len(targets)]]
            inst_id = f"{target.id}[{i}]"
            inst = StepState(spec=target.spec.model_copy(update={"id": inst_id}), map_index=i, map_item=item,
                             base=target.id)
            self.steps[inst_id] = inst
            instances[target.id].append(inst_id)
            deliveries.append((inst_id, {"item": item, "map_index": i}))
        for target_id, inst_ids in instances.items():
            kept = []
            for e in self.edges:
                if e.target == target_id:
                    kept += [e.model_copy(update={"id": f"{e.id}[{j}]", "target": t}) for j, t in enumerate(inst_ids)]
                elif e.source == target_id:
                    kept += [e.model_copy(update={"id": f"{e.id}[{j}]", "source": s}) for j, s in enumerate(inst_ids)]
                else:
                    kept.append(e)
            self.edges = kept
            self._resolve(self.steps[target_id], "skipped", "mapped", "expanded into mapped work items", now)
        all_ids = [i for ids in instances.values() for i in ids]
        self._event("workflow_step_scattered", source, now, count=len(all_ids), targets=targets, instance_ids=all_ids)
        return deliveries

    def patch(self, step_id: str, payload: dict[str, Any], now: float) -> list[str]:
        """Apply a ``workflow_graph_patch``; returns the ids of steps it added. Rejected patches change nothing."""
        source = self.steps[step_id]
        dynamic = self.spec.dynamic
        patch_id = payload.get("patch_id")
        content = json.dumps(payload, sort_keys=True, default=str)

        def reject(reason: str) -> list[str]:
            self._event("workflow_graph_patch_rejected", source, now, patch_id=patch_id, reason=reason)
            return []

        if dynamic is None:
            return reject("the workflow is not a dynamic_dag with dynamic.enabled")
        if not isinstance(patch_id, str) or not PATCH_ID.match(patch_id):
            return reject("patch_id must match ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
        if patch_id in self.patches:
            if self.patches[patch_id] == content:
                self._event("workflow_graph_patch_replayed", source, now, patch_id=patch_id)
                return []
            return reject("the patch id was used with other content")
        region_id = payload.get("region_id")
        region = dynamic.regions.get(region_id) if isinstance(region_id, str) else None
        if region is None:
            return reject(f"unknown region {payload.get('region_id')!r}")
        if region.controller not in (None, step_id) and source.base != region.controller:
            return reject(f"only the region's controller {region.controller!r} may patch it")
        if payload.get("base_revision", self.graph_revision) != self.graph_revision:
            return reject(f"base_revision {payload.get('base_revision')} is not the current {self.graph_revision}")
        operations = payload.get("operations")
        if not isinstance(operations, list) or not operations:
            return reject("operations must be a non-empty list")
        if len(operations) > dynamic.max_operations_per_patch:
            return reject(f"more than {dynamic.max_operations_per_patch} operations")
        if len(self.patches) >= dynamic.max_patches:
            return reject(f"more than {dynamic.max_patches} patches")
        steps, edges = dict(self.steps), list(self.edges)
        added_edges = set(self.added_edges)
        region_steps = {region.controller, region.exit} | {s.id for s in steps.values()
                                                           if s.spec.region_id == region.id}
        added: list[str] = []
        for op in operations:
            kind = op.get("op") or op.get("type") if isinstance(op, dict) else None
            if kind == "add_step":
                sid, template_id = op.get("id"), op.get("template")
                if not isinstance(sid, str) or sid in steps:
                    return reject(f"add_step: id {sid!r} is missing or taken")
                if template_id not in region.templates:
                    return reject(f"add_step: template {template_id!r} is not listed in region {region.id}")
                size = len(json.dumps(op.get("with"), default=str))
                if size > dynamic.max_instance_input_bytes:
                    return reject(f"add_step: with is {size} bytes, over {dynamic.max_instance_input_bytes}")
                template = dynamic.templates[template_id]
                base = next((s for s in self.spec.steps.values() if s.agent_id == template.get("agent_id")), None)
                agent = template.get("agent_id") or template.get("run")
                spec = (base or next(iter(self.spec.steps.values()))).model_copy(update={
                    "id": sid, "agent_id": agent, "label": template.get("label"), "dynamic": True,
                    "template_id": template_id, "region_id": region.id, "trigger_rule": "all_success", "quorum": None})
                steps[sid] = StepState(spec=spec, inputs=copy.deepcopy(op.get("with")))
                region_steps.add(sid)
                added.append(sid)
            elif kind == "remove_step":
                sid = op.get("id")
                target = steps.get(sid)
                if target is None or not target.spec.dynamic or target.status not in OPEN:
                    return reject(f"remove_step: {sid!r} is not a dynamic step that has not started")
                del steps[sid]
                edges = [e for e in edges if sid not in (e.source, e.target)]
            elif kind == "add_edge":
                eid, src, dst = op.get("id"), op.get("from"), op.get("to")
                if src == dst:
                    return reject("add_edge: self edges are not allowed")
                if src not in steps or dst not in steps:
                    return reject(f"add_edge: {src!r} -> {dst!r} names an unknown step")
                if src not in region_steps or dst not in region_steps:
                    return reject(f"add_edge: {src!r} -> {dst!r} leaves region {region.id}")
                eid = eid if isinstance(eid, str) else f"{src}->{dst}"
                accepts = op.get("accepts") or ["done"]
                edges.append(WorkflowEdge(id=eid, source=src, target=dst, accepts=tuple(accepts),
                                          required=op.get("required") is not False))
                added_edges.add(eid)
            elif kind == "remove_edge":
                eid = op.get("id")
                if eid not in region.mutable_edges and eid not in added_edges:
                    return reject(f"remove_edge: {eid!r} is neither mutable nor added by a patch")
                edges = [e for e in edges if e.id != eid]
            else:
                return reject(f"unknown operation {kind!r}")
        active = sum(1 for s in steps.values() if s.spec.dynamic and not s.terminal)
        if active > dynamic.max_active_steps:
            return reject(f"more than {dynamic.max_active_steps} active dynamic steps")
        cycle = find_cycle(list(steps), edges)
        if cycle:
            return reject(f"the patch makes a cycle: {' -> '.join(cycle)}")
        if region.strategy == "replace_path" and region.controller and region.exit:
            dangling = [s for s in added if not (_reaches(edges, region.controller, s) and _reaches(edges, s, region.exit))]
            if dangling:
                return reject(f"replace_path: {', '.join(dangling)} not on a path from {region.controller} to {region.exit}")
            if not _reaches(edges, region.controller, region.exit):
                return reject(f"replace_path: {region.exit} is no longer reachable from {region.controller}")
        self.steps, self.edges, self.added_edges = steps, edges, added_edges
        self.patches[patch_id] = content
        self.graph_revision += 1
        for sid in added:
            self.agent_to_step.setdefault(steps[sid].spec.agent_id, sid)
        self._event("workflow_graph_patch_applied", source, now, patch_id=patch_id, region_id=region.id,
                    graph_revision=self.graph_revision, strategy=region.strategy,
                    topology_delta={"added_steps": added, "operations": len(operations)})
        return added

    def as_json(self) -> dict[str, Any]:
        return {"schema_version": 2, "run_id": self.run_id, "graph_revision": self.graph_revision,
                "steps": {sid: s.as_json() for sid, s in self.steps.items()},
                "edges": [e.model_dump() for e in self.edges]}


def _reaches(edges: list[WorkflowEdge], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        for e in edges:
            if e.source == node and e.target not in seen:
                seen.add(e.target)
                todo.append(e.target)
    return False
