"""Apple GPUs (Metal) through ``system_profiler SPDisplaysDataType -json`` where it exists."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess

from mn_prefect.model.node import Device

log = logging.getLogger(__name__)


def detect_apple(timeout: float = 20.0) -> list[Device]:
    tool = shutil.which("system_profiler")
    if tool is None:
        return []
    try:
        out = subprocess.run([tool, "SPDisplaysDataType", "-json"], capture_output=True, text=True,
                             timeout=timeout, check=True).stdout
        displays = json.loads(out).get("SPDisplaysDataType", [])
    except (subprocess.SubprocessError, OSError, json.JSONDecodeError, AttributeError) as error:
        log.warning("system_profiler failed (%s): no Apple devices", error)
        return []
    devices = []
    for index, gpu in enumerate(d for d in displays if isinstance(d, dict)):
        metal = str(gpu.get("spdisplays_mtlgpufamilysupport", "")).lower()
        if not metal:
            continue
        devices.append(Device(
            id=f"apple-gpu-{index}", index=index, kind="gpu", vendor="apple", driver="metal",
            model=gpu.get("sppci_model") or gpu.get("_name"),
            capabilities=[metal.replace("spdisplays_", "")],
        ))
    return devices
