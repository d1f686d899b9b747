"""Reading a simulator trace: one JSON object a line, checked line by line (docs/simulator.md).

A line is ``{"t": seconds, "job": id, "duration": seconds, "resources": {...}, "job_type": "batch"}``:
``t`` (arrival, >= 0) and ``duration`` (>= 0) are required numbers, ``job`` a required, unique, non-empty
string (an integer is read as its decimal string), ``resources`` any request of docs/resources.md (absent:
an empty request), ``job_type`` one of service, batch (default), system, sysbatch. For a replay with queues
(simulate/fair.py) a line may name its ``queue`` (a string), ``priority`` (an integer, default the queue's) and
whether it is ``preemptible`` (default false), and ``checkpoint_every_s`` (a finite number >= 0, seconds: the job
checkpoints every so many seconds of its run, so an eviction loses only the work since its last checkpoint; 0:
never; absent: the replay's ``--checkpoint-every``). A line may declare its runtime estimate ``max_runtime_s`` (a number
above 0, seconds) and its ``deployment`` (a non-empty string, whose completed jobs' durations estimate the
runtime of the next: scheduler/holds.py). ``gang`` (an integer, 1 to 1024, default 1; batch and service jobs) makes
the job a gang of that many agents, each asking ``resources``, placed all or nothing as a multi-agent job is (on
one node when they fit together, else agent by agent), held on a set of distinct nodes. Blank lines are ignored. Any other key is an error, as in
``resources``: a misspelt ``job_tpye`` would otherwise silently be a batch job.

A bad line is a ``BadLine`` naming its line number and the field (``resources.devices[0].shares``); the
caller skips it or stops (``--strict``). Jobs with the same request and job type share one ``Shape``: the
request is parsed once, and the simulator's queue and caches work per shape.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mn_prefect.model.issues import Issue, Issues
from mn_prefect.model.policies import JOB_TYPES
from mn_prefect.model.queues import MAX_PRIORITY
from mn_prefect.model.resources import ResourceRequest, parse_resources
from mn_prefect.model.scalars import read_bool, read_int, read_number, read_string, type_name
from mn_prefect.scheduler.ask import Ask

LINE_KEYS = ("t", "job", "duration", "resources", "job_type", "queue", "priority", "preemptible", "max_runtime_s",
             "deployment", "gang", "checkpoint_every_s")
MAX_GANG = 1024  # agents of one gang at most
SYSTEM_JOB_TYPES = ("system", "sysbatch")
KEEP_BAD = 20  # bad lines kept with their messages (all are counted)


@dataclass(frozen=True, slots=True)
class BadLine:
    """A trace line that was not read, with every problem found on it."""

    line: int
    problems: tuple[Issue, ...]

    def __str__(self) -> str:
        return f"line {self.line}: " + "; ".join(str(p) for p in self.problems)

    def as_dict(self) -> dict[str, Any]:
        return {"line": self.line, "errors": [p.as_dict() for p in self.problems]}


@dataclass(frozen=True, slots=True)
class Shape:
    """A distinct (request, job type) of the trace; every job of this shape asks exactly this."""

    index: int
    request: ResourceRequest
    job_type: str
    ask: Ask
    # Whether it asks for GPU devices (whole, MIG slices or a fraction): a waiting one counts toward stranded GPUs.
    asks_gpu: bool
    source: str  # the request as the trace wrote it (JSON)
    gang: int = 1  # agents placed together, all or nothing (each asks ``request``)
    gang_asks: tuple[Ask, ...] = ()  # a gang's asks, one per agent (empty for one agent)

    @property
    def system(self) -> bool:
        return self.job_type in SYSTEM_JOB_TYPES

    @property
    def asks(self) -> tuple[Ask, ...]:
        """What the job asks, one ask per agent."""
        return self.gang_asks or (self.ask,)

    @property
    def planned(self) -> bool:
        """Placed by the whole job's plan (``plan_asks``): a system job, or a gang of several agents."""
        return self.system or self.gang > 1

    def describe(self) -> str:
        """The request in the trace's own terms, for people."""
        text = self.source if self.gang == 1 else f"{self.gang} x {self.source}"
        return text if self.job_type == "batch" else f"{text} ({self.job_type})"


