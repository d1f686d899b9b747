"""Running one agent's command on its node: argv, environment, workdir, timeout, output line by line.

No Prefect here: the agent flow (``mn_prefect.jobs.agent``) hands each output line to the run logger.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mn_prefect.credentials import passable
from mn_prefect.model.hints import allocation, env_hints, merge_env

# Variables a placed run receives besides the allocation's own hints.
JOB_VAR = "MN_JOB_ID"
AGENT_VAR = "MN_AGENT_ID"
ATTEMPT_VAR = "MN_AGENT_ATTEMPT"
KILL_GRACE_S = 5.0
WATCH_S = 0.2  # how often a watchdog is asked


class CommandRefused(RuntimeError):
    """The command cannot start here (no such program, no such workdir); nothing was run."""


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    seconds: float
    pid: int
    timed_out: bool = False
    stopped: str | None = None  # why the watchdog stopped it

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.stopped is None

    def describe(self) -> str:
        if self.stopped:
            return f"stopped: {self.stopped}"
        if self.timed_out:
            return f"timed out after {self.seconds:.1f} s and was killed"
        if self.exit_code < 0:
            return f"killed by signal {signal.Signals(-self.exit_code).name}"
        return f"exited with code {self.exit_code}"


def agent_environment(environ: Mapping[str, str], pass_env: Sequence[str], environment: Mapping[str, str]) -> dict[str, str]:
    """The command's environment: only the ``pass_env`` variables of ``environ`` (never a worker's secret:
    ``mn_prefect.credentials``), plus the hints of the placement in
    ``environ`` (docs/resources.md, "Environment hints"; the worker's own MN_ settings stay out), plus the blueprint's
    ``environment``. A hint never replaces a blueprint variable unless it is an MN_ or a GPU visibility variable
    (``merge_env``)."""
    env = {name: environ[name] for name in passable(pass_env) if name in environ}
    placement = allocation(environ, required=False)
    env.update(merge_env(environment, env_hints(placement) if placement is not None else {}))
    return env


def resolve_program(argv: Sequence[str], workdir: str | None, path: str | None) -> str:
    """The executable for ``argv[0]``: a path (relative to ``workdir``) or a name on ``path``."""
    if not argv:
        raise CommandRefused("config.command is empty")
    program = argv[0]
    if os.sep in program:
        candidate = Path(program) if os.path.isabs(program) else Path(workdir or ".") / program
        if not candidate.is_file() or not os.access(candidate, os.X_OK):
            raise CommandRefused(f"config.command[0]: {program!r} is not an executable file on this node")
        return str(candidate)
    found = shutil.which(program, path=path)
    if found is None:
        raise CommandRefused(f"config.command[0]: program {program!r} is not installed on this node (not on PATH)")
    return found


def check_workdir(workdir: str | None) -> None:
    if workdir is not None and not Path(workdir).is_dir():
        raise CommandRefused(f"config.workdir: {workdir!r} does not exist on this node")


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the agent runner dies, so a killed runner leaves no orphan behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_command(argv: Sequence[str], *, env: Mapping[str, str], workdir: str | None = None,
                timeout_s: float | None = None, on_line: Callable[[str, str], None],
                on_start: Callable[[int], None] | None = None, search_path: str | None = None,
                watchdog: Callable[[], str | None] | None = None) -> CommandResult:
    """Run ``argv`` to the end (or ``timeout_s`` seconds), handing every stdout/stderr line to ``on_line(stream,
    line)``. On timeout, when ``watchdog`` (asked every 0.2 s) gives a reason, or when this process is
    interrupted, the command's process group gets SIGTERM, then SIGKILL after a short grace."""
    check_workdir(workdir)
    program = resolve_program(argv, workdir, search_path if search_path is not None else os.environ.get("PATH"))
    started = time.monotonic()
    proc = subprocess.Popen([program, *argv[1:]], env=dict(env), cwd=workdir, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_die_with_parent, text=True, errors="replace", bufsize=1)
    if on_start is not None:
        on_start(proc.pid)
    readers = [threading.Thread(target=_pump, args=(stream, name, on_line), daemon=True)
               for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for reader in readers:
        reader.start()
    timed_out, stopped = False, None
    ends = None if timeout_s is None else started + timeout_s
    try:
        while True:
            left = None if ends is None else max(0.0, ends - time.monotonic())
            try:
                proc.wait(timeout=left if watchdog is None else min(WATCH_S, left if left is not None else WATCH_S))
                break
            except subprocess.TimeoutExpired:
                if ends is not None and time.monotonic() >= ends:
                    timed_out = True
                elif watchdog is None or (stopped := watchdog()) is None:
                    continue
                _stop_group(proc)
                break
    except BaseException:  # cancelled or interrupted: never leave the command running
        _stop_group(proc)
        raise
    for reader in readers:
        reader.join(timeout=5)
    return CommandResult(exit_code=proc.returncode, seconds=time.monotonic() - started, pid=proc.pid,
                         timed_out=timed_out, stopped=stopped)


def _pump(stream, name: str, on_line: Callable[[str, str], None]) -> None:
    for line in stream:
        on_line(name, line.rstrip("\n"))
    stream.close()


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
