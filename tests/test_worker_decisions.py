"""The worker's decisions without a server (mn_prefect/worker/decisions.py): each rule's branches, as tables."""

from __future__ import annotations

import pytest

from mn_prefect.model.placement import Plan
from mn_prefect.worker import decisions as d
from mn_prefect.worker.decisions import (
    ENDED_RUN_COPY_SECONDS,
    ORPHAN_PART_GRACE_SECONDS,
    Cancel,
    Crash,
    Deallocate,
    Fail,
    Keep,
    PutBack,
    Release,
    ReleaseJob,
    ReleaseStep,
    Wait,
)

GRACE = 30.0
NODE = "n1"

# -- a polled run that fits nowhere: wait, or fail after not_runnable_timeout_seconds ------------------------

NEVER = Plan(status="not_runnable", reason="needs 64 GPUs", agents={"a": {"n2": "too few GPUs", "n1": "too small"}})
BUSY = Plan(status="runnable_later", reason="no free GPU")


@pytest.mark.parametrize("plan, waited, timeout, last, shown, expected", [
    # never placeable and waited long enough: failed, each node's reason named once, sorted by node
    (NEVER, 60.0, 60.0, None, None,
     Fail("mn: no node can ever take this run (n1: too small; n2: too few GPUs)")),
    (NEVER, 61.0, 60.0, "not_runnable: needs 64 GPUs", "mn not_runnable: needs 64 GPUs",
     Fail("mn: no node can ever take this run (n1: too small; n2: too few GPUs)")),
    # never placeable but inside the timeout: waits, said and shown, under a name that says so and when it fails
    (NEVER, 59.9, 60.0, None, None,
     Wait("not_runnable: needs 64 GPUs", "mn not_runnable (fails after 60 s of waiting unless a node that can take "
          "it joins or comes back): needs 64 GPUs", announce=True, show=True, state_name="Never fits")),
    # a timeout of 0: no registered node could ever take it, whatever the nodes' states: failed at once
    (NEVER, 0.0, 0.0, None, None, Fail("mn: no node can ever take this run (n1: too small; n2: too few GPUs)")),
    # runnable_later (may fit later) never fails, however long it waited
    (BUSY, 1e9, 60.0, None, None, Wait("runnable_later: no free GPU", "mn runnable_later: no free GPU", announce=True, show=True)),
    # the same reason said already: not said again, shown again when Prefect's Late transition dropped it
    (BUSY, 5.0, 60.0, "runnable_later: no free GPU", None,
     Wait("runnable_later: no free GPU", "mn runnable_later: no free GPU", announce=False, show=True)),
    (BUSY, 5.0, 60.0, "runnable_later: no free GPU", "mn runnable_later: no free GPU",
     Wait("runnable_later: no free GPU", "mn runnable_later: no free GPU", announce=False, show=False)),
    # already on the state (an earlier announcer said it): neither said nor set again
    (BUSY, 5.0, 60.0, None, "mn runnable_later: no free GPU",
     Wait("runnable_later: no free GPU", "mn runnable_later: no free GPU", announce=False, show=False)),
    # a new reason: said, and shown over the old message
    (BUSY, 5.0, 60.0, "not_runnable: x", "mn not_runnable: x",
     Wait("runnable_later: no free GPU", "mn runnable_later: no free GPU", announce=True, show=True)),
    # a never-fitting run's message already on its state: neither said nor set again
    (NEVER, 5.0, 60.0, "not_runnable: needs 64 GPUs", "mn not_runnable (fails after 60 s of waiting unless a node "
     "that can take it joins or comes back): needs 64 GPUs",
     Wait("not_runnable: needs 64 GPUs", "mn not_runnable (fails after 60 s of waiting unless a node that can take "
          "it joins or comes back): needs 64 GPUs", announce=False, show=False, state_name="Never fits")),
])
def test_wait_or_fail_for_a_pool_that_waits_for_new_nodes(plan, waited, timeout, last, shown, expected):
    assert d.wait_or_fail(plan, waited_s=waited, timeout_s=timeout, last_reason=last, shown_message=shown,
                          wait_for_new_nodes=True) == expected


