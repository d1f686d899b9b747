"""Failpoints: named places where a test can make a process stop dead (to prove crash safety).

Inactive unless ``MN_FAILPOINTS`` names them (comma separated); then the process writes a marker file
(``MN_FAILPOINT_MARKER``, if set) and sleeps until it is killed. Costs one dict lookup when inactive.
"""

from __future__ import annotations

import os
import time

_ACTIVE = frozenset(filter(None, os.environ.get("MN_FAILPOINTS", "").split(",")))


def active(name: str) -> bool:
    return name in _ACTIVE


def reached(name: str) -> None:
    """Tell the test this process got to ``name`` (it may now be killed)."""
    marker = os.environ.get("MN_FAILPOINT_MARKER")
    if marker:
        with open(marker, "w") as fh:
            fh.write(name)


def failpoint(name: str) -> None:
    if name not in _ACTIVE:
        return
    reached(name)
    while True:  # wait for SIGKILL
        time.sleep(0.05)
