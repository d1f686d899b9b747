"""The Prefect side: the ``mn`` worker type (registered through the ``prefect.collections`` entry point)."""

from mn_prefect.worker.worker import MNWorker

__all__ = ["MNWorker"]