AT_ONCE = Fail("mn: no node can ever take this run (n1: too small; n2: too few GPUs); to wait for a node that can take "
               "it to join, set wait_for_new_nodes on the pool or the deployment")


@pytest.mark.parametrize("plan, waited, timeout, wait_for_new_nodes, expected", [
    # by default (the pool does not wait for nodes that may join): no registered node could take it, whatever their
    # states, so it fails at its first poll, whatever the timeout, each node's reason and how to wait in its message
    (NEVER, 0.0, 600.0, False, AT_ONCE),
    (NEVER, 0.0, 3600.0, False, AT_ONCE),
    (NEVER, 0.0, 0.0, False, AT_ONCE),
    # the pool waits for nodes that may join: today's timeout applies
    (NEVER, 0.0, 600.0, True, Wait("not_runnable: needs 64 GPUs", "mn not_runnable (fails after 600 s of waiting "
                                   "unless a node that can take it joins or comes back): needs 64 GPUs", announce=True,
                                   show=True, state_name="Never fits")),
    (NEVER, 600.0, 600.0, True, Fail("mn: no node can ever take this run (n1: too small; n2: too few GPUs)")),
    (NEVER, 0.0, 0.0, True, Fail("mn: no node can ever take this run (n1: too small; n2: too few GPUs)")),
    # a run that may fit later is not touched by the setting
    (BUSY, 1e9, 0.0, False, Wait("runnable_later: no free GPU", "mn runnable_later: no free GPU", announce=True,
                                 show=True)),
])
def test_a_run_no_registered_node_could_take_fails_at_once_unless_the_pool_waits_for_new_nodes(
        plan, waited, timeout, wait_for_new_nodes, expected):
    assert d.wait_or_fail(plan, waited_s=waited, timeout_s=timeout, last_reason=None, shown_message=None,
                          wait_for_new_nodes=wait_for_new_nodes) == expected


# A node refusing only for its state may take the run once it is back: the run waits (at least NODE_STATE_WAIT_S).
IN_MAINTENANCE = Plan(status="not_runnable", reason="no node can ever take this job", agents={"a": {
    "gpu-1": "node not ready: status maintenance", "cpu-1": "insufficient gpu: needs 1, has 0"}})
INELIGIBLE = Plan(status="not_runnable", reason="x", agents={"a": {"gpu-1": "scheduling ineligible: scheduling_eligible "
                                                                             "is false"}})
NO_NODES = Plan(status="not_runnable", reason="no node can ever take this job: no nodes", agents={"a": {}})
QUOTA = Plan(status="not_runnable", reason="quota: queue a can never hold 8 GPUs")
TOO_BIG = Plan(status="not_runnable", reason="x", agents={"a": {"gpu-1": "insufficient gpu: needs 99, has 2",
                                                                "cpu-1": "insufficient gpu: needs 99, has 0"}})
GANG = Plan(status="not_runnable", reason="x", agents={"a": {"gpu-1": "node not ready: status draining"},
                                                       "b": {"gpu-1": "missing runtime driver: docker"}})


@pytest.mark.parametrize("plan, waits", [
    (IN_MAINTENANCE, True), (INELIGIBLE, True), (NO_NODES, True), (QUOTA, True), (TOO_BIG, False), (GANG, False),
    (NEVER, False)])
def test_a_never_fitting_run_waits_for_nodes_only_when_a_node_refuses_it_for_its_state(plan, waits):
    assert d.waits_for_nodes(plan) is waits
    at_once = d.wait_or_fail(plan, waited_s=0.0, timeout_s=0.0, last_reason=None, shown_message=None)
    assert isinstance(at_once, Wait if waits else Fail)
    if waits:
        assert at_once.state_name == d.NEVER_FITS and "fails after 600 s of waiting" in at_once.state_message
        later = d.wait_or_fail(plan, waited_s=d.NODE_STATE_WAIT_S, timeout_s=0.0, last_reason=None, shown_message=None)
        assert later == Fail(d.never_placeable(plan))
        longer = d.wait_or_fail(plan, waited_s=d.NODE_STATE_WAIT_S, timeout_s=3600.0, last_reason=None,
                                shown_message=None)
        assert isinstance(longer, Wait)  # a pool that waits longer for nodes to join: its timeout applies


