"""The warm launcher: a process per worker that has imported Prefect (and a ``preload`` list) once, and forks each
host run's flow process from there instead of starting two new interpreters (docs/prefect.md, "Warm starts").

    python -m mn_prefect.worker.warm_launcher SOCKET STAMP [MODULE ...]

It never initialises a GPU library: after its imports it checks that no CUDA or NVML library is mapped in its
memory, and says so (``problem``) otherwise, and the worker then starts runs cold. Once ready it writes
``hello.json`` beside its socket (mode 0600) and serves one request per connection (``SOCK_SEQPACKET``): the run's
interpreter arguments (``-m MODULE ARGS``), environment, working directory, resource limits and umask, with its
stdout and stderr as file descriptors. For each it forks a *keeper* that forks the run's process, which does what a
cold start's interpreter does: the process group a cold start gets (the worker's, for a run that names it as
``pgid``; else a session of its own, ``setsid``, its pid its process group: Prefect isolates a workspace run so),
the environment
exactly as sent (``CUDA_VISIBLE_DEVICES`` included) before any of the flow's code runs, the working directory,
``sys.argv``, ``sys.path`` and ``sys.orig_argv`` as ``python -m MODULE ARGS`` there would have them, Prefect's
settings and logging read again from that environment, then the module run as ``__main__``. The keeper reports
the pid, releases the run when the worker says ``go`` (a worker that gave up meanwhile gets nothing started), waits
for it and reports its exit code (``-N`` for a signal, as ``subprocess`` does). The launcher keeps no run: killed,
it loses none (each keeper holds its run's connection).

Prefect's workspace supervisor (``prefect.runner._workspace_supervisor``, the process worker's first interpreter:
pull steps, then ``exec python -m prefect.engine``) runs in the run's process; when the engine command it chose is
the plain ``python -m prefect.engine``, the engine runs in that same process instead of a new interpreter (same pid,
as the supervisor's ``exec`` keeps it); any other command (a ``uv run`` project) is ``exec``-ed as cold.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

HELLO_FILE = "hello.json"
SUPERVISOR_MODULE = "prefect.runner._workspace_supervisor"
ENGINE_MODULE = "prefect.engine"
GO_TIMEOUT_S = 10.0  # how long a keeper waits for the worker's go before it ends the run it has not started
MAX_MESSAGE = 4 << 20
# Mapped in a process that initialised a GPU library: the launcher must never have one of these.
GPU_LIBRARIES = ("libcuda.so", "libnvidia-ml.so", "libcudart.so", "libamdhip64.so", "librocm_smi64.so")
# The interpreter's own start-up variables: a run whose values differ from the launcher's starts cold (a forked
# interpreter cannot take them up); PYTHONPATH is applied to sys.path and so may differ.
STARTUP_VARS = ("PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONOPTIMIZE", "PYTHONSAFEPATH",
                "PYTHONNOUSERSITE", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONWARNINGS", "PYTHONDEVMODE",
                "PYTHONHOME", "PYTHONPYCACHEPREFIX", "PYTHONINSPECT", "PYTHONVERBOSE", "PYTHONSTARTUP",
                "PYTHONFAULTHANDLER", "PYTHONTRACEMALLOC", "PYTHONPLATLIBDIR", "PYTHONUSERBASE", "PYTHONEXECUTABLE",
                "PYTHONMALLOC", "PYTHONCOERCECLOCALE", "PYTHONINTMAXSTRDIGITS", "PYTHONWARNDEFAULTENCODING",
                "PYTHONNODEBUGRANGES", "PYTHONPERFSUPPORT", "PYTHONSAFEPATH")


def install_stamp() -> str:
    """What a launcher was started from: the interpreter, mn-prefect's and Prefect's versions and the files they
    are read from. A launcher whose stamp differs from the worker's (an upgrade since it started) is replaced."""
    import importlib.util

    parts = [sys.executable, sys.version]
    for name in ("mn_prefect", "mn_prefect.worker.warm_launcher", "prefect"):
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        try:
            parts.append(f"{name}:{origin}:{os.stat(origin).st_mtime_ns}" if origin else f"{name}:-")
        except OSError:
            parts.append(f"{name}:{origin}:gone")
    try:
        from importlib.metadata import version

        parts.append(version("prefect"))
        parts.append(version("mn-prefect"))
    except Exception:  # not installed as a distribution: the files' times above still say it
        pass
    return "|".join(parts)


