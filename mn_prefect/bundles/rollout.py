"""Deployments of a bundle under a stable key, version by version, as Nomad rolls out a job: the rules.

A deployment keeps every version of its bundle. Deploying a new version starts its run(s); what happens to the
version before depends on the update policy (``policies.update`` in the manifest, or what the client sends):

- ``rolling`` (and ``blue-green``, the same for one run): the new version runs beside the stable one; once it is
  healthy it becomes the stable version and the old version's runs are cancelled.
- ``canary`` with ``canary: N``: N canary runs of the new version start beside the stable version. Once they are
  healthy the deployment waits for a promotion (``auto_promote`` promotes at once); promoting makes the new version
  stable and cancels the old version's runs. The first version of a deployment has nothing to be a canary beside:
  it rolls out directly.

A run is healthy once it has been running for ``min_healthy_ms`` (or has completed); it is unhealthy when it fails,
crashes or is cancelled first, or is not healthy ``healthy_deadline_ms`` after it started. A version that is not
healthy ``progress_deadline_ms`` after its first run started fails. Deadlines count from a run's start on a node,
so a version waiting for capacity does not fail for it (``fail`` ends such a rollout). A failed version with
``auto_revert`` has its runs cancelled, leaving the stable version serving; without it its runs are left for a
person to look at, and ``rollback`` makes a new version from an older one's bundle.

``pause`` holds the automatic steps (promotion, failure) until ``resume``. Deploying while a rollout is under way
cancels that rollout's runs.

Every function here decides and returns the new state with the effects to carry out, as values; the MirrorNeuron
API's deployments (mn_prefect.mn_api.deployments) carry them out on Prefect and keep the state.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, Field

from mn_prefect.model.issues import Issues

Strategy = Literal["rolling", "canary", "blue-green"]
STRATEGIES = ("rolling", "canary", "blue-green")
VersionStatus = Literal["canary", "rolling", "stable", "superseded", "failed", "cancelled"]
DeploymentStatus = Literal["running", "awaiting_promotion", "paused", "successful", "failed", "cancelled"]
IN_ROLLOUT = ("canary", "rolling")
RUN_FAILED = ("FAILED", "CRASHED", "CANCELLED", "CANCELLING")


class UpdatePolicy(BaseModel):
    strategy: Strategy = "rolling"
    canary: int = Field(0, ge=0)
    max_parallel: int = Field(1, ge=1)
    auto_promote: bool = False
    auto_revert: bool = False
    min_healthy_ms: int = Field(250, ge=0)
    healthy_deadline_ms: int = Field(300_000, ge=0)  # 0: no deadline
    progress_deadline_ms: int = Field(600_000, ge=0)  # 0: no deadline


_POLICY_INTS = ("canary", "max_parallel", "min_healthy_ms", "healthy_deadline_ms", "progress_deadline_ms")


def parse_policy(given: dict[str, Any], path: str) -> UpdatePolicy:
    """An update policy from a manifest's ``policies.update`` or a client's ``update_policy_json`` (unknown keys,
    such as the interface ``version`` or ``health_check``, are ignored). Bad values raise InvalidInput naming the
    field under ``path``."""
    issues = Issues()
    strategy = given.get("strategy", "rolling")
    if strategy not in STRATEGIES:
        issues.add(f"{path}.strategy", f"{strategy!r}: one of {', '.join(STRATEGIES)}")
    for name in _POLICY_INTS:
        value = given.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            issues.add(f"{path}.{name}", f"{value!r}: a whole number, 0 or more")
    if isinstance(given.get("max_parallel"), int) and given["max_parallel"] == 0:
        issues.add(f"{path}.max_parallel", "0: at least 1")
    for name in ("auto_promote", "auto_revert"):
        if name in given and not isinstance(given[name], bool):
            issues.add(f"{path}.{name}", f"{given[name]!r}: true or false")
    if strategy == "canary" and not given.get("canary"):
        issues.add(f"{path}.canary", "a canary strategy needs canary: 1 or more (how many canary runs)")
    issues.raise_if_any()
    return UpdatePolicy.model_validate({k: v for k, v in given.items() if k in UpdatePolicy.model_fields})


class VersionRun(BaseModel):
    run_id: str
    flow_run_id: str | None = None  # set once the run is created in Prefect


class Version(BaseModel):
    version: int
    tag: str = ""  # the manifest's own version, if it has one
    status: VersionStatus
    canary: bool = False
    runs: list[VersionRun] = Field(default_factory=list)
    created_at: datetime
    healthy_at: datetime | None = None
    ended_at: datetime | None = None
    reason: str = ""
    source_version: int | None = None  # a rollback's version: whose bundle it runs


class Deployment(BaseModel):
    key: str
    status: DeploymentStatus
    policy: UpdatePolicy
    versions: list[Version] = Field(default_factory=list)
    status_description: str = ""
    created_at: datetime
    updated_at: datetime

    @property
    def stable(self) -> Version | None:
        return next((v for v in reversed(self.versions) if v.status == "stable"), None)

    @property
    def rolling_out(self) -> Version | None:
        latest = self.versions[-1] if self.versions else None
        return latest if latest is not None and latest.status in IN_ROLLOUT else None

    def version(self, number: int) -> Version | None:
        return next((v for v in self.versions if v.version == number), None)


# -- effects -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartRuns:
    """Create these runs of a version (each version has its own copy of its bundle)."""
    version: int
    run_ids: tuple[str, ...]
    canary: bool


@dataclass(frozen=True)
class CancelRuns:
    version: int
    reason: str


@dataclass(frozen=True)
class MakeStable:
    """The Prefect deployment now runs this version by default (its bundle, its version label)."""
    version: int


Effect = StartRuns | CancelRuns | MakeStable


# -- what the runs say -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSeen:
    """A run as Prefect has it: its state type and when it started running (None before)."""
    state: str | None
    started: datetime | None


Health = Literal["healthy", "unhealthy", "pending"]


def run_health(seen: RunSeen | None, policy: UpdatePolicy, now: datetime) -> tuple[Health, str]:
    if seen is None or seen.state is None:
        return "pending", "not created yet"
    if seen.state == "COMPLETED":
        return "healthy", "completed"
    if seen.state in RUN_FAILED:
        return "unhealthy", seen.state.lower()
    if seen.started is None:
        return "pending", f"{seen.state.lower()}, not started"
    running_for = now - seen.started
    if seen.state == "RUNNING" and running_for >= timedelta(milliseconds=policy.min_healthy_ms):
        return "healthy", "running"
    if policy.healthy_deadline_ms and running_for > timedelta(milliseconds=policy.healthy_deadline_ms):
        return "unhealthy", f"not healthy {policy.healthy_deadline_ms} ms after it started ({seen.state.lower()})"
    return "pending", seen.state.lower()


def version_health(version: Version, seen: dict[str, RunSeen], policy: UpdatePolicy,
                   now: datetime) -> tuple[Health, str]:
    """Healthy when every run is; unhealthy when one is, or when the version is not healthy
    ``progress_deadline_ms`` after its first run started."""
    verdicts = [(run.run_id, *run_health(seen.get(run.run_id), policy, now)) for run in version.runs]
    for run_id, health, why in verdicts:
        if health == "unhealthy":
            return "unhealthy", f"run {run_id}: {why}"
    if verdicts and all(health == "healthy" for _, health, _ in verdicts):
        return "healthy", "every run healthy"
    starts = [s.started for r in version.runs if (s := seen.get(r.run_id)) is not None and s.started is not None]
    if starts and policy.progress_deadline_ms and now - min(starts) > timedelta(milliseconds=policy.progress_deadline_ms):
        return "unhealthy", f"not healthy {policy.progress_deadline_ms} ms after its first run started"
    pending = [f"{run_id} {why}" for run_id, health, why in verdicts if health == "pending"]
    return "pending", "waiting for " + ", ".join(pending)


# -- decisions -------------------------------------------------------------------------------------------------------


def _run_ids(key: str, number: int, count: int) -> tuple[str, ...]:
    base = f"{key}-v{number}"
    return (base,) if count == 1 else tuple(f"{base}-{i}" for i in range(1, count + 1))


def _touch(state: Deployment, now: datetime, **changes: Any) -> Deployment:
    return state.model_copy(update={**changes, "updated_at": now}, deep=True)


def deploy(state: Deployment | None, key: str, policy: UpdatePolicy, now: datetime, *, tag: str = "",
           source: int | None = None) -> tuple[Deployment, list[Effect]]:
    """A new version (its bundle written beforehand by the caller as version ``next_version(state)``). ``source``:
    a rollback's older version whose bundle the caller copied; a rollback rolls out without canaries."""
    effects: list[Effect] = []
    if state is None:
        state = Deployment(key=key, status="running", policy=policy, created_at=now, updated_at=now)
    else:
        state = _touch(state, now, policy=policy)
        if (under_way := state.rolling_out) is not None:
            under_way.status, under_way.ended_at = "cancelled", now
            under_way.reason = f"replaced by v{next_version(state)} before it finished"
            effects.append(CancelRuns(under_way.version, under_way.reason))
    number = next_version(state)
    canary = state.stable is not None and policy.strategy == "canary" and source is None
    count = policy.canary if canary else 1
    run_ids = _run_ids(key, number, count)
    state.versions.append(Version(version=number, tag=tag, status="canary" if canary else "rolling", canary=canary,
                                  runs=[VersionRun(run_id=r) for r in run_ids], created_at=now,
                                  source_version=source))
    effects.append(StartRuns(number, run_ids, canary))
    state.status = "paused" if state.status == "paused" else "running"
    state.status_description = (f"v{number}: {count} canary run(s) beside v{state.stable.version}" if canary
                                and state.stable else f"v{number} rolling out")
    return state, effects