@dataclass
class Trace:
    """The jobs of a trace in file order (``times``, ``durations``, ``shape_of`` and ``ids`` in step)."""

    times: array[float] = field(default_factory=lambda: array("d"))
    durations: array[float] = field(default_factory=lambda: array("d"))
    shape_of: array[int] = field(default_factory=lambda: array("q"))
    ids: list[str] = field(default_factory=list)
    lines: array[int] = field(default_factory=lambda: array("q"))
    shapes: list[Shape] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)  # the first KEEP_BAD
    bad_count: int = 0
    queue_of: array[int] = field(default_factory=lambda: array("q"))  # index in ``queues``, -1 for none
    queues: list[str] = field(default_factory=list)
    priority_of: list[int | None] = field(default_factory=list)
    preemptible: array[int] = field(default_factory=lambda: array("b"))
    max_runtime: array[float] = field(default_factory=lambda: array("d"))  # declared estimate, s; nan: none
    deployment_of: array[int] = field(default_factory=lambda: array("q"))  # index in ``deployments``, -1 none
    deployments: list[str] = field(default_factory=list)
    checkpoint_every: array[float] = field(default_factory=lambda: array("d"))  # s between checkpoints; nan: none

    def __len__(self) -> int:
        return len(self.times)


class TraceReader:
    """Reads lines into a ``Trace``; ``feed`` one line at a time (so a caller can show progress)."""

    def __init__(self) -> None:
        self.trace = Trace()
        self._shapes: dict[str, int] = {}  # canonical JSON of (resources, job type) -> shape index
        self._bad_shapes: dict[str, tuple[Issue, ...]] = {}
        self._seen: set[str] = set()
        self._queues: dict[str, int] = {}
        self._deployments: dict[str, int] = {}

    def feed(self, number: int, text: str) -> None:
        text = text.strip()
        if not text:
            return
        problems = self._read(number, text)
        if problems:
            trace = self.trace
            trace.bad_count += 1
            if len(trace.bad) < KEEP_BAD:
                trace.bad.append(BadLine(number, tuple(problems)))

    def _read(self, number: int, text: str) -> list[Issue]:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            return [Issue("(line)", f"malformed JSON at column {error.colno}: {error.msg}")]
        except RecursionError:
            return [Issue("(line)", "JSON is nested too deeply")]
        if not isinstance(raw, dict):
            return [Issue("(line)", f"must be a JSON object, got {type_name(raw)}")]
        issues = Issues()
        for key in raw:
            if key not in LINE_KEYS:
                issues.add(str(key), f"unknown key (a trace line has {', '.join(LINE_KEYS)})")
        t = _required_number(raw, "t", issues)
        duration = _required_number(raw, "duration", issues)
        job = self._job_id(raw, issues)
        job_type = raw.get("job_type", "batch")
        if job_type not in JOB_TYPES:
            issues.add("job_type", f"unknown job type {job_type!r} (allowed: {', '.join(JOB_TYPES)})")
            job_type = None
        gang = read_int(raw["gang"], "gang", issues, minimum=1, maximum=MAX_GANG) if raw.get("gang") is not None else 1
        if gang is not None and gang > 1 and job_type in SYSTEM_JOB_TYPES:
            issues.add("gang", f"a {job_type} job runs one copy per node: it is no gang")
            gang = None
        shape = self._shape(raw.get("resources"), job_type, gang, issues) \
            if job_type is not None and gang is not None else None
        queue = read_string(raw["queue"], "queue", issues) if raw.get("queue") is not None else None
        priority = read_int(raw["priority"], "priority", issues, minimum=-MAX_PRIORITY, maximum=MAX_PRIORITY) \
            if raw.get("priority") is not None else None
        preemptible = read_bool(raw["preemptible"], "preemptible", issues) if "preemptible" in raw else False
        max_runtime = _estimate(raw["max_runtime_s"], issues) if "max_runtime_s" in raw else math.nan
        checkpoint_every = _checkpoint_every(raw["checkpoint_every_s"], issues) \
            if raw.get("checkpoint_every_s") is not None else math.nan
        deployment = raw.get("deployment")
        if deployment is not None and (not isinstance(deployment, str) or not deployment.strip()):
            issues.add("deployment", f"must be a non-empty string, got {deployment!r}")
        if issues:
            return issues.items
        assert t is not None and duration is not None and job is not None and shape is not None
        trace = self.trace
        self._seen.add(job)
        trace.times.append(t)
        trace.durations.append(duration)
        trace.shape_of.append(shape)
        trace.ids.append(job)
        trace.lines.append(number)
        if queue is not None and queue not in self._queues:
            self._queues[queue] = len(trace.queues)
            trace.queues.append(queue)
        trace.queue_of.append(self._queues[queue] if queue is not None else -1)
        trace.priority_of.append(priority)
        trace.preemptible.append(1 if preemptible else 0)
        trace.max_runtime.append(max_runtime)
        trace.checkpoint_every.append(checkpoint_every)
        if deployment is not None and deployment not in self._deployments:
            self._deployments[deployment] = len(trace.deployments)
            trace.deployments.append(deployment)
        trace.deployment_of.append(self._deployments[deployment] if deployment is not None else -1)
        return []

    def _job_id(self, raw: dict[str, Any], issues: Issues) -> str | None:
        if "job" not in raw:
            issues.add("job", "is required")
            return None
        job = raw["job"]
        if isinstance(job, int) and not isinstance(job, bool):
            job = str(job)
        if not isinstance(job, str) or not job.strip():
            issues.add("job", f"must be a non-empty string, got {job!r}")
            return None
        if job in self._seen:
            first = self.trace.lines[self.trace.ids.index(job)]
            issues.add("job", f"duplicate job id {job!r} (first on line {first})")
            return None
        return job

    def _shape(self, resources: Any, job_type: str, gang: int, issues: Issues) -> int | None:
        source = json.dumps(resources if resources is not None else {}, sort_keys=True, separators=(",", ":"))
        key = f"{job_type}|{gang}|{source}"
        index = self._shapes.get(key)
        if index is not None:
            return index
        known = self._bad_shapes.get(key)
        if known is not None:
            issues.extend(list(known))
            return None
        found = Issues()
        request = parse_resources(resources, "resources", found)
        if found or request is None:
            self._bad_shapes[key] = tuple(found.items)
            issues.extend(found.items)
            return None
        shapes = self.trace.shapes
        index = self._shapes[key] = len(shapes)
        ask = Ask(agent_id="job", source_agent_id="job", request=request)
        gang_asks = () if gang == 1 else tuple(Ask(agent_id=f"job-{k}", source_agent_id=f"job-{k}", request=request)
                                               for k in range(gang))
        asks_gpu = any(d.kind == "gpu" for d in request.devices)
        shapes.append(Shape(index=index, request=request, job_type=job_type, ask=gang_asks[0] if gang_asks else ask,
                            asks_gpu=asks_gpu, source=source, gang=gang, gang_asks=gang_asks))
        return index


