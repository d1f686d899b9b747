"""Node states and lifecycle (docs/operating.md) on SQLite, Redis and PostgreSQL (real servers), and the `node` CLI."""

import json
import time

import cli_runner
import pytest
from builders import gpu, node

from mn_prefect.lifecycle import (
    Leadership,
    NodeStateRefused,
    NotLeader,
    Transition,
    advance_node_states,
    set_maintenance,
    undrain,
)
from mn_prefect.lifecycle.settings import disconnect_grace_s, heartbeat_timeout_s
from mn_prefect.model.issues import InvalidInput
from mn_prefect.model.resources import resource_request
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.store import StaleLease, open_store
from mn_prefect.store.base import NodeNotRegistered

T0 = 1_000_000.0  # registration time in the state tests; heartbeats and sweeps say their own `now`
TIMEOUT, GRACE = 30.0, 30.0


@pytest.fixture
def nodes(store):
    """"g" holds the only GPU; "c" is a CPU node. Both heartbeat at T0."""
    store.register_node(node("g", devices=[gpu("g0", 0)]), now=T0)
    store.register_node(node("c"), now=T0)
    return store


def gpu_job(store, job_id="j"):
    """Place a job only "g" can take, with every node's reason explained."""
    return place_and_commit(store, job_id, [Ask(agent_id="w", request=resource_request({"gpu": 1}))], explain=True)


def sweep(store, now):
    return advance_node_states(store, now=now, heartbeat_timeout_s=TIMEOUT, grace_s=GRACE)


def status(store, name):
    return store.get_node(name).record.status


def node_events(store, name):
    return [e for e in store.events(node=name) if e.kind.startswith("node.")]


# -- the store's conditional transition -------------------------------------------------------------------

def test_transition_applies_from_an_expected_status(nodes):
    record = nodes.transition_node("g", "disconnected", from_statuses=("healthy", "joining"), now=T0 + 1)
    assert record.status == "disconnected" and status(nodes, "g") == "disconnected"


def test_transition_does_not_apply_from_another_status(nodes):
    nodes.set_node_status("g", "maintenance")
    assert nodes.transition_node("g", "disconnected", from_statuses=("healthy",), now=T0 + 1) is None
    assert status(nodes, "g") == "maintenance"


def test_transition_loses_to_a_heartbeat_that_came_after_the_sweep_read(nodes):
    # The sweep saw "g" silent since T0; a heartbeat lands before its write: the heartbeat must stand.
    nodes.heartbeat("g", now=T0 + 40)
    cutoff = T0 + 45 - TIMEOUT
    assert nodes.transition_node("g", "disconnected", from_statuses=("healthy",), now=T0 + 45,
                                 heartbeat_before=cutoff) is None
    assert status(nodes, "g") == "healthy"


def test_transition_applies_when_the_heartbeat_is_older_than_the_cutoff(nodes):
    assert nodes.transition_node("g", "disconnected", from_statuses=("healthy",), now=T0 + 45,
                                 heartbeat_before=T0 + 15) is not None


def test_transition_records_its_event_with_reason_and_previous_status(nodes):
    nodes.transition_node("g", "maintenance", from_statuses=("healthy",), now=T0 + 5, reason="swap disk")
    event, = node_events(nodes, "g")
    assert (event.kind, event.at, event.reason, event.data) == (
        "node.maintenance", T0 + 5, "swap disk", {"from": "healthy", "to": "maintenance"})


def test_a_transition_that_does_not_apply_records_no_event(nodes):
    nodes.transition_node("g", "offline", from_statuses=("disconnected",), now=T0 + 5, reason="x")
    assert node_events(nodes, "g") == []


def test_transition_can_set_scheduling_eligibility(nodes):
    nodes.set_node_status("g", "draining", eligible=False)
    record = nodes.transition_node("g", "healthy", from_statuses=("draining",), eligible=True)
    assert record.scheduling_eligible is True and nodes.get_node("g").record.scheduling_eligible is True


def test_transition_keeps_eligibility_unless_asked(nodes):
    nodes.set_node_status("g", "maintenance", eligible=False)
    assert nodes.transition_node("g", "healthy", from_statuses=("maintenance",)).scheduling_eligible is False


