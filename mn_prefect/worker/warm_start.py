"""The worker's side of warm starts (``mn_prefect.worker.warm_launcher``; docs/prefect.md, "Warm starts").

``WarmLaunchers`` keeps this worker's launchers, one per ``preload`` list, in the worker's own folder
(``~/.mn-prefect/warm/<pid>/``, mode 0700; the socket 0600). ``run_warm`` is the process worker's ``run`` with
one change: the flow process is forked by a launcher instead of started as two new interpreters. Everything
else is Prefect's: the workspace, the control channel, the executor that reports Crashed and the exit code,
the process manager that cancels (SIGTERM to the process group, then SIGKILL after the grace).

Nothing waits on a launcher: one that is not ready, dead, hung, started from an older install (its stamp) or
whose ``preload`` failed makes that run start cold, and is restarted in the background (all but the failed
preload, which is said once, in the worker's log and as an ``mn.warm_start.preload_failed`` event).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from prefect.runner._flow_run_executor import FlowRunExecutionResult, FlowRunExecutorContext
from prefect.runner._process_manager import ProcessHandle, create_isolated_termination_scope
from prefect.runner._starter_engine import EngineCommandStarter
from prefect.runner._workspace_starter import WorkspaceResolvingEngineCommandStarter
from prefect.settings import get_current_settings
from prefect.utilities.processutils import command_from_string, get_sys_executable, sanitize_subprocess_env
from prefect.workers.process import ProcessWorkerResult

from mn_prefect import events, settings
from mn_prefect.worker.warm_launcher import HELLO_FILE, MAX_MESSAGE, install_stamp, startup_values

PRELOAD_FAILED = "mn.warm_start.preload_failed"
REPLY_TIMEOUT_S = 5.0  # a launcher that has not answered with the run's pid by then is hung: the run starts cold
RESTART_PAUSE_S = 5.0  # a launcher that died before it was ready is started again at most this often
MAX_LAUNCHERS = 4  # distinct preload lists with a launcher at once
_RLIMITS = [name for name in dir(resource) if name.startswith("RLIMIT_")]


class WarmUnavailable(Exception):
    """Why this run starts cold."""


class _Launcher:
    """One launcher process (its ``preload`` list), started in the background."""

    def __init__(self, folder: Path, preload: tuple[str, ...]):
        self.folder, self.preload = folder, preload
        self.process: subprocess.Popen | None = None
        self.started_at = 0.0
        self.was_ready = False  # it said hello once since its start: a launcher that dies later is no crash loop
        self.socket_path = self._socket_path()

    def _socket_path(self) -> Path:
        path = self.folder / "sock"
        if len(str(path)) < 100:
            return path
        short = Path(tempfile.mkdtemp(prefix="mn-warm-"))  # AF_UNIX paths are short: a private folder of its own
        return short / "sock"

    def start(self) -> None:
        """Start it (never waits for it: it says it is ready in hello.json)."""
        self.stop()
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileNotFoundError):
            (self.socket_path.parent / HELLO_FILE).unlink()
        log = os.open(self.folder / "launcher.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            # From the event loop's thread: the launcher ends with the thread that started it (PR_SET_PDEATHSIG).
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mn_prefect.worker.warm_launcher", str(self.socket_path), install_stamp(),
                 *self.preload], stdin=subprocess.DEVNULL, stdout=log, stderr=log, process_group=0,
                cwd=self.folder)  # a group of its own in the worker's session: a run may join the worker's group
        finally:
            os.close(log)
        self.started_at = time.monotonic()
        self.was_ready = False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
        self.process = None

    def hello(self) -> dict[str, Any] | None:
        """What it said once ready (None before)."""
        try:
            hello = json.loads((self.socket_path.parent / HELLO_FILE).read_text())
        except (OSError, ValueError):
            return None
        if self.process is None or hello.get("pid") != self.process.pid:
            return None
        self.was_ready = True
        return hello

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class WarmLaunchers:
    """This worker's launchers, by ``preload`` list. ``logger``: the worker's; ``node``: its node's name."""

    def __init__(self, *, logger: Any, node: str, folder: Path | None = None):
        self._logger, self._node = logger, node
        self._folder = folder or settings.home() / "warm" / str(os.getpid())
        self._launchers: dict[tuple[str, ...], _Launcher] = {}
        self._failed: set[tuple[str, ...]] = set()  # preload lists that failed to import, said once
        self._stamp = install_stamp()

    def start(self, preload: tuple[str, ...] = ()) -> None:
        """Start the launcher for ``preload`` (the worker starts its plain one with itself)."""
        key = tuple(preload)
        launcher = self._launchers.get(key)
        if launcher is None:
            if len(self._launchers) >= MAX_LAUNCHERS:
                return
            digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:12]
            launcher = self._launchers[key] = _Launcher(self._folder / digest, key)
        launcher.start()

    def pick(self, preload: tuple[str, ...], env: dict[str, str]) -> _Launcher:
        """The launcher to fork this run from; raises WarmUnavailable (the run starts cold) and, when the
        launcher is missing, dead or stale, starts it again in the background."""
        key = tuple(preload)
        if key in self._failed:
            raise WarmUnavailable(f"preload {list(key)} did not import")
        launcher = self._launchers.get(key)
        if launcher is None or not launcher.alive():
            if launcher is None or launcher.was_ready or time.monotonic() - launcher.started_at >= RESTART_PAUSE_S:
                self.start(key)
            raise WarmUnavailable("its launcher is starting")
        hello = launcher.hello()
        if hello is None:
            raise WarmUnavailable("its launcher is not ready yet")
        if hello.get("preload_failed"):
            self._failed.add(key)
            launcher.stop()
            reasons = "; ".join(f"{name}: {why}" for name, why in hello["preload_failed"].items())
            self._logger.warning("mn: warm starts with preload %s are off: %s; those runs start cold", list(key),
                                 reasons)
            events.emit(PRELOAD_FAILED, events.node(self._node), payload={
                "node": self._node, "preload": list(key), "failed": hello["preload_failed"]})
            raise WarmUnavailable(f"preload did not import ({reasons})")
        if hello.get("problem"):
            raise WarmUnavailable(f"its launcher cannot fork runs: {hello['problem']}")
        if hello.get("stamp") != self._stamp or install_stamp() != self._stamp:
            self._stamp = install_stamp()
            self.start(key)
            raise WarmUnavailable("its launcher was started from an older install; restarted")
        startup = startup_values({k: v for k, v in env.items() if v is not None})
        if startup != hello.get("startup", {}):
            raise WarmUnavailable("the run sets the interpreter's start-up variables otherwise than its launcher")
        return launcher

    def restart(self, launcher: _Launcher) -> None:
        """A launcher that failed a request (hung, or its socket gone): replaced in the background."""
        launcher.start()

    def close(self) -> None:
        for launcher in self._launchers.values():
            launcher.stop()
            if launcher.socket_path.parent != launcher.folder:
                shutil.rmtree(launcher.socket_path.parent, ignore_errors=True)
        shutil.rmtree(self._folder, ignore_errors=True)


