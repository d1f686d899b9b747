"""Restart and reschedule policies (docs/concepts.md): defaults per job type, delays, the sliding window."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mn_prefect.model.issues import Issues, child
from mn_prefect.model.scalars import read_bool, read_int, shown, type_name

JOB_TYPES = ("service", "batch", "system", "sysbatch")
STRATEGIES = ("binpack", "spread")
RECOVERY_MODES = ("local_restart", "cluster_recover", "manual_recover")
DELAY_FUNCTIONS = ("constant", "exponential", "fibonacci")
POLICY_MODES = ("fail", "delay")
_INT_FIELDS = ("attempts", "interval_ms", "delay_ms", "max_delay_ms")
POLICY_KEYS = (*_INT_FIELDS, "delay_function", "mode", "unlimited")

JobType = Literal["service", "batch", "system", "sysbatch"]
Strategy = Literal["binpack", "spread"]
RecoveryMode = Literal["local_restart", "cluster_recover", "manual_recover"]

_MINUTE = 60_000
_HOUR = 60 * _MINUTE


class RetryPolicy(BaseModel):
    """A restart or reschedule policy: ``attempts`` inside a sliding window of ``interval_ms``."""

    model_config = ConfigDict(frozen=True)

    attempts: int = Field(0, ge=0, description="Attempts allowed inside the window.")
    interval_ms: int = Field(0, ge=0, description="Sliding window length in ms.")
    delay_ms: int = Field(0, ge=0, description="Base delay in ms.")
    delay_function: Literal["constant", "exponential", "fibonacci"] = "constant"
    max_delay_ms: int = Field(0, ge=0, description="Cap on any delay in ms.")
    mode: Literal["fail", "delay"] = Field("fail", description="When attempts run out: fail, or wait for the window.")
    unlimited: bool = Field(False, description="Ignore `attempts`: always allowed.")

    def delay_for(self, attempt: int) -> int:
        """Delay in ms before attempt number ``attempt`` (1-based)."""
        return retry_delay_ms(self, attempt)

    def allows(self, attempt_times_ms: list[int], now_ms: int) -> bool:
        """Whether another attempt is allowed now, given the times of earlier attempts."""
        return self.unlimited or attempts_in_window(attempt_times_ms, now_ms, self.interval_ms) < self.attempts

    def remaining(self, attempt_times_ms: list[int], now_ms: int) -> int | None:
        """Attempts left in the window now; None when unlimited."""
        if self.unlimited:
            return None
        return max(0, self.attempts - attempts_in_window(attempt_times_ms, now_ms, self.interval_ms))


def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def retry_delay_ms(policy: RetryPolicy, attempt: int) -> int:
    """constant = delay; exponential = delay * 2^(n-1); fibonacci = delay * fib(n); capped at max_delay_ms."""
    n = max(1, attempt)
    cap = policy.max_delay_ms if policy.max_delay_ms > 0 else None
    if policy.delay_function == "constant":
        raw = policy.delay_ms
    elif policy.delay_function == "exponential":
        # Stop growing once past the cap: 2**n for huge n is wasted work.
        raw = policy.delay_ms * (1 << min(n - 1, 64))
    else:
        raw = policy.delay_ms * fibonacci(min(n, 100))
    return min(raw, cap) if cap is not None else raw


def attempts_in_window(attempt_times_ms: list[int], now_ms: int, interval_ms: int) -> int:
    """Attempts whose time lies inside ``(now - interval, now]``; interval 0 means no window (all count)."""
    if interval_ms <= 0:
        return sum(1 for t in attempt_times_ms if t <= now_ms)
    start = now_ms - interval_ms
    return sum(1 for t in attempt_times_ms if start < t <= now_ms)


def default_restart(job_type: str) -> RetryPolicy:
    if job_type in ("service", "system"):
        return RetryPolicy(attempts=3, interval_ms=10 * _MINUTE, delay_ms=1000,
                           delay_function="exponential", max_delay_ms=30_000, mode="fail")
    return RetryPolicy(attempts=3, interval_ms=24 * _HOUR, delay_ms=1000,
                       delay_function="exponential", max_delay_ms=30_000, mode="fail")


def default_reschedule(job_type: str, recovery_mode: str) -> RetryPolicy:
    if recovery_mode != "cluster_recover":
        return RetryPolicy(attempts=0, unlimited=False)
    if job_type in ("service", "system"):
        return RetryPolicy(attempts=0, unlimited=True, delay_ms=5000, delay_function="exponential",
                           max_delay_ms=5 * _MINUTE, interval_ms=0)
    return RetryPolicy(attempts=1, interval_ms=24 * _HOUR, delay_ms=5000, delay_function="constant",
                       max_delay_ms=5000)


def parse_policy_fields(raw: Any, path: str, issues: Issues) -> dict[str, Any] | None:
    """Validate a raw restart/reschedule object; returns only the fields it sets (for layering)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        issues.add(path, f"must be an object, got {type_name(raw)}")
        return None
    before = len(issues)
    out: dict[str, Any] = {}
    for key in _INT_FIELDS:
        if key in raw:
            value = read_int(raw[key], child(path, key), issues, allow_strings=False,
                             what="a non-negative integer")
            if value is not None:
                out[key] = value
    if "delay_function" in raw:
        if raw["delay_function"] not in DELAY_FUNCTIONS:
            issues.add(child(path, "delay_function"),
                       f"unknown delay function {shown(raw['delay_function'])} (allowed: {', '.join(DELAY_FUNCTIONS)})")
        else:
            out["delay_function"] = raw["delay_function"]
    if "mode" in raw:
        if raw["mode"] not in POLICY_MODES:
            issues.add(child(path, "mode"), f"unknown mode {shown(raw['mode'])} (allowed: fail, delay)")
        else:
            out["mode"] = raw["mode"]
    if "unlimited" in raw:
        value = read_bool(raw["unlimited"], child(path, "unlimited"), issues)
        if value is not None:
            out["unlimited"] = value
    return out if len(issues) == before else None


def layered(base: RetryPolicy, *overrides: dict[str, Any] | None) -> RetryPolicy:
    """``base`` with each override's fields laid on top, later ones winning."""
    merged = base.model_dump()
    for override in overrides:
        if override:
            merged.update(override)
    return RetryPolicy(**merged)
