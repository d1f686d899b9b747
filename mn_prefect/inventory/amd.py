"""AMD GPUs through ``rocm-smi --json`` where it is installed. No tool means no devices."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess

from mn_prefect.model.node import Device

log = logging.getLogger(__name__)


def _mb(value: object) -> float | None:
    try:
        return round(int(str(value)) / 2**20, 1)
    except ValueError:
        return None


def detect_amd(timeout: float = 10.0) -> list[Device]:
    tool = shutil.which("rocm-smi")
    if tool is None:
        return []
    try:
        out = subprocess.run([tool, "--showproductname", "--showmeminfo", "vram", "--showuniqueid", "--json"],
                             capture_output=True, text=True, timeout=timeout, check=True).stdout
        cards = json.loads(out)
    except (subprocess.SubprocessError, OSError, json.JSONDecodeError) as error:
        log.warning("rocm-smi failed (%s): no AMD devices", error)
        return []
    devices: list[Device] = []
    for key, info in sorted(cards.items()):
        if not key.startswith("card") or not isinstance(info, dict):
            continue
        index = int(key[4:]) if key[4:].isdigit() else len(devices)
        total = _mb(info.get("VRAM Total Memory (B)", ""))
        used = _mb(info.get("VRAM Total Used Memory (B)", ""))
        # rocm-smi prints "N/A" when a card has no unique id: fall back so ids stay distinct.
        unique = str(info.get("Unique ID") or "").strip()
        devices.append(Device(
            id=unique if unique and unique.upper() != "N/A" else f"amd-{index}", index=index, kind="gpu",
            vendor="amd", driver="rocm",
            # "Card series" in older rocm-smi, "Card Series" in ROCm 6.
            model=info.get("Card Series") or info.get("Card series") or info.get("Card SKU"),
            memory_total_mb=total,
            memory_free_mb=round(total - used, 1) if total is not None and used is not None else None,
            capabilities=[str(info["GFX Version"]).lower()] if info.get("GFX Version") else [],
        ))
    return devices
