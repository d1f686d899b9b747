"""One sample of what a GPU (or MIG slice) is doing: its utilisation in percent (None where the device does not
report one, as a MIG slice) and the memory in use, in MB."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceUse:
    percent: float | None
    memory_used_mb: float
