"""Replaying a trace in virtual time through the real scheduler and the store's admission rule (docs/simulator.md).

Nothing sleeps and nothing talks to Prefect or a store: time jumps from one event to the next. The cluster is a
``ClusterView`` of the node records (the structure the worker's placer keeps); every placement is chosen by the
scheduler (``ClusterView.place``, what ``plan_asks`` runs for a one-agent batch or service job; ``plan_asks``
itself for system and sysbatch jobs) and then checked with ``ClusterView.admit``, which decides with
``admission_reason``, the rule the store applies at commit. A refusal there is counted (``admission_refused``;
it would mean planner and store disagree) and the job is refused.

Events and order. Arrivals come from the trace (sorted by ``t``, file order among equal times), completions at
start + duration. At one instant, completions go first (every release), then one scan of the waiting queue,
then the arrivals in trace order; a job placed with duration 0 completes at that same instant.

Queue policy: FIFO with backfill, as Nomad unblocks every blocked evaluation when capacity frees. A job that
does not fit when it arrives waits. After releases, the waiting jobs are tried in arrival order; one that still
does not fit keeps its place and later ones may start ahead of it (no reservation for the head). Two exact
shortcuts keep this off O(N^2), without changing what it decides:
- jobs are queued per shape (same request and job type); within a scan, once a shape has failed every later
  job of that shape is passed over (capacity only shrinks during a scan), so a scan asks the scheduler at most
  once per waiting shape that fails, plus once per job it starts;
- an arriving job whose shape already waits is queued without asking (it failed since the last release);
- before asking, a shape that needs more CPU, memory, disk or GPUs than the largest free amount on any
  node at the start of the scan is known not to fit;
- a waiting shape did not fit anywhere before these releases, so it can only fit now on a node that was just
  released: the scheduler's own per-node check (``ClusterView.explain``) on those nodes (when there are at
  most RELEASED_CHECK of them) says whether to ask it at all, for a few microseconds instead of a placement
  over every node.
So "nothing waiting fits anywhere" holds between events, which makes stranded GPUs exact (below).

Head-of-line holds (``holds``, scheduler/holds.py; docs/simulator.md). With holds the greedy order above lets a
wide job starve behind a stream of narrow ones, so instead: the first waiting job (in arrival order) that does
not fit gets a hold (at most ``max_holds``) on the node where it can start soonest by the running jobs'
estimated ends; the hold books the job's request there (oversubscribing it), so other jobs see capacity -
running - hold. A job that does not fit otherwise may still run on a hold's node against capacity - running
(backfill) when its runtime estimate is known and it ends by the hold's expected start. At each scan the held
jobs are tried first (with their hold lifted), then every waiting job in arrival order; the shortcuts that
assume "nothing waiting fits anywhere" are not used (a held job waits while its node has room for others), and
within a scan a shape that failed is not asked again (capacity only shrinks). Estimates: ``max_runtime_s`` of
the trace, else the p90 of the last durations of the job's ``deployment`` (``learned_estimate``), else unknown.

Jobs that cannot fit even on the empty cluster (the scheduler's ``not_runnable``) are refused on arrival.

Metrics, over the span from the first arrival to the last completion (the makespan):
- utilisation of CPU, memory and GPUs: the time-weighted mean of booked / schedulable capacity (nodes whose
  status is healthy or joining and that are scheduling-eligible). A GPU booked whole counts 1, a fraction its
  ``shares``, a MIG slice its GPU-instance slices (the ``N`` of ``Ng.``) over 7 (the slices of an A100 or H100;
  over the sum of its GPU's slices when that is larger).
- waits: start - arrival for every job that started; mean, p50 and p99 (nearest rank), max.
- queue length: time-weighted mean and max.
- GPU fragmentation: a free GPU (nothing booked on it: not whole, not a slice, not a fraction) is stranded
  while at least one waiting job asks for GPU devices: it sits on a node that cannot take any waiting
  request (by the invariant above no waiting request fits on any node, for want of CPU, memory, enough free GPUs
  on one node, or the right kind of device). ``gpu_stranded`` is the time-weighted mean number of stranded
  GPUs; ``gpu_fragmentation`` the same as a share of the schedulable GPUs, and ``gpu_stranded_while_waiting``
  the mean over only the time GPU requests waited (how many GPUs stood idle while GPU work queued).
"""

