"""Replaying a trace with queues: who waits, for how long, and how fairly, under three policies.

The trace's lines name their ``queue`` (and may set ``priority`` and ``preemptible``); the queues' settings come
from a queues file (model/queues.py: quotas, borrowing, weights, priorities, cohorts). Time is virtual, as in
simulate/engine.py, and every placement is the real scheduler's (``plan_asks`` on a ``ClusterView``) within the
queue's quota (scheduler/quotas.py, the rule every commit applies).

Policies (what happens when capacity frees, and when a job arrives):
- ``fifo``: waiting jobs are offered capacity in arrival order; a job that does not fit lets later ones by
  (backfill), as mn-prefect's workers without queues do.
- ``fair``: by priority, then by their queue's fair share (scheduler/fairshare.py: dominant share, past use
  decaying over ``half_life_s``, over the queue's weight), then arrival; backfill as above.
- ``preempt``: ``fair``, and a job that does not fit may evict preemptible jobs that have run at least
  ``min_runtime_s``: of lower priority, or of the same priority from a queue with a larger share (a queue
  taking back what it is owed). The fewest are chosen, the least lost work first (scheduler/preemption.py:
  GPU-seconds, then CPU-seconds, since the job's last checkpoint or its start), then lowest priority and most
  recently started. An evicted job waits again from its arrival; it loses the work since its last checkpoint and
  resumes from there, or, when it never checkpointed, loses all of it and starts again from scratch.

Checkpoints: a job checkpoints every ``checkpoint_every_s`` seconds of its own run (its trace line's, else the
replay's; 0: never), counted over all its attempts: a job resumed from its checkpoint at 600 s of work checkpoints
next at 1200 s. A checkpoint costs no time here.

Metrics per policy, over the makespan (first arrival to last completion):
- ``utilisation``: useful GPU (and CPU) time, the completed jobs' requests x durations, over the capacity; work
  lost to preemption does not count;
- per queue: jobs, wait p50/p95 and mean (time not spent running between arrival and completion, lost work
  included), and mean slowdown ((wait + duration) / duration);
- ``jain``: Jain's fairness index of what each queue received over what it was entitled to, while two or more
  queues wanted the fleet's GPUs (CPU on a fleet without GPUs): its entitlement at each moment is its weighted
  max-min fair share of the capacity given every queue's demand (what it holds plus what it waits for); 1 when
  every queue got its entitlement in the same measure;
- ``preemptions``: jobs evicted; ``candidates_per_preemption``: how many running jobs each victim was chosen
  among, on average; ``lost_gpu_hours`` and ``lost_cpu_hours``: the work they lost (each victim's
  GPUs, and cores, times the seconds since its last checkpoint or start), in all and per queue.
"""

from __future__ import annotations

import heapq
import math
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Placement
from mn_prefect.model.queues import QueueSpec
from mn_prefect.scheduler.fairshare import Usage, capacity_of, precedence, share
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.scheduler.preemption import Evictable, choose, may_evict
from mn_prefect.scheduler.quotas import Queues, RunQueue, charge
from mn_prefect.scheduler.view import ClusterView
from mn_prefect.simulate.engine import JobLog
from mn_prefect.simulate.trace import Trace

POLICIES = ("fifo", "fair", "preempt")
NO_QUEUE = ""


@dataclass
class QueueResult:
    jobs: int = 0
    completed: int = 0
    refused: int = 0
    wait_p50: float = 0.0
    wait_p95: float = 0.0
    wait_mean: float = 0.0
    slowdown_mean: float = 0.0
    preempted: int = 0
    lost_gpu_s: float = 0.0
    lost_cpu_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"jobs": self.jobs, "completed": self.completed, "refused": self.refused,
                "wait_s": {"p50": self.wait_p50, "p95": self.wait_p95, "mean": self.wait_mean},
                "slowdown_mean": self.slowdown_mean, "preempted": self.preempted,
                "lost_gpu_hours": hours(self.lost_gpu_s), "lost_cpu_hours": hours(self.lost_cpu_s)}


