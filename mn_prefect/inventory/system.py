"""CPU, memory, disk, OS and architecture of this machine, from the OS."""

from __future__ import annotations

import os
import platform
import shutil
import socket
from pathlib import Path


def cpu_cores() -> float:
    try:
        return float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return float(os.cpu_count() or 1)


def memory_mb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (ValueError, OSError, AttributeError):
        return 0.0


def disk_mb(path: str = "/") -> float:
    try:
        return shutil.disk_usage(path).free / 2**20
    except OSError:
        return 0.0


def host_record() -> dict:
    """The host part of a node record: name, cpu_cores, memory_mb, disk_mb, os, arch."""
    return {
        "name": socket.gethostname() or "localhost",
        "cpu_cores": cpu_cores(),
        "memory_mb": round(memory_mb(), 1),
        "disk_mb": round(disk_mb(), 1),
        "os": platform.system().lower(),
        "arch": platform.machine().lower(),
    }
