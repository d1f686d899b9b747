"""Lifecycle settings read from the environment, in one place (the defaults of docs/operating.md)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from mn_prefect.model.issues import InvalidInput, Issue

HEARTBEAT_TIMEOUT_VAR = "MN_HEARTBEAT_TIMEOUT_SECONDS"
DISCONNECT_GRACE_VAR = "MN_DISCONNECT_GRACE_SECONDS"
ORPHAN_PENDING_VAR = "MN_ORPHAN_PENDING_SECONDS"
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
DEFAULT_DISCONNECT_GRACE_S = 30.0
DEFAULT_ORPHAN_PENDING_S = 30.0
DEVICE_SAMPLE_VAR = "MN_DEVICE_SAMPLE_SECONDS"
DEFAULT_DEVICE_SAMPLE_S = 30.0


def heartbeat_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds without a heartbeat after which a node is ``disconnected`` (``MN_HEARTBEAT_TIMEOUT_SECONDS``, 30)."""
    return _seconds(HEARTBEAT_TIMEOUT_VAR, DEFAULT_HEARTBEAT_TIMEOUT_S, environ, zero_ok=False)


def disconnect_grace_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds a node stays ``disconnected`` past the timeout before it is ``offline``
    (``MN_DISCONNECT_GRACE_SECONDS``, 30)."""
    return _seconds(DISCONNECT_GRACE_VAR, DEFAULT_DISCONNECT_GRACE_S, environ, zero_ok=True)


def orphan_pending_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds a run Pending (or Cancelling, or Running unbooked) on a node, with no launch of its worker holding
    it, waits before the node's sweep judges it lost with the worker that was starting or stopping it
    (``MN_ORPHAN_PENDING_SECONDS``, 30)."""
    return _seconds(ORPHAN_PENDING_VAR, DEFAULT_ORPHAN_PENDING_S, environ, zero_ok=False)


def device_sample_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds between two samples of this node's GPUs by its worker's device watch (``MN_DEVICE_SAMPLE_SECONDS``,
    30)."""
    return _seconds(DEVICE_SAMPLE_VAR, DEFAULT_DEVICE_SAMPLE_S, environ, zero_ok=False)


def _seconds(var: str, default: float, environ: Mapping[str, str] | None, *, zero_ok: bool) -> float:
    raw = (os.environ if environ is None else environ).get(var, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        bound = "0 or more" if zero_ok else "more than 0"
        raise InvalidInput([Issue(var, f"must be a number of seconds, {bound}; got {raw!r}")])
    return value