def test_transition_of_an_unknown_node_raises(nodes):
    with pytest.raises(NodeNotRegistered, match="'ghost'"):
        nodes.transition_node("ghost", "offline", from_statuses=("disconnected",))


def test_transition_to_an_unknown_status_is_refused_before_writing(nodes):
    with pytest.raises(ValueError, match="'asleep'"):
        nodes.transition_node("g", "asleep", from_statuses=("healthy",))
    assert status(nodes, "g") == "healthy"


def test_a_reconnecting_heartbeat_records_a_reconnected_event(nodes):
    nodes.transition_node("g", "disconnected", from_statuses=("healthy",), now=T0 + 40)
    assert nodes.heartbeat("g", now=T0 + 75).status == "healthy"
    event = node_events(nodes, "g")[-1]
    assert (event.kind, event.at, event.reason, event.data) == (
        "node.reconnected", T0 + 75, "heartbeat received while disconnected, 75 s after the last one",
        {"from": "disconnected", "to": "healthy"})


def test_an_ordinary_heartbeat_records_no_event(nodes):
    nodes.heartbeat("g", now=T0 + 5)
    assert node_events(nodes, "g") == []


# -- missed heartbeats ------------------------------------------------------------------------------------

def test_a_silent_healthy_node_becomes_disconnected(nodes):
    nodes.heartbeat("c", now=T0 + 40)
    changes = sweep(nodes, T0 + 45)
    assert changes == [Transition(node="g", from_status="healthy", to_status="disconnected",
                                  reason="no heartbeat for 45 s (timeout 30 s)", at=T0 + 45)]
    assert (status(nodes, "g"), status(nodes, "c")) == ("disconnected", "healthy")


def test_disconnecting_records_an_event_naming_the_silence(nodes):
    sweep(nodes, T0 + 45)
    event, = node_events(nodes, "g")
    assert (event.kind, event.reason) == ("node.disconnected", "no heartbeat for 45 s (timeout 30 s)")


def test_a_silent_joining_node_becomes_disconnected(nodes):
    nodes.set_node_status("g", "joining")
    sweep(nodes, T0 + 45)
    assert status(nodes, "g") == "disconnected"


def test_a_disconnected_node_within_grace_stays_disconnected(nodes):
    sweep(nodes, T0 + 45)
    assert sweep(nodes, T0 + 55) == [] and status(nodes, "g") == "disconnected"


def test_a_disconnected_node_becomes_offline_after_grace(nodes):
    sweep(nodes, T0 + 45)
    assert sweep(nodes, T0 + 61) == []  # silent past timeout + grace, but disconnected only 16 s ago
    changes = sweep(nodes, T0 + 76)
    assert [(c.node, c.from_status, c.to_status) for c in changes] == [
        ("c", "disconnected", "offline"), ("g", "disconnected", "offline")]
    assert node_events(nodes, "g")[-1].reason == "no heartbeat for 76 s (timeout 30 s + grace 30 s)"


def test_a_node_silent_past_timeout_and_grace_is_disconnected_first_and_offline_a_grace_later(nodes):
    """As after a store outage: nothing could beat, so the first sweep finds every node silent for long. Offline
    (which moves a node's work) waits until the node was seen disconnected for the grace."""
    changes = sweep(nodes, T0 + 100)
    assert [(c.from_status, c.to_status) for c in changes if c.node == "g"] == [("healthy", "disconnected")]
    assert sweep(nodes, T0 + 129) == []
    later = sweep(nodes, T0 + 131)
    assert [(c.from_status, c.to_status) for c in later if c.node == "g"] == [("disconnected", "offline")]
    assert [e.kind for e in node_events(nodes, "g")] == ["node.disconnected", "node.offline"]


def test_after_a_store_outage_live_nodes_come_back_and_are_never_taken_offline(nodes):
    changes = sweep(nodes, T0 + 100)  # the first sweep after 100 s without the store
    assert {c.to_status for c in changes} == {"disconnected"}
    nodes.heartbeat("g", now=T0 + 105)  # its worker's next beat lands
    assert [c.node for c in sweep(nodes, T0 + 131)] == ["c"]  # c stayed silent: it is lost; g is back
    assert status(nodes, "g") == "healthy" and status(nodes, "c") == "offline"


