"""The lifecycle flows, for `prefect deploy` (deployments/prefect.yaml); they live in mn_prefect.ops.flows."""

from mn_prefect.ops.flows import drain_node, reconcile_cluster

__all__ = ["drain_node", "reconcile_cluster"]
