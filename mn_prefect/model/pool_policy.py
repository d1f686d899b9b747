"""A pool's admission policy: which runs it refuses (a deny-list), the default priority of runs by tag, and whether
(and how many) head-of-line holds it makes.

A rule of the deny-list matches a run's ``deployment`` (``flow/deployment`` name), its ``flow`` name or one of its
``tag`` s against a glob pattern (``*``, ``?``, ``[...]``, any case) and says why: ``tag:experimental*`` with
the reason "no experiments on the production pool". A run that matches any rule is refused before anything is
booked, with that reason. A default priority per tag gives a run without a ``priority`` of its own the highest
of its tags' priorities (else its queue's). Pure: parsing with path-named errors and the two decisions.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mn_prefect.model.grace import DEFAULT_POOL_MAX_GRACE_S, MAX_GRACE_S
from mn_prefect.model.issues import Issues
from mn_prefect.model.queues import MAX_PRIORITY
from mn_prefect.model.scalars import read_int, read_string

Subject = Literal["deployment", "flow", "tag"]
SUBJECTS: tuple[Subject, ...] = ("deployment", "flow", "tag")


class DenyRule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    subject: Subject
    pattern: str = Field(min_length=1, max_length=200)
    reason: str = Field(min_length=1, max_length=500)

    def matches(self, value: str) -> bool:
        return fnmatch.fnmatchcase(value.lower(), self.pattern.lower())

    def __str__(self) -> str:
        return f"{self.subject}:{self.pattern}"


class PoolPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    deny: tuple[DenyRule, ...] = ()
    tag_priorities: dict[str, int] = Field(default_factory=dict)
    holds: bool = Field(True, description="Whether the first waiting run that does not fit gets a head-of-line hold "
                                          "(docs/scheduling.md, \"Holds and backfill\"; on by default); off: greedy order.")
    max_holds: int = Field(1, ge=0, le=100, description="Holds standing at once per queue (per pool without queues).")
    max_preemption_grace_s: float = Field(
        DEFAULT_POOL_MAX_GRACE_S, ge=0, le=MAX_GRACE_S, allow_inf_nan=False,
        description="The longest preemption_grace_seconds a run of the pool may ask for; a run asking for more is "
                    "refused before anything is booked.")
    idle_gpu_percent: float = Field(
        5.0, ge=0, le=100, allow_inf_nan=False,
        description="A booked GPU under this utilisation (percent) for idle_gpu_seconds is idle: mn.device.idle.")
    idle_gpu_seconds: float = Field(
        1800.0, gt=0, le=7 * 86400, allow_inf_nan=False,
        description="How long a booked GPU stays under idle_gpu_percent before it is said idle.")

    def refusal(self, *, deployment: str | None, flow: str | None, tags: Iterable[str]) -> str | None:
        """Why the pool refuses a run (the first rule it matches, with what matched), or None."""
        values = {"deployment": [deployment] if deployment else [], "flow": [flow] if flow else [],
                  "tag": list(tags)}
        for rule in self.deny:
            for value in values[rule.subject]:
                if rule.matches(value):
                    return f"refused by the pool's deny-list: {rule.reason} ({rule.subject} {value!r} matches {rule})"
        return None

    def priority_for(self, tags: Iterable[str]) -> int | None:
        """The highest default priority among the run's tags (exact tag names, any case), or None."""
        by_tag = {t.lower(): p for t, p in self.tag_priorities.items()}
        found = [by_tag[t.lower()] for t in tags if t.lower() in by_tag]
        return max(found) if found else None


def parse_deny(text: str, path: str, issues: Issues) -> DenyRule | None:
    """``SUBJECT:PATTERN=REASON`` from the command line (``tag:experimental*=no experiments here``)."""
    head, sep, reason = text.partition("=")
    subject, colon, pattern = head.partition(":")
    subject = subject.strip().lower()
    if not sep or not colon or subject not in SUBJECTS or not pattern.strip() or not reason.strip():
        issues.add(path, f"{text!r} is not SUBJECT:PATTERN=REASON with SUBJECT one of {', '.join(SUBJECTS)} "
                         "(e.g. tag:experimental*=no experiments on this pool)")
        return None
    return DenyRule(subject=subject, pattern=pattern.strip(), reason=reason.strip())


def parse_tag_priority(text: str, path: str, issues: Issues) -> tuple[str, int] | None:
    """``TAG=PRIORITY`` from the command line."""
    tag, sep, value = text.partition("=")
    if not sep or read_string(tag.strip(), path, issues) is None:
        if not sep:
            issues.add(path, f"{text!r} is not TAG=PRIORITY (e.g. urgent=50)")
        return None
    priority = read_int(value.strip(), path, issues, minimum=-MAX_PRIORITY, maximum=MAX_PRIORITY)
    return (tag.strip(), priority) if priority is not None else None
