"""``mn-prefect`` commands for the tests, run in the test process.

Most CLI tests are about what a command does and prints, not about the process it runs in, and a new interpreter
costs each call about a second of CPU in imports: most of the fast tier's time went there. ``run`` calls the
console script's own entry point (``mn_prefect.cli.app.main``: the same parsing, error handling and exit codes) with
the given arguments, environment and standard input, and answers as ``subprocess.run`` would: return code, stdout and
stderr as text. ``MN_TEST_CLI=process`` runs every call as a real subprocess instead (the same assertions hold
there); tests/test_cli.py keeps the installed ``mn-prefect`` executable itself under test.

Only for commands that end by themselves. A call whose environment names a Prefect server (``PREFECT_API_URL``) runs
as a subprocess: Prefect reads its settings once per process. Long-running commands (``mn-api serve``, ``metrics
serve``, ``up``) are started with ``subprocess.Popen`` by their tests.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

MN = str(Path(sys.executable).parent / "mn-prefect")


def run(args: Iterable[object], *, env: Mapping[str, str] | None = None, input: str | None = None,
        cwd: str | Path | None = None, timeout: float = 120, whole_env: bool = False,
        process: bool = False) -> subprocess.CompletedProcess:
    """``mn-prefect *args`` in ``cwd``, in a subprocess with ``process``. ``env`` is added to this process's
    environment, or with ``whole_env`` is the whole of it. ``timeout`` applies to the subprocess form only."""
    argv = [MN, *map(str, args)]
    environment = dict(env or {}) if whole_env else {**os.environ, **(env or {})}
    if process or os.environ.get("MN_TEST_CLI") == "process" or environment.get("PREFECT_API_URL"):
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input, env=environment,
                              cwd=cwd)
    return _in_process(argv, environment, input, cwd)


def _in_process(argv: list[str], environment: dict[str, str], input: str | None,
                cwd: str | Path | None) -> subprocess.CompletedProcess:
    from mn_prefect.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_argv, saved_stdin, saved_cwd = dict(os.environ), sys.argv, sys.stdin, os.getcwd()
    os.environ.clear()
    os.environ.update(environment)
    sys.argv, sys.stdin = argv, io.StringIO(input or "")
    code: int = 0
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exit:  # what the interpreter does with sys.exit's argument
                if exit.code is None or isinstance(exit.code, int):
                    code = exit.code or 0
                else:
                    print(exit.code, file=sys.stderr)
                    code = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv, sys.stdin = saved_argv, saved_stdin
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