class _WarmProcess:
    """What Prefect's ``ProcessHandle`` reads of a process: its pid and, once it ended, its exit code."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None


def _request_run(launcher: _Launcher, request: dict[str, Any], fds: list[int]) -> tuple[socket.socket, int]:
    """Send the run, read its pid (blocking, in a thread): the connection, still to be told go, and the pid."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.settimeout(REPLY_TIMEOUT_S)
        conn.connect(str(launcher.socket_path))
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        reply = json.loads(conn.recv(MAX_MESSAGE) or b"{}")
        if not isinstance(reply.get("pid"), int):
            raise WarmUnavailable(f"its launcher answered {reply!r}")
        return conn, reply["pid"]
    except BaseException:
        conn.close()
        raise


def _wait_exit(conn: socket.socket, pid: int, pidfd: int | None) -> int:
    """The run's exit code as its keeper reports it (blocking, in a thread). A keeper that ended without saying
    (killed): the process is waited for by its pidfd, and its code is unknown (1: the run is judged by its state)."""
    conn.settimeout(None)
    try:
        data = conn.recv(MAX_MESSAGE)
        code = json.loads(data).get("exit") if data else None
        if isinstance(code, int):
            return code
    except (OSError, ValueError):
        pass
    if pidfd is not None:
        select.select([pidfd], [], [])
    else:
        while _alive(pid):
            time.sleep(0.5)
    return 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stdio_fds(stream_output: bool) -> tuple[list[int], list[int]]:
    """The run's stdout and stderr: this worker's own when it streams the run's output, else /dev/null; and the
    descriptors to close once sent."""
    if not stream_output:
        null = os.open(os.devnull, os.O_WRONLY)
        return [null, null], [null]
    fds = []
    for stream, fallback in ((sys.stdout, 1), (sys.stderr, 2)):
        try:
            stream.flush()
            fds.append(stream.fileno())
        except (AttributeError, OSError, ValueError):
            fds.append(fallback)
    return fds, []


