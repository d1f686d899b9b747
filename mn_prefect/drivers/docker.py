"""The docker driver's I/O half: one container per run, through docker-py (the client prefect-docker installs).

Why docker-py and not a held ``DockerWorker``: prefect-docker 0.7's worker prints a container's output to the
worker's stdout (not the run's logs), has no job fields for GPUs, CPU quota, cpuset or mounts, and on Linux
adds a ``host-gateway`` host entry that a daemon without a bridge refuses. The container's settings come from
``container.container_spec`` (pure); this module only talks to the daemon:
- create and start; a container whose start fails is removed before the error is raised;
- its output, line by line, into the flow run's logs;
- its exit code is the run's; the container is removed once that is read;
- ``stop`` for cancellation and the worker's own stop; ``sweep_orphans`` for a restarted worker.
The daemon is the one ``DOCKER_HOST`` names (Docker's own variable), else the default socket.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mn_prefect.drivers.container import NODE_LABEL, RUN_LABEL, ContainerSpec

# Host paths every container gets read-only at the same path, separated by ':' (a shared Python and the flow
# code, for images that carry neither).
TOOLCHAIN_VAR = "MN_DOCKER_TOOLCHAIN"
CLIENT_TIMEOUT_SECONDS = 60
PING_TIMEOUT_SECONDS = 5


def toolchain_paths(environ: dict[str, str] | None = None) -> list[str]:
    environ = dict(os.environ) if environ is None else environ
    return [p for p in environ.get(TOOLCHAIN_VAR, "").split(":") if p]


def client(timeout: int = CLIENT_TIMEOUT_SECONDS) -> Any:
    """A docker-py client for the daemon of ``DOCKER_HOST`` (raises docker.errors.DockerException when none)."""
    import docker

    return docker.from_env(timeout=timeout)


def daemon_problem() -> str | None:
    """Why this machine cannot start containers (no daemon reachable), or None when it can."""
    try:
        import docker
    except ImportError as error:  # pragma: no cover - docker-py comes with prefect-docker, a dependency
        return f"docker-py is not installed ({error})"
    try:
        conn = docker.from_env(timeout=PING_TIMEOUT_SECONDS)
        try:
            conn.ping()
        finally:
            conn.close()
    except Exception as error:
        return f"no Docker daemon answers at {os.environ.get('DOCKER_HOST') or DEFAULT_SOCKET}: {_why(error)}"
    return None


DEFAULT_SOCKET = "unix:///var/run/docker.sock"
# What docker-py's error text says, in words (its exceptions wrap requests' and urllib3's, which wrap the OS error).
_CAUSES = (("FileNotFoundError", "the socket does not exist (is Docker installed and its daemon started?)"),
           ("No such file", "the socket does not exist (is Docker installed and its daemon started?)"),
           ("PermissionError", "permission denied on the socket (run as a user in the docker group)"),
           ("Permission denied", "permission denied on the socket (run as a user in the docker group)"),
           ("Connection refused", "nothing listens there (is the daemon started?)"),
           ("timed out", f"it did not answer within {PING_TIMEOUT_SECONDS:g} s"))


def _why(error: Exception) -> str:
    text = str(error)
    return next((words for mark, words in _CAUSES if mark in text), f"{type(error).__name__}: {text[:200]}")


class ContainerRun:
    """One run's container, from creation to removal. Blocking calls: run them in a thread."""

    def __init__(self, spec: ContainerSpec, log: Callable[[str], None]):
        self.spec = spec
        self._log = log
        self._client = client()
        self.container: Any = None

    @property
    def id(self) -> str:
        return self.container.id if self.container is not None else ""

    def start(self) -> str:
        """Create and start the container; its id. A start that fails removes what it created, then raises."""
        import docker.errors

        try:
            self._client.images.get(self.spec.image)
        except docker.errors.ImageNotFound:
            self._log(f"image {self.spec.image} is not on this node; pulling it")
            self._client.images.pull(self.spec.image)
        self.container = self._client.containers.create(**self.spec.create_kwargs())
        try:
            self.container.start()
        except BaseException:
            self.remove()
            raise
        return self.container.id

    def stream_logs(self) -> None:
        """Every line the container writes (stdout and stderr), as it comes, until it exits."""
        pending = b""
        for chunk in self.container.logs(stream=True, follow=True, stdout=True, stderr=True):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self._log(line.decode(errors="replace").rstrip("\r"))
        if pending:
            self._log(pending.decode(errors="replace"))

    def wait(self) -> int:
        """The container's exit code, once it has exited."""
        return int(self.container.wait()["StatusCode"])

    def stop(self, grace_seconds: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_seconds``; a container already gone is no error."""
        import docker.errors

        if self.container is None:
            return
        try:
            self.container.stop(timeout=max(int(grace_seconds), 0))
        except docker.errors.NotFound:
            pass

    def remove(self) -> None:
        """Remove the container (force: also while it still runs); a container already gone is no error."""
        import docker.errors

        if self.container is not None:
            try:
                self.container.remove(force=True)
            except docker.errors.NotFound:
                pass
        self._client.close()


def _on_container(name_or_id: str, act: Callable[[Any], None]) -> bool:
    """``act`` on one container by name or id; False when there is none."""
    import docker.errors

    conn = client()
    try:
        act(conn.containers.get(name_or_id))
        return True
    except docker.errors.NotFound:
        return False
    finally:
        conn.close()


def remove_container(name_or_id: str) -> bool:
    """Remove a container (force: also while it runs); False when there is none."""
    return _on_container(name_or_id, lambda container: container.remove(force=True))


def stop_container(container_id: str, grace_seconds: float) -> bool:
    """Stop one container by id (SIGTERM, SIGKILL after ``grace_seconds``); False when there is none."""
    return _on_container(container_id, lambda container: container.stop(timeout=max(int(grace_seconds), 0)))


def sweep_orphans(node: str, keep: Iterable[str], log: logging.Logger | logging.LoggerAdapter) -> list[str]:
    """Remove this node's containers (by label) whose run is not in ``keep``: left by a worker that stopped
    without cleaning up. Returns the run ids of the containers removed."""
    keep = set(keep)
    conn = client()
    removed = []
    try:
        for container in conn.containers.list(all=True, filters={"label": f"{NODE_LABEL}={node}"}):
            run_id = container.labels.get(RUN_LABEL, "")
            if run_id in keep:
                continue
            log.warning("removing container %s of run %s: its worker stopped without removing it",
                        container.name, run_id)
            container.remove(force=True)
            removed.append(run_id)
    finally:
        conn.close()
    return removed


def default_toolchain() -> list[str]:
    """The host paths a container needs to run this installation's Python and mn-prefect at the same paths:
    the Python installation, its virtualenv, the project (an editable install) and the system libraries."""
    import sys
    from pathlib import Path

    import mn_prefect

    candidates = [sys.base_prefix, sys.prefix, str(Path(mn_prefect.__file__).resolve().parents[1]), "/usr"]
    candidates += [p for p in ("/lib", "/lib64", "/lib32") if os.path.isdir(p) and not os.path.islink(p)]
    real = sorted({os.path.realpath(p) for p in candidates if os.path.isdir(p)})
    return [p for p in real if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in real)]


def empty_rootfs_tar() -> bytes:
    """A root filesystem with nothing in it but the directories a process expects (and this machine's
    lib -> usr/lib style links): the toolchain is mounted into it. /sbin stays a directory: Docker mounts its
    init there, which it cannot do through a link into the read-only /usr."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, mode in (("tmp", 0o1777), ("root", 0o700), ("etc", 0o755), ("proc", 0o555), ("sys", 0o555),
                           ("dev", 0o755), ("usr", 0o755), ("run", 0o755), ("var", 0o755), ("var/tmp", 0o1777),
                           ("sbin", 0o755)):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        for link in ("bin", "lib", "lib64", "lib32"):
            if os.path.islink(f"/{link}"):
                info = tarfile.TarInfo(link)
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(f"/{link}")
                tar.addfile(info)
        passwd = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size, info.mode = len(passwd), 0o644
        tar.addfile(info, io.BytesIO(passwd))
    return buffer.getvalue()


