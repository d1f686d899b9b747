"""Which bookings preemption may evict (scheduler/preemption.py), as tables: which bookings it considers at all
(``evictable_booking``) and which of those a waiting run of a queue and priority may evict (``may_evict``). The
evictions themselves, end to end: tests/test_worker_rules.py (in one process), tests/test_worker_queues.py (lab)."""

from __future__ import annotations

import math

import pytest

from mn_prefect.model.placement import Placement
from mn_prefect.model.queues import QueueRecord, QueueSpec
from mn_prefect.scheduler.preemption import Evictable, evictable_booking, may_evict
from mn_prefect.scheduler.quotas import Queues

NOW = 10_000.0


def placement(**fields) -> Placement:
    return Placement(**{"agent_id": "a", "node": "n1", "job_id": "victim", "preemptible": True, **fields})


@pytest.mark.parametrize(("booking", "placements", "expected"), [
    ("victim", [placement()], True),
    ("waiting", [placement(job_id="waiting")], False),  # the waiting run's own booking
    ("victim", [placement(preemptible=False)], False),
    ("victim", [placement(), placement(node="n2")], False),  # a gang or a system run: never split
    ("victim", [placement(reservation="rsv-1")], False),  # what a reservation holds is its owner's
    ("victim", [], False),
])
def test_the_bookings_preemption_considers(booking, placements, expected):
    assert evictable_booking(booking, placements, for_booking="waiting") is expected


def queues(**specs) -> Queues:
    return Queues(queues={name: QueueRecord(spec=QueueSpec(name=name, **spec), used=used)
                          for name, (spec, used) in specs.items()})


@pytest.mark.parametrize(("victim", "queue", "priority", "expected"), [
    (dict(priority=0), "urgent", 10, True),  # a lower priority goes
    (dict(priority=10), "urgent", 10, False),  # the same priority, no cohort to reclaim from
    (dict(priority=20), "urgent", 10, False),
    (dict(priority=0, preemptible=False), "urgent", 10, False),
    (dict(priority=0, min_runtime_s=600), "urgent", 10, False),  # it has run 300 s of the 600 it is promised
    (dict(priority=0, min_runtime_s=200), "urgent", 10, True),
])
def test_who_a_waiting_run_may_evict(victim, queue, priority, expected):
    victim = Evictable(booking="victim", placements=(placement(queue="batch", **victim),), started=NOW - 300)
    assert may_evict(victim, queue, priority, None, NOW) is expected


def test_a_lender_takes_back_what_its_cohort_borrowed_from_a_run_of_the_same_priority():
    lab = queues(**{"team-a": ({"quota": {"gpu": 1}, "cohort": "lab"}, {"gpu": 2}),
                    "team-b": ({"quota": {"gpu": 1}, "cohort": "lab"}, {})})
    borrowed = Evictable(booking="victim", placements=(placement(queue="team-a"),), started=-math.inf)
    assert may_evict(borrowed, "team-b", 0, lab, NOW)  # team-a is over its quota, team-b under
    assert not may_evict(borrowed, "team-a", 0, lab, NOW)  # not from its own queue
    within = queues(**{"team-a": ({"quota": {"gpu": 1}, "cohort": "lab"}, {"gpu": 1}),
                       "team-b": ({"quota": {"gpu": 1}, "cohort": "lab"}, {})})
    assert not may_evict(borrowed, "team-b", 0, within, NOW)  # team-a borrows nothing: nothing to take back
