"""The node-status rule has one home (mn_prefect/model/node_status.py): the Redis scripts' status lists are
written from its constants, and decide exactly as the Python rule the SQL backends and lifecycle use. No server:
the scripts' status conditions are read from their text and evaluated here."""

from __future__ import annotations

import re

import pytest

from mn_prefect.model import node_status
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.node_status import (
    KEPT_ON_REGISTER,
    LOST,
    NODE_STATES,
    RECONNECTED,
    SCHEDULABLE_STATES,
    heartbeat_status,
    registered_status,
)
from mn_prefect.store import redis_scripts

_QUOTED = re.compile(r"'([a-z_]+)'")
_CONDITION = re.compile(r"^\s*if (.+?) then\b", re.M)
_TERM = re.compile(r"^(\S+) == '([a-z_]+)'$")


def _statuses_named(script: str) -> set[str]:
    return {word for word in _QUOTED.findall(script) if word in NODE_STATES}


def _status_conditions(script: str, variable: str) -> list[set[str]]:
    """Each ``if <variable> == 'a' or <variable> == 'b' ... then`` of the script, as the set of statuses it tests."""
    found = []
    for condition in _CONDITION.findall(script):
        terms = [_TERM.match(term.strip()) for term in condition.split(" or ")]
        if all(terms) and {t.group(1) for t in terms if t} == {variable}:
            found.append({t.group(2) for t in terms if t})
    return found


def test_the_status_literal_of_the_node_record_is_the_rule_s_list_of_statuses():
    assert NodeRecord.model_fields["status"].annotation is node_status.NodeStatus
    assert NODE_STATES == ("healthy", "joining", "maintenance", "draining", "disconnected", "offline", "quarantined")
    assert SCHEDULABLE_STATES <= set(NODE_STATES) and set(LOST) <= set(NODE_STATES)
    assert set(KEPT_ON_REGISTER) <= set(NODE_STATES) and RECONNECTED in SCHEDULABLE_STATES


@pytest.mark.parametrize("status", NODE_STATES)
def test_the_heartbeat_script_moves_each_status_as_heartbeat_status_does(status):
    [reconnects] = _status_conditions(redis_scripts.HEARTBEAT, "status")
    becomes = RECONNECTED if status in reconnects else status
    assert f"status = '{RECONNECTED}'" in redis_scripts.HEARTBEAT
    assert becomes == heartbeat_status(status)


@pytest.mark.parametrize("stored", NODE_STATES)
def test_the_register_script_keeps_each_status_as_registered_status_does(stored):
    [kept] = _status_conditions(redis_scripts.REGISTER, "cur[1]")
    new = NodeRecord(name="n", status="joining")
    lua = stored if stored in kept else new.status
    assert lua == registered_status(new, stored, True)[0]


def test_the_node_scripts_name_no_status_the_rule_does_not_list():
    # Everything a script says of statuses comes from node_status's constants, nothing is copied by hand.
    assert _statuses_named(redis_scripts.HEARTBEAT) == {*LOST, RECONNECTED}
    assert _statuses_named(redis_scripts.REGISTER) == set(KEPT_ON_REGISTER)
    for name in ("TRANSITION_NODE", "APPLY", "READ", "SNAPSHOT", "RELEASE", "RELEASE_NODE"):
        assert _statuses_named(getattr(redis_scripts, name)) == set(), name


def test_a_heartbeat_brings_back_only_a_lost_node():
    assert {s: heartbeat_status(s) for s in NODE_STATES} == {
        "healthy": "healthy", "joining": "joining", "maintenance": "maintenance", "draining": "draining",
        "disconnected": "healthy", "offline": "healthy", "quarantined": "quarantined"}


def test_node_list_never_shows_a_negative_heartbeat_age():
    from builders import node

    from mn_prefect.cli.nodes import node_summary
    from mn_prefect.store.base import StoredNode

    stored = StoredNode(record=node("gpu-1"), last_heartbeat=1000.0)
    assert node_summary(stored, now=998.4)["heartbeat_age_s"] == 0.0  # stamped by a clock a little ahead
    assert node_summary(stored, now=1002.5)["heartbeat_age_s"] == 2.5
    assert node_summary(StoredNode(record=node("gpu-2")), now=1.0)["heartbeat_age_s"] is None
