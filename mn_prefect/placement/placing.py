"""Plan against the store's current view and commit, re-planning on conflict (bounded retries)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mn_prefect.model.blueprint import Blueprint
from mn_prefect.model.bookings import Owner, Why, parse
from mn_prefect.model.placement import Placement, Plan
from mn_prefect.placement.ending import announce_ended, expire_due
from mn_prefect.scheduler.ask import Ask, asks_for_blueprint
from mn_prefect.scheduler.plan import plan_asks
from mn_prefect.scheduler.quotas import Queues, RunQueue
from mn_prefect.scheduler.view import ClusterView
from mn_prefect.store.base import ClusterStore, CommitResult, Event, Lease
from mn_prefect.store.releasing import release


@dataclass
class PlaceResult:
    """The last plan, the commit (None when the plan itself refused), and how many rounds it took; ``conflicts``:
    the commits of this call the store refused (someone booked first: it planned again), ``rereads``: the times
    its commits' apply found the nodes changed and the store decided again (``CommitResult.rereads``)."""

    plan: Plan
    commit: CommitResult | None
    attempts: int
    conflicts: int = 0
    rereads: int = 0

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
    group: str | None = None,
    update: dict[str, Any] | None = None,
) -> PlaceResult:
    """Plan ``asks`` against the store's bookings and commit atomically; on conflict, re-plan from fresh state.
    A one-off ``Placer``: every reservation (worker, blueprint coordinator, bundle runner) goes through it.
    With ``group``, only that resource group's nodes are considered; ``update`` sets fields on every placement
    committed (``Placer.place``)."""
    return Placer(store, retries=retries, group=group).place(job_id, asks, job_type=job_type, strategy=strategy,
                                                             lease=lease, explain=explain, update=update)


def place_blueprint(store: ClusterStore, job_id: str, blueprint: Blueprint, *, strategy: str | None = None,
                    retries: int = 8, lease: Lease | None = None, group: str | None = None) -> PlaceResult:
    return place_and_commit(store, job_id, asks_for_blueprint(blueprint), job_type=blueprint.job_type,
                            strategy=strategy or blueprint.strategy, retries=retries, lease=lease, group=group)


REREAD_MODES = ("every_call", "on_invalidate")