NO_DOCKER = Plan(status="not_runnable", reason="no node can ever take this job", agents={"a": {
    "cpu-1": "missing runtime driver: docker", "gpu-1": "missing runtime driver: docker"}})


@pytest.mark.parametrize("timeout", [0.0, 600.0, 3600.0])
def test_a_run_whose_runtime_driver_no_node_offers_fails_at_once_saying_what_to_do(timeout):
    assert d.missing_driver(NO_DOCKER) == "docker"
    decision = d.wait_or_fail(NO_DOCKER, waited_s=0.0, timeout_s=timeout, last_reason=None, shown_message=None)
    assert decision == Fail("mn: no node offers runtime driver docker, which this run asks for (cpu-1, gpu-1 do not): "
                            "run it where a worker on a machine whose Docker daemon answers (`mn-prefect up` offers it "
                            "when one does), or deploy it without runtime_driver docker")
    other = Plan(status="not_runnable", reason="x", agents={"a": {"n1": "missing runtime driver: podman"}})
    assert "a node that advertises podman (MN_NODE_RUNTIME_DRIVERS)" in d.no_driver_message(other, "podman")


@pytest.mark.parametrize("plan", [
    # a node that offers the driver is only away (maintenance): it may come back, so the run waits
    Plan(status="not_runnable", reason="x", agents={"a": {"cpu-1": "missing runtime driver: docker",
                                                          "gpu-1": "node not ready: status maintenance"}}),
    # another node refuses it for something else: the usual never-fits wait (in a pool that waits for new nodes)
    Plan(status="not_runnable", reason="x", agents={"a": {"cpu-1": "missing runtime driver: docker",
                                                          "gpu-1": "insufficient cpu: asks 64, has 16"}}),
    NO_NODES,
])
def test_a_driver_some_node_may_still_offer_is_not_failed_at_once(plan):
    assert d.missing_driver(plan) is None
    assert isinstance(d.wait_or_fail(plan, waited_s=0.0, timeout_s=600.0, last_reason=None, shown_message=None,
                                     wait_for_new_nodes=True), Wait)


def test_a_never_fitting_run_fails_at_once_by_default_and_is_shown_under_its_own_name_when_the_pool_waits():
    from mn_prefect.worker.variables import MNJobConfiguration, MNVariables

    timeout = MNVariables.model_fields["not_runnable_timeout_seconds"].default
    assert timeout == MNJobConfiguration.model_fields["not_runnable_timeout_seconds"].default == 600
    waits = MNVariables.model_fields["wait_for_new_nodes"].default
    assert waits is MNJobConfiguration.model_fields["wait_for_new_nodes"].default is False
    failed = d.wait_or_fail(TOO_BIG, waited_s=0.0, timeout_s=timeout, last_reason=None, shown_message=None,
                            wait_for_new_nodes=waits)
    assert isinstance(failed, Fail) and "cpu-1: insufficient gpu: needs 99, has 0" in failed.message
    waiting = d.wait_or_fail(TOO_BIG, waited_s=5.0, timeout_s=timeout, last_reason=None, shown_message=None,
                             wait_for_new_nodes=True)
    assert isinstance(waiting, Wait) and waiting.state_name == "Never fits"  # never "Late", which says nothing
    assert waiting.state_message.startswith("mn not_runnable (fails after 600 s of waiting unless a node that can "
                                            "take it joins or comes back)")


def test_a_long_reason_is_cut_to_what_prefect_keeps_on_the_state():
    decision = d.wait_or_fail(Plan(status="runnable_later", reason="x" * 6000), waited_s=0, timeout_s=60, last_reason=None,
                              shown_message=None)
    assert isinstance(decision, Wait) and len(decision.state_message) == d.STATE_MESSAGE_LIMIT
    assert decision.reason == "runnable_later: " + "x" * 6000


