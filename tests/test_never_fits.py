"""A run that can never fit says so where users look: the announcer shows it under the state name "Never fits"
(which Prefect's late-runs service never renames "Late") with a message saying when it fails, and a run that a node
in maintenance could take waits for that node (at least NODE_STATE_WAIT_S), whatever the pool's timeout. In one
process (tests/harness.py): the worker's real parts over a real SQLite store."""

from __future__ import annotations

import pytest
from builders import gpu, node
from harness import Harness

from mn_prefect.worker.decisions import NEVER_FITS


@pytest.fixture
def pool(tmp_path, monkeypatch):
    harness = Harness(tmp_path, [node("gpu-1", 16, 65536, devices=[gpu("GPU-1a", 0, 24576)]), node("cpu-1", 8, 32768)],
                      monkeypatch=monkeypatch)
    yield harness
    harness.close()


def test_a_run_that_can_never_fit_is_shown_as_never_fits_with_when_it_fails(pool):
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
