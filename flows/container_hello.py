"""A flow run in a container (runtime_driver docker): it reads back the limits the kernel enforces on it."""

from pathlib import Path

from prefect import flow, get_run_logger

import mn_prefect

# cgroup v1, then v2: the memory limit in bytes and the CPU quota per period.
MEMORY = ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory.max")
CPU = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu.max")


def _first(paths: tuple[str, ...]) -> str:
    for path in paths:
        if Path(path).exists():
            return Path(path).read_text().strip()
    return "unknown"


@flow(name="container-hello")
def container_hello() -> dict:
    allocation = mn_prefect.allocation()
    seen = {"node": allocation.node, "in_container": Path("/.dockerenv").exists(),
            "memory_limit_bytes": _first(MEMORY), "cpu_quota": _first(CPU)}
    get_run_logger().info("in a container on %s: memory limit %s bytes, CPU quota %s (booked %g cores, %g MB)",
                          allocation.node, seen["memory_limit_bytes"], seen["cpu_quota"],
                          allocation.resources.cpu_cores, allocation.resources.memory_mb)
    return seen
