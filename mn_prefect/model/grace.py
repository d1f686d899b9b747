"""How long a preempted run is given to checkpoint before it is stopped (job variable ``preemption_grace_seconds``).

A number of seconds from 0 (stopped at once, as before notices existed) to the pool's maximum (``PoolPolicy``'s
``max_preemption_grace_s``, 600 s by default; never above a day). Pure: reading with path-named problems.
"""

from __future__ import annotations

import math
from typing import Any

from mn_prefect.model.issues import Issues
from mn_prefect.model.scalars import type_name

DEFAULT_GRACE_S = 30.0
DEFAULT_POOL_MAX_GRACE_S = 600.0
MAX_GRACE_S = 86400.0


def grace_problem(value: Any, maximum: float = MAX_GRACE_S) -> str | None:
    """What is wrong with ``value`` as a grace in seconds, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a number of seconds, got {type_name(value)}"
    if not math.isfinite(value):
        return f"must be a finite number of seconds, got {value}"
    if value < 0:
        return f"must be 0 or more seconds, got {value:g}"
    if value > maximum:
        return f"is {value:g} s, above the maximum of {maximum:g} s"
    return None


def read_grace(value: Any, path: str, issues: Issues) -> float | None:
    """A declared grace in seconds, None when absent; a bad one is added to ``issues`` naming ``path``."""
    if value is None:
        return None
    problem = grace_problem(value)
    if problem is not None:
        issues.add(path, problem)
        return None
    return float(value)


def above_pool_maximum(seconds: float, maximum: float) -> str | None:
    """Why a run's grace is refused by its pool (named by its job variable), or None."""
    if seconds <= maximum:
        return None
    return (f"preemption_grace_seconds: {seconds:g} s is above the pool's maximum of {maximum:g} s "
            "(mn-prefect queue policy --max-preemption-grace)")