def startup_values(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    return {k: env[k] for k in STARTUP_VARS if k in env}


def gpu_libraries_loaded() -> list[str]:
    """The GPU libraries mapped in this process (Linux: /proc/self/maps); [] elsewhere."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({lib for lib in GPU_LIBRARIES if lib in maps})


# -- the run's process -------------------------------------------------------------------------------------------

def python_path(cwd: str, env: dict[str, str], base: list[str]) -> list[str]:
    """``sys.path`` as ``python -m`` started in ``cwd`` with ``env`` has it: the working directory, PYTHONPATH's
    entries, then the interpreter's own (``base``: the launcher's, less its own first entry and PYTHONPATH)."""
    extra = [os.path.abspath(p) if p else os.getcwd() for p in env.get("PYTHONPATH", "").split(os.pathsep)] \
        if env.get("PYTHONPATH") else []
    return [cwd, *extra, *base]


def _base_path() -> list[str]:
    """The interpreter's own ``sys.path`` entries, as read at the launcher's start (before any import)."""
    own = set()
    if os.environ.get("PYTHONPATH"):
        own = {os.path.abspath(p) for p in os.environ["PYTHONPATH"].split(os.pathsep) if p}
    return [p for p in sys.path[1:] if os.path.abspath(p) not in own]


def _stdio(fd: int, errors: str):
    import io

    raw = io.FileIO(fd, "wb" if fd else "rb", closefd=False)
    tty = raw.isatty()
    buffered = io.BufferedWriter(raw) if fd else io.BufferedReader(raw)
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"
    return io.TextIOWrapper(buffered, encoding=encoding, errors=errors, line_buffering=tty and bool(fd))


def _refresh_settings() -> None:
    """Prefect's settings read again from this process's environment and working directory, and its logging set
    up again when its settings changed (as a new interpreter would at ``import prefect``)."""
    from prefect.context import refresh_global_settings_context
    from prefect.logging import configuration
    from prefect.settings import get_current_settings

    before = get_current_settings().logging.model_dump()
    refresh_global_settings_context()
    if get_current_settings().logging.model_dump() != before or not configuration.PROCESS_LOGGING_CONFIG:
        configuration.PROCESS_LOGGING_CONFIG.clear()
        configuration.setup_logging(incremental=False)


def _switch(cwd: str, env: dict[str, str], base: list[str], module: str, args: list[str]) -> None:
    """Make this process look as ``python -m module args`` started in ``cwd`` with ``env`` would: then run it."""
    import runpy
    import warnings

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = python_path(os.getcwd(), env, base)
    sys.orig_argv = [sys.executable, "-m", module, *args]
    sys.argv = [module, *args]  # runpy puts the module's file first, as -m does
    _refresh_settings()
    with warnings.catch_warnings():  # the launcher imported it (prefect.flow_engine does); -m runs it afresh
        warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package.*",
                                category=RuntimeWarning)
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def _supervise_then_engine(args: list[str], base: list[str]) -> int:
    """Prefect's workspace supervisor (pull steps, the workspace's environment), then its engine in this process
    when its command is the plain ``python -m prefect.engine``; any other command is ``exec``-ed, as cold."""
    import prefect.runner._workspace_supervisor as supervisor
    from prefect.utilities.processutils import get_sys_executable

    chosen: dict[str, Any] = {}

    async def launch(command: list[str], *, cwd: Path, environment: dict[str, str]) -> int:
        chosen.update(command=command, cwd=str(cwd), environment=environment)
        return 0

    supervisor._launch_engine = launch  # this process only: it was forked for this run
    code = supervisor.main(args)
    if code or not chosen:
        return code or 1
    command, cwd, environment = chosen["command"], chosen["cwd"], chosen["environment"]
    if command != [get_sys_executable(), "-m", ENGINE_MODULE]:
        os.chdir(cwd)
        os.execvpe(command[0], command, environment)
    _switch(cwd, environment, base, ENGINE_MODULE, [])
    return 0


def _exit_code(error: SystemExit) -> int:
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _run(request: dict[str, Any], fds: list[int], base: list[str]) -> None:
    """The run's process, after setsid and the keeper's go: never returns."""
    import atexit
    import resource
    import threading
    import traceback

    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        sys.stdin, sys.stdout, sys.stderr = _stdio(0, "strict"), _stdio(1, "strict"), _stdio(2, "backslashreplace")
        for name in ("stdin", "stdout", "stderr"):
            setattr(sys, f"__{name}__", getattr(sys, name))
        for name, (soft, hard) in request.get("rlimits", {}).items():
            try:
                resource.setrlimit(getattr(resource, name), (soft, hard))
            except (ValueError, OSError, AttributeError):
                pass  # a limit the launcher cannot take back up stays the launcher's (never above it)
        os.umask(request.get("umask", 0o022))
        argv = request["argv"]
        if len(argv) < 2 or argv[0] != "-m":
            raise ValueError(f"the warm launcher runs 'python -m MODULE ...', not {argv!r}")
        module, args = argv[1], argv[2:]
        env = {k: v for k, v in request["env"].items() if v is not None}
        if module == SUPERVISOR_MODULE:
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(env)
            sys.path[:] = python_path(os.getcwd(), env, base)
            sys.orig_argv = [sys.executable, *argv]
            sys.argv = [supervisor_file(), *args]
            _refresh_settings()
            code = _supervise_then_engine(args, base)
        else:
            _switch(request["cwd"], env, base, module, args)
            code = 0
    except SystemExit as error:
        code = _exit_code(error)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit: wait for its threads
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except BaseException:
        pass
    os._exit(code)


def supervisor_file() -> str:
    import importlib.util

    spec = importlib.util.find_spec(SUPERVISOR_MODULE)
    return spec.origin if spec is not None and spec.origin else SUPERVISOR_MODULE


# -- the keeper --------------------------------------------------------------------------------------------------

def _send(conn: socket.socket, message: dict[str, Any]) -> bool:
    try:
        conn.send(json.dumps(message).encode())
        return True
    except OSError:
        return False


def _keep(conn: socket.socket, request: dict[str, Any], fds: list[int], base: list[str]) -> None:
    """Fork the run's process, report its pid, release it on the worker's go, report its exit: never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it outlives its launcher, to report its run's end
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            conn.close()
            os.close(ready_r)
            os.close(go_w)
            if isinstance(request.get("pgid"), int):  # the worker's group, as a cold start that is not isolated
                os.setpgid(0, request["pgid"])
            else:
                os.setsid()  # its pid is its process group: group signals reach it and what it starts
            for number in range(1, signal.NSIG):
                try:
                    signal.signal(number, signal.SIG_DFL)
                except (OSError, ValueError, RuntimeError):
                    pass
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            os.write(ready_w, b"r")
            os.close(ready_w)
            if os.read(go_r, 1) != b"g":
                os._exit(1)
            os.close(go_r)
        except BaseException:
            os._exit(1)
        _run(request, fds, base)
    os.close(ready_w)
    os.close(go_r)
    for fd in fds:
        os.close(fd)
    os.read(ready_r, 1)
    os.close(ready_r)
    go = False
    if _send(conn, {"pid": pid}):
        conn.settimeout(GO_TIMEOUT_S)
        try:
            go = json.loads(conn.recv(MAX_MESSAGE) or b"{}").get("go") is True
        except (OSError, ValueError):
            go = False
    if go:
        os.write(go_w, b"g")
    else:
        os.kill(pid, signal.SIGKILL)
    os.close(go_w)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            status = None
            break
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status) if status is not None else 1
    if go:
        conn.settimeout(None)
        _send(conn, {"exit": code})
    os._exit(0)


