"""Starting a placed run on this node: ``Launching`` checks again what placement could only check from afar (the
driver, the volumes) and hands the run to its driver's launcher, fails a run its node cannot start as placed, stops
a run at its declared runtime limit (``max_runtime_is_limit``), and removes the containers a killed worker left
behind.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from prefect.exceptions import Abort, ObjectNotFound, Pause
from prefect.settings import PREFECT_API_URL
from prefect.states import Cancelling, Crashed, Failed, Pending
from prefect.utilities.engine import propose_state
from prefect.workers.process import ProcessWorkerResult

from mn_prefect import notify
from mn_prefect.api_tls import plain_http_env
from mn_prefect.credentials import without_secrets
from mn_prefect.drivers import docker as docker_io
from mn_prefect.drivers.launchers import HOST_LOCAL, Launch, Launcher, LaunchRefused, refusal
from mn_prefect.inventory.hostpaths import volume_escapes
from mn_prefect.model.estimates import limit_message
from mn_prefect.model.hints import env_hints, merge_env
from mn_prefect.model.node import NodeRecord
from mn_prefect.model.placement import Placement
from mn_prefect.model.scalars import is_uuid
from mn_prefect.model.states import TERMINAL_RUN_STATES
from mn_prefect.preemption import run_files
from mn_prefect.worker import visibility
from mn_prefect.worker.variables import MNJobConfiguration


async def propose_pending(client, flow_run_id, message: str | None, logger) -> Any:
    """Propose Pending for a run about to be submitted: the state the server answered, or None when the run
    may not be submitted. The server refuses with a signal, not an error, when the run moved on since it was
    read: ``Abort`` (it is no longer Scheduled) or ``Pause`` (the reconcile paused it, its node lost). Either
    raised here would end the worker's task group, and the worker with it."""
    try:
        return await propose_state(client, Pending(message=message), flow_run_id=flow_run_id)
    except (Abort, Pause) as signal:
        logger.info("Aborted submission of flow run '%s': %s", flow_run_id, signal)
    except Exception:
        logger.exception("Failed to update state of flow run '%s'", flow_run_id)
    return None


def run_environment(configuration: MNJobConfiguration, placement: Placement, store_env: dict[str, str],
                    run_folder: Path | None = None) -> dict:
    """A host process's environment: the process worker's, the user's variables with the placement's hints (a
    user's variable wins, but for mn-prefect's own), the one-certificate TLS bundle when the run's API is plain
    http and the user set no TLS setting (``mn_prefect.api_tls``); what opens the worker's store for mn-prefect's
    own flows only: a user's run gets none of the worker's secrets (``mn_prefect.credentials``) it did not set itself.
    ``run_folder``: where the run's preemption notice and checkpoint files go (``mn_prefect.preemption``); a
    preemptible run also persists its task results unless the user said otherwise, so that its next attempt does
    not run again what it finished."""
    user = configuration._user_env
    api_url = user.get("PREFECT_API_URL") or PREFECT_API_URL.value()
    tls = plain_http_env(api_url, {k: v for k, v in {**os.environ, **user}.items() if v is not None})
    own = {**env_hints(placement), **tls}
    if run_folder is not None:
        own.update(run_files(run_folder))
    env = {**configuration.env, **merge_env(user, own)}
    if configuration.preemptible and RESULTS_PERSIST_VAR not in user:
        env[RESULTS_PERSIST_VAR] = "true"
    if configuration.own_flow:
        return {**env, **store_env}
    return without_secrets(env, user)


RESULTS_PERSIST_VAR = "PREFECT_RESULTS_PERSIST_BY_DEFAULT"


class PausedBeforeStart(Exception):
    """The readiness a run that was paused before it started reports: nothing was launched."""


