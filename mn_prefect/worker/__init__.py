"""The Prefect side: the ``mn`` worker type. Prefect finds it through the ``prefect.collections`` entry point
(mn_prefect/prefect_collection.py); ``MNWorker`` is loaded here on first use, so that the worker's parts import
without Prefect."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mn_prefect.worker.worker import MNWorker

__all__ = ["MNWorker"]


def __getattr__(name: str) -> Any:
    if name == "MNWorker":
        from mn_prefect.prefect_collection import MNWorker

        return MNWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