@pytest.mark.parametrize("plan, says", [
    (Plan(status="not_runnable", reason="no node matches"), "(no node matches)"),
    (Plan(status="not_runnable"), "(no nodes)"),
])
def test_never_placeable_falls_back_to_the_plans_reason(plan, says):
    assert d.never_placeable(plan) == f"mn: no node can ever take this run {says}"


# -- a run placed on a lost node before it started ------------------------------------------------------------

@pytest.mark.parametrize("count, node, reservation, system_run, expected", [
    (1, "n2", False, False, True),
    (1, NODE, False, False, False),  # on this node: this worker starts it
    (2, "n2", False, False, False),  # a gang: not moved one placement at a time
    (1, "n2", True, False, False),  # inside a reservation: it belongs there
    (1, "n2", False, True, False),  # a system run's part: waits for its node
])
def test_movable(count, node, reservation, system_run, expected):
    assert d.movable(count, node, NODE, in_reservation=reservation, system_run=system_run) is expected


@pytest.mark.parametrize("status, expected", [
    ("offline", Release("its node is offline", "node_lost")),
    ("disconnected", Release("its node is disconnected", "node_lost")),
    ("healthy", Keep()),
    ("draining", Keep()),
])
def test_off_lost_node(status, expected):
    assert d.off_lost_node(status) == expected


# -- the node a booked run goes to, or its failure ---------------------------------------------------------------

@pytest.mark.parametrize("node, expected", [
    ("n2", "n2"),
    (None, Fail("mn: job j1 holds no booking for agent a1 (released?)")),
])
def test_booked_node(node, expected):
    assert d.booked_node(node, "j1", "a1") == expected


@pytest.mark.parametrize("held, expected", [
    (True, "n2"),
    (False, Fail("mn: this copy of run r1 has no booking on n2 any more (its part was released: the node was lost, "
                 "or the run's booking ended); it does not run")),
])
def test_copy_node(held, expected):
    assert d.copy_node("n2", "r1", part_held=held) == expected


@pytest.mark.parametrize("node, booked, expected", [
    ("n1", ["n1", "n2"], "n1"),
    ("n1", ["n3", "n2", "n3"], Fail("mn: this run's part of its booking on n1 was released before it started (its "
                                    "copies on n2, n3 keep theirs); it does not run")),
])
def test_system_run_node(node, booked, expected):
    assert d.system_run_node(node, booked) == expected


@pytest.mark.parametrize("system_run, error, plan, expected", [
    (True, None, None, Fail("mn: job_variables.reservation: a system run places a copy on every node of the group; "
                            "it does not run inside a reservation")),
    (False, "reservation r9 ended", None, Fail("mn: reservation r9 ended")),
    (False, None, NEVER, Fail("mn: does not fit inside reservation r9: needs 64 GPUs")),
    (False, None, BUSY, None),  # waits inside the reservation like any run
    (False, None, Plan(status="runnable_now"), None),
])
def test_inside_reservation(system_run, error, plan, expected):
    assert d.inside_reservation("r9", "system", system_run=system_run, error=error, plan=plan) == expected


def test_a_long_reservation_refusal_is_cut_to_what_prefect_keeps():
    refusal = d.inside_reservation("r9", "batch", system_run=False, error="x" * 6000)
    assert isinstance(refusal, Fail) and len(refusal.message) == d.STATE_MESSAGE_LIMIT


# -- a running run's health --------------------------------------------------------------------------------------

@pytest.mark.parametrize("verdict, owned, expected", [
    (None, True, Keep()),
    ("failed its health check 3 times", True, Deallocate("mn: failed its health check 3 times", release=True)),
    ("failed its health check 3 times", False, Deallocate("mn: failed its health check 3 times", release=False)),
])
def test_deallocation(verdict, owned, expected):
    assert d.deallocation(verdict, owned=owned) == expected


