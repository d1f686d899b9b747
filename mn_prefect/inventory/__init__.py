"""Reading this machine into a node record: OS figures, GPU detectors, a mock file, MN_NODE_* overrides.

Order of precedence (last wins): detection, the mock inventory file (``MN_INVENTORY_FILE``), MN_NODE_*.
A missing vendor library or tool is not an error: that vendor contributes no devices.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from mn_prefect.inventory.amd import detect_amd
from mn_prefect.inventory.apple import detect_apple
from mn_prefect.inventory.hostpaths import resolve_host_paths
from mn_prefect.inventory.mockfile import read_inventory_file
from mn_prefect.inventory.nvidia import detect_nvidia
from mn_prefect.inventory.overrides import apply_overrides
from mn_prefect.inventory.system import host_record
from mn_prefect.model.issues import InvalidInput, Issue, Issues
from mn_prefect.model.node import Device, NodeRecord, parse_node, parse_nodes
from mn_prefect.model.scalars import type_name

log = logging.getLogger(__name__)

INVENTORY_FILE_VAR = "MN_INVENTORY_FILE"

# One detector per vendor (the accelerator-plugin shape): each returns its devices or [].
DETECTORS: tuple[tuple[str, Callable[[], list[Device]]], ...] = (
    ("nvidia", detect_nvidia),
    ("amd", detect_amd),
    ("apple", detect_apple),
)


def detect_devices() -> list[Device]:
    devices: list[Device] = []
    for vendor, detect in DETECTORS:
        try:
            found = detect()
        except Exception as error:  # a broken vendor tool must not stop the worker
            log.warning("%s device detection failed (%s): no %s devices", vendor, error, vendor)
            continue
        devices.extend(found)
    return devices


def detect_local_record(*, devices: bool = True) -> dict:
    """The raw record of this machine before the mock file and overrides."""
    record = host_record()
    found = detect_devices() if devices else []
    record["devices"] = [d.model_dump(exclude_none=True) for d in found]
    return record


def _mock_content(environ: Mapping[str, str]) -> tuple[dict | None, list]:
    """(record laid over this machine, extra mock nodes) from MN_INVENTORY_FILE."""
    path = environ.get(INVENTORY_FILE_VAR)
    if not path:
        return None, []
    raw = read_inventory_file(path)
    if not isinstance(raw, (dict, list)):
        raise InvalidInput([Issue(path, "the inventory file must hold a node record object, "
                                        f'{{"nodes": [...]}} or a list of node records, got {type_name(raw)}')])
    if isinstance(raw, dict) and "nodes" not in raw:
        return raw, []
    return None, raw if isinstance(raw, list) else raw.get("nodes", [])


def local_node(environ: Mapping[str, str] | None = None) -> NodeRecord:
    """This machine as a node record. Raises InvalidInput naming the file or variable that is wrong."""
    environ = os.environ if environ is None else environ
    overlay, _ = _mock_content(environ)
    # A mock record that declares devices replaces detection entirely: the point is to pretend.
    record = detect_local_record(devices=not (overlay and "devices" in overlay))
    if overlay:
        record.update(overlay)
    issues = Issues()
    record = apply_overrides(record, environ, issues)
    issues.raise_if_any()
    source = environ.get(INVENTORY_FILE_VAR) or "local node"
    node = parse_node(record, source, issues)
    issues.raise_if_any()
    assert node is not None
    # Resolve symlinks only after validation: host paths must be absolute and '..'-free as written.
    if node.host_paths:
        node = node.model_copy(update={"host_paths": resolve_host_paths(node.host_paths)})
    return node


def local_nodes(environ: Mapping[str, str] | None = None) -> list[NodeRecord]:
    """This machine plus any extra nodes a mock fleet file declares (``{"nodes": [...]}`` or a list)."""
    environ = os.environ if environ is None else environ
    _, fleet = _mock_content(environ)
    nodes = [local_node(environ)]
    if fleet:
        issues = Issues()
        nodes += parse_nodes(fleet, environ[INVENTORY_FILE_VAR], issues)
        issues.raise_if_any()
    return nodes