@dataclass
class PolicyResult:
    policy: str
    jobs: int = 0
    completed: int = 0
    refused: int = 0
    preemptions: int = 0
    lost_gpu_s: float = 0.0  # work lost to preemption: GPU-seconds (and CPU-seconds) since the last checkpoint
    lost_cpu_s: float = 0.0
    candidates: int = 0  # over all evictions: the running jobs each could take its victims from
    util_gpu: float = 0.0
    util_cpu: float = 0.0
    jain: float = 1.0
    makespan: float = 0.0
    wall_s: float = 0.0
    queues: dict[str, QueueResult] = field(default_factory=dict)
    log: JobLog | None = None  # per job: its last start, its end, its nodes (``--jobs-out``)

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "jobs": self.jobs, "completed": self.completed, "refused": self.refused,
                "preemptions": self.preemptions, "lost_gpu_hours": hours(self.lost_gpu_s),
                "lost_cpu_hours": hours(self.lost_cpu_s),
                "candidates_per_preemption": self.candidates / self.preemptions if self.preemptions else 0.0,
                "utilisation": {"gpu": self.util_gpu, "cpu": self.util_cpu},
                "jain": self.jain, "makespan_s": self.makespan, "wall_s": round(self.wall_s, 3),
                "queues": {name: q.as_dict() for name, q in sorted(self.queues.items())}}


@dataclass
class _Running:
    job: int
    placements: list[Placement]
    start: float
    end: float
    queue: str
    priority: int
    preemptible: bool
    saved: float = 0.0  # seconds of the job's work done before this start, kept by a checkpoint
    every: float = 0.0  # seconds of its run between checkpoints; 0: it never checkpoints


def hours(seconds: float) -> float:
    return seconds / 3600.0


def last_checkpoint(start: float, saved: float, every: float, now: float) -> float:
    """When a job started at ``start`` with ``saved`` seconds of work behind it, checkpointing every ``every``
    seconds of its work (0: never), last checkpointed by ``now``: -inf when not since this start (what it resumed
    from was saved before)."""
    if every <= 0:
        return -math.inf
    done = math.floor((saved + max(now - start, 0.0)) / every) * every
    return start + (done - saved) if done > saved else -math.inf


def replay_queues(nodes: list[NodeRecord], trace: Trace, specs: list[QueueSpec], policy: str, *,
                  half_life_s: float = 3600.0, min_runtime_s: float = 0.0, checkpoint_every_s: float = 0.0,
                  progress: Callable[[int], None] | None = None) -> PolicyResult:
    """Replay ``trace`` on ``nodes`` with the queues ``specs`` under ``policy`` (``POLICIES``); a job whose trace
    line sets no ``checkpoint_every_s`` checkpoints every ``checkpoint_every_s`` seconds of its run (0: never)."""
    if policy not in POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
    if not (isinstance(checkpoint_every_s, (int, float)) and math.isfinite(checkpoint_every_s)
            and checkpoint_every_s >= 0):
        raise ValueError(f"checkpoint_every_s: must be a finite number of seconds >= 0, got {checkpoint_every_s!r}")
    return _Replay(nodes, trace, specs, policy, half_life_s, min_runtime_s, checkpoint_every_s, progress).run()


