"""mn-prefect: resource-aware placement of Prefect flow runs on a small fleet of mixed machines."""

from mn_prefect.model.hints import allocation
from mn_prefect.model.resources import ResourceRequest, resource_request
from mn_prefect.preemption import Notice, checkpointed, preemption

__version__ = "0.1.0"
__all__ = ["allocation", "checkpointed", "Notice", "preemption", "ResourceRequest", "resource_request", "__version__"]
