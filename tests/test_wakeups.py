"""Event-driven wake-ups: the store announces what can let a waiting run start (ClusterStore.changes), on SQLite,
Redis and PostgreSQL (real servers), and a real mn worker polls at once on it (a real Prefect server)."""

from __future__ import annotations

import time

import prefect_env
import pytest
import servers
from builders import gpu, node
from lab import Lab

from mn_prefect.model.resources import resource_request
from mn_prefect.placement import reservations as rsv
from mn_prefect.placement.placing import place_and_commit
from mn_prefect.scheduler import Ask
from mn_prefect.settings import wakeups_enabled
from mn_prefect.store import open_store
from mn_prefect.store.base import CAPACITY, PLACED, placed_topic

# Long enough for a loaded machine to deliver a change; a wait that hears it returns at once.
HEAR = 10.0
# What "nothing was announced" waits: the watchers poll (SQLite) or read (Redis, PostgreSQL) several times in it.
QUIET = 0.5


def ask(name="w", **resources):
    return Ask(agent_id=name, request=resource_request(resources))


@pytest.fixture
def two_nodes(store):
    store.register_node(node("a", cpu=4))
    store.register_node(node("b", cpu=4))
    return store


@pytest.fixture
def other(two_nodes):
    """A second connection to the same store: what another worker would hold."""
    second = open_store(two_nodes.url.raw)
    yield second
    second.close()


@pytest.fixture
def watch(two_nodes):
    watchers = []

    def open_watcher(node_name=None):
        watcher = two_nodes.changes(node=node_name)
        watchers.append(watcher)
        return watcher

    yield open_watcher
    for watcher in watchers:
        watcher.close()


def test_a_watcher_hears_a_release_made_by_another_connection(two_nodes, other, watch):
    assert place_and_commit(other, "holder", [ask(cpu_cores=4)]).placed
    watcher = watch("a")
    watcher.wait(QUIET)  # whatever the commit announced is behind us
    assert other.release("holder") == 1
    assert CAPACITY in watcher.wait(HEAR)


def test_a_watcher_of_a_node_hears_commits_on_it_and_not_on_others(two_nodes, other, watch):
    on_a, on_b = watch("a"), watch("b")
    placed = place_and_commit(other, "run", [ask(cpu_cores=1)], strategy="binpack").commit.placements[0]
    target, bystander = (on_a, on_b) if placed.node == "a" else (on_b, on_a)
    assert target.wait(HEAR) == {PLACED}
    assert bystander.wait(QUIET) == frozenset()


def test_a_watcher_of_every_node_hears_every_commit(two_nodes, other, watch):
    watcher = watch()
    assert place_and_commit(other, "run", [ask(cpu_cores=1)]).placed
    assert PLACED in watcher.wait(HEAR)


def test_an_announcement_from_another_connection_wakes_only_the_node_it_names(two_nodes, other, watch):
    """What a creator of runs booked beforehand (a system run's copies, a blueprint's agents) sends once they
    exist in Prefect: the node's worker then finds them at once."""
    on_a, on_b = watch("a"), watch("b")
    other.announce([placed_topic("b")])
    assert on_b.wait(HEAR) == {PLACED}
    assert on_a.wait(QUIET) == frozenset()


def test_a_node_joining_or_coming_back_is_capacity(two_nodes, other, watch):
    watcher = watch("a")
    other.register_node(node("c", cpu=2))
    assert watcher.wait(HEAR) == {CAPACITY}
    other.set_node_status("b", "disconnected")
    assert watcher.wait(HEAR) == {CAPACITY}
    other.heartbeat("b")  # the beat that brings b back
    assert watcher.wait(HEAR) == {CAPACITY}


def test_a_heartbeat_that_changes_nothing_is_not_announced(two_nodes, other, watch):
    watcher = watch()
    other.heartbeat("a")
    other.heartbeat("b")
    assert watcher.wait(QUIET) == frozenset()


