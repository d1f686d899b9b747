"""Plan against the store's current view and commit, re-planning on conflict (bounded retries)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from mn_prefect.model.blueprint import Blueprint
from mn_prefect.model.placement import Plan
from mn_prefect.scheduler.ask import Ask, asks_for_blueprint
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.store.base import ClusterStore, CommitResult, Lease


@dataclass
class PlaceResult:
    """The last plan, the commit (None when the plan itself refused), and how many rounds it took."""

    plan: Plan
    commit: CommitResult | None
    attempts: int

    @property
    def placed(self) -> bool:
        return self.commit is not None and self.commit.ok


def place_and_commit(
    store: ClusterStore,
    job_id: str,
    asks: list[Ask],
    *,
    job_type: str = "batch",
    strategy: str = "binpack",
    retries: int = 8,
    lease: Lease | None = None,
    explain: bool = False,
) -> PlaceResult:
    """Plan ``asks`` against the store's bookings and commit atomically; on conflict, re-plan from fresh state."""
    result: PlaceResult | None = None
    for attempt in range(1, retries + 2):
        snap = store.snapshot()
        plan = plan_asks(asks, snap.nodes, snap.holds, job_type=job_type, strategy=strategy, limits=snap.limits,
                         explain=explain, job_id=job_id)
        if plan.status != "runnable_now":
            return PlaceResult(plan=plan, commit=None, attempts=attempt)
        commit = store.commit_plan(job_id, list(plan.placements), lease=lease)
        result = PlaceResult(plan=plan, commit=commit, attempts=attempt)
        if commit.ok:
            return result
        # Someone else booked first: back off a little (jittered) so racing placers spread out.
        time.sleep(random.uniform(0, 0.002 * attempt))
    assert result is not None
    return result


def place_blueprint(store: ClusterStore, job_id: str, blueprint: Blueprint, *, strategy: str | None = None,
                    retries: int = 8, lease: Lease | None = None) -> PlaceResult:
    return place_and_commit(store, job_id, asks_for_blueprint(blueprint), job_type=blueprint.job_type,
                            strategy=strategy or blueprint.strategy, retries=retries, lease=lease)
