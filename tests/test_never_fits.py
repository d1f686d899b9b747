"""A run that can never fit says so where users look. No registered node could take it, whatever their states: it
fails at its first poll with every node's reason as the Failed state's message, unless the pool (or deployment) sets
wait_for_new_nodes; then the announcer shows it under the state name "Never fits" (which Prefect's late-runs service
never renames "Late") with a message saying when it fails. A run that a node in maintenance could take waits for that
node (at least NODE_STATE_WAIT_S), whatever the pool's timeout. In one process (tests/harness.py): the worker's real
parts over a real SQLite store."""

from __future__ import annotations

import pytest
import servers
from builders import gpu, node
from harness import Harness

from mn_prefect.worker.decisions import NEVER_FITS


@pytest.fixture
def pool(tmp_path, monkeypatch):
    harness = Harness(tmp_path, [node("gpu-1", 16, 65536, devices=[gpu("GPU-1a", 0, 24576)]), node("cpu-1", 8, 32768)],
                      monkeypatch=monkeypatch)
    yield harness
    harness.close()


def test_a_run_that_can_never_fit_fails_at_its_first_poll_with_every_nodes_reason_by_default(pool):
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 99}}))  # the defaults: 600 s, no waiting
    pool.poll()
    state = pool.prefect.state(run.id)
    assert state.is_failed(), (state.type, state.name, state.message)
    assert state.message.startswith("mn: no node can ever take this run (cpu-1: insufficient gpu"), state.message
    assert "gpu-1: insufficient gpu" in state.message and "set wait_for_new_nodes" in state.message
    assert [s.type for s in pool.prefect.said(run.id)] == [state.type]  # one state, never Scheduled "Never fits"
    assert not pool.booked(run)


def test_a_pool_that_waits_for_new_nodes_shows_it_as_never_fits_with_when_it_fails(pool):
    pool.prefect.work_pool.base_job_template["variables"]["properties"]["wait_for_new_nodes"]["default"] = True
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 99}}))  # the default timeout, 600 s
    pool.poll()
    state = pool.prefect.state(run.id)
    assert state.is_scheduled() and state.name == NEVER_FITS, (state.name, state.message)
    assert state.message.startswith("mn not_runnable (fails after 600 s of waiting unless a node that can take it "
                                    "joins or comes back)"), state.message
    assert "gpu-1: insufficient gpu" in state.message and "cpu-1: insufficient gpu" in state.message
    pool.poll()
    assert len(pool.prefect.said(run.id)) == 1  # set once: the name and message stand


def test_a_timeout_of_zero_fails_it_at_once_with_every_nodes_reason(pool):
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 99}, "not_runnable_timeout_seconds": 0}))
    pool.poll()
    state = pool.prefect.state(run.id)
    assert state.is_failed() and state.message.startswith("mn: no node can ever take this run"), state.message


def test_a_run_only_a_node_in_maintenance_could_take_waits_for_it_whatever_the_timeout(pool):
    pool.store.set_node_status("gpu-1", "maintenance", eligible=False)
    run = pool.prefect.run(pool.prefect.deploy({"resources": {"gpu": 1}, "not_runnable_timeout_seconds": 0}))
    pool.poll()
    state = pool.prefect.state(run.id)
    assert state.is_scheduled() and state.name == NEVER_FITS, (state.type, state.message)
    assert "fails after 600 s" in state.message and "gpu-1:" in state.message


# -- end to end: a real Prefect server, the lab's workers ------------------------------------------------------


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from lab import Lab

    lab = Lab(tmp_path_factory.mktemp("never-fits"))
    yield lab
    lab.stop()


@pytest.mark.lab
def test_in_a_lab_a_run_no_node_can_take_fails_at_its_first_poll_and_one_that_waits_says_why(lab):
    failing = lab.run(lab.deploy({"resources": {"gpu": 99}}))  # the defaults: not_runnable_timeout_seconds 600
    waiting = lab.run(lab.deploy({"resources": {"gpu": 99}, "wait_for_new_nodes": True}))
    # Failed well inside the 600 s it used to wait: at the announcer's first poll of it.
    failed = lab.wait(failing, timeout=120)
    assert failed["state"]["type"] == "FAILED", failed["state"]
    message = failed["state"]["message"]
    assert message.startswith("mn: no node can ever take this run (") and "insufficient gpu" in message, message
    assert "set wait_for_new_nodes" in message
    lab.wait_for_log(failing, "mn: no node can ever take this run (")
    # The one that waits keeps its reason on its state, under a name the runs list shows, and its log says it.
    shown = servers.wait_for(lambda: (r := lab.flow_run(waiting))["state"]["name"] == NEVER_FITS and r, timeout=120,
                             interval=0.5, what="the waiting run shown as Never fits")
    assert shown["state"]["message"].startswith("mn not_runnable (fails after 600 s of waiting"), shown["state"]
    logs = lab.wait_for_log(waiting, "mn: waiting to be placed (not_runnable:")
    said = [line for line in logs if "waiting to be placed" in line]
    assert len(said) == 1 and "insufficient gpu" in said[0], logs  # said once, at its first poll
    lab.http.post(f"/flow_runs/{waiting}/set_state", json={"state": {"type": "CANCELLED"}, "force": True})
