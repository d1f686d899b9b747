"""What a job does when one of its agents stops (docs/concepts.md, "Job types"): restart within policy, complete, or
fail.

Pure decisions over times in milliseconds; the coordinator flow applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mn_prefect.model.policies import RetryPolicy, attempts_in_window

Action = Literal["complete", "restart", "fail"]
RUN_TO_COMPLETION = ("batch", "sysbatch")


@dataclass(frozen=True)
class ExitDecision:
    """``restart`` after ``delay_ms``; ``complete`` (the agent is done); ``fail`` (the job fails)."""

    action: Action
    delay_ms: int = 0
    reason: str = ""
    counts: bool = True  # whether this restart uses one of the policy's attempts


def after_exit(job_type: str, policy: RetryPolicy, restarts_ms: list[int], now_ms: int, *, succeeded: bool,
               how: str) -> ExitDecision:
    """Decide what follows an agent's exit. ``restarts_ms``: when earlier restarts happened; ``how``: the
    exit in words, for the reason."""
    if succeeded and job_type in RUN_TO_COMPLETION:
        return ExitDecision("complete", reason=f"completed ({how})")
    what = "failed" if not succeeded else "exited unexpectedly"
    used = attempts_in_window(restarts_ms, now_ms, policy.interval_ms)
    if policy.allows(restarts_ms, now_ms):
        delay = policy.delay_for(used + 1)
        return ExitDecision("restart", delay_ms=delay,
                            reason=f"{what} ({how}); restart {used + 1}{_of(policy)} in {delay / 1000:g} s")
    window = f"{policy.interval_ms / 1000:g} s" if policy.interval_ms else "the job's life"
    if policy.attempts == 0:
        return ExitDecision("fail", reason=f"{what} ({how}); the restart policy allows no restarts")
    if policy.mode == "delay" and policy.interval_ms > 0:
        in_window = sorted(t for t in restarts_ms if now_ms - policy.interval_ms < t <= now_ms)
        # Wait until enough of the oldest restarts have left the window that one more fits, then restart (as
        # Nomad's mode "delay"): the oldest alone when the window holds exactly `attempts`, more when it holds more.
        wait = max(in_window[-policy.attempts] + policy.interval_ms - now_ms,
                   policy.delay_for(used + 1)) if in_window else 0
        return ExitDecision("restart", delay_ms=wait,
                            reason=f"{what} ({how}); {used} restarts in {window} used up, waiting {wait / 1000:g} s "
                                   "for the window (mode delay)")
    return ExitDecision("fail", reason=f"{what} ({how}); restart attempts exhausted ({policy.attempts} in {window})")


def _of(policy: RetryPolicy) -> str:
    return "" if policy.unlimited else f" of {policy.attempts}"