def test_a_change_made_while_nobody_waits_is_reported_by_the_next_wait(two_nodes, other, watch):
    for i in range(4):
        assert place_and_commit(other, f"r{i}", [ask(cpu_cores=1)]).placed
    watcher = watch("a")
    watcher.wait(QUIET)
    for i in range(4):  # a burst, between two waits
        other.release(f"r{i}")
    assert CAPACITY in watcher.wait(HEAR)


def test_a_refused_commit_announces_nothing(two_nodes, other, watch):
    assert place_and_commit(other, "big", [ask(cpu_cores=4)]).placed
    assert place_and_commit(other, "big2", [ask(cpu_cores=4)]).placed
    watcher = watch()
    watcher.wait(QUIET)
    assert not place_and_commit(other, "too-big", [ask(cpu_cores=4)]).placed
    assert watcher.wait(QUIET) == frozenset()


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("on", True), ("off", False), ("OFF", False),
                                                 ("0", False), ("true", True)])
def test_the_wakeups_setting(value, enabled):
    assert wakeups_enabled({} if value is None else {"MN_WAKEUPS": value}) is enabled


def test_a_wrong_wakeups_setting_names_the_variable():
    with pytest.raises(ValueError, match="MN_WAKEUPS"):
        wakeups_enabled({"MN_WAKEUPS": "sometimes"})


# -- a real worker --------------------------------------------------------------------------------------------

WAKEUP_LINE = "mn: submitted on a store change"
EVENT_LINE = "mn: submitted on Prefect's event"


def woken(lab: Lab, run: str, why: str = "", *, or_event: bool = False) -> None:
    """The worker's line on the run that says a wake-up submitted it (worker logs reach the API in batches);
    ``or_event``: Prefect's event of the run's creation may have woken its worker first, also before a poll."""
    lab.wait_for_log(run, f"{WAKEUP_LINE} {why}".strip(), *([EVENT_LINE] if or_event else []))


def add_worker(lab: Lab, node_spec: dict, **env: str) -> None:
    """One more node and its worker in the lab (``env``: the worker's extra settings)."""
    lab.nodes.append(node_spec)
    lab.workers.append(prefect_env.start_worker(lab.server, lab.pool, node_spec, lab.store_url, lab.home,
                                                extra_env=env))


@pytest.fixture(scope="module")
def slow_poll_lab(tmp_path_factory):
    """A Prefect server and an mn pool whose worker (started by the test) polls once a minute."""
    lab = Lab(tmp_path_factory.mktemp("wakeups"), fleet=[])
    yield lab
    lab.stop()


def _hold_with_a_reservation(lab: Lab, name: str, cpu: int, group: str) -> str:
    """Register ``name`` (its worker comes later) and reserve all its cores, as another process would."""
    lab.store.create_group(group)
    lab.store.register_node(node(name, cpu=cpu, group=group))
    made = rsv.reserve(lab.store, resource_request({"cpu": cpu}), {"cpu": cpu}, 3600, group=group, node=name)
    assert made.record is not None, made.plan.reason
    return made.record.job_id


def _state(lab: Lab, run: str) -> dict:
    return lab.flow_run(run)["state"]


@pytest.mark.lab
def test_a_run_waiting_on_a_reservation_starts_on_the_wakeup_of_its_release(slow_poll_lab):
    """The worker refused the run (its view held the reservation); the release, made by another process, must be
    seen on the wake-up it causes: a refusal is never believed on a view read before the change."""
    lab = slow_poll_lab
    rid = _hold_with_a_reservation(lab, "w-rsv", 6, lab.pool)
    run = lab.run(lab.deploy({"resources": {"cpu": 6}}))
    # Started after the run exists: its first poll refuses it, and its next is a minute away.
    add_worker(lab, {"name": "w-rsv", "cpu_cores": 6, "memory_mb": 8192}, PREFECT_WORKER_QUERY_SECONDS="60")
    servers.wait_for(lambda: (_state(lab, run).get("message") or "").startswith("mn runnable_later"), timeout=90,
                     interval=0.5, what="the run to wait for the reservation")
    time.sleep(3)  # the poll that the reason's own Scheduled event wakes (run_events.py) refuses it too, first
    rsv.release(lab.store, rid, None)
    assert lab.wait(run, timeout=50)["state"]["type"] == "COMPLETED"  # before the worker's next poll
    woken(lab, run, "(capacity)")


