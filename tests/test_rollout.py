"""The rules of a deployment's rollout (mn_prefect.bundles.rollout): pure decisions, checked as tables of
what the runs say and what the rules do next."""

from datetime import UTC, datetime, timedelta

import pytest

from mn_prefect.bundles import rollout
from mn_prefect.bundles.rollout import CancelRuns, MakeStable, RolloutRefused, RunSeen, StartRuns, UpdatePolicy
from mn_prefect.model.issues import InvalidInput

T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
CANARY = UpdatePolicy(strategy="canary", canary=1, auto_revert=True)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def running(since: float) -> RunSeen:
    return RunSeen(state="RUNNING", started=at(since))


def stable_v1(policy: UpdatePolicy = CANARY):
    """A deployment whose first version rolled out and became stable."""
    state, _ = rollout.deploy(None, "svc", policy, at(0))
    state, _ = rollout.advance(state, {"svc-v1": running(1)}, at(2))
    assert state.status == "successful" and state.stable.version == 1
    return state


def test_the_first_version_rolls_out_without_canaries_and_becomes_stable_once_healthy():
    state, effects = rollout.deploy(None, "svc", CANARY, at(0), tag="1.0")
    assert effects == [StartRuns(1, ("svc-v1",), canary=False)]
    assert state.status == "running" and state.versions[0].status == "rolling" and state.versions[0].tag == "1.0"
    same, effects = rollout.advance(state, {"svc-v1": RunSeen("PENDING", None)}, at(30))
    assert same is state and effects == []  # waiting for capacity is not a failure
    same, effects = rollout.advance(state, {"svc-v1": running(1)}, at(1.1))
    assert effects == []  # running, but not yet for min_healthy_ms
    done, effects = rollout.advance(state, {"svc-v1": running(1)}, at(1.3))
    assert effects == [MakeStable(1)] and done.status == "successful" and done.stable.version == 1
    assert state.status == "running"  # decisions return a new state; the old one is untouched


def test_a_canary_runs_beside_the_stable_version_and_waits_for_promotion():
    state, effects = rollout.deploy(stable_v1(), "svc", CANARY, at(10))
    assert effects == [StartRuns(2, ("svc-v2",), canary=True)]
    assert state.rolling_out.version == 2 and state.stable.version == 1
    waiting, effects = rollout.advance(state, {"svc-v1": running(1), "svc-v2": running(11)}, at(12))
    assert effects == [] and waiting.status == "awaiting_promotion" and waiting.rolling_out.healthy_at == at(12)
    promoted, effects = rollout.promote(waiting, {"svc-v2": running(11)}, at(20))
    assert effects == [CancelRuns(1, "superseded by v2"), MakeStable(2)]
    assert [(v.version, v.status) for v in promoted.versions] == [(1, "superseded"), (2, "stable")]
    assert promoted.status == "successful"


def test_auto_promote_promotes_healthy_canaries_at_once_and_several_canaries_are_several_runs():
    policy = UpdatePolicy(strategy="canary", canary=2, auto_promote=True)
    state, effects = rollout.deploy(stable_v1(policy), "svc", policy, at(10))
    assert effects == [StartRuns(2, ("svc-v2-1", "svc-v2-2"), canary=True)]
    half = {"svc-v2-1": running(11), "svc-v2-2": RunSeen("PENDING", None)}
    assert rollout.advance(state, half, at(12))[1] == []  # one canary healthy is not enough
    done, effects = rollout.advance(state, {"svc-v2-1": running(11), "svc-v2-2": running(11)}, at(12))
    assert effects == [CancelRuns(1, "superseded by v2"), MakeStable(2)] and done.stable.version == 2


@pytest.mark.parametrize("seen, why", [
    (RunSeen("FAILED", at(11)), "run svc-v2: failed"),
    (RunSeen("CRASHED", at(11)), "run svc-v2: crashed"),
    (RunSeen("CANCELLED", None), "run svc-v2: cancelled"),
])
def test_a_failing_canary_fails_the_version_and_auto_revert_cancels_it(seen, why):
    state, _ = rollout.deploy(stable_v1(), "svc", CANARY, at(10))
    failed, effects = rollout.advance(state, {"svc-v2": seen}, at(12))
    assert effects == [CancelRuns(2, f"v2 failed: {why}")]
    assert failed.status == "failed" and failed.stable.version == 1 and failed.versions[1].status == "failed"
    assert "v1 stays stable (auto_revert)" in failed.status_description


def test_without_auto_revert_a_failed_versions_runs_are_left_for_a_person():
    policy = UpdatePolicy(strategy="canary", canary=1)
    state, _ = rollout.deploy(stable_v1(policy), "svc", policy, at(10))
    failed, effects = rollout.advance(state, {"svc-v2": RunSeen("FAILED", at(11))}, at(12))
    assert effects == [] and failed.status == "failed" and "left as they are" in failed.status_description