def build_toolchain_image(tag: str) -> str:
    """Import an empty root filesystem as ``tag`` (no registry needed): with ``MN_DOCKER_TOOLCHAIN`` set to
    ``default_toolchain()``, a container of it runs this machine's Python and flows. Returns the image id."""
    repository, _, version = tag.partition(":")
    conn = client()
    try:
        conn.api.import_image_from_data(empty_rootfs_tar(), repository=repository, tag=version or "latest")
        return conn.images.get(tag).id
    finally:
        conn.close()


BUILD_LABEL = "mn.build.digest"
BUILD_TIMEOUT_SECONDS = 1800


def context_digest(context: Path) -> str:
    """A digest of a build context: every file's path, mode and bytes (what the image is built from)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in context.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(context)).encode() + b"\0" + oct(path.stat().st_mode & 0o777).encode()
                      + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:32]


def ensure_image(tag: str, context: Path, log: Callable[[str], None]) -> str:
    """The image ``tag`` built from ``context`` (a folder with a Dockerfile), built only when needed: an image of that
    tag built from the same content (its ``mn.build.digest`` label) is used as it is; one built from other content is
    built again; one that mn-prefect did not build (no label: the operator's own) is used untouched. Builds of one
    content on one machine happen one at a time (a lock file per digest). Returns the image id."""
    import docker.errors

    digest = context_digest(context)
    lock_path = Path(tempfile.gettempdir()) / f"mn-prefect-build-{digest}.lock"
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        conn = client(timeout=BUILD_TIMEOUT_SECONDS)
        try:
            try:
                image = conn.images.get(tag)
                built_from = (image.labels or {}).get(BUILD_LABEL)
                if built_from is None or built_from == digest:
                    return image.id
                log(f"image {tag} was built from other content ({built_from}); building it again")
            except docker.errors.ImageNotFound:
                log(f"image {tag} is not on this node: building it from {context} ({digest})")
            started = time.monotonic()
            # Host networking: this daemon may have no bridge, and a build that fetches needs the host's network.
            image, _ = conn.images.build(path=str(context), tag=tag, labels={BUILD_LABEL: digest}, rm=True,
                                         forcerm=True, network_mode="host", pull=False)
            log(f"built image {tag} ({image.id[7:19]}) in {time.monotonic() - started:.1f} s")
            return image.id
        finally:
            conn.close()
