"""Running one launch the way MirrorNeuron's HostLocal runner does (docs/bundles.md, "The worker-process contract"): a
fresh sandbox with the uploaded payload as working directory, the input/context/message/body files, the environment
contract, argv placeholders, a timeout that kills the whole process group, and in-place retries of transient failures.

The sandbox stands in for ``/sandbox/job`` (and ``/mn/job``, where MirrorNeuron's DockerWorker puts a step's
uploads): a ``workdir`` under either is mapped into it, so nothing is ever written to a real ``/sandbox`` or
``/mn``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from mn_prefect.credentials import passable
from mn_prefect.drivers import docker as docker_io
from mn_prefect.drivers.container import container_spec
from mn_prefect.jobs.command import CommandRefused, run_command
from mn_prefect.model.hints import merge_env
from mn_prefect.model.placement import Placement
from mn_prefect.preemption import CHECKPOINT_FILE_VAR, NOTICE_FILE_VAR
from mn_prefect.workflow.engine import StepLaunch
from mn_prefect.workflow.manifest import AgentSpec
from mn_prefect.workflow.protocol import BEACON_MISSED, BEACON_PREFIX, ProcessResult, capped, is_transient, redact

SANDBOX_ROOT = "/sandbox/job"
DOCKER_WORKER_ROOT = "/mn/job"  # where MirrorNeuron's DockerWorker puts a step's uploads in its container
# The little of the runner's own environment a step inherits; the rest must be asked for with pass_env.
BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL", "TERM")
PYTHON_NAMES = ("python3.11", "python3", "python")
# What the docker command needs of the runner's environment to reach its daemon (never passed into a container).
DOCKER_CLIENT_ENV = ("DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CERT_PATH", "DOCKER_TLS_VERIFY", "DOCKER_CONTEXT")
CHECKPOINT_DIR_VAR = "MN_CHECKPOINT_DIR"
CHECKPOINTS_FOLDER = "checkpoints"  # in the run's folder: one folder per step
# What a runner placed by an mn worker has to hear of its preemption (mn_prefect.preemption): its steps get them
# too, so that they can read its notice and say it checkpointed (a container step with their folder mounted).
PREEMPTION_ENV = (NOTICE_FILE_VAR, CHECKPOINT_FILE_VAR)


def checkpoint_dir(run_env: Mapping[str, str], label: str) -> Path | None:
    """A step's checkpoint folder, ``$MN_RUNS_ROOT/$MN_RUN_ID/checkpoints/<step>``: the same for every attempt of
    the step in the run, on whatever node it runs, and kept when an attempt is stopped (None without a run
    store)."""
    if not run_env.get("MN_RUNS_ROOT") or not run_env.get("MN_RUN_ID"):
        return None
    name = quote(label, safe="[]")  # a step id (``worker[2]`` for a scatter instance) as one folder name
    if name in ("", ".", ".."):
        name = f"step-{quote(name, safe='')}"
    return Path(run_env["MN_RUNS_ROOT"]) / run_env["MN_RUN_ID"] / CHECKPOINTS_FOLDER / name


def python_for(name: str, path: str | None) -> tuple[str, str | None]:
    """``python3.11`` where the node has only a ``python3`` of version 3.11 (or this interpreter): the program
    to run and a note saying what it resolved to."""
    if shutil.which(name, path=path):
        return name, None
    if name == "python3.11":
        if sys.version_info[:2] == (3, 11):
            return sys.executable, f"python3.11 is not on PATH: using {sys.executable} (Python 3.11)"
        candidate = shutil.which("python3", path=path)
        if candidate:
            probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 11))"],
                                   capture_output=True, text=True)
            if probe.stdout.strip() == "True":
                return candidate, f"python3.11 is not on PATH: using {candidate} (Python 3.11)"
    return name, None


def upload_source(roots: Sequence[Path], rel: str) -> Path:
    """Where an upload path is read from: the first of the bundle's upload roots that has it (payloads/, then, for a
    source-format blueprint, its top folder: mn_prefect.bundles.bundle.Bundle.upload_roots)."""
    return next((root / rel for root in roots if (root / rel).exists()), roots[0] / rel)


def stage(launch: StepLaunch, payloads: Path | Sequence[Path], temp_root: str | None = None) -> tuple[Path, Path]:
    """A fresh sandbox for one launch, with its uploads copied in; returns (sandbox, workdir)."""
    agent = launch.agent
    roots = (payloads,) if isinstance(payloads, Path) else tuple(payloads)
    base = Path(tempfile.mkdtemp(prefix=f"mirror_neuron_host_local_{agent.node_id}_", dir=temp_root))
    uploads = []
    if agent.upload_path:
        uploads.append((agent.upload_path, agent.upload_as or Path(agent.upload_path).name))
    uploads += [(u.source, u.target) for u in agent.upload_paths]
    for source, target in uploads:
        src, dst = upload_source(roots, source), base / target
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    rel = sandbox_relative(agent)
    if isinstance(rel, SandboxEscape):  # the bundle's loader refuses it first: this is the last guard
        shutil.rmtree(base, ignore_errors=True)
        raise ValueError(f"agent {agent.node_id}: {rel.why}")
    cwd = base / rel
    cwd.mkdir(parents=True, exist_ok=True)
    return base, cwd


@dataclass(frozen=True)
class SandboxEscape:
    why: str


def _within(rel: str) -> bool:
    """Whether the relative path ``rel`` stays inside the folder it is taken from."""
    parts = os.path.normpath(rel).split(os.sep)
    return not os.path.isabs(rel) and parts[0] != ".."


def sandbox_relative(agent: AgentSpec) -> str | SandboxEscape:
    """The agent's ``workdir`` as a path inside its sandbox ("." for the sandbox itself): one under the sandbox
    (``/sandbox/job``, ``/mn/job`` or the agent's ``sandbox_upload_path``) or relative to it. One elsewhere, or
    that climbs out with ``..``, is a SandboxEscape: a step runs in its sandbox, never in a folder of the host."""
    sandbox_root = str(agent.config.get("sandbox_upload_path") or SANDBOX_ROOT).rstrip("/")
    workdir = agent.workdir
    prefixes = (sandbox_root, SANDBOX_ROOT, DOCKER_WORKER_ROOT, "/sandbox")  # the most specific first
    if workdir is None or workdir in prefixes:
        return "."
    if prefix := next((p for p in prefixes if workdir.startswith(p + "/")), None):
        rel = workdir[len(prefix) + 1:]
    elif not os.path.isabs(workdir):
        rel = workdir
    else:
        return SandboxEscape(f"workdir {workdir!r} is outside the sandbox: use a path under {SANDBOX_ROOT} (or "
                             "relative to it)")
    if not _within(rel):
        return SandboxEscape(f"workdir {workdir!r} climbs out of the sandbox")
    return rel


def _files(base: Path, launch: StepLaunch) -> dict[str, str]:
    paths = {"input": base / "mirror_neuron_input.json", "context": base / "mirror_neuron_context.json",
             "message": base / "mirror_neuron_message.json", "body": base / "mirror_neuron_body.bin"}
    body = launch.message.body
    paths["input"].write_text(json.dumps(body, indent=2, sort_keys=True, default=str))
    paths["context"].write_text(json.dumps(launch.context_doc, indent=2, sort_keys=True, default=str))
    paths["message"].write_text(json.dumps(launch.message_doc, indent=2, sort_keys=True, default=str))
    paths["body"].write_bytes(json.dumps(body, default=str).encode())
    return {k: str(v) for k, v in paths.items()}


def environment(launch: StepLaunch, files: dict[str, str], workdir: Path, *, job_id: str, run_env: Mapping[str, str],
                hints: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The process environment, lowest layer first (docs/bundles.md, "Environment"): a few basics of the runner's own
    (and the runner's preemption notice and checkpoint files), the runtime variables, beacon
    settings, the run's variables (with the step's ``MN_CHECKPOINT_DIR``), the node's ``config.environment``, the
    allocation's hints, the message's workflow headers (they outrank the node's values), then ``pass_env`` (never a
    worker's secret: ``mn_prefect.credentials``)."""
    agent = launch.agent
    env = {name: environ[name] for name in BASE_ENV if name in environ}
    env.update({name: environ[name] for name in PREEMPTION_ENV if environ.get(name)})
    env.update({
        "MN_INPUT_FILE": files["input"], "MN_CONTEXT_FILE": files["context"], "MN_MESSAGE_FILE": files["message"],
        "MN_BODY_FILE": files["body"], "MN_BODY_CONTENT_TYPE": "application/json",
        "MN_BODY_CONTENT_ENCODING": "identity", "MN_AGENT_TYPE": agent.agent_type, "MN_AGENT_TEMPLATE": agent.template,
        "MN_JOB_ID": job_id, "MN_AGENT_ID": agent.node_id, "MN_WORKDIR": str(workdir), "MN_ARTIFACTS_JSON": "[]",
    })
    config = agent.config
    if config.get("beacon_enabled"):
        ctx = launch.context_doc.get("workflow", {})
        env.update({"MN_AGENT_BEACON_STDOUT_PREFIX": str(config.get("beacon_stdout_prefix") or BEACON_PREFIX),
                    "MN_AGENT_BEACON_INTERVAL_MS": str(config.get("beacon_interval_ms", 15000)),
                    "MN_AGENT_BEACON_TIMEOUT_MS": str(config.get("beacon_timeout_ms", 45000)),
                    "MN_AGENT_BEACON_REQUIRED": "1" if config.get("agent_beacon_required") else "0",
                    "MN_AGENT_BEACON_JOB_ID": job_id, "MN_AGENT_BEACON_AGENT_ID": agent.node_id,
                    "MN_AGENT_BEACON_ATTEMPT": str(ctx.get("attempt", 1)),
                    "MN_AGENT_BEACON_STEP": str(ctx.get("step_id", "")), "MN_AGENT_BEACON_SOURCE": "agent"})
    env.update(run_env)
    checkpoints = checkpoint_dir(run_env, launch.label)
    if checkpoints is not None:
        env[CHECKPOINT_DIR_VAR] = str(checkpoints)
    env.update(agent.environment)
    env = merge_env(env, hints)
    env.update(launch.workflow_env)
    env.update({name: environ[name] for name in passable(agent.pass_env) if name in environ})
    return env


def _argv(launch: StepLaunch, files: dict[str, str], workdir: Path, job_id: str, path: str | None,
          notes: list[str]) -> list[str]:
    command = launch.agent.command
    if command is None:
        return [sys.executable, "-c", "pass"]  # MirrorNeuron runs a no-op for an agent without a command
    if isinstance(command, str):
        return ["bash", "-lc", command]
    values = {"input_file": files["input"], "context_file": files["context"], "message_file": files["message"],
              "body_file": files["body"], "workdir": str(workdir), "job_id": job_id, "agent_id": launch.agent_id}
    argv = []
    for arg in command:
        for key, value in values.items():
            arg = arg.replace("{" + key + "}", value)
        argv.append(arg)
    if argv[0] in PYTHON_NAMES:
        argv[0], note = python_for(argv[0], path)
        if note:
            notes.append(note)
    return argv


BUILD_FOLDER = "docker_worker"


def build_context(agent: AgentSpec, payloads: Path) -> Path | None:
    """Where a DockerWorker agent's image is built from when the node lacks it: its ``build`` (docs/bundles.md),
    else ``payloads/<upload_path>/docker_worker`` when that folder holds a Dockerfile (MirrorNeuron's layout);
    None: the image must be on the node or pullable."""
    if agent.image is None:
        return None
    if agent.build is not None:
        return payloads / agent.build
    if agent.upload_path and (payloads / agent.upload_path / BUILD_FOLDER / "Dockerfile").is_file():
        return payloads / agent.upload_path / BUILD_FOLDER
    return None


def run_launch(launch: StepLaunch, payloads: Path | Sequence[Path], *, job_id: str, run_env: Mapping[str, str],
               hints: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None,
               on_line: Callable[[str, str], None] | None = None, node: str | None = None,
               on_start: Callable[[int], None] | None = None,
               sleep: Callable[[float], None] = time.sleep, placement: Placement | None = None) -> ProcessResult:
    """Stage, run (retrying transient failures in place: docs/bundles.md, "Exit codes, timeouts and retries") and clean
    up one launch. A DockerWorker agent's command runs in a container of its image, with ``placement``'s allocation
    enforced."""
    environ = os.environ if environ is None else environ
    hints = hints or {}
    base, workdir = stage(launch, payloads, environ.get("MN_TEMP_DIR"))
    try:
        files = _files(base, launch)
        env = environment(launch, files, workdir, job_id=job_id, run_env=run_env, hints=hints, environ=environ)
        checkpoints = checkpoint_dir(run_env, launch.label)
        if checkpoints is not None:  # made before the step runs; never removed with its sandbox
            checkpoints.mkdir(parents=True, exist_ok=True)
        notes: list[str] = []
        argv = _argv(launch, files, workdir, job_id, env.get("PATH"), notes)
        container = None
        if launch.agent.image is not None:
            if placement is None:
                raise ValueError(f"agent {launch.agent_id} runs in a container: its placement is needed")
            context = build_context(launch.agent, payloads if isinstance(payloads, Path) else payloads[0])
            if context is not None:
                docker_io.ensure_image(launch.agent.image, context,
                                       lambda text: on_line("note", text) if on_line else None)
            container = container_spec(placement, run_id=uuid.uuid4().hex, run_name=launch.agent_id,
                                       image=launch.agent.image, command=argv, run_env=env, node_cpuset=None,
                                       toolchain=docker_io.toolchain_paths(dict(environ)), working_dir=str(workdir),
                                       scratch=[str(base), *_run_dir(run_env), *_preemption_folders(env)])
            argv = container.run_argv()
            # The docker command finds its daemon; the container gets only the step's own environment.
            env = {**container.environment, **{k: environ[k] for k in DOCKER_CLIENT_ENV if k in environ}}
        for note in notes:
            if on_line:
                on_line("note", note)
        agent = launch.agent
        result = None
        for run in range(1, agent.max_attempts + 1):
            result = _run_once(argv, env, workdir, launch.timeout_s, on_line, node, on_start,
                               BeaconWatch.of(agent.config))
            if container is not None:  # its name is free again for the next attempt
                docker_io.remove_container(container.name)
            result.runs = run
            if result.ok or run == agent.max_attempts or not is_transient(result):
                break
            delay = agent.retry_backoff_ms * 2 ** (run - 1) / 1000
            if on_line:
                on_line("note", f"transient failure ({result.error_text()}): running again in {delay:g} s")
            sleep(delay)
        assert result is not None
        return result
    finally:
        if container is not None:  # also after a timeout killed the docker command: the container goes too
            docker_io.remove_container(container.name)
        if not environ.get("MN_KEEP_SANDBOX"):
            shutil.rmtree(base, ignore_errors=True)


def _run_dir(run_env: Mapping[str, str]) -> list[str]:
    """The run's own folder (MN_RUNS_ROOT/MN_RUN_ID), which a step may write to: mounted into its container."""
    if not run_env.get("MN_RUNS_ROOT") or not run_env.get("MN_RUN_ID"):
        return []
    folder = Path(run_env["MN_RUNS_ROOT"]) / run_env["MN_RUN_ID"]
    folder.mkdir(parents=True, exist_ok=True)
    return [str(folder)]


def _preemption_folders(env: Mapping[str, str]) -> list[str]:
    """The folders of the runner's preemption notice and checkpoint files: mounted into a step's container at their
    own paths, read-write, so that the step can read its notice and say it checkpointed."""
    folders = {str(Path(env[name]).parent) for name in PREEMPTION_ENV if env.get(name)}
    return sorted(folder for folder in folders if Path(folder).is_dir())


class BeaconWatch:
    """Required beacons (``beacon_enabled`` and ``agent_beacon_required``; docs/bundles.md, "Exit codes, timeouts and
    retries"): a process that prints no beacon line for ``beacon_timeout_ms`` (from its start or its last beacon) is
    stopped, with MirrorNeuron's reason, which is a transient one (retried in place while ``max_attempts`` allows)."""

    def __init__(self, prefix: str, timeout_s: float):
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.last = time.monotonic()

    @classmethod
    def of(cls, config: Mapping[str, object]) -> BeaconWatch | None:
        if not (config.get("beacon_enabled") and config.get("agent_beacon_required")):
            return None
        timeout_ms = config.get("beacon_timeout_ms", 45000)
        return cls(str(config.get("beacon_stdout_prefix") or BEACON_PREFIX),
                   float(timeout_ms) / 1000 if isinstance(timeout_ms, int | float) else 45.0)

    def saw(self, stream: str, text: str) -> None:
        if stream == "stdout" and text.startswith(self.prefix):
            self.last = time.monotonic()

    def __call__(self) -> str | None:
        return BEACON_MISSED if time.monotonic() - self.last > self.timeout_s else None


def _run_once(argv: list[str], env: dict[str, str], workdir: Path, timeout_s: float | None,
              on_line: Callable[[str, str], None] | None, node: str | None,
              on_start: Callable[[int], None] | None = None, beacons: BeaconWatch | None = None) -> ProcessResult:
    out: list[str] = []
    err: list[str] = []

    def line(stream: str, text: str) -> None:
        (out if stream == "stdout" else err).append(text)
        if beacons is not None:
            beacons.saw(stream, text)
        if on_line:
            on_line(stream, redact(text, env))

    started = time.monotonic()
    try:
        done = run_command(argv, env=env, workdir=str(workdir), timeout_s=timeout_s, on_line=line,
                           on_start=on_start, search_path=env.get("PATH", ""), watchdog=beacons)
    except CommandRefused as refused:
        return ProcessResult(exit_code=127, stdout="", stderr="", seconds=time.monotonic() - started,
                             refused=str(refused), node=node)
    return ProcessResult(exit_code=done.exit_code, stdout=capped("\n".join(out)), stderr=capped("\n".join(err)),
                         seconds=done.seconds, timed_out=done.timed_out, node=node, stopped=done.stopped)
