"""The one way a booking is released: its owner's release rule is checked first (``mn_prefect.model.bookings``).

``release(store, owner, why)`` is what every releaser calls (placement and the layers above it reach it as
``mn_prefect.placement.bookings.release``; a reservation's end in ``store.expiry`` calls it here). It raises
ReleaseRefused, touching nothing, when the owner's rule does not allow ``why``; otherwise it releases as
``ClusterStore.release`` does and returns how many placements it released. A store backend's own ``release``
is called from nowhere else (tests/test_import_graph.py checks it).
"""

from __future__ import annotations

from mn_prefect.model.bookings import Owner, ReleaseRefused, Why, check
from mn_prefect.store.base import ClusterStore, Lease

__all__ = ["ReleaseRefused", "release"]


def release(store: ClusterStore, owner: Owner, why: Why, *, lease: Lease | None = None,
            node: str | None = None) -> int:
    """Release ``owner``'s booking (only its placements on ``node`` when given) for ``why``; how many placements
    were released. ReleaseRefused, with nothing changed, when the owner's rule does not allow ``why``;
    StaleLease as ``ClusterStore.release``."""
    check(owner, why)
    return store.release(str(owner), lease=lease, node=node)