def test_nodes_that_heartbeat_in_time_are_left_alone(nodes):
    assert sweep(nodes, T0 + 30) == [] and node_events(nodes, "g") == []


def test_a_second_sweep_changes_and_records_nothing_more(nodes):
    sweep(nodes, T0 + 45)
    assert sweep(nodes, T0 + 46) == [] and len(node_events(nodes, "g")) == 1


@pytest.mark.parametrize("held", ["maintenance", "draining", "quarantined"])
def test_silence_never_moves_a_node_out_of_an_operator_state(nodes, held):
    nodes.set_node_status("g", held)
    sweep(nodes, T0 + 100)
    assert status(nodes, "g") == held


def test_a_disconnected_node_offers_no_capacity(nodes):
    sweep(nodes, T0 + 45)
    result = gpu_job(nodes)
    assert not result.placed and result.plan.agents["w"]["g"] == "node not ready: status disconnected"


def test_a_heartbeat_brings_a_disconnected_node_back_into_placement(nodes):
    sweep(nodes, T0 + 45)
    nodes.heartbeat("g", now=T0 + 50)
    assert gpu_job(nodes).placed


def test_settings_default_to_thirty_seconds_each():
    assert (heartbeat_timeout_s({}), disconnect_grace_s({})) == (30.0, 30.0)


def test_settings_come_from_the_environment():
    env = {"MN_HEARTBEAT_TIMEOUT_SECONDS": "12.5", "MN_DISCONNECT_GRACE_SECONDS": "0"}
    assert (heartbeat_timeout_s(env), disconnect_grace_s(env)) == (12.5, 0.0)


@pytest.mark.parametrize("value", ["soon", "-1", "0", "nan"])
def test_a_bad_heartbeat_timeout_names_the_variable(value):
    with pytest.raises(InvalidInput, match="MN_HEARTBEAT_TIMEOUT_SECONDS"):
        heartbeat_timeout_s({"MN_HEARTBEAT_TIMEOUT_SECONDS": value})


# -- maintenance and undrain ------------------------------------------------------------------------------

def test_maintenance_stops_new_placements_even_after_a_heartbeat(nodes):
    set_maintenance(nodes, "g", True, "firmware update")
    assert nodes.heartbeat("g").status == "maintenance"
    result = gpu_job(nodes)
    assert not result.placed and result.plan.agents["w"]["g"] == "node not ready: status maintenance"


def test_maintenance_moves_nothing(nodes):
    assert gpu_job(nodes, "running").placed
    set_maintenance(nodes, "g", True, "firmware update")
    assert [p.node for p in nodes.active_placements(job_id="running")] == ["g"]


def test_a_plan_made_before_maintenance_cannot_be_committed_after(nodes):
    snap_plan = gpu_job(nodes, "first").plan
    nodes.release("first")
    set_maintenance(nodes, "g", True, "firmware update")
    commit = nodes.commit_plan("late", list(snap_plan.placements))
    assert not commit.ok and commit.conflict.reason.startswith("node not ready")


def test_maintenance_records_an_event_with_the_reason(nodes):
    change = set_maintenance(nodes, "g", True, "firmware update", now=T0 + 3)
    assert change == Transition(node="g", from_status="healthy", to_status="maintenance", reason="firmware update",
                                at=T0 + 3)
    event, = node_events(nodes, "g")
    assert (event.kind, event.reason) == ("node.maintenance", "firmware update")


def test_enabling_maintenance_twice_changes_nothing_the_second_time(nodes):
    set_maintenance(nodes, "g", True, "firmware update")
    assert set_maintenance(nodes, "g", True, "again") is None and len(node_events(nodes, "g")) == 1


def test_disabling_maintenance_makes_the_node_healthy_and_placeable(nodes):
    set_maintenance(nodes, "g", True, "firmware update")
    change = set_maintenance(nodes, "g", False, "done")
    assert (change.from_status, change.to_status) == ("maintenance", "healthy") and gpu_job(nodes).placed


def test_disabling_maintenance_on_a_node_not_in_it_changes_nothing(nodes):
    nodes.set_node_status("g", "quarantined")
    assert set_maintenance(nodes, "g", False, "done") is None and status(nodes, "g") == "quarantined"