def next_version(state: Deployment | None) -> int:
    return (state.versions[-1].version + 1) if state is not None and state.versions else 1


def _promote(state: Deployment, version: Version, now: datetime, why: str) -> list[Effect]:
    effects: list[Effect] = []
    old = state.stable
    if old is not None:
        old.status, old.ended_at, old.reason = "superseded", now, f"superseded by v{version.version}"
        effects.append(CancelRuns(old.version, old.reason))
    version.status, version.reason = "stable", version.reason or why
    version.healthy_at = version.healthy_at or now
    effects.append(MakeStable(version.version))
    state.status, state.status_description = "successful", f"v{version.version} is stable ({why})"
    return effects


def _fail(state: Deployment, version: Version, now: datetime, why: str) -> list[Effect]:
    version.status, version.ended_at, version.reason = "failed", now, why
    state.status = "failed"
    stable = state.stable
    if state.policy.auto_revert:
        back = f"; v{stable.version} stays stable" if stable else ""
        state.status_description = f"v{version.version} failed: {why}{back} (auto_revert)"
        return [CancelRuns(version.version, f"v{version.version} failed: {why}")]
    state.status_description = f"v{version.version} failed: {why}; its runs are left as they are"
    return []


def advance(state: Deployment, seen: dict[str, RunSeen], now: datetime) -> tuple[Deployment, list[Effect]]:
    """What the rollout under way does next, from its runs' health; nothing while paused or when none is."""
    version = state.rolling_out
    if version is None or state.status == "paused":
        return state, []
    health, why = version_health(version, seen, state.policy, now)
    if health == "pending":
        return state, []
    state = _touch(state, now)
    version = state.rolling_out
    assert version is not None
    if health == "unhealthy":
        return state, _fail(state, version, now, why)
    if not version.canary:
        return state, _promote(state, version, now, "healthy")
    if state.policy.auto_promote:
        return state, _promote(state, version, now, "canaries healthy, auto_promote")
    version.healthy_at = version.healthy_at or now
    if state.status != "awaiting_promotion":
        state.status = "awaiting_promotion"
        state.status_description = f"v{version.version}'s canaries are healthy: promote it, or fail it"
    return state, []


