"""A bundle's ``schedule`` as the schedules of its Prefect deployment.

MirrorNeuron's periodic schedule (``{"kind": "periodic", "crons": ["@hourly"], "timezone": "UTC", "enabled":
true, "prohibit_overlap": true, ...}``) becomes one cron schedule per entry of ``crons`` on the bundle's
``mn-bundle-run/<name>`` deployment, active when ``enabled``; ``prohibit_overlap`` becomes the deployment's
concurrency limit of 1, so a run never starts while the one before it still runs. Prefect's scheduler then makes
the runs (Scheduled flow runs, visible in the UI). ``missed_policy: skip`` is what Prefect's scheduler does: it
never backfills missed slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mn_prefect.model.issues import Issues
from mn_prefect.model.scalars import shown

KINDS = ("periodic", "cron")
MISSED = ("skip", None)


@dataclass(frozen=True)
class BundleSchedule:
    crons: tuple[str, ...]
    timezone: str
    active: bool
    no_overlap: bool


def parse_schedule(document: dict[str, Any], issues: Issues) -> BundleSchedule | None:
    """The manifest's ``schedule`` (None when it has none); every problem is an issue naming its field."""
    raw = document.get("schedule")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        issues.add("schedule", "must be an object (kind, crons, timezone, enabled)")
        return None
    kind = raw.get("kind", "periodic")
    if kind not in KINDS:
        issues.add("schedule.kind", f"{shown(kind)} is not a schedule mn-prefect runs (periodic: crons)")
    crons = raw.get("crons")
    if isinstance(raw.get("cron"), str) and crons is None:
        crons = [raw["cron"]]
    if not isinstance(crons, list) or not crons:
        issues.add("schedule.crons", "a list of at least one cron expression is required (e.g. [\"@hourly\"])")
        crons = []
    timezone = raw.get("timezone") or "UTC"
    if not isinstance(timezone, str):
        issues.add("schedule.timezone", "must be a time zone name such as UTC or Europe/Paris")
        timezone = "UTC"
    if raw.get("missed_policy") not in MISSED:
        issues.add("schedule.missed_policy", f"{shown(raw['missed_policy'])}: mn-prefect skips missed runs (skip)")
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    for i, cron in enumerate(crons):
        try:
            CronSchedule(cron=cron, timezone=timezone)
        except ValidationError as error:
            first = error.errors(include_url=False)[0]
            if first["loc"] and first["loc"][0] == "timezone":
                issues.add("schedule.timezone", first["msg"].removeprefix("Value error, "))
                break
            issues.add(f"schedule.crons[{i}]", first["msg"].removeprefix("Value error, "))
    return BundleSchedule(crons=tuple(c for c in crons if isinstance(c, str)), timezone=timezone,
                          active=raw.get("enabled", True) is not False, no_overlap=bool(raw.get("prohibit_overlap")))


def deployment_schedules(schedule: BundleSchedule) -> list[Any]:
    """Prefect's DeploymentScheduleCreate for each cron of ``schedule``."""
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule

    return [DeploymentScheduleCreate(schedule=CronSchedule(cron=cron, timezone=schedule.timezone),
                                     active=schedule.active) for cron in schedule.crons]