@pytest.mark.lab
def test_a_waiting_run_starts_when_the_run_before_it_ends_not_on_the_next_poll(slow_poll_lab):
    lab = slow_poll_lab
    gpu_node = {"name": "w-gpu", "cpu_cores": 4, "memory_mb": 8192, "devices": [gpu("W0", 0)]}
    # Made before any node has a GPU: wait_for_new_nodes keeps the workers of the pool from failing them as runs no
    # node can ever take.
    deployment = lab.deploy({"resources": {"gpu": 1}, "wait_for_new_nodes": True})
    runs = [lab.run(deployment, seconds=3), lab.run(deployment)]  # one GPU: one of them waits for the other
    # Started after the runs exist: its first poll sees both, and its next is a minute away.
    add_worker(lab, gpu_node, PREFECT_WORKER_QUERY_SECONDS="60")
    for run in runs:
        assert lab.wait(run, timeout=180)["state"]["type"] == "COMPLETED"
    first, second = sorted(runs, key=lambda r: lab.record(r)["start"])
    assert lab.record(second)["start"] >= lab.record(first)["end"]  # it did wait
    # The second started on the wake-up of the first's release. (The first started on the worker's first poll, on
    # Prefect's event or on the wake-up of its node joining, itself a capacity change: whichever came first.)
    woken(lab, second)


@pytest.mark.lab
def test_a_run_booked_onto_a_node_by_someone_else_starts_there_without_a_poll(slow_poll_lab):
    lab = slow_poll_lab
    booked = {"name": "w-booked", "cpu_cores": 4, "memory_mb": 8192}
    add_worker(lab, booked, PREFECT_WORKER_QUERY_SECONDS="60")
    servers.wait_for(lambda: lab.store.get_node("w-booked"), timeout=90, what="the worker of w-booked registered")
    # Two GPUs: no worker's own poll can place it (no node has them); the booking below, made as another worker
    # would make it, is what w-booked's worker starts (the store, not the job variables, holds the allocation).
    run = lab.run(lab.deploy({"resources": {"gpu": 2}}))
    booking = place_and_commit(lab.store, run, [Ask(agent_id="r", request=resource_request({"cpu_cores": 1}),
                                                    preferred_node="w-booked")], group=lab.pool)
    assert booking.commit.placements[0].node == "w-booked"
    assert lab.wait(run, timeout=180)["state"]["type"] == "COMPLETED"
    woken(lab, run, "(placed)", or_event=True)


@pytest.mark.lab
def test_a_run_made_after_the_workers_last_poll_starts_on_prefects_event_not_on_the_next_poll(slow_poll_lab):
    lab = slow_poll_lab
    add_worker(lab, {"name": "w-event", "cpu_cores": 2, "memory_mb": 4096, "labels": {"role": "event"}},
               PREFECT_WORKER_QUERY_SECONDS="60")
    # Runs only w-event can take: made once it is in the store (before, the pool's other workers would fail them
    # as runs no node can ever take).
    servers.wait_for(lambda: lab.store.get_node("w-event"), timeout=90, what="the worker of w-event registered")
    only_here = [{"attribute": "labels.role", "operator": "==", "value": "event"}]
    deployment = lab.deploy({"resources": {"cpu": 1}, "constraints": only_here})
    # A first run: once it is over, the worker's first poll (made as it started) is behind it for sure.
    assert lab.wait(lab.run(deployment), timeout=120)["state"]["type"] == "COMPLETED"
    made = time.time()
    run = lab.run(deployment)
    assert lab.wait(run, timeout=50)["state"]["type"] == "COMPLETED"  # well before the worker's next poll
    assert lab.record(run)["start"] - made < 40
    # Every worker of the pool polls once a minute and nothing changed in the store before the run was placed: a
    # worker woke on Prefect's event of its creation. Which one placed it decides the line: w-event's own worker
    # says so; another's placement wakes w-event's worker by the store's commit ("placed").
    woken(lab, run, "(placed)", or_event=True)