@pytest.mark.parametrize("enable", [True, False])
def test_maintenance_on_a_draining_node_is_refused_pointing_to_undrain(nodes, enable):
    nodes.set_node_status("g", "draining")
    with pytest.raises(NodeStateRefused, match="'g' is draining: use undrain"):
        set_maintenance(nodes, "g", enable, "x")
    assert status(nodes, "g") == "draining"


def test_maintenance_needs_a_reason(nodes):
    with pytest.raises(InvalidInput, match="reason"):
        set_maintenance(nodes, "g", True, "  ")


def test_maintenance_of_an_unknown_node_raises(nodes):
    with pytest.raises(NodeNotRegistered, match="'ghost'"):
        set_maintenance(nodes, "ghost", True, "x")


def test_undrain_leaves_the_node_in_maintenance(nodes):
    nodes.set_node_status("g", "draining", eligible=False)
    change = undrain(nodes, "g", "drain cancelled")
    assert (change.from_status, change.to_status) == ("draining", "maintenance")
    assert not gpu_job(nodes).placed
    assert node_events(nodes, "g")[-1].reason == "drain cancelled"


def test_undrain_with_mark_eligible_makes_the_node_healthy_and_eligible(nodes):
    nodes.set_node_status("g", "draining", eligible=False)
    undrain(nodes, "g", "back in service", mark_eligible=True)
    record = nodes.get_node("g").record
    assert (record.status, record.scheduling_eligible) == ("healthy", True) and gpu_job(nodes).placed


def test_undrain_with_mark_eligible_returns_a_drained_node_to_service(nodes):
    nodes.set_node_status("g", "maintenance", eligible=False)
    assert undrain(nodes, "g", "done", mark_eligible=False) is None
    undrain(nodes, "g", "done", mark_eligible=True)
    assert gpu_job(nodes).placed


def test_undrain_of_a_node_that_is_not_draining_is_refused(nodes):
    with pytest.raises(NodeStateRefused, match="'g' is healthy, not draining"):
        undrain(nodes, "g", "x")


# -- leadership -------------------------------------------------------------------------------------------

def test_a_second_owner_cannot_lead_while_the_first_holds_the_lease(store):
    first, second = Leadership(store, "one", ttl_s=60), Leadership(store, "two", ttl_s=60)
    assert first.acquire().name == "mn-reconciler"
    assert second.acquire() is None and second.keep() is None


def test_the_context_manager_refuses_when_another_owner_leads(store):
    Leadership(store, "one", ttl_s=60).acquire()
    with pytest.raises(NotLeader, match="mn-reconciler"):
        with Leadership(store, "two"):
            pass


def test_renewal_keeps_the_lease_and_its_epoch(store):
    now = time.time()
    leader = Leadership(store, "one", ttl_s=60)
    epoch = leader.acquire(now=now).epoch
    renewed = leader.keep(now=now + 30)
    assert renewed.epoch == epoch and renewed.expires_at == pytest.approx(now + 90)
    assert Leadership(store, "two").acquire(now=now + 70) is None  # unrenewed, it would have expired at now + 60


def test_after_expiry_the_next_owner_gets_a_higher_epoch_and_old_lease_writes_are_stale(nodes):
    old = Leadership(nodes, "one", ttl_s=10)
    old_lease = old.acquire(now=time.time() - 100)  # expired long ago: the owner was paused
    new = Leadership(nodes, "two", ttl_s=60)
    assert new.acquire().epoch > old_lease.epoch
    kept = gpu_job(nodes, "kept")
    with pytest.raises(StaleLease):
        nodes.release("kept", lease=old_lease)
    with pytest.raises(StaleLease):
        nodes.commit_plan("other", list(kept.plan.placements), lease=old_lease)
    assert old.renew() is None and old.lease is None
    assert nodes.release("kept", lease=new.lease) == 1


def test_leaving_the_context_releases_the_lease_for_the_next_owner(store):
    with Leadership(store, "one", ttl_s=60) as leader:
        epoch = leader.lease.epoch
    assert Leadership(store, "two").acquire().epoch == epoch + 1


