"""What stays with the workers: the store's URL (its password in it) and the API token are never handed to a user's
flow run, process or container. Only mn-prefect's own flows, which must reach the store (a bundle's runner and its
steps' launcher, a blueprint job's coordinator, reconcile and drain), get the worker's store URL; they are known by
their deployment's entrypoint, a module of the installed mn_prefect package (a file path could be anyone's file).

A user run gets a variable of these only when its own deployment sets it (it asked for it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mn_prefect.settings import STORE_URL_VAR

GRPC_TOKEN_VAR = "MN_GRPC_AUTH_TOKEN"
WORKER_SECRETS = (STORE_URL_VAR, GRPC_TOKEN_VAR)

# mn-prefect's own flows (their entrypoints are the constants of bundles.flows, jobs.deploy and ops.flows; a test
# keeps the two in step). A blueprint agent's run (mn_prefect.jobs.agent.mn_agent) runs the blueprint's command:
# not one of them.
OWN_FLOWS = frozenset({
    "mn_prefect.bundles.flows.bundle_run",
    "mn_prefect.bundles.flows.mn_step",
    "mn_prefect.jobs.coordinator.blueprint_job",
    "mn_prefect.ops.flows.reconcile_cluster",
    "mn_prefect.ops.flows.drain_node",
})


def is_own_flow(entrypoint: str | None) -> bool:
    """Whether a deployment's ``entrypoint`` is one of mn-prefect's own flows (``module.flow`` or ``module:flow``)."""
    return entrypoint is not None and entrypoint.replace(":", ".") in OWN_FLOWS


def without_secrets(env: Mapping[str, str | None], asked: Mapping[str, str | None]) -> dict[str, str | None]:
    """``env`` with the workers' secrets unset (``None``: Prefect's process launch leaves the name out of what the
    process inherits from its worker), but for those the run's own deployment set (in ``asked``)."""
    return {**env, **{name: None for name in WORKER_SECRETS if asked.get(name) is None}}


def passable(names: Sequence[str]) -> list[str]:
    """The names of a ``pass_env`` list a step or an agent may copy from its runner's environment: never a worker's
    secret (a bundle or blueprint naming one gets nothing for it)."""
    return [name for name in names if name not in WORKER_SECRETS]