@pytest.mark.lab
def test_a_worker_started_with_wakeups_off_polls_only_and_says_so(slow_poll_lab):
    lab = slow_poll_lab
    quiet = {"name": "w-off", "cpu_cores": 2, "memory_mb": 4096}
    add_worker(lab, quiet, MN_WAKEUPS="off")
    log = lab.home / "worker-w-off.log"
    servers.wait_for(lambda: "wake-ups are off (MN_WAKEUPS=off)" in log.read_text(), timeout=90,
                     what="the worker of w-off to start")


@pytest.mark.lab
def test_a_system_runs_copy_starts_on_its_node_when_the_copy_exists_not_on_the_next_poll(slow_poll_lab):
    """A system run's part on another node is committed before its copy exists in Prefect: the commit's wake-up
    comes too early for that node's worker, so the worker that made the copy announces it once it exists."""
    lab = slow_poll_lab
    first, second = ({"name": f"wk-sys-{s}", "cpu_cores": 2, "memory_mb": 4096, "labels": {"role": "wake"}}
                     for s in ("a", "b"))
    for spec in (first, second):
        add_worker(lab, spec, PREFECT_WORKER_QUERY_SECONDS="60", PREFECT_LOGGING_LEVEL="DEBUG")
    servers.wait_for(lambda: lab.store.get_node("wk-sys-a") and lab.store.get_node("wk-sys-b"), timeout=90,
                     what="both workers registered")
    for spec in (first, second):  # registered is not started: a worker polls first once Prefect says it started
        servers.wait_for(lambda spec=spec: f"Worker 'mn-{spec['name']}' started!" in (
            lab.home / f"worker-{spec['name']}.log").read_text(), timeout=90, interval=0.5, what="the worker started")
    time.sleep(8)  # their first polls are behind them (they found nothing); their next are a minute away
    only_here = [{"attribute": "labels.role", "operator": "==", "value": "wake"}]
    # Whichever worker places it (the run itself on wk-sys-a, a copy for wk-sys-b) makes the copy and announces it.
    run = lab.run(lab.deploy({"job_type": "sysbatch", "resources": {"cpu": 1}, "constraints": only_here}))
    assert lab.wait(run, timeout=180)["state"]["type"] == "COMPLETED"
    body = {"flow_runs": {"tags": {"all_": [f"mn-copy-of:{run}"]}}}
    [copy] = servers.wait_for(lambda: lab.http.post("/flow_runs/filter", json=body).json(), timeout=60,
                              what="the copy", interval=0.5)
    assert lab.wait(copy["id"], timeout=120)["state"]["type"] == "COMPLETED"
    assert lab.record(copy["id"])["env"]["MN_NODE"] == "wk-sys-b"
    try:
        woken(lab, copy["id"], "(placed)", or_event=True)
    except AssertionError as missed:  # what wk-sys-b's worker did meanwhile (it logs its polls at DEBUG here)
        polls = [line for line in (lab.home / "worker-wk-sys-b.log").read_text().splitlines()
                 if any(word in line for word in ("woke", "Discovered", "submitting", "WARNING", "ERROR"))]
        raise AssertionError(f"{missed}\nwk-sys-b's worker: " + "\n".join(polls[-30:])) from None