def _required_number(raw: dict[str, Any], key: str, issues: Issues) -> float | None:
    if key not in raw:
        issues.add(key, "is required (seconds, a number >= 0)")
        return None
    value = read_number(raw[key], key, issues)
    return value if value is None or math.isfinite(value) else None


def _estimate(value: Any, issues: Issues) -> float:
    """A declared ``max_runtime_s``: a finite number above 0 (seconds); nan after an issue."""
    number = read_number(value, "max_runtime_s", issues)
    if number is None:
        return math.nan
    if not (math.isfinite(number) and number > 0):
        issues.add("max_runtime_s", f"must be a number of seconds above 0, got {value!r}")
        return math.nan
    return number


def _checkpoint_every(value: Any, issues: Issues) -> float:
    """A line's ``checkpoint_every_s``: a finite number >= 0 (seconds; 0: never checkpoints); nan after an issue."""
    number = read_number(value, "checkpoint_every_s", issues)
    if number is None:
        return math.nan
    if not (math.isfinite(number) and number >= 0):
        issues.add("checkpoint_every_s", f"must be a finite number of seconds >= 0, got {value!r}")
        return math.nan
    return number


def read_trace(lines: Iterable[str], progress: Callable[[int], None] | None = None, every: int = 10_000) -> Trace:
    """Every line of ``lines`` (numbered from 1) into a Trace; ``progress`` is called with the characters read
    so far every ``every`` lines."""
    reader = TraceReader()
    done = 0
    for number, text in enumerate(lines, 1):
        reader.feed(number, text)
        if progress is not None:
            done += len(text)
            if number % every == 0:
                progress(done)
    if progress is not None:
        progress(done)
    return reader.trace