# -- command line (tests/cli_runner.py, SQLite) -----------------------------------------------------------

def cli(*args, env=None):
    return cli_runner.run(["node", *args], env=env)


@pytest.fixture
def cli_store(tmp_path):
    """A SQLite store with "g" (GPU, heartbeat 100 s ago) and "c" (fresh); yields its --store-url arguments."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    store.register_node(node("g", devices=[gpu("g0", 0)]), now=time.time() - 100)
    store.register_node(node("c"))
    yield store, ["--store-url", url]
    store.close()


def test_node_list_shows_status_eligibility_heartbeat_age_and_devices(cli_store):
    store, url = cli_store
    listed = json.loads(cli("list", *url, "--json").stdout)
    g = listed[1]
    assert (g["name"], g["status"], g["scheduling_eligible"], g["devices"]) == ("g", "healthy", True, ["g0"])
    assert g["heartbeat_age_s"] >= 100 and g["last_heartbeat"]
    table = cli("list", *url).stdout
    assert "g0" in table and "healthy" in table and "s ago" in table


def test_node_maintenance_enable_then_disable(cli_store):
    store, url = cli_store
    result = cli("maintenance", "c", "--enable", "--reason", "new PSU", *url, "--json")
    doc = json.loads(result.stdout)
    assert result.returncode == 0 and doc["changed"] and doc["status"] == "maintenance"
    assert doc["transition"]["reason"] == "new PSU" and status(store, "c") == "maintenance"
    back = cli("maintenance", "c", "--disable", "--reason", "fixed", *url)
    assert back.returncode == 0 and "maintenance -> healthy" in back.stdout and status(store, "c") == "healthy"


def test_node_maintenance_on_a_draining_node_exits_1_saying_undrain(cli_store):
    store, url = cli_store
    store.set_node_status("c", "draining")
    result = cli("maintenance", "c", "--enable", "--reason", "x", *url)
    assert result.returncode == 1 and "'c' is draining" in result.stderr and "undrain" in result.stderr


@pytest.mark.parametrize("args, named", [
    (["maintenance", "ghost", "--enable", "--reason", "x"], "ghost"),
    (["maintenance", "c", "--reason", "x"], "--enable/--disable"),
    (["maintenance", "c", "--enable", "--reason", " "], "reason"),
    (["undrain", "ghost", "--reason", "x"], "ghost"),
])
def test_node_commands_exit_2_on_bad_input_naming_it(cli_store, args, named):
    store, url = cli_store
    result = cli(*args, *url)
    assert result.returncode == 2 and named in result.stderr and "Traceback" not in result.stderr


def test_node_undrain_mark_eligible(cli_store):
    store, url = cli_store
    store.set_node_status("c", "draining", eligible=False)
    doc = json.loads(cli("undrain", "c", "--reason", "cancelled", "--mark-eligible", *url, "--json").stdout)
    assert (doc["status"], doc["scheduling_eligible"]) == ("healthy", True)


def test_node_undrain_of_a_node_not_draining_exits_1(cli_store):
    store, url = cli_store
    result = cli("undrain", "c", "--reason", "x", *url)
    assert result.returncode == 1 and "'c' is healthy, not draining" in result.stderr


def test_node_states_prints_the_transitions_of_one_sweep(cli_store):
    store, url = cli_store
    doc = json.loads(cli("states", *url, "--json").stdout)
    assert [(t["node"], t["to_status"]) for t in doc] == [("g", "disconnected")]  # offline a grace later
    assert status(store, "g") == "disconnected" and status(store, "c") == "healthy"


def test_node_states_reads_the_timeout_from_the_environment(cli_store):
    store, url = cli_store
    doc = json.loads(cli("states", *url, "--json", env={"MN_HEARTBEAT_TIMEOUT_SECONDS": "1000"}).stdout)
    assert doc == [] and status(store, "g") == "healthy"


def test_node_states_with_a_bad_setting_exits_2_naming_it(cli_store):
    store, url = cli_store
    result = cli("states", *url, env={"MN_DISCONNECT_GRACE_SECONDS": "-5"})
    assert result.returncode == 2 and "MN_DISCONNECT_GRACE_SECONDS" in result.stderr