from __future__ import annotations

import heapq
import math
import re
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Allocation, PlacedResources, Placement
from mn_prefect.scheduler.admission import EPSILON
from mn_prefect.scheduler.holds import (
    HISTORY,
    HoldChoice,
    Running,
    choose_hold,
    learned_estimate,
    may_backfill,
    worth_holding,
)
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.scheduler.view import Choice, ClusterView
from mn_prefect.simulate.trace import Shape, Trace

STRATEGIES = ("binpack", "spread")
MIG_SLICES = 7  # GPU-instance slices of an A100 / H100 in MIG mode
_MIG_G = re.compile(r"(?:^|\.)([1-8])g\.")
TIMELINE_POINTS = 1000  # buckets of the utilisation/queue timeline (more when the run outlasts the estimate)
RELEASED_CHECK = 32  # a scan checks the released nodes one by one when there are at most this many
REFUSAL_REASONS = 10  # distinct refused shapes explained (each explanation plans once against the empty cluster)


@dataclass
class Timeline:
    """Time-weighted means per bucket of virtual time: CPU, memory and GPU utilisation (0..1), queue length."""

    start: float
    width: float
    times: list[float] = field(default_factory=list)  # each bucket's start
    cpu: list[float] = field(default_factory=list)
    memory: list[float] = field(default_factory=list)
    gpu: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[float]]:
        return {"t": self.times, "cpu": self.cpu, "memory": self.memory, "gpu": self.gpu, "queue": self.queue}


@dataclass
class Result:
    """What one strategy did with the trace."""

    strategy: str
    jobs: int = 0
    placed: int = 0
    refused: int = 0  # not_runnable on arrival, plus admission refusals
    not_runnable: int = 0
    admission_refused: int = 0
    waited: int = 0  # started later than they arrived
    wait_mean: float = 0.0
    wait_p50: float = 0.0
    wait_p99: float = 0.0
    wait_max: float = 0.0
    queue_max: int = 0
    queue_mean: float = 0.0
    util_cpu: float = 0.0
    util_memory: float = 0.0
    util_gpu: float = 0.0
    gpu_stranded: float = 0.0
    gpu_fragmentation: float = 0.0
    gpu_stranded_while_waiting: float = 0.0
    gpu_waiting_time: float = 0.0  # virtual seconds during which a GPU request waited
    makespan: float = 0.0
    start: float = 0.0
    end: float = 0.0
    events: int = 0
    scheduler_calls: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # processor time of the replay (on a shared machine, less than wall_s)
    refusals: dict[str, int] = field(default_factory=dict)  # reason -> jobs
    timeline: Timeline | None = None
    holds: bool = False  # replayed with head-of-line holds and backfill
    holds_made: int = 0
    backfilled: int = 0  # jobs started on a hold's node ahead of it
    widest: dict[str, float] = field(default_factory=dict)  # {"gpus", "jobs", "wait_max"} of the widest requests
    log: JobLog | None = None  # per job: started, ended, nodes

    def as_dict(self) -> dict[str, Any]:
        out = self._metrics()
        out.update({"holds": "on" if self.holds else "off", "holds_made": self.holds_made,
                    "backfilled": self.backfilled, "widest": self.widest})
        return out

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else 0.0

    def _metrics(self) -> dict[str, Any]:
        out = {
            "jobs": self.jobs, "placed": self.placed, "refused": self.refused, "not_runnable": self.not_runnable,
            "admission_refused": self.admission_refused, "waited": self.waited,
            "wait_s": {"mean": self.wait_mean, "p50": self.wait_p50, "p99": self.wait_p99, "max": self.wait_max},
            "queue": {"max": self.queue_max, "mean": self.queue_mean},
            "utilisation": {"cpu": self.util_cpu, "memory": self.util_memory, "gpu": self.util_gpu},
            "gpu_fragmentation": {"stranded_gpus_mean": self.gpu_stranded, "share_of_gpus": self.gpu_fragmentation,
                                  "stranded_gpus_while_waiting": self.gpu_stranded_while_waiting,
                                  "gpu_waiting_s": self.gpu_waiting_time},
            "makespan_s": self.makespan, "start_s": self.start, "end_s": self.end,
            "events": self.events, "scheduler_calls": self.scheduler_calls,
            "wall_s": round(self.wall_s, 3), "cpu_s": round(self.cpu_s, 3),
            "events_per_s": round(self.events_per_s, 1),
            "refusals": self.refusals,
        }
        if self.timeline is not None:
            out["timeline"] = self.timeline.as_dict()
        return out


