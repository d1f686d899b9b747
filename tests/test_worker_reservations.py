"""Runs inside a reservation through real mn workers and a real Prefect server (docs/operating.md, "Reservations with
expiry"): a deployment with ``job_variables.reservation`` is placed in what the reservation holds, never competes with
other runs for it, and a wrong key or an ended reservation fails the run with the field named."""

from __future__ import annotations

import pytest
import servers
from builders import gpu
from lab import Lab

from mn_prefect.model.resources import resource_request
from mn_prefect.placement import reservations as rsv

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab


def fleet() -> list[dict]:
    return [{"name": "g1", "cpu_cores": 8, "memory_mb": 32768, "dynamic_port_range": [26000, 26999],
             "devices": [gpu("GPU-A", 0, 24576), gpu("GPU-B", 1, 24576)]}]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("reservations"), fleet=fleet())
    yield lab
    lab.stop()


def test_runs_inside_a_reservation_take_its_capacity_and_outsiders_wait(lab):
    held = rsv.reserve(lab.store, resource_request({"cpu": 4, "gpu": 1}), {"cpu": 4, "gpu": 1}, 600, key="team")
    rid = held.record.job_id
    reserved_gpu = held.plan.placements[0].device_ids[0]
    inside = lab.deploy({"reservation": rid, "reservation_key": "team",
                         "resources": {"cpu": 2, "devices": [{"kind": "gpu", "shares": 0.5}]}})
    outside = lab.deploy({"resources": {"cpu": 4, "gpu": 1}})
    barrier = lab.out / "reservation.barrier"
    ins = [lab.run(inside, hold_until=str(barrier)) for _ in range(3)]
    outs = [lab.run(outside, hold_until=str(barrier)) for _ in range(2)]

    # The reservation holds 4 cores and one GPU: two half-GPU runs of 2 cores fit inside, the third waits. The
    # node's other 4 cores and GPU take exactly one outside run; the second waits (it cannot use the reservation).
    servers.wait_for(lambda: len(lab.started(ins)) == 2 and len(lab.started(outs)) == 1, timeout=240,
                     what="two runs inside the reservation and one outside holding at the barrier")
    lab.told_to_wait([r for r in ins + outs if r not in lab.started(ins + outs)])
    assert len(lab.started(ins)) == 2 and len(lab.started(outs)) == 1
    for run_id in lab.started(ins):
        placement = lab.booked(run_id)[0]
        assert placement.reservation == rid and placement.device_ids == [reserved_gpu]
    assert lab.booked(lab.started(outs)[0])[0].device_ids != [reserved_gpu]
    barrier.write_text("go")
    for run_id in ins + outs:
        assert lab.wait(run_id, timeout=240)["state"]["type"] == "COMPLETED"
    env = lab.record(ins[0])["env"]
    assert env["MN_GPU_SHARES"] == "0.5" and env["CUDA_VISIBLE_DEVICES"] == {"GPU-A": "0", "GPU-B": "1"}[reserved_gpu]
    rsv.release(lab.store, rid, "team")


def test_a_wrong_key_or_an_ended_reservation_fails_the_run_naming_the_field(lab):
    rid = rsv.reserve(lab.store, resource_request({"cpu": 1}), {"cpu": 1}, 600, key="right").record.job_id
    wrong = lab.run(lab.deploy({"reservation": rid, "reservation_key": "nope", "resources": {"cpu": 1}}))
    state = lab.wait(wrong, timeout=120)["state"]
    assert state["type"] == "FAILED" and "job_variables.reservation_key" in state["message"]
    rsv.release(lab.store, rid, "right")
    ended = lab.run(lab.deploy({"reservation": rid, "reservation_key": "right", "resources": {"cpu": 1}}))
    state = lab.wait(ended, timeout=120)["state"]
    assert state["type"] == "FAILED" and "has ended" in state["message"]
    assert lab.booked(wrong) == [] and lab.booked(ended) == []
