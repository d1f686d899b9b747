"""What Prefect loads through the ``prefect.collections`` entry point: the ``mn`` worker type (a ``BaseWorker``
subclass registers its type when its class is defined), the blocks' types, and, in a Prefect server's process, the
listing of the type in the UI's views (worker/ui_listing.py).

A module of its own, so that importing ``mn_prefect.worker``'s parts (health checks, visibility, decisions) from
commands that never talk to Prefect does not load Prefect."""

import mn_prefect.blocks  # noqa: F401  (registers the blocks' types)
from mn_prefect.worker.ui_listing import list_in_server_views
from mn_prefect.worker.worker import MNWorker

list_in_server_views()  # in a Prefect server's process: the UI lists the mn type

__all__ = ["MNWorker"]
