"""The docker driver's pure half: a placement becomes the settings of one container (docs/drivers.md).

No I/O here: what the kernel enforces follows from the allocation alone, so it is tested without Docker.
- CPU: ``nano_cpus`` from ``cpu_cores`` (a CFS quota), and ``cpuset_cpus`` when the node pins its cores.
- Memory: ``mem_limit`` = ``memswap_limit`` from ``memory_mb`` (no swap beyond the booking).
- GPUs: a device request with the exact device ids (never a count); none at all for a run with no GPU, and
  ``NVIDIA_VISIBLE_DEVICES=void`` so the NVIDIA runtime shows it none either.
- Volumes: bind mounts at ``target``, read-only unless ``rw`` (mounts, not ``-v``: a missing source is an
  error, never a directory Docker creates as root).
- Ports: host networking (the booked numbers are the host's, read from ``MN_PORT_<LABEL>``).
- Environment: the run's own environment and the hints, nothing of the worker's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from mn_prefect.api_tls import API_CA_VAR, PLAIN_HTTP_CA
from mn_prefect.model.hints import env_hints, merge_env
from mn_prefect.model.placement import Placement

# Labels every container of this driver carries: the sweep of a restarted worker finds its orphans by them.
RUN_LABEL = "io.mn-prefect.flow-run-id"
NODE_LABEL = "io.mn-prefect.node"
DRIVER_LABEL = "io.mn-prefect.driver"
NVIDIA_DRIVER = "cuda"


class ContainerRefused(ValueError):
    """A placement this driver cannot give a container (the message says why, naming the field)."""


class Mount(BaseModel):
    model_config = ConfigDict(frozen=True)

    source: str
    target: str
    read_only: bool = True


class ContainerSpec(BaseModel):
    """Everything Docker is told about one run's container."""

    model_config = ConfigDict(frozen=True)

    name: str
    image: str
    command: tuple[str, ...]
    environment: dict[str, str]
    labels: dict[str, str]
    nano_cpus: int | None = None
    cpuset_cpus: str | None = None
    mem_limit: int | None = None
    memswap_limit: int | None = None
    gpu_ids: tuple[str, ...] = ()
    mounts: tuple[Mount, ...] = ()
    working_dir: str | None = None
    network_mode: str = "host"

    def create_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of docker-py's ``containers.create`` for this container."""
        from docker.types import DeviceRequest, Mount as DockerMount  # docker-py: its types only, no connection

        kwargs: dict[str, Any] = {
            "name": self.name, "image": self.image, "command": list(self.command), "environment": self.environment,
            "labels": self.labels, "network_mode": self.network_mode, "init": True, "detach": True,
            "mounts": [DockerMount(target=m.target, source=m.source, type="bind", read_only=m.read_only)
                       for m in self.mounts],
        }
        if self.nano_cpus is not None:
            kwargs["nano_cpus"] = self.nano_cpus
        if self.cpuset_cpus is not None:
            kwargs["cpuset_cpus"] = self.cpuset_cpus
        if self.mem_limit is not None:
            kwargs["mem_limit"] = self.mem_limit
            kwargs["memswap_limit"] = self.memswap_limit
        if self.gpu_ids:
            kwargs["device_requests"] = [DeviceRequest(driver="nvidia", device_ids=list(self.gpu_ids),
                                                       capabilities=[["gpu"]])]
        if self.working_dir is not None:
            kwargs["working_dir"] = self.working_dir
        return kwargs


    def run_argv(self, docker: str = "docker") -> list[str]:
        """The same container as a ``docker run`` command line, for a runner that supervises a process (a bundle
        step). Values of the environment never appear on it: ``-e NAME`` takes each from the environment the
        command is started with (``environment``)."""
        argv = [docker, "run", "--name", self.name, "--init", "--network", self.network_mode]
        for key, value in self.labels.items():
            argv += ["--label", f"{key}={value}"]
        if self.nano_cpus is not None:
            argv += ["--cpus", f"{self.nano_cpus / 1e9:g}"]
        if self.cpuset_cpus is not None:
            argv += ["--cpuset-cpus", self.cpuset_cpus]
        if self.mem_limit is not None:
            argv += ["--memory", f"{self.mem_limit}b", "--memory-swap", f"{self.memswap_limit}b"]
        if self.gpu_ids:
            argv += ["--gpus", f'"device={",".join(self.gpu_ids)}"']
        for mount in self.mounts:
            argv += ["--mount", f"type=bind,source={mount.source},target={mount.target}"
                                + (",readonly" if mount.read_only else "")]
        if self.working_dir is not None:
            argv += ["--workdir", self.working_dir]
        for key in sorted(self.environment):
            argv += ["--env", key]
        return [*argv, self.image, *self.command]


def container_name(run_name: str | None, run_id: str) -> str:
    """A readable, unique container name: ``mn-<run name>-<first 8 of the run id>``."""
    slug = re.sub(r"[^a-zA-Z0-9_.-]+", "-", run_name or "run").strip("-.") or "run"
    return f"mn-{slug[:40]}-{run_id[:8]}"


def container_spec(placement: Placement, *, run_id: str, run_name: str | None, image: str, command: Sequence[str],
                   run_env: Mapping[str, str | None], node_cpuset: str | None = None,
                   toolchain: Sequence[str] = (), working_dir: str | None = None,
                   scratch: Sequence[str] = ()) -> ContainerSpec:
    """The container of ``placement``: ``run_env`` is the run's own environment (the deployment's env and
    Prefect's variables for the run), to which the hints are added; ``toolchain`` lists host paths every
    container gets read-only at the same path (a shared Python, say), ``scratch`` host paths it gets read-write
    at the same path (a bundle step's sandbox). Raises ContainerRefused."""
    allocation = placement.allocation
    others = [d for d in allocation.devices if d.driver != NVIDIA_DRIVER]
    if others:
        raise ContainerRefused(
            f"runtime_driver docker passes NVIDIA (cuda) GPUs only; device {others[0].id} is "
            f"{others[0].vendor or others[0].driver or 'of another vendor'}")
    gpu_ids = tuple(d.id for d in allocation.devices)
    hints = env_hints(placement, in_container=True)
    environment = {k: v for k, v in merge_env(run_env, hints).items() if v is not None}
    if environment.get(API_CA_VAR) == str(PLAIN_HTTP_CA):  # a host file the container may not see: Prefect's default
        del environment[API_CA_VAR]
    environment["NVIDIA_VISIBLE_DEVICES"] = ",".join(gpu_ids) if gpu_ids else "void"
    environment.setdefault("PYTHONUNBUFFERED", "1")  # its output reaches the run's logs as it is written
    resources = placement.resources
    memory = int(resources.memory_mb * 1024 * 1024) if resources.memory_mb > 0 else None
    mounts = [Mount(source=v.source, target=v.target, read_only=v.mode != "rw") for v in allocation.volumes]
    mounts += [Mount(source=path, target=path, read_only=False) for path in scratch]
    taken = {m.target for m in mounts}
    mounts += [Mount(source=path, target=path) for path in toolchain if path not in taken]
    return ContainerSpec(
        name=container_name(run_name, run_id), image=image, command=tuple(command), environment=environment,
        labels={RUN_LABEL: run_id, NODE_LABEL: placement.node, DRIVER_LABEL: "docker"},
        nano_cpus=int(round(resources.cpu_cores * 1e9)) if resources.cpu_cores > 0 else None,
        cpuset_cpus=node_cpuset, mem_limit=memory, memswap_limit=memory, gpu_ids=gpu_ids, mounts=tuple(mounts),
        working_dir=working_dir)