def test_deadlines_count_from_a_runs_start_on_a_node():
    policy = UpdatePolicy(min_healthy_ms=5000, healthy_deadline_ms=3000, progress_deadline_ms=0)
    state, _ = rollout.deploy(None, "svc", policy, at(0))
    assert rollout.advance(state, {"svc-v1": running(1)}, at(3.5))[1] == []
    failed, _ = rollout.advance(state, {"svc-v1": running(1)}, at(4.5))
    assert failed.status == "failed" and "not healthy 3000 ms after it started" in failed.versions[0].reason
    slow = UpdatePolicy(strategy="canary", canary=2, progress_deadline_ms=10_000)
    state, _ = rollout.deploy(stable_v1(slow), "svc", slow, at(10))
    seen = {"svc-v2-1": running(11), "svc-v2-2": RunSeen("PENDING", None)}
    assert rollout.advance(state, seen, at(20))[0].status == "running"
    failed, _ = rollout.advance(state, seen, at(21.5))
    assert failed.status == "failed" and "10000 ms after its first run started" in failed.versions[1].reason


def test_a_paused_deployment_takes_no_automatic_step_until_resumed():
    state, _ = rollout.deploy(stable_v1(), "svc", CANARY, at(10))
    paused = rollout.pause(state, at(11))
    assert rollout.advance(paused, {"svc-v2": RunSeen("FAILED", at(11))}, at(12)) == (paused, [])
    resumed = rollout.resume(paused, at(13))
    assert resumed.status == "running"
    assert rollout.advance(resumed, {"svc-v2": RunSeen("FAILED", at(11))}, at(14))[0].status == "failed"
    with pytest.raises(RolloutRefused, match="not paused"):
        rollout.resume(resumed, at(15))


def test_deploying_during_a_rollout_cancels_it():
    state, _ = rollout.deploy(stable_v1(), "svc", CANARY, at(10))
    again, effects = rollout.deploy(state, "svc", CANARY, at(11))
    assert effects == [CancelRuns(2, "replaced by v3 before it finished"), StartRuns(3, ("svc-v3",), canary=True)]
    assert [(v.version, v.status) for v in again.versions] == [(1, "stable"), (2, "cancelled"), (3, "canary")]


def test_promote_and_fail_are_refused_when_they_do_not_apply():
    with pytest.raises(RolloutRefused, match="no canary to promote"):
        rollout.promote(stable_v1(), {}, at(5))
    state, _ = rollout.deploy(stable_v1(), "svc", CANARY, at(10))
    with pytest.raises(RolloutRefused, match="not healthy yet: waiting for svc-v2 pending"):
        rollout.promote(state, {"svc-v2": RunSeen("PENDING", None)}, at(11))
    with pytest.raises(RolloutRefused, match="no rollout under way to fail"):
        rollout.fail(stable_v1(), "why", at(5))
    failed, effects = rollout.fail(state, "bad numbers", at(12))
    assert effects == [CancelRuns(2, "v2 failed: bad numbers")] and failed.status == "failed"


def test_a_rollback_returns_to_an_older_version_without_canaries():
    state, _ = rollout.deploy(stable_v1(), "svc", CANARY, at(10))
    state, _ = rollout.promote(state, {"svc-v2": running(11)}, at(12))
    assert rollout.rollback_source(state, "", "").version == 1  # the last good one before the newest
    assert rollout.rollback_source(state, "v1", "").version == 1 and rollout.rollback_source(state, "2", "").version == 2
    source = rollout.rollback_source(state, "1", "")
    back, effects = rollout.deploy(state, "svc", state.policy, at(20), source=source.version)
    assert effects == [StartRuns(3, ("svc-v3",), canary=False)] and back.versions[-1].source_version == 1
    done, effects = rollout.advance(back, {"svc-v3": running(21)}, at(22))
    assert effects == [CancelRuns(2, "superseded by v3"), MakeStable(3)] and done.stable.version == 3
    with pytest.raises(RolloutRefused, match="no version 9"):
        rollout.rollback_source(state, "9", "")
    with pytest.raises(RolloutRefused, match="no version tagged 'x'"):
        rollout.rollback_source(state, "", "x")


@pytest.mark.parametrize("given, field", [
    ({"strategy": "big-bang"}, "update_policy.strategy"),
    ({"strategy": "canary"}, "update_policy.canary"),
    ({"canary": -1}, "update_policy.canary"),
    ({"max_parallel": 0}, "update_policy.max_parallel"),
    ({"auto_promote": "yes"}, "update_policy.auto_promote"),
    ({"healthy_deadline_ms": 1.5}, "update_policy.healthy_deadline_ms"),
])
def test_a_bad_policy_is_refused_naming_its_field(given, field):
    with pytest.raises(InvalidInput) as raised:
        rollout.parse_policy(given, "update_policy")
    assert field in [issue.path for issue in raised.value.issues]


def test_a_manifests_policy_reads_with_its_own_extra_keys():
    policy = rollout.parse_policy({"auto_promote": False, "auto_revert": True, "canary": 1,
                                   "health_check": "agent_states", "healthy_deadline_ms": 5000, "max_parallel": 1,
                                   "min_healthy_ms": 250, "progress_deadline_ms": 10000, "strategy": "canary"},
                                  "policies.update")
    assert policy.strategy == "canary" and policy.canary == 1 and policy.auto_revert
