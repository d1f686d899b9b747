"""The Prefect side: the ``mn`` worker type (registered through the ``prefect.collections`` entry point)."""

import mn_prefect.blocks  # noqa: F401  (registers the blocks' types wherever Prefect loads its collections)
from mn_prefect.worker.worker import MNWorker

__all__ = ["MNWorker"]