# -- a booking the sweep looks at -----------------------------------------------------------------------------

@pytest.mark.parametrize("state_type, name, expected", [
    ("COMPLETED", "Completed", Release("the run is Completed", "run_ended")),
    ("FAILED", "Failed", Release("the run is Failed", "run_ended")),
    ("CRASHED", "Crashed", Release("the run is Crashed", "run_ended")),
    ("CANCELLED", "Cancelled", Release("the run is Cancelled", "run_ended")),
    ("RUNNING", "Running", None),
    ("PENDING", "Pending", None),
    ("SCHEDULED", "Late", None),
    ("CANCELLING", "Cancelling", None),
    (None, None, None),
])
def test_run_over(state_type, name, expected):
    assert d.run_over(state_type, name) == expected


PUT_BACK = PutBack(message=f"mn: the worker that was starting this run on {NODE} stopped before it started; it "
                           "starts again", what="was Pending with no worker starting it: back to Scheduled")


@pytest.mark.parametrize("state_type, message, age, alive, expected", [
    # Pending past the orphan grace, no process: back to Scheduled, its booking kept
    ("PENDING", None, GRACE, False, PUT_BACK),
    ("PENDING", "placed", GRACE + 100, False, PUT_BACK),
    # inside the grace, or its process still runs: left alone
    ("PENDING", None, GRACE - 0.1, False, Keep()),
    ("PENDING", None, GRACE + 100, True, Keep()),
    # Cancelling with no process left to stop: Cancelled, the cancel's reason kept
    ("CANCELLING", "stop it", GRACE, False,
     Cancel(message=f"mn: no process of this run is left on {NODE} to stop (stop it)",
            what="was Cancelling with no process left to stop: Cancelled")),
    ("CANCELLING", None, GRACE, False,
     Cancel(message=f"mn: no process of this run is left on {NODE} to stop (cancelling)",
            what="was Cancelling with no process left to stop: Cancelled")),
    ("CANCELLING", None, GRACE, True, Keep()),
    ("CANCELLING", None, 1.0, False, Keep()),
    # any other state, or no timestamp: not this rule's
    ("RUNNING", None, GRACE + 100, False, Keep()),
    ("SCHEDULED", None, GRACE + 100, False, Keep()),
    ("PAUSED", None, GRACE + 100, False, Keep()),
    ("PENDING", None, None, False, Keep()),
    (None, None, None, False, Keep()),
])
def test_orphaned_run(state_type, message, age, alive, expected):
    assert d.orphaned_run(state_type, message, age, grace_s=GRACE, process_alive=alive, node=NODE) == expected


@pytest.mark.parametrize("state_type, name, age, expected", [
    ("COMPLETED", "Completed", ENDED_RUN_COPY_SECONDS, "Completed"),
    ("FAILED", "Failed", ENDED_RUN_COPY_SECONDS + 1, "Failed"),
    ("COMPLETED", "Completed", ENDED_RUN_COPY_SECONDS - 0.1, None),  # ended only just now: its copy may come
    ("RUNNING", "Running", 1e6, None),
    (None, None, 1e6, None),
])
def test_ended_for(state_type, name, age, expected):
    assert d.ended_for(state_type, name, age, ENDED_RUN_COPY_SECONDS) == expected


@pytest.mark.parametrize("ended, unheld, expected", [
    # the run ended ENDED_RUN_COPY_SECONDS ago and made no copy for this node: released at once
    ("Completed", 0.0, Release("the run is Completed and made no copy for this node", "run_ended")),
    ("deleted", 0.0, Release("the run is deleted and made no copy for this node", "run_ended")),
    # the run lives: released once no run held the part for ORPHAN_PART_GRACE_SECONDS
    (None, ORPHAN_PART_GRACE_SECONDS, Release("no run holds it: its copy was never made or was deleted", "orphaned")),
    (None, ORPHAN_PART_GRACE_SECONDS - 0.1, Keep()),
    (None, 0.0, Keep()),
])
def test_unheld_part(ended, unheld, expected):
    assert d.unheld_part(ended, unheld) == expected


