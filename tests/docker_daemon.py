"""A real Docker daemon for the docker driver's tests: Debian's ``dockerd`` with its own data root, exec root
and socket in a temporary folder, no bridge and no iptables (containers use host networking; nothing is
created on a private address range). Stopped, with whatever it left mounted unmounted, at the end.

No image registry is reachable: ``TOOLCHAIN_IMAGE`` is an empty root filesystem imported locally, run with
this machine's Python, virtualenv and project mounted read-only at the same paths (MN_DOCKER_TOOLCHAIN).

Where Docker cannot run (no root), ``MN_TEST_NO_DOCKER=1`` skips these tests; CI never sets it, so a missing
``dockerd`` fails them there.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import servers

from mn_prefect.drivers import docker as docker_io

OPT_OUT_VAR = "MN_TEST_NO_DOCKER"
TOOLCHAIN_IMAGE = "mn-prefect-test/toolchain:1"


class DockerDaemon:
    def __init__(self) -> None:
        servers.lab_only("dockerd")
        if os.environ.get(OPT_OUT_VAR) == "1":
            pytest.skip(f"{OPT_OUT_VAR}=1: this machine cannot run dockerd (never set in CI)")
        binary = shutil.which("dockerd") or "/usr/sbin/dockerd"
        if not os.path.exists(binary):
            raise RuntimeError("dockerd is not installed (Debian's docker.io); .ci/run installs it")
        # A short folder: the daemon's unix sockets must fit in 108 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="mnd-", dir="/tmp"))
        self.host = f"unix://{self.root}/docker.sock"
        namespace = f"mn-test-{uuid.uuid4().hex[:12]}"  # containerd allows [A-Za-z0-9] runs joined by one of ._-
        self.log = open(self.root / "dockerd.log", "w")
        self.proc = subprocess.Popen(
            [binary, "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "exec"),
             "-H", self.host, "--pidfile", str(self.root / "docker.pid"), "--bridge=none", "--iptables=false",
             "--ip-forward=false", "--ip-masq=false", "--shutdown-timeout", "2",
             "--containerd-namespace", namespace, "--containerd-plugins-namespace", f"{namespace}-plugins"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.env = {"DOCKER_HOST": self.host}
        try:
            servers.wait_for(self._answers, timeout=60, interval=0.1, what="dockerd to answer")
        except BaseException:
            self.stop()
            raise

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"dockerd exited: {(self.root / 'dockerd.log').read_text()[-2000:]}")
        with _docker_host(self.host):
            return docker_io.daemon_problem() is None

    def client(self):
        import docker

        return docker.DockerClient(base_url=self.host, timeout=60)

    def build_toolchain_image(self) -> str:
        with _docker_host(self.host):
            return docker_io.build_toolchain_image(TOOLCHAIN_IMAGE)

    def containers(self, **filters) -> list:
        conn = self.client()
        try:
            return conn.containers.list(all=True, filters=filters)
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        _unmount_under(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


class _docker_host:
    """DOCKER_HOST set for the calls inside (docker_io reads Docker's own variable, as a worker does)."""

    def __init__(self, host: str):
        self.host = host

    def __enter__(self):
        self.before = os.environ.get("DOCKER_HOST")
        os.environ["DOCKER_HOST"] = self.host

    def __exit__(self, *exc):
        if self.before is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = self.before


def _unmount_under(root: Path) -> None:
    """Unmount what the daemon left mounted below ``root`` (overlay layers, its exec root), deepest first."""
    prefix = str(root) + "/"
    for _ in range(3):
        with open("/proc/self/mounts") as mounts:
            points = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
        if not points:
            return
        for point in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)
        time.sleep(0.1)
