"""How long a run will hold what it books: the rule that gives a run its runtime estimate, and the words for it.

A run's estimate comes from, in this order (``estimate_of``):

1. **declared**: what its deployment says (the job variable ``max_runtime_seconds``, ``@requires(max_runtime_s=...)``);
2. **timeout**: a limit something else already enforces (a flow's ``timeout_seconds``, a bundle step's or a
   blueprint agent's ``timeout_seconds``): the run cannot hold its booking much past it;
3. **learned**: the p90, by nearest rank, of the durations of the last ``HISTORY`` completed runs of the same
   deployment, bundle step or blueprint agent;
4. **unknown** otherwise.

An estimate never stops a run. Only a declared value its author marked as a limit (``max_runtime_is_limit``) does,
and the worker does that, not this module. Pure: no store, no Prefect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mn_prefect.model.issues import Issues
from mn_prefect.model.scalars import shown, type_name

EstimateSource = Literal["declared", "timeout", "learned", "unknown"]

HISTORY = 20  # the completed runs a learned estimate is taken from (the most recent)
HISTORY_SIZE = HISTORY
PERCENTILE = 90  # of those durations, by nearest rank
MAX_RUNTIME_SECONDS = 10 * 365 * 86400  # ten years: anything longer is a typo, not a runtime
MAX_RUNTIME_S = float(MAX_RUNTIME_SECONDS)


@dataclass(frozen=True)
class Estimate:
    """How long a run is expected to hold its booking: ``seconds`` (None when unknown), where that came from,
    how many past runs it was learned from (0 unless learned) and whether the run is stopped when it reaches it
    (a declared limit, or a timeout that ends the run)."""

    seconds: float | None
    source: EstimateSource
    samples: int = 0
    is_limit: bool = False

    def describe(self) -> str:
        """The estimate in words people read: "about 12 min, learned from 14 runs (p90)", "declared 2 h",
        "at most 30 min (its timeout)", "unknown"."""
        if self.seconds is None or self.source == "unknown":
            return "unknown"
        length = duration_words(self.seconds)
        if self.source == "declared":
            return f"declared {length}" + (", a limit: the run is stopped then" if self.is_limit else "")
        if self.source == "timeout":
            return f"at most {length} (its timeout)"
        runs = "1 run" if self.samples == 1 else f"{self.samples} runs"
        return f"about {length}, learned from {runs} (p{PERCENTILE})"

    def as_json(self) -> dict[str, Any]:
        """``{"seconds", "source", "samples", "is_limit"}``, as ``plan --json`` prints it."""
        return {"seconds": self.seconds, "source": self.source, "samples": self.samples, "is_limit": self.is_limit}


UNKNOWN = Estimate(None, "unknown")


def estimate_of(declared: float | None, timeout: float | None, history: Sequence[float], *,
                is_limit: bool = False) -> Estimate:
    """The run's estimate: ``declared`` seconds win (``is_limit``: the author marked them a limit), then a
    ``timeout`` in seconds (a limit by nature), then the p90 of ``history`` (durations in seconds of completed
    runs, oldest first; only the last ``HISTORY`` count), else unknown."""
    if declared is not None:
        return Estimate(float(declared), "declared", is_limit=is_limit)
    if timeout is not None:
        return Estimate(float(timeout), "timeout", is_limit=True)
    learned = p90(history)
    if learned is None:
        return UNKNOWN
    return Estimate(learned, "learned", samples=min(len(history), HISTORY))


def p90(durations: Sequence[float]) -> float | None:
    """The 90th percentile, by nearest rank, of the last ``HISTORY`` of ``durations`` (seconds, oldest first); None
    when there are none."""
    recent = list(durations)[-HISTORY:]
    return nearest_rank(recent, PERCENTILE) if recent else None


def nearest_rank(values: Sequence[float], percentile: float) -> float:
    """The ``percentile`` (0 < p <= 100) of ``values`` by nearest rank: the smallest value at least that share of
    the values is at or below (of 10 values, p90 is the 9th smallest)."""
    if not values:
        raise ValueError("the percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(percentile / 100 * len(ordered)))
    return float(ordered[rank - 1])


def kept_history(durations: Sequence[float], seconds: float) -> list[float]:
    """``durations`` (oldest first) with ``seconds`` appended, only the last ``HISTORY`` kept."""
    return [*durations, float(seconds)][-HISTORY:]


def is_sample(seconds: float) -> bool:
    """Whether a measured duration may be learned from: finite and not negative (a clock that stepped back
    gives a negative one)."""
    return math.isfinite(seconds) and seconds >= 0


def runtime_problem(value: Any) -> str | None:
    """What is wrong with ``value`` as a number of seconds a run takes (a positive finite number of at most ten
    years; a bool or a numeric string is no number here), or None when nothing is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number of seconds, got {type_name(value)} {shown(value)}"
    if isinstance(value, float) and not math.isfinite(value):  # an int is finite, math.isfinite() of a huge one raises
        return f"must be a finite number of seconds, got {value!r}"
    if value <= 0:
        return f"must be more than 0 seconds, got {shown(value)}"
    if value > MAX_RUNTIME_SECONDS:
        return f"must be at most {MAX_RUNTIME_SECONDS} seconds (ten years), got {shown(value)}"
    return None


def check_max_runtime(value: object, field: str) -> float:
    """``value`` as seconds; ValueError naming ``field`` unless it is a positive finite number (not a bool) of at
    most ``MAX_RUNTIME_SECONDS``."""
    problem = runtime_problem(value)
    if problem is not None:
        raise ValueError(f"{field}: {problem}")
    return float(value)  # type: ignore[arg-type]  # runtime_problem found it a number


def read_max_runtime(value: Any, path: str, issues: Issues) -> float | None:
    """A declared runtime in seconds, None when absent; a bad one is added to ``issues`` naming ``path`` (so every
    problem of an input is reported at once)."""
    if value is None:
        return None
    problem = runtime_problem(value)
    if problem is not None:
        issues.add(path, problem)
        return None
    return float(value)


def limit_message(seconds: float, field: str = "max_runtime_seconds") -> str:
    """The state message of a run stopped at its declared limit."""
    return (f"mn: stopped after {duration_words(seconds)}: it reached its declared limit ({field}={seconds:g}, "
            "max_runtime_is_limit)")


def duration_words(seconds: float) -> str:
    """A duration for people: "45 s", "12 min", "2 h", "2.5 h", "3 d"."""
    if seconds < 90:
        return f"{_round(seconds)} s"
    if seconds < 90 * 60:
        return f"{_round(seconds / 60)} min"
    if seconds < 48 * 3600:
        return f"{_round(seconds / 3600)} h"
    return f"{_round(seconds / 86400)} d"


def _round(value: float) -> str:
    """Whole below 10 only when whole ("2", "2.5"); whole from 10 on ("12")."""
    if value >= 10:
        return str(round(value))
    tenth = round(value, 1)
    return f"{tenth:g}"