def test_an_ended_runs_part_goes_well_before_the_orphan_grace():
    assert ENDED_RUN_COPY_SECONDS < ORPHAN_PART_GRACE_SECONDS


@pytest.mark.parametrize("status, found, over, expected", [
    ("running", True, False, Keep()),
    ("running", True, True, ReleaseStep("its bundle run w1 is over", crash_workflow=True)),
    ("running", False, False, ReleaseStep("its bundle run w1 is gone", crash_workflow=True)),
    ("completed", True, True, ReleaseStep("its bundle run w1 is over", crash_workflow=False)),
    ("crashed", False, False, ReleaseStep("its bundle run w1 is gone", crash_workflow=False)),
])
def test_step_booking(status, found, over, expected):
    assert d.step_booking("w1", status, run_found=found, run_over=over) == expected


@pytest.mark.parametrize("finished, status, coordinator_over, expected", [
    (True, "completed", False, ReleaseJob("the job is completed", "completed", stop_agents=False)),
    (True, "failed", True, ReleaseJob("the job is failed", "failed", stop_agents=False)),
    (False, "running", False, Keep()),
    (False, "running", True, ReleaseJob("its coordinator run is over", "cancelled", stop_agents=True)),
])
def test_job_bookings(finished, status, coordinator_over, expected):
    assert d.job_bookings(finished, status, coordinator_over=coordinator_over) == expected


# -- runs of the pool whose end never reached the server ------------------------------------------------------

PENDING_CRASH = Crash(message="mn: the run's flow process ended before the run started, and its worker could not "
                              "report it (its booking is already released)",
                      what="was Pending with no booking: marked Crashed")


@pytest.mark.parametrize("age, in_flight, elsewhere, booked, expected", [
    (GRACE, False, False, False, PENDING_CRASH),  # Pending past the grace with no booking: Crashed
    (GRACE - 0.1, False, False, False, Keep()),
    (None, False, False, False, Keep()),
    (GRACE, True, False, False, Keep()),  # this worker is submitting or running it
    (GRACE, False, True, False, Keep()),  # a blueprint agent's or a system copy's: its owner judges it
    (GRACE, False, False, True, Keep()),  # still booked: its node's worker judges it (orphaned_run)
])
def test_unreported_pending_end(age, in_flight, elsewhere, booked, expected):
    assert d.unreported_pending_end(age, GRACE, in_flight=in_flight, owned_elsewhere=elsewhere,
                                    booked=booked) == expected


RUNNING_CRASH = Crash(message=f"mn: the run's flow process on {NODE} ended, and its end never reached the server "
                              "(its booking is already released)",
                      what="was Running with no booking and no process: marked Crashed")


@pytest.mark.parametrize("age, in_flight, elsewhere, here, booked, alive, expected", [
    (GRACE, False, False, True, False, False, RUNNING_CRASH),  # placed here, unbooked, no process: Crashed
    (GRACE - 0.1, False, False, True, False, False, Keep()),
    (None, False, False, True, False, False, Keep()),
    (GRACE, True, False, True, False, False, Keep()),
    (GRACE, False, True, True, False, False, Keep()),
    (GRACE, False, False, False, False, False, Keep()),  # placed elsewhere: its own node's worker judges it
    (GRACE, False, False, True, True, False, Keep()),  # still booked: its process's end releases it
    (GRACE, False, False, True, False, True, Keep()),  # its process still runs here
])
def test_lost_running(age, in_flight, elsewhere, here, booked, alive, expected):
    assert d.lost_running(age, GRACE, in_flight=in_flight, owned_elsewhere=elsewhere, placed_here=here,
                          booked=booked, process_alive=alive, node=NODE) == expected


