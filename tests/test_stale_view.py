"""A placer's cached view never makes a refusal outlive the capacity that caused it.

Each path that frees capacity is taken by another process (another store connection), never by the placer
that refused: its cached view cannot have seen the change. The refused run must be placed on the next try,
for a standalone placer (every call may follow a change) and for a worker's (each poll invalidates first).
"""

import time

import pytest
from builders import node

from mn_prefect.lifecycle.drain import start_drain
from mn_prefect.lifecycle.maintenance import set_maintenance, undrain
from mn_prefect.model.bookings import FlowRun
from mn_prefect.model.resources import resource_request
from mn_prefect.placement import reservations as rsv
from mn_prefect.placement.placing import Placer
from mn_prefect.scheduler import Ask
from mn_prefect.scheduler.limits import Limits
from mn_prefect.store import open_store


def ask(cpu: float) -> Ask:
    return Ask(agent_id="w", request=resource_request({"cpu": cpu}))


@pytest.fixture
def one_node(store):
    """One 8-core node in group P, and a second connection to the same store: 'another process'."""
    store.create_group("P")
    store.register_node(node("n1", cpu=8, group="P"))
    other = open_store(store.url.raw)
    yield store, other
    other.close()


def _book(store, job: str) -> None:
    result = Placer(store, group="P").place(job, [ask(8)])
    assert result.placed, result.plan.reason


def _reserve(store) -> str:
    made = rsv.reserve(store, resource_request({"cpu": 8}), {"cpu": 8}, 3600, group="P")
    assert made.record is not None, made.plan.reason
    return made.record.job_id


def take_and_free(case: str, other):
    """(take, free): ``take`` leaves n1 unable to run an 8-core run; ``free`` undoes it from another process."""
    if case == "release":
        return (lambda: _book(other, "run1")), (lambda: other.release("run1"))
    if case == "reservation released":
        held = {}
        return (lambda: held.setdefault("id", _reserve(other))), (lambda: rsv.release(other, held["id"], None))
    if case == "reservation expired":
        def take():
            made = rsv.reserve(other, resource_request({"cpu": 8}), {"cpu": 8}, 1.0, group="P")
            assert made.record is not None
        return take, (lambda: time.sleep(1.1))  # nobody ends it: the placer's re-read must
    if case == "maintenance off":
        return (lambda: set_maintenance(other, "n1", True, "disk swap")), \
            (lambda: set_maintenance(other, "n1", False, "disk swapped"))
    if case == "undrain":
        return (lambda: start_drain(other, "n1", "kernel update", deadline_s=60)), \
            (lambda: undrain(other, "n1", "not today", mark_eligible=True))
    if case == "node came back":
        return (lambda: other.set_node_status("n1", "disconnected")), (lambda: other.heartbeat("n1"))
    if case == "limit raised":
        return (lambda: other.set_limits(Limits(cpu=50))), (lambda: other.set_limits(Limits()))
    raise AssertionError(case)


CASES = ["release", "reservation released", "reservation expired", "maintenance off", "undrain", "node came back",
         "limit raised"]


@pytest.mark.parametrize("case", CASES)
def test_a_standalone_placer_places_as_soon_as_capacity_is_freed(one_node, case):
    store, other = one_node
    take, free = take_and_free(case, other)
    placer = Placer(store, group="P")
    assert placer.place("warm", [ask(1)]).placed  # the view is read and cached now
    placer.release(FlowRun("warm"), why="run_ended")
    take()
    refused = placer.place("run2", [ask(8)])
    assert not refused.placed
    free()
    placed = placer.place("run2", [ask(8)])
    assert placed.placed, f"{case}: refused on a stale view: {placed.plan.reason}"
    assert [p.node for p in store.active_placements(job_id="run2")] == ["n1"]


@pytest.mark.parametrize("case", CASES)
def test_a_workers_placer_believes_a_refusal_only_until_the_next_poll(one_node, case):
    store, other = one_node
    take, free = take_and_free(case, other)
    placer = Placer(store, group="P", reread="on_invalidate")
    placer.invalidate()
    assert placer.place("warm", [ask(1)]).placed
    placer.release(FlowRun("warm"), why="run_ended")
    take()
    placer.invalidate()  # a poll begins
    assert not placer.place("run2", [ask(8)]).placed
    free()
    placer.invalidate()  # the next poll (or the store watcher's capacity signal)
    placed = placer.place("run2", [ask(8)])
    assert placed.placed, f"{case}: refused on a stale view: {placed.plan.reason}"


def test_the_issue_repro_five_refusals_after_a_release_elsewhere(one_node):
    """Place run1 (fills n1), refuse run2; another connection releases run1: the same placer places run2."""
    store, other = one_node
    placer = Placer(store, group="P")
    assert placer.place("run1", [ask(8)]).placed
    assert not placer.place("run2", [ask(8)]).placed
    other.release("run1")
    assert placer.place("run2", [ask(8)]).placed


def test_an_unknown_reread_mode_is_refused(store):
    with pytest.raises(ValueError, match="reread"):
        Placer(store, reread="sometimes")


def test_a_fast_placer_re_reads_once_its_view_is_old_enough_and_sees_what_others_freed(tmp_path):
    """``refresh_every`` placements on a view younger than ``refresh_seconds`` need no re-read (its own commits
    keep it current); past that age the next placement re-reads and plans on what another process freed."""
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store.register_node(node("a", cpu=64))
    store.register_node(node("b", cpu=64))
    other = open_store(store.url.raw)
    assert Placer(other).place("big", [Ask(agent_id="w", request=resource_request({"cpu": 64}))]).placed
    big_on = store.active_placements(job_id="big")[0].node
    reads = []
    real = store.snapshot
    store.snapshot = lambda **kw: reads.append(1) or real(**kw)
    placer = Placer(store, refresh_every=3, refresh_seconds=0.5)

    def place(job: str) -> str:
        result = placer.place(job, [ask(1)], strategy="spread")
        assert result.placed, result.plan.reason
        return result.plan.placements[0].node

    assert {place(f"r{i}") for i in range(3)} != {big_on} and len(reads) == 1
    other.release("big")  # another process frees a whole node: spread would go there
    assert place("r3") != big_on and len(reads) == 1  # a young view: planned on it as it is
    time.sleep(0.6)
    assert place("r4") == big_on and len(reads) == 2  # old enough: read again, and the freed node is seen
    other.close()
    store.close()
