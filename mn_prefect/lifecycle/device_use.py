"""Booked GPUs that do nothing, and shared GPUs that use more memory than their runs booked: the rule the
worker's device watch applies to each sample of its node's GPUs (``inventory.gpu_use``).

A booked GPU whose utilisation stays under ``threshold_percent`` for ``after_s`` (the pool's ``idle_gpu_percent``
and ``idle_gpu_seconds``: 5% for 30 minutes by default) is **idle**: said once per booking, until it is busy again
(the clock starts anew). A GPU booked in shares (fractions with memory) whose memory in use is above what its
bookings booked together is **over memory**: the fractions are limits the program is told, not limits the kernel
enforces. Said once per booking set of that device until it is under again. Pure: times are numbers handed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mn_prefect.model.device_use import DeviceUse


@dataclass(frozen=True)
class Idle:
    device: str
    booking: str
    percent: float
    idle_s: float


@dataclass(frozen=True)
class OverMemory:
    device: str
    bookings: tuple[str, ...]
    used_mb: float
    booked_mb: float


@dataclass(frozen=True)
class Booked:
    """What the store says of one device of this node: the bookings holding it, and the memory they booked when
    they hold shares of it (None: held whole)."""

    bookings: tuple[str, ...]
    shared_mb: float | None = None


@dataclass
class DeviceWatch:
    threshold_percent: float = 5.0
    after_s: float = 1800.0
    _quiet_since: dict[tuple[str, str], float] = field(default_factory=dict)
    _told_idle: set[tuple[str, str]] = field(default_factory=set)
    _told_over: set[tuple[str, tuple[str, ...]]] = field(default_factory=set)

    def observe(self, now: float, use: Mapping[str, DeviceUse],
                booked: Mapping[str, Booked]) -> list[Idle | OverMemory]:
        """What is new to say after a sample taken at ``now``: ``use`` by device, ``booked`` the node's booked
        devices."""
        out: list[Idle | OverMemory] = []
        live: set[tuple[str, str]] = set()
        for device, held in booked.items():
            seen = use.get(device)
            if seen is None:
                continue
            for booking in held.bookings:
                key = (device, booking)
                live.add(key)
                if seen.percent is None or seen.percent >= self.threshold_percent:
                    self._quiet_since.pop(key, None)
                    self._told_idle.discard(key)
                    continue
                since = self._quiet_since.setdefault(key, now)
                if now - since >= self.after_s and key not in self._told_idle:
                    self._told_idle.add(key)
                    out.append(Idle(device, booking, seen.percent, now - since))
            if held.shared_mb is not None:
                over = (device, tuple(sorted(held.bookings)))
                if seen.memory_used_mb > held.shared_mb + 1e-6:
                    if over not in self._told_over:
                        self._told_over.add(over)
                        out.append(OverMemory(device, over[1], seen.memory_used_mb, held.shared_mb))
                else:
                    self._told_over.discard(over)
        for key in [k for k in self._quiet_since if k not in live]:  # bookings gone: forgotten
            self._quiet_since.pop(key)
            self._told_idle.discard(key)
        self._told_over = {o for o in self._told_over if o[0] in booked}
        return out

    def quiet_since(self, device: str, booking: str) -> float | None:
        """Since when ``booking``'s ``device`` has been under the threshold (None: busy, or not seen)."""
        return self._quiet_since.get((device, booking))

    def is_idle(self, device: str, booking: str) -> bool:
        """Whether ``booking``'s ``device`` was found idle (and has not been busy since)."""
        return (device, booking) in self._told_idle

    def is_over_memory(self, device: str, bookings: tuple[str, ...]) -> bool:
        """Whether ``device``, held in shares by ``bookings``, was found over memory (and is not under since)."""
        return (device, tuple(sorted(bookings))) in self._told_over


def booked_devices(placements) -> dict[str, Booked]:
    """The devices ``placements`` (one node's bookings; holds left out) hold, with their bookings and, for a GPU
    held in shares, the memory the shares booked together."""
    bookings: dict[str, list[str]] = {}
    shared: dict[str, float] = {}
    for p in placements:
        if p.hold or not p.job_id:
            continue
        for device in p.allocation.devices:
            bookings.setdefault(device.id, []).append(p.job_id)
        for share in p.allocation.shares:
            bookings.setdefault(share.id, []).append(p.job_id)
            shared[share.id] = shared.get(share.id, 0.0) + share.memory_mb
    return {device: Booked(tuple(dict.fromkeys(held)), shared.get(device)) for device, held in bookings.items()}
