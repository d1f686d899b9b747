"""The lifecycle flows, for a `prefect deploy` of your own (deployments/prefect.yaml names them by module,
mn_prefect.ops.flows, as the workers know mn-prefect's own flows: a flow deployed from this file is a user's and
does not get the worker's store)."""

from mn_prefect.ops.flows import drain_node, reconcile_cluster

__all__ = ["drain_node", "reconcile_cluster"]
