"""The runtime drivers' switch table: how a placed run is started on its node (docs/drivers.md).

A placement's ``runtime_driver`` is honoured or refused, never replaced: ``host_local`` starts the run as a
host process (Prefect's process worker), ``docker`` as a container with its allocation enforced by the
kernel. A driver that this worker cannot launch (unknown, or docker with no daemon) is refused with that
reason. A node advertises docker only while its worker reaches a Docker daemon (``advertised_drivers``).
Adding a driver: one class with ``name``, ``problem()`` and ``launch()``, and one entry in ``LAUNCHERS``.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import anyio
import anyio.to_thread
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled
from prefect.workers.process import ProcessWorkerResult

from mn_prefect.drivers import docker as docker_io
from mn_prefect.drivers.container import ContainerRefused, container_spec
from mn_prefect.model.containers import DOCKER
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Placement
from mn_prefect.preemption import run_files, run_folder

HOST_LOCAL = "host_local"
DOCKER_PID_PREFIX = "docker:"
# How often a container's run is checked for a cancel request, and how long it then gets to stop.
CANCEL_POLL_SECONDS = 2.0
STOP_GRACE_SECONDS = 10.0


class LaunchRefused(Exception):
    """A run its node cannot start as placed; the message says why (the run fails, its booking is released)."""


@dataclass
class Launch:
    """One run to start, as the worker hands it to a driver."""

    flow_run: Any
    placement: Placement
    node: NodeRecord
    image: str | None
    command: str
    run_env: dict[str, str | None]  # the run's own environment: Prefect's variables for it and the deployment's
    working_dir: str | None
    client: Any  # the worker's Prefect client
    log: logging.LoggerAdapter  # the run's logger: lines reach the flow run's logs
    run_process: Callable[[Any], Awaitable[ProcessWorkerResult]]  # the process worker's run(task_status)


class Launcher(Protocol):
    name: ClassVar[str]

    def problem(self) -> str | None:
        """Why this machine cannot launch runs with this driver; None when it can."""

    async def launch(self, launch: Launch, task_status: Any) -> ProcessWorkerResult:
        """Start the run, report its infrastructure id through ``task_status``, wait for it to end."""


class HostLocal:
    """A host process, as Prefect's process worker starts it."""

    name: ClassVar[str] = HOST_LOCAL

    def problem(self) -> str | None:
        return None

    async def launch(self, launch: Launch, task_status: Any) -> ProcessWorkerResult:
        return await launch.run_process(task_status)


class Docker:
    """A container per run, its allocation enforced (drivers/container.py says how)."""

    name: ClassVar[str] = DOCKER

    def problem(self) -> str | None:
        return docker_io.daemon_problem()

    async def launch(self, launch: Launch, task_status: Any) -> ProcessWorkerResult:
        if not launch.image:
            raise LaunchRefused("job_variables.image is required with runtime_driver docker (the container image)")
        try:
            folder = run_folder(str(launch.flow_run.id))  # its preemption notice and checkpoint files
            spec = container_spec(launch.placement, run_id=str(launch.flow_run.id), run_name=launch.flow_run.name,
                                  image=launch.image, command=shlex.split(launch.command),
                                  run_env={**launch.run_env, **run_files(folder)}, node_cpuset=launch.node.cpuset,
                                  toolchain=docker_io.toolchain_paths(), working_dir=launch.working_dir,
                                  scratch=[str(folder)])
        except ContainerRefused as refused:
            raise LaunchRefused(str(refused)) from None
        container = await anyio.to_thread.run_sync(docker_io.ContainerRun, spec, launch.log.info)
        try:
            container_id = await anyio.to_thread.run_sync(container.start)
        except Exception as error:
            raise LaunchRefused(f"the container did not start: {_docker_error(error)}") from None
        launch.log.info("mn: run started in container %s (%s) from image %s", spec.name, container_id[:12], spec.image)
        task_status.started(DOCKER_PID_PREFIX + container_id)
        cancelled = False
        try:
            async with anyio.create_task_group() as watchers:
                watchers.start_soon(_abandoned, container.stream_logs)

                async def watch_cancel() -> None:
                    nonlocal cancelled
                    cancelled = await _cancel_requested(launch)
                    if cancelled:
                        await anyio.to_thread.run_sync(container.stop, STOP_GRACE_SECONDS)

                watchers.start_soon(watch_cancel)
                exit_code = await _abandoned(container.wait)
                watchers.cancel_scope.cancel()
        finally:
            with anyio.move_on_after(STOP_GRACE_SECONDS + 5, shield=True):
                await anyio.to_thread.run_sync(container.stop, 0 if cancelled else STOP_GRACE_SECONDS)
                await anyio.to_thread.run_sync(container.remove)
        if cancelled:
            await launch.client.set_flow_run_state(launch.flow_run.id, Cancelled(
                message="mn: the run was cancelled; its container was stopped"), force=True)
            return ProcessWorkerResult(status_code=0, identifier=container_id)
        return ProcessWorkerResult(status_code=exit_code, identifier=container_id)


