"""The Prefect side: the ``mn`` worker type (registered through the ``prefect.collections`` entry point)."""

import mn_prefect.blocks  # noqa: F401  (registers the blocks' types wherever Prefect loads its collections)
from mn_prefect.worker.ui_listing import list_in_server_views
from mn_prefect.worker.worker import MNWorker

list_in_server_views()  # in a Prefect server's process: the UI lists the mn type (worker/ui_listing.py)

__all__ = ["MNWorker"]