class WarmEngineStarter(EngineCommandStarter):
    """Prefect's engine command starter (its environment, its control channel registration) with the process
    forked by a launcher; it starts cold, as Prefect's, when the launcher cannot take the run."""

    def __init__(self, *, launchers: WarmLaunchers, preload: tuple[str, ...], logger: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self._launchers, self._preload, self._logger = launchers, preload, logger
        self.started_warm = False

    async def start(self, flow_run, task_status: anyio.abc.TaskStatus[ProcessHandle] = anyio.TASK_STATUS_IGNORED
                    ) -> None:
        env = self._environment(flow_run)
        try:
            launcher = self._launchers.pick(self._preload, env)
        except WarmUnavailable as why:
            self._logger.debug("mn: run %s starts cold: %s", flow_run.id, why)
            return await super().start(flow_run, task_status=task_status)
        control_env: dict[str, str] = {}
        registered = False
        if self._control_channel is not None:
            try:
                port, token = self._control_channel.register(flow_run.id)
                control_env = {"PREFECT__CONTROL_PORT": str(port), "PREFECT__CONTROL_TOKEN": token}
                registered = True
            except RuntimeError:
                pass
        command = command_from_string(self._command) if self._command else None
        if not command or command[0] not in (sys.executable, get_sys_executable()) or command[1:2] != ["-m"]:
            if registered and self._control_channel is not None:
                self._control_channel.unregister(flow_run.id)
            return await super().start(flow_run, task_status=task_status)
        fds, close = _stdio_fds(self._stream_output)
        request = {"argv": command[1:], "env": {**env, **control_env},
                   "cwd": str(self._cwd if self._cwd is not None else os.getcwd()),
                   "rlimits": {name: resource.getrlimit(getattr(resource, name)) for name in _RLIMITS},
                   "umask": _umask()}
        if not self._isolate_process_group:  # as Prefect's cold start: in this worker's process group
            request["pgid"] = os.getpgid(0)
        try:
            conn, pid = await anyio.to_thread.run_sync(_request_run, launcher, request, fds)
        except Exception as error:
            for fd in close:
                os.close(fd)
            self._logger.warning("mn: run %s starts cold: its launcher did not answer (%s); restarting it",
                                 flow_run.id, error)
            self._launchers.restart(launcher)
            if registered and self._control_channel is not None:
                self._control_channel.unregister(flow_run.id)
            return await super().start(flow_run, task_status=task_status)
        for fd in close:
            os.close(fd)
        pidfd = None
        with contextlib.suppress(OSError, AttributeError):
            pidfd = os.pidfd_open(pid)
        process = _WarmProcess(pid)
        try:
            conn.send(b'{"go": true}')
            self.started_warm = True
            # It reads pid and returncode. A process group of its own is signalled whole, as Prefect's would be.
            task_status.started(ProcessHandle(process) if "pgid" in request else  # type: ignore[arg-type]
                                ProcessHandle(process,  # type: ignore[arg-type]
                                              termination_scope=create_isolated_termination_scope(pid)))
            try:
                process.returncode = await anyio.to_thread.run_sync(_wait_exit, conn, pid, pidfd,
                                                                    abandon_on_cancel=True)
            except anyio.get_cancelled_exc_class():
                with contextlib.suppress(ProcessLookupError):  # as an anyio process left by a cancelled caller
                    os.kill(pid, signal.SIGKILL)
                raise
        finally:
            conn.close()
            if pidfd is not None:
                os.close(pidfd)

    def _environment(self, flow_run) -> dict[str, str]:
        """The environment Prefect's engine command starter gives the process (less the control channel's)."""
        deployment_name = (self._deployment_name if self._deployment_name is not None
                           else self._env.get("PREFECT__DEPLOYMENT_NAME"))
        env: dict[str, str | None] = dict(os.environ)
        settings_environment = get_current_settings().to_environment_variables(exclude_unset=True)
        if self._env_overrides_settings:
            env.update(settings_environment)
            env.update(self._env)
        else:
            env.update(self._env)
            env.update(settings_environment)
        env.update({"PREFECT__FLOW_RUN_ID": str(flow_run.id),
                    **({"PREFECT__STORAGE_BASE_PATH": str(self._tmp_dir)} if self._tmp_dir is not None else {}),
                    "PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS": "false",
                    "PREFECT__DEPLOYMENT_NAME": deployment_name,
                    **({"PREFECT__FLOW_ENTRYPOINT": self._entrypoint} if self._entrypoint else {}),
                    **({"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(int(self._heartbeat_seconds))}
                       if self._heartbeat_seconds is not None else {})})
        return sanitize_subprocess_env(env)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class WarmWorkspaceStarter(WorkspaceResolvingEngineCommandStarter):
    """Prefect's workspace starter (the supervisor: pull steps, then the engine) with its first process forked
    by a launcher."""

    def __init__(self, *, launchers: WarmLaunchers, preload: tuple[str, ...], logger: Any, **kwargs: Any):
        super().__init__(**kwargs)
        self._warm = (launchers, preload, logger)

    async def start(self, flow_run, task_status: anyio.abc.TaskStatus[ProcessHandle] = anyio.TASK_STATUS_IGNORED
                    ) -> None:
        from prefect.runner._workspace_runtime import WorkspaceSupervisorConfig, write_private_model
        from prefect.utilities.processutils import command_to_string

        write_private_model(self._config_path, WorkspaceSupervisorConfig(
            flow_run_id=flow_run.id, workspace_root=self._workspace_root, manifest_path=self._manifest_path,
            command=self._command))
        launchers, preload, logger = self._warm
        starter = WarmEngineStarter(
            launchers=launchers, preload=preload, logger=logger,
            command=command_to_string([get_sys_executable(), "-m", "prefect.runner._workspace_supervisor",
                                       str(self._config_path)]),
            cwd=self._source_cwd, env=self._environment, stream_output=self._stream_output,
            heartbeat_seconds=self._heartbeat_seconds, deployment_name=self._deployment_name,
            control_channel=self._control_channel, isolate_process_group=True, env_overrides_settings=True)
        await starter.start(flow_run, task_status=task_status)


async def run_warm(flow_run, configuration, task_status, *, launchers: WarmLaunchers, preload: tuple[str, ...],
                   logger: Any) -> ProcessWorkerResult:
    """``ProcessWorker.run`` (Prefect 3.9) with the flow process forked by a launcher, cold when it cannot."""
    from prefect.flows import load_flow_from_flow_run

    if task_status is None:
        task_status = anyio.TASK_STATUS_IGNORED
    working_dir_ctx = (tempfile.TemporaryDirectory(suffix="prefect") if not configuration.working_dir
                       else contextlib.nullcontext(configuration.working_dir))
    execution: FlowRunExecutionResult | None = None
    with working_dir_ctx as working_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        async with FlowRunExecutorContext() as ctx:
            workspace_root = Path(working_dir).resolve()
            if configuration._command_configured:
                starter: Any = WarmEngineStarter(
                    launchers=launchers, preload=preload, logger=logger, command=configuration.command,
                    cwd=workspace_root, env=configuration.env, stream_output=configuration.stream_output,
                    control_channel=ctx.control_channel)
                executor = ctx.create_executor(flow_run, starter, resolve_flow=load_flow_from_flow_run,
                                               propose_submitting=False)
            else:
                starter = WarmWorkspaceStarter(
                    launchers=launchers, preload=preload, logger=logger, workspace_root=workspace_root,
                    command=None, stream_output=configuration.stream_output, control_channel=ctx.control_channel,
                    source_cwd=workspace_root, environment=configuration.env)
                ctx.call_after_exit(starter.close)
                executor = ctx.create_executor(flow_run, starter, propose_submitting=False,
                                               hook_runner=starter.hook_runner)

            async def execute(*, task_status: anyio.abc.TaskStatus[ProcessHandle] = anyio.TASK_STATUS_IGNORED
                              ) -> None:
                nonlocal execution
                execution = await executor.submit(task_status=task_status)

            async with anyio.create_task_group() as group:
                handle = await group.start(execute)
                if handle.pid is None:
                    raise RuntimeError("Flow run process has no PID")
                task_status.started(handle.pid)
    if execution is None or execution.status_code is None:
        raise RuntimeError("Failed to start flow run process.")
    return ProcessWorkerResult(status_code=execution.status_code, identifier=str(execution.handle.pid))
