"""Host volume checks: each source must be an advertised host path or lie under one (docs/scheduling.md).

Paths are compared after lexical normalisation (``..`` is already refused by validation); the node
resolves symlinks on its own file system when it advertises paths and again at launch
(``mn_prefect.inventory.hostpaths``), since the planner cannot see the node's disk.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from mn_prefect.model.placement import VolumeAllocation
from mn_prefect.model.resources import VolumeRequest


def is_under(path: str, root: str) -> bool:
    """``path`` equals ``root`` or is inside it, by whole path components (/mnt/a2 is not under /mnt/a)."""
    path, root = posixpath.normpath(path), posixpath.normpath(root)
    return root == "/" or path == root or path.startswith(root + "/")


def check_volumes(
    requests: Iterable[VolumeRequest], host_paths: Iterable[str]
) -> tuple[list[VolumeAllocation] | None, VolumeRequest | None]:
    roots = list(host_paths)
    out = []
    for request in requests:
        if not any(is_under(request.source, root) for root in roots):
            return None, request
        out.append(VolumeAllocation(name=request.name, source=posixpath.normpath(request.source),
                                    target=request.target, mode=request.mode, type=request.type))
    return out, None