class _Replay:
    def __init__(self, nodes, trace: Trace, specs, policy, half_life_s, min_runtime_s, checkpoint_every_s, progress):
        self.trace, self.policy, self.min_runtime_s, self.progress = trace, policy, min_runtime_s, progress
        self.checkpoint_every = float(checkpoint_every_s)
        self.specs = {s.name: s for s in specs}
        self.queues = Queues.build(specs)
        self.view = ClusterView(nodes, queues=self.queues)
        self.empty_queues = Queues.build(specs)
        self.empty = ClusterView(nodes, queues=self.empty_queues)
        self.nodes = self.view.nodes
        self.capacity = capacity_of([n for n in self.nodes if n.schedulable])
        self.usage = Usage(half_life_s=half_life_s)
        self.held: dict[str, dict[str, float]] = {}  # queue -> cpu/memory/gpu held now (fair share's view)
        # waiting: (queue, priority) -> shape -> heap of (since, job)
        self.waiting: dict[tuple[str, int], dict[int, list[tuple[float, int]]]] = {}
        self.running: dict[int, _Running] = {}
        self.ends: list[tuple[float, int, int]] = []  # (end, serial, job): a job preempted leaves a stale entry
        self.serial = 0
        self.wakeups: list[float] = []  # when a job too young to preempt comes of age: look again then
        self.finished: dict[int, float] = {}
        self.refused: set[int] = set()
        self.preempted: dict[int, int] = {}
        self.saved: dict[int, float] = {}  # job -> seconds of its work kept by its last checkpoint
        self.lost: dict[str, list[float]] = {}  # queue -> [GPU-seconds, CPU-seconds] lost to preemption
        self.never: dict[tuple[int, str], bool] = {}
        self.candidates = 0  # summed over evictions: the jobs each victim was chosen among
        self.useful = {"gpu": 0.0, "cpu": 0.0}
        self.dim = "gpu" if self.capacity["gpu"] > 0 else "cpu"  # the dimension fairness is measured in
        self.wanted: dict[str, float] = {}  # queue -> amount of ``dim`` its waiting jobs ask for
        self.received: dict[str, float] = {}  # queue -> integral of what it held while queues competed
        self.entitled: dict[str, float] = {}  # queue -> integral of its fair entitlement then
        self.log = JobLog(started=array("d", [math.nan]) * len(trace), ended=array("d", [math.nan]) * len(trace))

    # -- the job's settings ---------------------------------------------------------------------------

    def queue_of(self, job: int) -> str:
        index = self.trace.queue_of[job] if len(self.trace.queue_of) > job else -1
        return self.trace.queues[index] if index >= 0 else NO_QUEUE

    def priority_of(self, job: int) -> int:
        given = self.trace.priority_of[job] if len(self.trace.priority_of) > job else None
        if given is not None:
            return given
        spec = self.specs.get(self.queue_of(job))
        return spec.priority if spec is not None else 0

    def every(self, job: int) -> float:
        """Seconds of ``job``'s run between its checkpoints: its trace line's, else the replay's (0: never)."""
        given = self.trace.checkpoint_every[job] if len(self.trace.checkpoint_every) > job else math.nan
        return self.checkpoint_every if math.isnan(given) else given

    def run_queue(self, job: int) -> RunQueue | None:
        queue = self.queue_of(job)
        preemptible = bool(self.trace.preemptible[job]) if len(self.trace.preemptible) > job else False
        return RunQueue(queue, self.priority_of(job), preemptible, int(self.min_runtime_s)) if queue else None

    # -- the replay -----------------------------------------------------------------------------------

    def run(self) -> PolicyResult:
        started = time.perf_counter()
        trace = self.trace
        order = sorted(range(len(trace)), key=lambda j: (trace.times[j], j))
        arrivals = 0
        now = trace.times[order[0]] if order else 0.0
        first = now
        while arrivals < len(order) or self.ends:
            next_arrival = trace.times[order[arrivals]] if arrivals < len(order) else math.inf
            next_end = self.ends[0][0] if self.ends else math.inf
            while self.wakeups and self.wakeups[0] <= now:
                heapq.heappop(self.wakeups)
            now = min(next_arrival, next_end, self.wakeups[0] if self.wakeups else math.inf)
            self._account(now - self.usage.at if self.usage.at else 0.0)
            self.usage.advance(now, self.held)
            while self.ends and self.ends[0][0] <= now:
                _, serial, job = heapq.heappop(self.ends)
                running = self.running.get(job)
                if running is not None and running.end == now and running.start <= now:
                    self._finish(running, now)
            while arrivals < len(order) and trace.times[order[arrivals]] <= now:
                self._arrive(order[arrivals], now)
                arrivals += 1
                if self.progress is not None and arrivals % 1000 == 0:
                    self.progress(arrivals)
            self._schedule(now)
        return self._result(first, now, time.perf_counter() - started)

    def _arrive(self, job: int, now: float) -> None:
        shape = self.trace.shape_of[job]
        queue = self.queue_of(job)
        key = (shape, queue)
        if key not in self.never:
            plan = plan_asks(list(self.trace.shapes[shape].asks), [], job_type=self.trace.shapes[shape].job_type,
                             explain=False, view=self.empty, queue=self.run_queue(job))
            for p in plan.placements:
                self.empty.unhold(p)
            if plan.placements:
                self.empty_queues.add(queue, self.empty_queues.amounts(queue, plan.placements), -1)
            self.never[key] = plan.status != "runnable_now"
        if self.never[key]:
            self.refused.add(job)
            return
        self._wait(job, self.trace.times[job])

    def _wait(self, job: int, since: float) -> None:
        queue = self.queue_of(job)
        group = self.waiting.setdefault((queue, self.priority_of(job)), {})
        heapq.heappush(group.setdefault(self.trace.shape_of[job], []), (since, job))
        self.wanted[queue] = self.wanted.get(queue, 0.0) + self._asks(job)

    def _asks(self, job: int) -> float:
        request = self.trace.shapes[self.trace.shape_of[job]].request
        return float(request.gpu_count + len(request.devices)) if self.dim == "gpu" else request.cpu_cores

    def _account(self, dt: float) -> None:
        """Add ``dt`` of the present to what each queue received and was entitled to, when queues compete."""
        demand = {q: self.held.get(q, {}).get(self.dim, 0.0) + self.wanted.get(q, 0.0)
                  for q in {*self.held, *self.wanted}}
        demand = {q: d for q, d in demand.items() if d > 1e-9}
        if dt <= 0 or len(demand) < 2:
            return
        weights = {q: (self.specs[q].weight if q in self.specs else 1.0) for q in demand}
        for queue, amount in entitlement(demand, weights, self.capacity[self.dim]).items():
            self.entitled[queue] = self.entitled.get(queue, 0.0) + amount * dt
            self.received[queue] = self.received.get(queue, 0.0) + self.held.get(queue, {}).get(self.dim, 0.0) * dt

    def _shares(self) -> dict[str, float]:
        return {q: share(q, self.held.get(q, {}), self.capacity, self.queues, self.usage)
                for q in {q for q, _ in self.waiting} | set(self.held)}

    def _schedule(self, now: float) -> None:
        failed: set[tuple[int, str]] = set()  # capacity only shrinks within a pass (but for evictions)
        shares = self._shares()
        while True:
            best = None
            for (queue, priority), shapes in self.waiting.items():
                for shape, heap in shapes.items():
                    if not heap or (shape, queue) in failed:
                        continue
                    since, job = heap[0]
                    run = f"{job:012d}"  # ties go to the earlier line of the trace
                    key = (since, run) if self.policy == "fifo" else precedence(run, queue, priority, since,
                                                                                  self.queues, shares)
                    if best is None or key < best[0]:
                        best = (key, queue, priority, shape)
            if best is None:
                return
            _, queue, priority, shape = best
            heap = self.waiting[(queue, priority)][shape]
            since, job = heap[0]
            if self._start(job, now) or (self.policy == "preempt" and self._preempt_for(job, now, shares)):
                heapq.heappop(heap)
                self.wanted[queue] = max(self.wanted.get(queue, 0.0) - self._asks(job), 0.0)
                shares[queue] = share(queue, self.held.get(queue, {}), self.capacity, self.queues, self.usage)
            else:
                failed.add((shape, queue))

    def _start(self, job: int, now: float) -> bool:
        shape = self.trace.shapes[self.trace.shape_of[job]]
        plan = plan_asks(list(shape.asks), [], job_type=shape.job_type, explain=False, view=self.view,
                         queue=self.run_queue(job))
        if plan.status != "runnable_now":
            return False
        queue = self.queue_of(job)
        saved = self.saved.get(job, 0.0)
        end = now + (self.trace.durations[job] - saved if saved else self.trace.durations[job])
        running = _Running(job, list(plan.placements), now, end, queue, self.priority_of(job),
                           bool(self.trace.preemptible[job]), saved, self.every(job))
        self.running[job] = running
        self.log.started[job] = now
        self._hold(queue, running.placements, 1)
        self.serial += 1
        heapq.heappush(self.ends, (end, self.serial, job))
        return True

    def _hold(self, queue: str, placements: list[Placement], sign: int) -> None:
        amounts = charge(placements)
        held = self.held.setdefault(queue, {})
        for dim in ("cpu", "memory", "gpu"):
            held[dim] = max(held.get(dim, 0.0) + sign * amounts[dim], 0.0)

    def _release(self, running: _Running) -> None:
        del self.running[running.job]
        for placement in running.placements:
            self.view.unhold(placement)
        self._hold(running.queue, running.placements, -1)

    def _finish(self, running: _Running, now: float) -> None:
        self._release(running)
        self.finished[running.job] = now
        self.log.ended[running.job] = now
        self.log.nodes[running.job] = tuple(p.node for p in running.placements)
        amounts = charge(running.placements)
        duration = running.end - running.start + running.saved  # the work of every attempt it kept
        self.useful["gpu"] += amounts["gpu"] * duration
        self.useful["cpu"] += amounts["cpu"] * duration

    def _preempt_for(self, job: int, now: float, shares: dict[str, float]) -> bool:
        """Evict the fewest preemptible jobs that let ``job`` start (scheduler/preemption.py, the rule the workers
        apply); nothing is evicted when even all of them would not."""
        queue, priority = self.queue_of(job), self.priority_of(job)
        runs = {str(r.job): r for r in self.running.values()}
        candidates = [Evictable(booking=key, placements=tuple(r.placements), started=r.start,
                                checkpointed=last_checkpoint(r.start, r.saved, r.every, now))
                      for key, r in runs.items()]
        young = [c.started + (c.first.min_runtime_s or 0) for c in candidates
                 if not may_evict(c, queue, priority, self.queues, now)
                 and may_evict(c, queue, priority, self.queues, math.inf)]
        if young:
            heapq.heappush(self.wakeups, min(young))
        eligible = [c for c in candidates if may_evict(c, queue, priority, self.queues, now)]
        if not eligible:
            return False
        shape = self.trace.shapes[self.trace.shape_of[job]]
        victims, _plan = choose(self.view, lambda: plan_asks(list(shape.asks), [], job_type=shape.job_type, explain=False,
                                                             view=self.view, queue=self.run_queue(job)), eligible,
                              now=now)
        if not victims:
            return False
        self.candidates += len(eligible) * len(victims)
        for victim in victims:
            gone = runs[victim.booking]
            self._release(gone)
            self.preempted[gone.job] = self.preempted.get(gone.job, 0) + 1
            lost = self.lost.setdefault(gone.queue or "(none)", [0.0, 0.0])
            for k, amount in enumerate(victim.lost(now)):
                lost[k] += amount
            if victim.checkpointed > -math.inf:  # it resumes from its last checkpoint, else from the last it had
                self.saved[gone.job] = gone.saved + (victim.checkpointed - gone.start)
            self._wait(gone.job, self.trace.times[gone.job])
        return self._start(job, now)

    def _result(self, first: float, last: float, wall: float) -> PolicyResult:
        trace = self.trace
        result = PolicyResult(policy=self.policy, jobs=len(trace), completed=len(self.finished),
                              refused=len(self.refused), preemptions=sum(self.preempted.values()), wall_s=wall,
                              candidates=self.candidates, log=self.log)
        result.makespan = max(last - first, 0.0)
        span = result.makespan or 1.0
        result.util_gpu = self.useful["gpu"] / (self.capacity["gpu"] * span) if self.capacity["gpu"] else 0.0
        result.util_cpu = self.useful["cpu"] / (self.capacity["cpu"] * span) if self.capacity["cpu"] else 0.0
        waits: dict[str, list[float]] = {}
        slowdowns: dict[str, list[float]] = {}
        for job in range(len(trace)):
            queue = self.queue_of(job) or "(none)"
            stats = result.queues.setdefault(queue, QueueResult())
            stats.jobs += 1
            stats.refused += job in self.refused
            stats.preempted += self.preempted.get(job, 0)
            end = self.finished.get(job)
            if end is None:
                continue
            stats.completed += 1
            duration = trace.durations[job]
            wait = max(end - trace.times[job] - duration, 0.0)
            waits.setdefault(queue, []).append(wait)
            slowdowns.setdefault(queue, []).append((wait + duration) / duration if duration > 0 else 1.0)
        for queue, values in waits.items():
            values.sort()
            stats = result.queues[queue]
            stats.wait_p50, stats.wait_p95 = _rank(values, 0.50), _rank(values, 0.95)
            stats.wait_mean = sum(values) / len(values)
            stats.slowdown_mean = sum(slowdowns[queue]) / len(slowdowns[queue])
        for queue, (gpu_s, cpu_s) in self.lost.items():
            stats = result.queues.setdefault(queue, QueueResult())
            stats.lost_gpu_s, stats.lost_cpu_s = gpu_s, cpu_s
            result.lost_gpu_s += gpu_s
            result.lost_cpu_s += cpu_s
        ratios = [self.received.get(q, 0.0) / e for q, e in self.entitled.items() if e > 0]
        result.jain = (sum(ratios) ** 2) / (len(ratios) * sum(x * x for x in ratios)) if any(ratios) else 1.0
        return result


def entitlement(demand: dict[str, float], weights: dict[str, float], capacity: float) -> dict[str, float]:
    """Weighted max-min fair shares of ``capacity`` (water-filling): no queue gets more than its demand, and what
    one does not need is shared by the others in proportion to their weights."""
    out = dict.fromkeys(demand, 0.0)
    left, active = capacity, {q for q, d in demand.items() if d > 0}
    while active and left > 1e-9:
        total = sum(weights[q] for q in active)
        sated = {q for q in active if demand[q] - out[q] <= left * weights[q] / total + 1e-12}
        if not sated:
            for q in active:
                out[q] += left * weights[q] / total
            break
        for q in sated:
            left -= demand[q] - out[q]
            out[q] = demand[q]
        active -= sated
    return out


def _rank(values: list[float], p: float) -> float:
    """Nearest-rank percentile of sorted ``values``."""
    return values[max(math.ceil(p * len(values)) - 1, 0)]
