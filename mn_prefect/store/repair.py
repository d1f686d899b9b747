"""What ``store.repair_derived`` changes: the derived state (usage counters, held claims) made to agree with the
live bookings, computed once here for every backend, which then applies it in one atomic step.

The counters are summed with the commit path's own arithmetic (``booking.demand_by_node``, ``booking.added``),
so repaired counters are what a clean sequence of commits would have left; the claims are the keys each live
booking's placements claim (``dimensions.CLAIM_KINDS``). Bookings are never changed. A key that more than one
live booking claims is a real double booking: it is left as it is, for an operator.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from mn_prefect.model.placement import Placement
from mn_prefect.store.booking import added, demand_by_node

# Counters closer than this to what the bookings hold agree (commits round every step to 1e-6, so the order
# in which bookings were added can move a sum by a few millionths).
TOLERANCE = 1e-5

Held = tuple[str, str, str, str]  # (kind, node, key, job)


@dataclass
class Repair:
    """The fixes, in words (``lines``), and what to write for them."""

    lines: list[str] = field(default_factory=list)
    usage: dict[str, dict[str, float]] = field(default_factory=dict)  # node -> its whole new usage
    drop: list[Held] = field(default_factory=list)
    add: list[Held] = field(default_factory=list)

    @property
    def writes(self) -> bool:
        return bool(self.usage or self.drop or self.add)


def plan_repair(used: dict[str, dict[str, float]], bookings: dict[str, list[Placement]], held: list[Held]) -> Repair:
    """The fixes that make ``used`` (each registered node's counters) and ``held`` agree with ``bookings``
    (each live job's placements)."""
    fix = Repair()
    expected: dict[str, dict[str, float]] = defaultdict(dict)
    claims: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for job in sorted(bookings):
        for node, demand in demand_by_node(bookings[job]).items():
            for kind, keys in demand.claim.items():
                for key in keys:
                    if job not in claims[(kind, node, key)]:
                        claims[(kind, node, key)].append(job)
            if node not in used:  # no counters to set, nor claims to restore, on a node the store does not have
                fix.lines.append(f"job {job} holds capacity on node {node}, which is not registered: "
                                 f"needs an operator (no automatic fix)")
                continue
            expected[node] = added(expected[node], demand.add)
    for node in sorted(used):
        stored, want = used[node], expected.get(node, {})
        new = dict(stored)
        for dim in sorted({*stored, *want}):
            have, should = float(stored.get(dim, 0.0)), want.get(dim, 0.0)
            if abs(have - should) > TOLERANCE:
                new[dim] = should
                fix.lines.append(f"set node {node}'s {dim} usage from {have:g} to {should:g} (what its bookings hold)")
        if new != stored:
            fix.usage[node] = new
    holders: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for kind, node, key, job in held:
        holders[(kind, node, key)].append(job)
    for where in sorted({*holders, *claims}):
        kind, node, key = where
        claimants, holding = claims.get(where, []), holders.get(where, [])
        if len(claimants) > 1:
            fix.lines.append(f"{kind} {node}/{key} is claimed by {len(claimants)} live bookings "
                             f"({', '.join(sorted(claimants))}) and held by {', '.join(holding) or 'none'}: a double "
                             f"booking, left for an operator (no automatic fix)")
            continue
        owner = claimants[0] if claimants else None
        for job in holding:
            if job == owner:
                continue
            fix.drop.append((kind, node, key, job))
            why = "whose booking does not claim it" if job in bookings else "which has no live booking"
            fix.lines.append(f"removed the claim on {kind} {node}/{key} held by {job}, {why}")
        if owner is not None and owner not in holding and node in used:
            fix.add.append((kind, node, key, owner))
            fix.lines.append(f"restored the claim on {kind} {node}/{key} for {owner}, whose booking claims it")
    return fix