def test_the_orphan_grace_is_the_workers_setting_read_once_and_named_when_wrong():
    """The rules take the grace as an input; the worker reads MN_ORPHAN_PENDING_SECONDS at its start."""
    from mn_prefect.lifecycle.settings import ORPHAN_PENDING_VAR, orphan_pending_s
    from mn_prefect.model.issues import InvalidInput

    assert orphan_pending_s({}) == d.ORPHAN_PENDING_GRACE_SECONDS == 30.0
    assert orphan_pending_s({ORPHAN_PENDING_VAR: "3"}) == 3.0
    for wrong in ("abc", "0", "-1", "nan"):
        with pytest.raises(InvalidInput, match=ORPHAN_PENDING_VAR):
            orphan_pending_s({ORPHAN_PENDING_VAR: wrong})


def test_decisions_are_frozen_values():
    decision = Release("x", "run_ended")
    with pytest.raises(AttributeError):
        decision.why = "y"  # type: ignore[misc]
    assert Release("x", "run_ended") == decision and hash(Keep()) == hash(Keep())


@pytest.mark.parametrize("age, booked, alive, expected", [
    # Stopped by its worker, its booking released, its Cancelled lost (the API away, or its worker cut off):
    (GRACE, False, False, d.Cancel(
        message=f"mn: the run's flow process on {NODE} was stopped, and its end never reached the server (its "
                "booking is already released)",
        what="was Cancelling with no booking and no process: Cancelled")),
    (GRACE - 0.1, False, False, Keep()),
    (GRACE, True, False, Keep()),  # still booked: its worker is stopping it and releases it then
    (GRACE, False, True, Keep()),  # its process still runs here: its worker stops it
])
def test_a_lost_cancelling_run_is_cancelled_not_crashed(age, booked, alive, expected):
    assert d.lost_running(age, GRACE, in_flight=False, owned_elsewhere=False, placed_here=True, booked=booked,
                          process_alive=alive, node=NODE, cancelling=True) == expected


SCHEDULE_AGAIN = "mn: the worker on n1 stopped before starting this run; it waits to be placed again"
NOT_STARTED = Release("its worker stopped before starting it", "not_started")


@pytest.mark.parametrize(("state", "agent", "system_part", "expected"), [
    ("PENDING", False, False, d.StoppedLaunch(SCHEDULE_AGAIN, release=NOT_STARTED)),
    ("SCHEDULED", False, False, d.StoppedLaunch(SCHEDULE_AGAIN, release=NOT_STARTED)),
    ("COMPLETED", False, False, d.StoppedLaunch(None, release=NOT_STARTED)),
    ("RUNNING", False, False, d.StoppedLaunch()),
    ("CANCELLING", False, False, d.StoppedLaunch()),
    ("PAUSED", False, True, d.StoppedLaunch()),
    ("PENDING", True, False, d.StoppedLaunch(SCHEDULE_AGAIN)),  # a blueprint agent: its job keeps the booking
    ("CANCELLED", True, False, d.StoppedLaunch()),
    ("PENDING", False, True, d.StoppedLaunch(SCHEDULE_AGAIN)),  # a system run's part waits for its node
    ("FAILED", False, True, d.StoppedLaunch(release_part=Release("the run is over", "run_ended"))),
])
def test_a_run_whose_worker_stopped_while_launching_it(state, agent, system_part, expected):
    assert d.stopped_launch(state, node="n1", agent=agent, system_part=system_part) == expected


@pytest.mark.parametrize(("state", "deleted", "left_s", "step"), [
    ("CRASHED", False, 40.0, "done"),      # the report took
    ("COMPLETED", False, 40.0, "done"),    # the run ended some other way: nothing more to report
    ("PENDING", False, 40.0, "again"),     # the API did not take it: again, after the pause
    (None, False, 40.0, "again"),          # the API is still away
    (None, False, 1.0, "leave"),           # time is up: the pool's sweep of unreported ends takes it
    ("SCHEDULED", False, 40.0, "leave"),   # put back meanwhile: not this report's
    (None, True, 40.0, "leave"),           # deleted
])
def test_a_crash_report_is_made_again_only_while_the_api_did_not_take_it(state, deleted, left_s, step):
    assert d.crash_report_next(state, deleted=deleted, left_s=left_s, pause_s=2.0) == step
