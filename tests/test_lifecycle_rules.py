"""The lifecycle's decisions without a server: recovery rules, drain rules, durations."""

from __future__ import annotations

import pytest

from mn_prefect.lifecycle.drain import drain_action, parse_duration
from mn_prefect.lifecycle.reconcile import recovery_rule


@pytest.mark.parametrize("mode", ["local_restart", "manual_recover"])
def test_work_not_under_cluster_recover_is_paused_for_review_first(mode):
    action, reason = recovery_rule(mode, "service", "n1", "offline")
    assert action == "paused" and "paused for review" in reason and mode in reason


def test_cluster_recover_work_waits_while_its_node_is_inside_the_grace_window():
    assert recovery_rule("cluster_recover", "batch", "n1", "disconnected")[0] == "skipped"


@pytest.mark.parametrize("job_type", ["system", "sysbatch"])
def test_system_work_waits_for_its_node(job_type):
    action, reason = recovery_rule("cluster_recover", job_type, "n1", "offline")
    assert action == "skipped" and "waits for its node" in reason


@pytest.mark.parametrize("job_type", ["service", "batch"])
def test_cluster_recover_work_on_an_offline_node_is_re_placed(job_type):
    assert recovery_rule("cluster_recover", job_type, "n1", "offline") is None


def test_a_draining_node_migrates_cluster_recover_services_at_once():
    assert drain_action("service", "cluster_recover", safe_to_retry=False, deadline_passed=False)[0] == "migrate"


def test_batch_work_may_finish_before_the_deadline():
    assert drain_action("batch", "cluster_recover", safe_to_retry=True, deadline_passed=False)[0] == "wait"


def test_after_the_deadline_batch_work_migrates_only_when_safe():
    assert drain_action("batch", "cluster_recover", safe_to_retry=True, deadline_passed=True)[0] == "migrate"
    action, reason = drain_action("batch", "cluster_recover", safe_to_retry=False, deadline_passed=True)
    assert action == "pause" and "left running" in reason


@pytest.mark.parametrize("job_type", ["system", "sysbatch"])
def test_system_work_is_ignored_by_a_drain(job_type):
    assert drain_action(job_type, "cluster_recover", safe_to_retry=True, deadline_passed=True)[0] == "ignore"


def test_a_service_that_cannot_move_pauses_instead_of_being_killed():
    assert drain_action("service", "local_restart", safe_to_retry=True, deadline_passed=True)[0] == "pause"


@pytest.mark.parametrize("text,seconds", [("30m", 1800), ("90s", 90), ("1h30m", 5400), ("45", 45), ("2h", 7200)])
def test_deadlines_read_as_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "5x", "m30", "1h 30m", "-5m"])
def test_what_is_not_a_duration_is_refused(text):
    assert parse_duration(text) is None