class Launching:
    """The launches of this node's worker, with ``launchers`` (by runtime driver) and ``store_env`` (what
    mn-prefect's own flows get to open the worker's store). ``node``, ``client`` and ``work_pool`` are read at each use; ``sleep``
    waits out a run's declared limit (seconds)."""

    def __init__(self, *, launchers: dict[str, Launcher], store_env: dict[str, str], node: Callable[[], NodeRecord],
                 client: Callable[[], Any], work_pool: Callable[[], Any], logger: Any,
                 run_logger: Callable[[Any], Any], sleep: Callable[[float], Awaitable[Any]] = anyio.sleep):
        self._launchers, self._store_env, self._node = launchers, store_env, node
        self._client, self._work_pool, self._logger, self._run_logger = client, work_pool, logger, run_logger
        self._sleep = sleep

    async def launch(self, flow_run, configuration: MNJobConfiguration, placement: Placement, task_status,
                     run_process: Callable[[Any], Awaitable[ProcessWorkerResult]]) -> ProcessWorkerResult:
        """Start the run with the driver its placement names, after checking again what placement could only
        check from afar: that this worker can launch the driver, and that every volume source still resolves
        inside the node's host paths (a symlink swapped in since would escape them). Raises LaunchRefused.
        ``run_process``: the process worker's own run, for a host process."""
        driver = placement.allocation.runtime_driver or HOST_LOCAL
        launcher = self._launchers.get(driver)
        if launcher is None:
            raise LaunchRefused(refusal(driver, self._launchers))
        escapes = await anyio.to_thread.run_sync(volume_escapes, placement.allocation.volumes, self._node().host_paths)
        if escapes:
            raise LaunchRefused("; ".join(escapes))
        if task_status is None:
            task_status = anyio.TASK_STATUS_IGNORED
        launch = Launch(flow_run=flow_run, placement=placement, node=self._node(), image=configuration.image,
                        command=configuration.command or "", run_env={**configuration.run_env,
                                                                   **(self._store_env if configuration.own_flow else {})},
                        working_dir=str(configuration.working_dir) if configuration.working_dir else None,
                        client=self._client(), log=self._run_logger(flow_run), run_process=run_process)
        limit = configuration.max_runtime_seconds if configuration.max_runtime_is_limit else None
        if limit is None:  # an estimate, if any, never stops a run
            return await launcher.launch(launch, task_status)
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self.stop_at_limit, flow_run, limit)
                try:
                    result = await launcher.launch(launch, task_status)
                finally:
                    group.cancel_scope.cancel()  # the run is over: no limit to watch
        except BaseExceptionGroup as errors:  # the task group wraps what the launch raised: raise it as it was
            if len(errors.exceptions) == 1:
                raise errors.exceptions[0] from None
            raise
        return result

    async def stop_at_limit(self, flow_run, limit_s: float) -> bool:
        """Cancel the run once it has run ``limit_s`` seconds from its launch (its declared
        ``max_runtime_seconds`` with ``max_runtime_is_limit``), saying so in its state message; its worker then
        ends its process and releases its booking as for any cancelled run. True when it was cancelled; False for
        a run that had already ended."""
        await self._sleep(limit_s)
        message = limit_message(limit_s)
        try:
            run = await self._client().read_flow_run(flow_run.id)
            if run.state is not None and run.state.type in TERMINAL_RUN_STATES:
                return False
            self._run_logger(flow_run).error(message)
            await self._client().set_flow_run_state(flow_run.id, Cancelling(message=message[:5000]), force=True)
        except ObjectNotFound:
            return False
        except Exception as error:  # raised here, it would end the launch it watches
            self._logger.warning("could not stop run %s at its limit: %s", flow_run.id, error)
            return False
        return True

    async def refuse(self, flow_run, placement: Placement, reason: str, task_status) -> None:
        """A run its node cannot start as placed: it fails (never started some other way), with the reason and
        an event; the booking of a flow run is released by the worker's run(), a blueprint agent's by its job."""
        message = f"mn: not started on {placement.node}: {reason}"
        self._run_logger(flow_run).error(message)
        visibility.emit_placement(visibility.LAUNCH_REFUSED, flow_run.id, placement.node,
                                  {"reason": reason, "runtime_driver": placement.allocation.runtime_driver},
                                  run_name=flow_run.name, work_pool=self._work_pool())
        await self._client().set_flow_run_state(flow_run.id, Failed(message=message[:5000]), force=True)
        if task_status is not None:
            task_status.started(LaunchRefused(reason))

    async def sweep_orphaned_containers(self) -> None:
        """Containers of this node left by a worker that stopped without removing them (killed, say): removed,
        and their runs, which no worker watches any more, marked Crashed (the sweep then releases them)."""
        node = self._node().name
        try:
            removed = await anyio.to_thread.run_sync(docker_io.sweep_orphans, node, (), self._logger)
        except Exception as error:
            self._logger.warning("could not sweep this node's orphaned containers: %s", error)
            return
        for run_id in removed:
            if not is_uuid(run_id):
                continue
            try:
                run = await self._client().read_flow_run(uuid.UUID(run_id))
                if run.state is None or run.state.type not in TERMINAL_RUN_STATES:
                    await self._client().set_flow_run_state(run.id, Crashed(
                        message=f"mn: its container on {node} outlived its worker and was removed"),
                        force=True)
                    notify.publish("OFFLINE", "mn.run.crashed", node=node, job_id=run_id,
                                   reason="its container outlived its worker")
            except ObjectNotFound:
                continue
