"""The reconciler's leader lease: one owner at a time, and a fencing token for its writes.

The lease's epoch grows with every new owner; writes passed ``lease=`` (``commit_plan``, ``release``) check it
in the store, so a leader that was paused past its TTL and deposed cannot write with its old lease
(``StaleLease``).
"""

from __future__ import annotations

import os
import socket
import uuid

from mn_prefect.store.base import ClusterStore, Lease

RECONCILER_LEASE = "mn-reconciler"
DEFAULT_TTL_S = 15.0


class NotLeader(RuntimeError):
    """Another owner holds the lease."""


def default_owner() -> str:
    """host:pid:random, unique per process and per Leadership."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Leadership:
    """Acquire, renew and release the lease ``name`` for ``owner`` (TTL in seconds).

    Use ``keep()`` once per tick of a loop (acquires when not leading, renews when leading; the lease or None),
    or ``with Leadership(store, owner) as leader:`` (NotLeader when someone else leads; released on exit).
    ``lease`` is what fenced writes take.
    """

    def __init__(self, store: ClusterStore, owner: str | None = None, *, ttl_s: float = DEFAULT_TTL_S,
                 name: str = RECONCILER_LEASE):
        self.store = store
        self.owner = owner or default_owner()
        self.ttl_s = ttl_s
        self.name = name
        self.lease: Lease | None = None

    def acquire(self, *, now: float | None = None) -> Lease | None:
        """The lease when no one else holds it (unexpired); None otherwise."""
        self.lease = self.store.acquire_lease(self.name, self.owner, self.ttl_s, now=now)
        return self.lease

    def renew(self, *, now: float | None = None) -> Lease | None:
        """Extend the held lease by the TTL; None (and no longer leading) when it expired or was taken over."""
        if self.lease is not None:
            self.lease = self.store.renew_lease(self.lease, self.ttl_s, now=now)
        return self.lease

    def keep(self, *, now: float | None = None) -> Lease | None:
        """Renew when leading, else try to acquire: the current lease, or None when another owner leads."""
        return self.renew(now=now) if self.lease is not None else self.acquire(now=now)

    def release(self) -> bool:
        """Give the lease up now (its epoch stays, so the next owner's is higher); False when it was not ours."""
        lease, self.lease = self.lease, None
        return lease is not None and self.store.release_lease(lease)

    def __enter__(self) -> Leadership:
        if self.acquire() is None:
            raise NotLeader(f"lease {self.name!r} is held by another owner")
        return self

    def __exit__(self, *exc) -> None:
        self.release()
