"""The ``mn`` type in the Prefect UI's list of worker types.

The UI names a pool's type, and offers types in its "create work pool" wizard, from one server view,
``/api/collections/views/aggregate-worker-metadata``: Prefect's registry of the integrations it knows, fetched from
the network or read from a copy inside the server package. A type from elsewhere is missing there, so the UI shows
an ``mn`` pool's Type field blank and cannot create one. A Prefect server imports the ``prefect.collections`` entry
points of the packages installed beside it when it starts (block registration); mn-prefect's entry point calls
``list_in_server_views`` then, which adds the ``mn`` entry (its default base job template included) to that view as
the server returns it. In any other process, or on a server whose module no longer has that view, it does nothing.
"""

from __future__ import annotations

import sys
from typing import Any

VIEW = "aggregate-worker-metadata"
COLLECTION = "mn-prefect"
DESCRIPTION = ("Places each flow run on a node of the fleet with the CPU, memory, disk, GPUs, ports and volumes it "
               "asks for, and runs it there as a process or in a container.")
# A small mark drawn inline: the UI shows the logo, and the lab's server has no network to fetch one.
LOGO = ("data:image/svg+xml;utf8,<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 32 32'>"
        "<rect width='32' height='32' rx='6' fill='%23115e59'/><text x='16' y='22' font-size='15' "
        "font-family='sans-serif' font-weight='bold' text-anchor='middle' fill='white'>mn</text></svg>")


def entry() -> dict[str, Any]:
    from mn_prefect.worker.worker import MNWorker

    return {"type": MNWorker.type, "display_name": "mn (resource-aware placement)", "description": DESCRIPTION,
            "documentation_url": "", "install_command": "pip install mn-prefect", "is_beta": False,
            "logo_url": LOGO, "default_base_job_configuration": MNWorker.get_default_base_job_template()}


def with_mn(view: dict[str, Any]) -> dict[str, Any]:
    """The worker view with the mn entry added (a copy: the server caches what it fetched)."""
    return {**view, COLLECTION: {"mn": entry()}}


def list_in_server_views() -> bool:
    """Wrap the server's view reader so that the worker view lists ``mn``; True when it did (or had)."""
    collections = sys.modules.get("prefect.server.api.collections")
    read = getattr(collections, "get_collection_view", None)
    if read is None:
        return False
    if getattr(read, "lists_mn", False):
        return True

    async def get_collection_view(view: str) -> dict[str, Any]:
        data = await read(view)
        return with_mn(data) if view == VIEW else data

    get_collection_view.lists_mn = True  # type: ignore[attr-defined]
    collections.get_collection_view = get_collection_view  # type: ignore[union-attr]
    return True