class RolloutRefused(ValueError):
    """An action that does not apply to the deployment as it stands (the API answers FAILED_PRECONDITION)."""


def promote(state: Deployment, seen: dict[str, RunSeen], now: datetime) -> tuple[Deployment, list[Effect]]:
    """Make the canary version stable: only once its canaries are healthy."""
    version = state.rolling_out
    if version is None or not version.canary:
        raise RolloutRefused(f"deployment {state.key!r} has no canary to promote ({state.status})")
    health, why = version_health(version, seen, state.policy, now)
    if health != "healthy":
        raise RolloutRefused(f"v{version.version}'s canaries are not healthy yet: {why}")
    state = _touch(state, now)
    version = state.rolling_out
    assert version is not None
    return state, _promote(state, version, now, "promoted")


def fail(state: Deployment, reason: str, now: datetime) -> tuple[Deployment, list[Effect]]:
    version = state.rolling_out
    if version is None:
        raise RolloutRefused(f"deployment {state.key!r} has no rollout under way to fail ({state.status})")
    state = _touch(state, now)
    version = state.rolling_out
    assert version is not None
    return state, _fail(state, version, now, reason or "failed by hand")


def pause(state: Deployment, now: datetime) -> Deployment:
    if state.status in ("failed", "cancelled"):
        raise RolloutRefused(f"deployment {state.key!r} is {state.status}: nothing to pause")
    return _touch(state, now, status="paused")


def resume(state: Deployment, now: datetime) -> Deployment:
    if state.status != "paused":
        raise RolloutRefused(f"deployment {state.key!r} is not paused ({state.status})")
    status: DeploymentStatus = "running" if state.rolling_out is not None else "successful"
    return _touch(state, now, status=status)


def rollback_source(state: Deployment, version: str, tag: str) -> Version:
    """The older version a rollback returns to: by number (``3`` or ``v3``), by tag, or else the last stable or
    superseded version before the newest."""
    if version:
        try:
            number = int(version.removeprefix("v"))
        except ValueError:
            raise RolloutRefused(f"version {version!r} is not a version number") from None
        found = state.version(number)
        if found is None:
            raise RolloutRefused(f"deployment {state.key!r} has no version {number}")
        return found
    if tag:
        tagged = [v for v in state.versions if v.tag == tag]
        if not tagged:
            raise RolloutRefused(f"deployment {state.key!r} has no version tagged {tag!r}")
        return tagged[-1]
    earlier = [v for v in state.versions[:-1] if v.status in ("stable", "superseded")]
    if not earlier:
        raise RolloutRefused(f"deployment {state.key!r} has no earlier good version to roll back to")
    return earlier[-1]
