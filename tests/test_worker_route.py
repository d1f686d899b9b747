"""The head-of-line route of a polled run that did not fit (worker/route.py), as a table of facts and answers."""

import pytest

from mn_prefect.model.placement import PlacedResources, Placement
from mn_prefect.placement.holding import StandingHold
from mn_prefect.worker.decisions import Keep, Release, hold_over
from mn_prefect.worker.route import Backfill, HoldFacts, KeepWaiting, MakeHold, PlaceOver, route

NOW = 1000.0


def standing(run="other", start=NOW + 600.0, queue=None, hold_id="hold-00000001"):
    p = Placement(agent_id="hold", node="g1", job_id=hold_id, hold=hold_id, hold_for=run, hold_start=start,
                  resources=PlacedResources(gpu_count=4))
    return StandingHold(hold_id=hold_id, run_id=run, placements=(p,), expected_start=start, queue=queue)


def facts(**kw):
    base = dict(plan_status="runnable_later", estimate_s=None, now=NOW, own=None, standing=(), head=True,
                decider=True)
    return HoldFacts(**{**base, **kw})


@pytest.mark.parametrize(("given", "expected"), [
    (facts(), MakeHold()),
    (facts(decider=False), KeepWaiting()),
    (facts(head=False), KeepWaiting()),
    (facts(plan_status="not_runnable"), KeepWaiting()),
    (facts(holds_on=False), KeepWaiting()),
    (facts(reason="quota: queue a is at its quota of gpu 2"), KeepWaiting()),
    (facts(reason="g1: port in use: tcp:8080 on g1"), KeepWaiting()),
    (facts(reason="g1: insufficient gpu: asks 4, 1 of 4 free on g1"), MakeHold()),
    (facts(own=standing(run="me")), PlaceOver(standing(run="me"))),
    (facts(standing=(standing(),)), MakeHold(replacing=(standing(),))),
    (facts(standing=(standing(),), max_holds=2), MakeHold()),
    (facts(standing=(standing(),), head=False, estimate_s=300.0), Backfill((standing(),), KeepWaiting())),
    (facts(standing=(standing(),), head=False, estimate_s=900.0), KeepWaiting()),
    (facts(standing=(standing(start=None),), head=False, estimate_s=1.0), KeepWaiting()),
    (facts(standing=(standing(),), head=False, estimate_s=None), KeepWaiting()),
    (facts(standing=(standing(),), estimate_s=300.0, max_holds=2), Backfill((standing(),), MakeHold())),
])
def test_the_route_of_a_run_that_did_not_fit(given, expected):
    assert route(given) == expected


@pytest.mark.parametrize(("state", "decision"), [
    ("SCHEDULED", Keep()),
    ("PENDING", Release("its run no longer waits", "hold_ended")),
    ("RUNNING", Release("its run no longer waits", "hold_ended")),
    ("CANCELLED", Release("its run no longer waits", "hold_ended")),
    (None, Release("its run is gone", "hold_ended")),
])
def test_a_hold_stands_only_while_its_run_waits(state, decision):
    assert hold_over(state) == decision