@dataclass
class JobLog:
    """Per job of the trace (file order): virtual start and end in seconds (nan: never), and its nodes."""

    started: array[float]
    ended: array[float]
    nodes: dict[int, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class _Hold:
    """A standing hold: where its job will start, and the bookings that keep the room for it."""

    choice: HoldChoice
    placements: tuple[Placement, ...]


class ReplayFleet:
    """The node records and what the metrics need of them, shared by every strategy's replay."""

    def __init__(self, nodes: list[NodeRecord]):
        self.empty = ClusterView(nodes)  # never booked for long: "would it fit the empty cluster?"
        self.nodes = self.empty.nodes
        ok = np.array([n.schedulable for n in self.nodes], dtype=bool)
        self.schedulable = ok
        self.cap_cpu = float(self.empty.cap_cpu[ok].sum())
        self.cap_mem = float(self.empty.cap_mem[ok].sum())
        self.gpus = sum(len(n.gpu_devices) for n, good in zip(self.nodes, ok, strict=True) if good)
        # (node index, slice id) -> what a MIG slice counts of a GPU
        self.slice_weight: dict[tuple[int, str], float] = {}
        for i, node in enumerate(self.nodes):
            slices = [d for d in node.devices if d.parent is not None]
            per_parent: dict[str, int] = {}
            for d in slices:
                per_parent[d.parent or ""] = per_parent.get(d.parent or "", 0) + _mig_g(d.mig_profile)
            for d in slices:
                self.slice_weight[(i, d.id)] = _mig_g(d.mig_profile) / max(MIG_SLICES, per_parent[d.parent or ""])
        self._runnable: dict[int, bool] = {}
        self._reasons: dict[int, str] = {}

    def runnable(self, shape: Shape) -> bool:
        """Whether the shape fits the empty cluster (else the scheduler's ``not_runnable``)."""
        known = self._runnable.get(shape.index)
        if known is not None:
            return known
        if shape.planned:
            plan = plan_asks(list(shape.asks), [], job_type=shape.job_type, strategy="binpack", explain=False,
                             view=self.empty)
            for p in plan.placements:
                self.empty.unhold(p)
            fits = plan.status == "runnable_now"
        else:
            choice, _ = self.empty.place(shape.ask, "binpack")
            if choice is not None:
                assert choice.token is not None
                self.empty.unbook(choice.token)
            fits = choice is not None
        self._runnable[shape.index] = fits
        return fits

    def refusal_reason(self, shape: Shape) -> str:
        """Why the shape never fits, from the scheduler (one plan against the empty cluster)."""
        known = self._reasons.get(shape.index)
        if known is None:
            plan = plan_asks(list(shape.asks), self.nodes, job_type=shape.job_type, strategy="binpack", explain=False)
            known = plan.reason or plan.status
            known = self._reasons[shape.index] = known if len(known) <= 300 else known[:297] + "..."
        return known


def _mig_g(profile: str | None) -> int:
    match = _MIG_G.search(profile or "")
    return int(match.group(1)) if match else 1


_BARE: dict[str | None, Allocation] = {}  # runtime driver -> an allocation of nothing else
_RESOURCES: dict[tuple[float, float, float, int], PlacedResources] = {}


def placement_for(view: ClusterView, choice: Choice, job_type: str, job_id: str) -> Placement:
    """The placement ``plan_asks`` builds from a choice (scheduler/plan.py), without the env hints and score that
    nothing here reads: what the admission rule checks and a release gives back. Built without validation (the
    scheduler's choice is already valid), sharing equal parts between placements: this runs once per job."""
    request = choice.ask.request
    key = (request.cpu_cores, request.memory_mb, request.disk_mb, choice.gpu)
    resources = _RESOURCES.get(key)
    if resources is None:
        if len(_RESOURCES) > 4096:
            _RESOURCES.clear()
        resources = _RESOURCES[key] = PlacedResources.model_construct(
            cpu_cores=request.cpu_cores, memory_mb=request.memory_mb, disk_mb=request.disk_mb, gpu_count=choice.gpu)
    bare = not (choice.devices or choice.ports or choice.volumes or choice.shares)
    allocation = _BARE.get(choice.runtime_driver) if bare else None
    if allocation is None:
        allocation = Allocation.model_construct(devices=tuple(choice.devices), shares=tuple(choice.shares),
                                                ports=tuple(choice.ports), volumes=tuple(choice.volumes),
                                                runtime_driver=choice.runtime_driver)
        if bare:
            _BARE[choice.runtime_driver] = allocation
    return Placement.model_construct(agent_id=choice.ask.agent_id, source_agent_id=choice.ask.agent_id,
                                     node=view.nodes[choice.node].name, resources=resources, allocation=allocation,
                                     locality="job_colocated", job_id=job_id, env={}, score=None, preferred=None,
                                     group=None)


class Replay:
    """One strategy's run over the trace."""

    def __init__(self, fleet: ReplayFleet, trace: Trace, strategy: str, *, timeline: bool = False,
                 progress: Callable[[int], None] | None = None, progress_every: int = 4096, holds: bool = False,
                 max_holds: int = 1):
        self.fleet = fleet
        self.holds = holds
        self.max_holds = max_holds
        self.held: dict[int, _Hold] = {}  # job -> its hold, in the order made
        self.line: list[int] = []  # with holds: the waiting jobs in arrival order
        self.history: dict[int, deque[float]] = {}  # deployment -> its last completed durations
        n = len(trace)
        self.log = JobLog(started=array("d", [math.nan]) * n, ended=array("d", [math.nan]) * n)
        self.trace = trace
        self.strategy = strategy
        self.view = ClusterView(fleet.nodes)
        self.progress = progress
        self.progress_every = progress_every
        self.result = Result(strategy=strategy, jobs=len(trace), holds=holds, log=self.log)
        # usage
        self.used_cpu = 0.0
        self.used_mem = 0.0
        self.used_gpu = 0.0
        self.busy: dict[tuple[int, str], int] = {}  # physical GPU -> bookings on it
        self.busy_gpus = 0
        # queue: per shape a FIFO of job indices, and a heap of (head job, shape) with one entry per waiting shape
        self.waiting: dict[int, deque[int]] = {}
        self.heads: list[tuple[int, int]] = []
        self.queued = 0
        self.waiting_gpu = 0
        # completions: (end, job) ; running job -> (placements, cpu, memory, gpu equivalents, GPUs touched)
        self.completions: list[tuple[float, int]] = []
        self.running: dict[int, tuple[tuple[Placement, ...], float, float, float, list[tuple[int, str]]]] = {}
        self.waits = array("d")
        self.refused_by_shape: dict[int, int] = {}
        # time integrals
        self.now = 0.0
        self.last_completion = 0.0
        self.area_cpu = self.area_mem = self.area_gpu = self.area_queue = 0.0
        self.area_stranded = 0.0
        self.gpu_wait_time = 0.0
        self.timeline: Timeline | None = None
        self._want_timeline = timeline
        self._tl_end = 0.0
        self._tl_acc = [0.0, 0.0, 0.0, 0.0]

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> Result:
        started, cpu = time.perf_counter(), time.process_time()
        trace = self.trace
        n = len(trace)
        result = self.result
        if n == 0:
            return result
        times = np.frombuffer(trace.times, dtype=np.float64) if n else np.zeros(0)
        order = np.argsort(times, kind="stable").tolist()
        t_list = trace.times
        self.now = result.start = float(times[order[0]])
        if self._want_timeline:
            ends = times + np.frombuffer(trace.durations, dtype=np.float64)
            width = max(float(ends.max()) - self.now, 1e-9) / TIMELINE_POINTS
            self.timeline = Timeline(start=self.now, width=width)
            self._tl_end = self.now + width
        completions = self.completions
        inf = float("inf")
        a = 0
        events = 0
        every = self.progress_every
        while a < n or completions:
            next_arrival = t_list[order[a]] if a < n else inf
            t = completions[0][0] if completions and completions[0][0] <= next_arrival else next_arrival
            if t > self.now:
                self._advance(t)
            if completions and completions[0][0] <= t:
                released: set[int] = set()
                while completions and completions[0][0] <= t:
                    _, job = heapq.heappop(completions)
                    self._release(job, released)
                    events += 1
                if self.queued:
                    if self.holds:
                        self._scan_holding(t)
                    else:
                        self._scan(t, released)
                continue
            while a < n and t_list[order[a]] == t:
                self._arrive(order[a], t)
                a += 1
                events += 1
                if self.progress is not None and a % every == 0:
                    self.progress(a)
        if self.progress is not None:
            self.progress(n)
        result.end = max(self.last_completion, result.start)
        result.events = events
        self._finish()
        result.wall_s = time.perf_counter() - started
        result.cpu_s = time.process_time() - cpu
        return result

    def _arrive(self, job: int, t: float) -> None:
        shape = self.trace.shapes[self.trace.shape_of[job]]
        if not self.fleet.runnable(shape):
            self.result.not_runnable += 1
            self.refused_by_shape[shape.index] = self.refused_by_shape.get(shape.index, 0) + 1
            return
        if self.holds:
            if not (self._try_start(job, shape, t) or self._backfill(job, shape, t, set())):
                self._wait_in_line(job, shape)
                if len(self.held) < self.max_holds:
                    self._make_hold(job, shape, t)
            return
        if shape.index in self.waiting or not self._try_start(job, shape, t):
            self._enqueue(job, shape)

    # -- holds (see the module docstring) --------------------------------------------------------------

    def _wait_in_line(self, job: int, shape: Shape) -> None:
        self.line.append(job)
        self.queued += 1
        if shape.asks_gpu:
            self.waiting_gpu += 1
        if self.queued > self.result.queue_max:
            self.result.queue_max = self.queued

    def _scan_holding(self, t: float) -> None:
        """With holds: the held jobs (their holds lifted), then every waiting job in arrival order."""
        view = self.view
        shapes, shape_of = self.trace.shapes, self.trace.shape_of
        gone: set[int] = set()
        for job, hold in list(self.held.items()):
            for p in hold.placements:
                view.unhold(p)
            if self._try_start(job, shapes[shape_of[job]], t):
                del self.held[job]
                gone.add(job)
            else:
                for p in hold.placements:
                    view.hold(p)
        failed: set[int] = set()  # shapes that did not fit normally in this scan
        no_room: set[int] = set()  # shapes that did not fit on a hold's node with the hold lifted
        for job in self.line:
            if job in gone or job in self.held:
                continue
            shape = shapes[shape_of[job]]
            if shape.index not in failed:
                if self._try_start(job, shape, t):
                    gone.add(job)
                    continue
                failed.add(shape.index)
            if self.held and shape.index not in no_room and self._backfill(job, shape, t, no_room):
                gone.add(job)
                continue
            if len(self.held) < self.max_holds:
                self._make_hold(job, shape, t)
        if gone:
            self.line = [job for job in self.line if job not in gone]
            for job in gone:
                self.queued -= 1
                if shapes[shape_of[job]].asks_gpu:
                    self.waiting_gpu -= 1

    def _estimate(self, job: int) -> float | None:
        """The job's runtime estimate in seconds: declared, else learned from its deployment, else None."""
        declared = self.trace.max_runtime[job] if len(self.trace.max_runtime) > job else math.nan
        if not math.isnan(declared):
            return declared
        deployment = self.trace.deployment_of[job] if len(self.trace.deployment_of) > job else -1
        if deployment < 0:
            return None
        return learned_estimate(self.history.get(deployment, ()))

    def _backfill(self, job: int, shape: Shape, t: float, no_room: set[int]) -> bool:
        """Start ``job`` on a hold's node against capacity - running, if it is known to end by the hold's start."""
        if shape.system or not self.held:
            return False
        estimate = self._estimate(job)
        tried = False
        view = self.view
        for hold in self.held.values():
            if not may_backfill(estimate, t, hold.choice.expected_start):
                continue
            tried = True
            for p in hold.placements:
                view.unhold(p)
            started = self._try_start(job, shape, t)
            for p in hold.placements:
                view.hold(p)
            if started:
                self.result.backfilled += 1
                return True
        if tried:
            no_room.add(shape.index)
        return False

    def _make_hold(self, job: int, shape: Shape, t: float) -> None:
        """Hold room for ``job`` where it can start soonest (scheduler/holds.py); none for a system job."""
        if shape.system:
            return
        started = self.log.started
        running: list[Running] = []
        for other, (placements, *_rest) in self.running.items():
            estimate = self._estimate(other)
            ends = started[other] + estimate if estimate is not None else None
            job_id = self.trace.ids[other]
            running.extend(Running(job_id, p.node, ends, p.resources.cpu_cores, p.resources.memory_mb,
                                   p.resources.disk_mb, p.resources.gpu_count) for p in placements)
        choice = choose_hold(self.view, list(shape.asks), running, t)
        if choice is None or not worth_holding(choice):
            return
        r = shape.request
        resources = PlacedResources.model_construct(cpu_cores=r.cpu_cores, memory_mb=r.memory_mb, disk_mb=r.disk_mb,
                                                    gpu_count=r.gpu_count)
        placements = tuple(Placement.model_construct(
            agent_id="hold", source_agent_id="hold", node=node, resources=resources, allocation=Allocation(),
            locality="job_colocated", job_id=self.trace.ids[job], env={}, score=None, preferred=None, group=None)
            for node in choice.nodes)
        for p in placements:
            self.view.hold(p)
        self.held[job] = _Hold(choice, placements)
        self.result.holds_made += 1

    def _enqueue(self, job: int, shape: Shape) -> None:
        queue = self.waiting.get(shape.index)
        if queue is None:
            queue = self.waiting[shape.index] = deque()
            heapq.heappush(self.heads, (job, shape.index))
        queue.append(job)
        self.queued += 1
        if shape.asks_gpu:
            self.waiting_gpu += 1
        if self.queued > self.result.queue_max:
            self.result.queue_max = self.queued

    def _scan(self, t: float, released: set[int]) -> None:
        """After releases on the nodes ``released``: try the waiting jobs in arrival order (see the module
        docstring)."""
        view = self.view
        check = released if len(released) <= RELEASED_CHECK else None
        ok = self.fleet.schedulable
        most = (float(view.free_cpu[ok].max(initial=0.0)), float(view.free_mem[ok].max(initial=0.0)),
                float(view.free_disk[ok].max(initial=0.0)), float(view.free_gpu[ok].max(initial=0.0)))
        shapes = self.trace.shapes
        heads = self.heads
        failed: list[tuple[int, int]] = []
        while heads:
            entry = heapq.heappop(heads)
            index = entry[1]
            shape = shapes[index]
            queue = self.waiting[index]
            r = shape.request
            if (r.cpu_cores > most[0] + EPSILON or r.memory_mb > most[1] + EPSILON or r.disk_mb > most[2] + EPSILON
                    or r.gpu_count > most[3]) or (check is not None and not shape.system and all(
                        view.explain(i, shape.ask) is not None for i in check)) or not self._try_start(queue[0], shape, t):
                failed.append(entry)
                continue
            queue.popleft()
            self.queued -= 1
            if shape.asks_gpu:
                self.waiting_gpu -= 1
            if queue:
                heapq.heappush(heads, (queue[0], index))
            else:
                del self.waiting[index]
        self.heads = failed  # popped in order: already a heap

    # -- placing and releasing ---------------------------------------------------------------------

    def _try_start(self, job: int, shape: Shape, t: float) -> bool:
        """Place ``job`` now if the scheduler finds room; True when the job is done with (started, or refused by
        the admission rule), False when it does not fit."""
        view = self.view
        self.result.scheduler_calls += 1
        job_id = self.trace.ids[job]
        if shape.planned:
            plan = plan_asks(list(shape.asks), [], job_type=shape.job_type, strategy=self.strategy, explain=False,
                             job_id=job_id, view=view)
            if plan.status != "runnable_now":
                return False
            placements = plan.placements
            for p in placements:
                view.unhold(p)  # planned and booked in the view: the admission rule books them again below
        else:
            choice, _ = view.place(shape.ask, self.strategy)
            if choice is None:
                return False
            assert choice.token is not None
            view.unbook(choice.token)
            placements = (placement_for(view, choice, shape.job_type, job_id),)
        admitted: list[Placement] = []
        for placement in placements:
            why = view.admit(placement)
            if why is not None:
                for done in admitted:
                    view.unhold(done)
                self.result.admission_refused += 1
                reason = f"admission rule refused the scheduler's placement: {why}"
                self.result.refusals[reason] = self.result.refusals.get(reason, 0) + 1
                return True
            admitted.append(placement)
        self._start(job, placements, t)
        return True

    def _start(self, job: int, placements: tuple[Placement, ...], t: float) -> None:
        trace = self.trace
        wait = t - trace.times[job]
        self.waits.append(wait)
        if wait > 0:
            self.result.waited += 1
        cpu = mem = gpu = 0.0
        touched: list[tuple[int, str]] = []
        view = self.view
        weight = self.fleet.slice_weight
        for p in placements:
            cpu += p.resources.cpu_cores
            mem += p.resources.memory_mb
            allocation = p.allocation
            if not allocation.devices:
                continue
            i = view.index[p.node]
            shared = {s.id: s.shares for s in allocation.shares}
            for device in allocation.devices:
                if device.kind != "gpu":
                    continue
                if device.parent is not None:
                    gpu += weight.get((i, device.id), 1.0 / MIG_SLICES)
                    touched.append((i, device.parent))
                else:
                    gpu += shared.get(device.id, 1.0)
                    touched.append((i, device.id))
        busy = self.busy
        for key in touched:
            count = busy.get(key, 0)
            if count == 0:
                self.busy_gpus += 1
            busy[key] = count + 1
        self.used_cpu += cpu
        self.used_mem += mem
        self.used_gpu += gpu
        self.running[job] = (placements, cpu, mem, gpu, touched)
        self.log.started[job] = t
        heapq.heappush(self.completions, (t + trace.durations[job], job))
        self.result.placed += 1

    def _release(self, job: int, released: set[int]) -> None:
        placements, cpu, mem, gpu, touched = self.running.pop(job)
        self.last_completion = self.now
        log = self.log
        log.ended[job] = self.now
        log.nodes[job] = tuple(p.node for p in placements)
        if self.holds:
            deployment = self.trace.deployment_of[job] if len(self.trace.deployment_of) > job else -1
            if deployment >= 0:
                self.history.setdefault(deployment, deque(maxlen=HISTORY)).append(self.now - log.started[job])
        view = self.view
        for p in placements:
            view.unhold(p)
            released.add(view.index[p.node])
        busy = self.busy
        for key in touched:
            count = busy[key] - 1
            if count:
                busy[key] = count
            else:
                del busy[key]
                self.busy_gpus -= 1
        self.used_cpu -= cpu
        self.used_mem -= mem
        self.used_gpu -= gpu

    # -- metrics -----------------------------------------------------------------------------------

    def _advance(self, t: float) -> None:
        """Integrate the state held since ``self.now`` up to ``t``."""
        dt = t - self.now
        self.area_cpu += self.used_cpu * dt
        self.area_mem += self.used_mem * dt
        self.area_gpu += self.used_gpu * dt
        self.area_queue += self.queued * dt
        if self.waiting_gpu:
            self.gpu_wait_time += dt
            self.area_stranded += (self.fleet.gpus - self.busy_gpus) * dt
        if self.timeline is not None:
            self._bucket(t)
        self.now = t

    def _bucket(self, t: float) -> None:
        tl = self.timeline
        assert tl is not None
        fleet = self.fleet
        values = (self.used_cpu / fleet.cap_cpu if fleet.cap_cpu else 0.0,
                  self.used_mem / fleet.cap_mem if fleet.cap_mem else 0.0,
                  self.used_gpu / fleet.gpus if fleet.gpus else 0.0, float(self.queued))
        acc = self._tl_acc
        at = self.now
        while at < t:
            end = min(t, self._tl_end)
            span = end - at
            for k in range(4):
                acc[k] += values[k] * span
            at = end
            if end >= self._tl_end:
                self._flush(tl.width)
                self._tl_end += tl.width

    def _flush(self, span: float) -> None:
        tl = self.timeline
        assert tl is not None
        acc = self._tl_acc
        tl.times.append(self._tl_end - tl.width)
        for series, k in ((tl.cpu, 0), (tl.memory, 1), (tl.gpu, 2), (tl.queue, 3)):
            series.append(acc[k] / span if span > 0 else 0.0)
            acc[k] = 0.0

    def _finish(self) -> None:
        result = self.result
        fleet = self.fleet
        span = result.end - result.start
        result.makespan = span
        result.refused = result.not_runnable + result.admission_refused
        if span > 0:
            result.util_cpu = self.area_cpu / (fleet.cap_cpu * span) if fleet.cap_cpu else 0.0
            result.util_memory = self.area_mem / (fleet.cap_mem * span) if fleet.cap_mem else 0.0
            result.util_gpu = self.area_gpu / (fleet.gpus * span) if fleet.gpus else 0.0
            result.queue_mean = self.area_queue / span
            result.gpu_stranded = self.area_stranded / span
            result.gpu_fragmentation = result.gpu_stranded / fleet.gpus if fleet.gpus else 0.0
        result.gpu_waiting_time = self.gpu_wait_time
        if self.gpu_wait_time > 0:
            result.gpu_stranded_while_waiting = self.area_stranded / self.gpu_wait_time
        if len(self.waits):
            waits = np.frombuffer(self.waits, dtype=np.float64)
            result.wait_mean = float(waits.mean())
            result.wait_p50, result.wait_p99 = (float(v) for v in np.percentile(waits, [50, 99],
                                                                                  method="inverted_cdf"))
            result.wait_max = float(waits.max())
        tl = self.timeline
        if tl is not None:
            partial = self.now - (self._tl_end - tl.width)
            if partial > 1e-12:
                self._flush(partial)
            result.timeline = tl
        shapes = self.trace.shapes
        result.widest = self._widest()
        for k, (index, count) in enumerate(sorted(self.refused_by_shape.items(), key=lambda kv: -kv[1])):
            shape = shapes[index]
            head = f"not runnable on any node: {shape.describe()}"
            reason = f"{head}: {self.fleet.refusal_reason(shape)}" if k < REFUSAL_REASONS else head
            result.refusals[reason] = result.refusals.get(reason, 0) + count


    def _widest(self) -> dict[str, float]:
        """The widest requests (most GPUs) that were not refused: their GPUs, how many, and the longest wait (s)."""
        trace = self.trace
        width = [s.request.gpu_count for s in trace.shapes]
        started, ended = self.log.started, self.log.ended
        gpus, jobs, wait = 0, 0, 0.0
        for job in range(len(trace)):
            w = width[trace.shape_of[job]]
            if math.isnan(started[job]) and math.isnan(ended[job]) and not self._waits_still(job):
                continue  # refused
            if w > gpus:
                gpus, jobs, wait = w, 0, 0.0
            if w == gpus:
                jobs += 1
                if not math.isnan(started[job]):
                    wait = max(wait, started[job] - trace.times[job])
        return {"gpus": gpus, "jobs": jobs, "wait_max": wait}

    def _waits_still(self, job: int) -> bool:
        return job in self.line or any(job in q for q in self.waiting.values())


def simulate(nodes: list[NodeRecord], trace: Trace, strategies: tuple[str, ...] = STRATEGIES, *,
             timeline: bool = False, progress: Callable[[str, int], None] | None = None,
             holds: tuple[bool, ...] = (False,), max_holds: int = 1) -> list[Result]:
    """Replay ``trace`` once per strategy and holds setting (``holds``: with head-of-line holds, without, or
    both, in that order per strategy); ``progress(strategy, arrivals done)`` now and then."""
    fleet = ReplayFleet(nodes)
    results = []
    for strategy in strategies:
        for holding in holds:
            report = (lambda done, s=strategy: progress(s, done)) if progress is not None else None
            results.append(Replay(fleet, trace, strategy, timeline=timeline, progress=report, holds=holding,
                                  max_holds=max_holds).run())
    return results