# -- the launcher ------------------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """End with the worker that started it (Linux); a keeper and its run are not affected (a fork clears it)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _preload(modules: list[str]) -> dict[str, str]:
    """Import Prefect's run-time modules and ``modules``; what failed to import, with why."""
    import importlib

    import prefect  # noqa: F401
    import prefect.flow_engine  # noqa: F401
    import prefect.flows  # noqa: F401
    import prefect.runner._workspace_supervisor  # noqa: F401
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()  # as the engine's own import of prefect does, with the same settings

    failed: dict[str, str] = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as error:  # a module's own SystemExit too: the launcher says so and goes on
            failed[name] = f"{type(error).__name__}: {error}"
    return failed


def write_private(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


def _reap(*_: Any) -> None:
    """SIGCHLD: wait for every keeper that ended."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str]) -> int:
    base = _base_path()
    socket_path, stamp, modules = Path(argv[0]), argv[1], argv[2:]
    _die_with_parent()
    failed = _preload(modules)
    gpu = gpu_libraries_loaded()
    import threading

    problem = None
    if gpu:
        problem = f"a GPU library was loaded by its imports ({', '.join(gpu)})"
    elif threading.active_count() != 1:
        problem = f"its imports started {threading.active_count() - 1} thread(s); a fork would lose them"
    # Keepers are reaped as they end, not ignored (SIG_IGN): a waited-for keeper's CPU, and that of the run it
    # waited for, is added to the launcher's children's, as a cold run's is to the worker's.
    signal.signal(signal.SIGCHLD, _reap)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if socket_path.exists():
        socket_path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(socket_path))
    finally:
        os.umask(old_umask)
    os.chmod(socket_path, 0o600)
    listener.listen(64)
    write_private(socket_path.with_name(HELLO_FILE), json.dumps({
        "pid": os.getpid(), "stamp": stamp, "preload": modules, "preload_failed": failed, "problem": problem,
        "startup": startup_values(os.environ)}))
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        try:
            conn, _ = listener.accept()
        except InterruptedError:
            continue
        try:
            conn.settimeout(GO_TIMEOUT_S)
            data, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, 2)
            request = json.loads(data)
            if len(fds) != 2:
                raise ValueError("a request carries its stdout and stderr")
        except (OSError, ValueError) as error:
            _send(conn, {"error": str(error)})
            conn.close()
            continue
        if os.fork() == 0:
            listener.close()
            try:
                _keep(conn, request, fds, base)
            finally:
                os._exit(1)
        conn.close()
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