class Placer:
    """A long-lived placer (one per worker): plans against a cached view of the store, commits atomically,
    and re-reads the store only when it must: after a conflict, before believing a refusal, or once it has made
    ``refresh_every`` placements on a view at least ``refresh_seconds`` old (what others freed meanwhile is then
    seen; what they took, a commit finds itself). The store's commit re-check keeps a placement safe; the cache
    saves a round trip and rebuilding the view (its class cache survives between placements). A placer making
    hundreds of placements a second re-reads once a second, not every ``refresh_every``: its own commits keep
    its view current, and the re-read would be the slowest of its placements.

    A refusal is believed only when it was decided on a view read after the last change this placer could have
    missed. By default every ``place`` call may have missed one (another process released, a reservation ended,
    a node came back): a refusal re-reads the store and plans again before it is returned. A caller that learns
    of changes itself (a worker: it polls, and its store watcher reports freed capacity) sets
    ``reread="on_invalidate"`` and calls ``invalidate()`` at the start of each poll and on each change it hears
    of; refusals within one poll then share one re-read.

    With ``group`` (a resource group, docs/operating.md) it reads and plans against that group's nodes only and
    stamps the group on every placement it commits, so the store refuses a node of any other group. Commits in
    other groups touch none of its nodes: they never make it re-plan, and its reads do not grow with them.
    """

    def __init__(self, store: ClusterStore, *, refresh_every: int = 50, refresh_seconds: float = 1.0, retries: int = 8,
                 group: str | None = None, reread: str = "every_call"):
        if reread not in REREAD_MODES:
            raise ValueError(f"reread: {reread!r} is not one of {', '.join(REREAD_MODES)}")
        self.store = store
        self.refresh_every = refresh_every
        self.refresh_seconds = refresh_seconds
        self.retries = retries
        self.group = group
        self.reread = reread
        self._view: ClusterView | None = None
        self._own: dict[str, list] = {}
        self._since_refresh = 0
        self._read_at = 0.0  # time.monotonic() of the last read
        self._epoch = 0  # bumped by every change this placer may have missed
        self._read_epoch = -1  # the epoch its view was read in

    def forget(self) -> None:
        """Drop the cached view: the next plan reads the store first (capacity was freed that it counts as held)."""
        self._view = None

    def invalidate(self) -> None:
        """Something may have changed in the store (a poll begins, a change was heard of): the next refusal
        re-reads before it is believed. Placements still plan on the cached view (their commit re-checks)."""
        self._epoch += 1

    @property
    def view(self) -> ClusterView:
        """The cached view (read now if there is none yet)."""
        if self._view is None:
            self.refresh()
        assert self._view is not None
        return self._view

    @property
    def current(self) -> bool:
        """Whether the view was read after the last change this placer may have missed."""
        return self._view is not None and self._read_epoch == self._epoch

    def refresh(self) -> None:
        self._read_epoch = self._epoch  # before reading: a change heard of while reading invalidates it again
        self._read()
        self._own = {}
        self._since_refresh = 0
        self._read_at = time.monotonic()

    def _read(self) -> None:
        expire_due(self.store)  # an expired reservation holds nothing: end it before reading (cheap when none is)
        snap = self.store.snapshot(group=self.group)
        self._view = ClusterView(snap.columns, (), snap.limits, Queues.of(snap.queues, snap.cohorts))

    @property
    def _stale(self) -> bool:
        """Due for a re-read: ``refresh_every`` placements made on a view at least ``refresh_seconds`` old."""
        return (self._since_refresh >= self.refresh_every
                and time.monotonic() - self._read_at >= self.refresh_seconds)

    def place(self, job_id: str, asks: list[Ask], *, job_type: str = "batch", strategy: str = "binpack",
              lease: Lease | None = None, explain: bool = False, update: dict[str, Any] | None = None,
              queue: RunQueue | None = None, before_commit: Callable[[Plan], None] | None = None,
              event: Callable[[Plan], Event] | None = None) -> PlaceResult:
        """Plan and commit; ``update`` sets fields on every placement committed (a reservation's stamp); with
        ``queue``, the run is charged to that queue and placed only within its quota; ``before_commit`` is
        called with each plan about to be committed (a reservation writes its record naming the nodes);
        ``event`` gives the store's event to record with the booking the plan makes (``commit_plan``)."""
        if self.reread == "every_call":
            self.invalidate()  # this call may follow any change: a refusal re-reads before it is believed
        if self._view is None or self._stale:
            self.refresh()
        fresh = self.current
        result: PlaceResult | None = None
        conflicts = rereads = 0
        for attempt in range(1, self.retries + 2):
            plan = plan_asks(asks, [], job_type=job_type, strategy=strategy, explain=explain, job_id=job_id,
                             view=self._view, queue=queue)
            if plan.status != "runnable_now":
                if fresh:
                    return PlaceResult(plan=plan, commit=None, attempts=attempt, conflicts=conflicts, rereads=rereads)
                self.refresh()  # the cache may still hold bookings that others have released
                fresh = True
                continue
            if not fresh and any(p.preferred == "fallback" for p in plan.placements):
                # The preferred node may have come back (or freed up) since the cache was read: look again.
                self.refresh()
                fresh = True
                continue
            if before_commit is not None:
                before_commit(plan)
            commit = self.commit(job_id, list(plan.placements), lease=lease, booked_in_view=True, update=update,
                                 event=event(plan) if event is not None else None)
            rereads += commit.rereads
            conflicts += not commit.ok and commit.conflict is not None and not commit.conflict.job_booked
            result = PlaceResult(plan=plan, commit=commit, attempts=attempt, conflicts=conflicts, rereads=rereads)
            if not commit.ok and commit.conflict is not None and commit.conflict.job_booked:
                self.refresh()  # another placer booked this very job: that booking stands
                return result
            if commit.ok:
                return result
            self.refresh()  # someone booked first: re-read, re-plan
            fresh = True
            time.sleep(random.uniform(0, 0.002 * attempt))
        assert result is not None
        return result

    def commit(self, job_id: str, placements: list[Placement], *, lease: Lease | None = None,
               booked_in_view: bool = False, update: dict[str, Any] | None = None,
               event: Event | None = None) -> CommitResult:
        """Commit placements planned here (or, for a system job's per-node copies, planned once and committed
        node by node); the view counts them from now on."""
        stamp = {**(update or {}), **({"group": self.group} if self.group is not None else {})}
        if stamp:
            placements = [p.model_copy(update=stamp) for p in placements]
        commit = self.store.commit_plan(job_id, placements, lease=lease, event=event)
        announce_ended(self.store, commit.ended)  # the reservations the commit ended on the way, their time up
        if commit.ok and not commit.already_committed:
            if self._view is not None and not booked_in_view:
                for placement in placements:
                    self._view.hold(placement)
            self._own[job_id] = list(placements)
            self._since_refresh += 1
        return commit

    def release(self, booking: Owner | str, *, why: Why, lease: Lease | None = None) -> int:
        """Release a booking placed here (``mn_prefect.store.releasing.release``: its owner's rule is checked
        for ``why``; a bare id's owner is what the id tells, ``parse``) and stop counting it."""
        job_id = str(booking)
        count = release(self.store, parse(booking) if isinstance(booking, str) else booking, why, lease=lease)
        placements = self._own.pop(job_id, None)
        if placements is not None and self._view is not None:
            for placement in placements:
                self._view.unhold(placement)
        elif count:
            self.forget()  # it was part of the snapshot: re-read before the next plan
        return count