async def _abandoned(fn: Callable[[], Any]) -> Any:
    """``fn`` in a thread that a cancelled caller leaves behind (a blocking Docker call cannot be interrupted;
    the caller stops the container, which ends the call)."""
    return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)


async def _cancel_requested(launch: Launch) -> bool:
    """Wait until the run is Cancelling (True); runs until cancelled otherwise."""
    while True:
        await anyio.sleep(CANCEL_POLL_SECONDS)
        try:
            run = await launch.client.read_flow_run(launch.flow_run.id)
        except Exception:
            continue  # the API may be back on the next poll
        if run.state is not None and run.state.type == StateType.CANCELLING:
            launch.log.info("mn: cancel requested; stopping the container")
            return True


def _docker_error(error: Exception) -> str:
    explanation = getattr(error, "explanation", None)
    return str(explanation or error)


LAUNCHERS: dict[str, type[Launcher]] = {HostLocal.name: HostLocal, Docker.name: Docker}


def available_launchers(log: logging.Logger | logging.LoggerAdapter) -> dict[str, Launcher]:
    """The drivers this machine can launch, each checked once (a worker calls this at start)."""
    found: dict[str, Launcher] = {}
    for name, kind in LAUNCHERS.items():
        launcher = kind()
        problem = launcher.problem()
        if problem is None:
            found[name] = launcher
        elif name != HOST_LOCAL:
            log.info("runtime driver %s is not available on this node: %s", name, problem)
    return found


def advertised_drivers(declared: Sequence[str], available: Sequence[str]) -> list[str]:
    """What the node record offers: the inventory's drivers less the ones mn-prefect knows and cannot launch
    here, plus every one it can launch. A driver mn-prefect does not know stays advertised (the inventory
    says so) and is refused at launch."""
    kept = [d for d in declared if d not in LAUNCHERS or d in available]
    return kept + [d for d in available if d not in kept]


def this_node(log: logging.Logger | logging.LoggerAdapter) -> tuple[NodeRecord, dict[str, Launcher]]:
    """This machine's node record offering the drivers it can launch, and those launchers (worker and local
    bundle runs alike)."""
    from mn_prefect.inventory import local_node

    launchers = available_launchers(log)
    node = local_node()
    return node.model_copy(update={"runtime_drivers": advertised_drivers(node.runtime_drivers, list(launchers))}), \
        launchers


def refusal(driver: str, launchers: dict[str, Launcher]) -> str:
    """Why a run placed with ``driver`` cannot start on this worker."""
    if driver in LAUNCHERS:
        return f"runtime driver {driver!r} is not available on this node (its worker cannot launch it)"
    return f"runtime driver {driver!r} has no launcher in mn-prefect (known: {', '.join(LAUNCHERS)})"
