"""The one way a booking is released: its owner's release rule is checked first (``mn_prefect.model.bookings``).

``release(store, owner, why)`` is what every releaser calls (placement and the layers above it reach it as
``mn_prefect.placement.bookings.release``; a reservation's end in ``store.expiry`` calls it here). It raises
ReleaseRefused, touching nothing, when the owner's rule does not allow ``why``; otherwise it releases as
``ClusterStore.release`` does and returns how many placements it released. A store backend's own ``release``
is called from nowhere else (tests/test_import_graph.py checks it), but for mn_prefect/worker/, which is being
converted, and ``release_unchecked`` below, kept for the worker's calls through ``Placer.release``.
"""

from __future__ import annotations

from mn_prefect.model.bookings import Owner, ReleaseRefused, Why, check
from mn_prefect.store.base import ClusterStore, Lease

__all__ = ["ReleaseRefused", "release", "release_unchecked"]


def release(store: ClusterStore, owner: Owner, why: Why, *, lease: Lease | None = None,
            node: str | None = None) -> int:
    """Release ``owner``'s booking (only its placements on ``node`` when given) for ``why``; how many placements
    were released. ReleaseRefused, with nothing changed, when the owner's rule does not allow ``why``;
    StaleLease as ``ClusterStore.release``."""
    check(owner, why)
    return _release(store, str(owner), lease, node)


def release_unchecked(store: ClusterStore, booking: str, *, lease: Lease | None = None,
                      node: str | None = None) -> int:
    """A release that says no reason: only ``Placer.release`` without ``why``, which mn_prefect/worker/ still
    calls so (it is being converted to say why; then this goes)."""
    return _release(store, booking, lease, node)


def _release(store: ClusterStore, booking: str, lease: Lease | None, node: str | None) -> int:
    return store.release(booking, lease=lease, node=node)

