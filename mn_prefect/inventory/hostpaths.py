"""Host paths on this machine: advertised paths are resolved, and volumes re-checked at launch.

The planner compares paths lexically because it cannot see the node's disk; this module runs on the node,
where a symlink inside an advertised path could point anywhere, so it compares real paths.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from mn_prefect.model.placement import VolumeAllocation
from mn_prefect.scheduler.volumes import is_under


def resolve_host_paths(paths: Iterable[str]) -> list[str]:
    """Each advertised path with symlinks resolved (the form a node record should carry)."""
    return [os.path.realpath(p) for p in paths]


def volume_escapes(volumes: Iterable[VolumeAllocation], host_paths: Iterable[str]) -> list[str]:
    """Problems with volumes whose real source path leaves every advertised host path (empty list = fine)."""
    roots = resolve_host_paths(host_paths)
    problems = []
    for volume in volumes:
        real = os.path.realpath(volume.source)
        if not any(is_under(real, root) for root in roots):
            problems.append(f"volume {volume.name}: {volume.source} resolves to {real}, outside every advertised host path")
    return problems
