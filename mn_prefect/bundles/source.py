"""MirrorNeuron's source manifest format (``apiVersion: mn.workflow.source/v1|v2``: ``identity``, ``agents.registry``,
``workflow.steps`` with ``needs``, ``workers.groups``), expanded into a runnable manifest by MirrorNeuron's own
converter, ``mn_sdk.manifest_converter.expand_manifest_source`` (mirrorneuron-python-sdk), as ``mn blueprint run``
expands it. mn-prefect does not re-implement the expansion.

The converter renders agent templates from the mn-agents catalog: ``MN_AGENTS_ROOT`` (a folder holding its
``index.json``), else ``~/.mn/agents`` (``DEFAULT_AGENTS_ROOT``), never a ``mn-agents`` folder that happens to lie
above the working directory (the SDK's own fallback); it is public (``git clone
https://github.com/MirrorNeuronLab/mn-agents ~/.mn/agents``). The converter may need skills (``MN_SKILLS_ROOT``); what it lacks is named in the error with the setting that
points to it. A source blueprint keeps ``config/`` and ``examples/`` beside ``payloads/``, and MirrorNeuron's
submission stages them with its payloads: its upload paths are read from ``payloads/``, then from its top folder
(``Bundle.upload_roots``). Every node that runs a step loads the bundle, so each needs the SDK and the catalog.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from mn_prefect.model.issues import InvalidInput, Issue

SOURCE_API_VERSIONS = ("mn.workflow.source/v1", "mn.workflow.source/v2")

AGENTS_ENV = "MN_AGENTS_ROOT"
DEFAULT_AGENTS_ROOT = "~/.mn/agents"
GET_CATALOG = f"git clone https://github.com/MirrorNeuronLab/mn-agents {DEFAULT_AGENTS_ROOT}"
_ENV_LOCK = threading.Lock()


def agents_root() -> Path:
    """Where the mn-agents catalog is read from: ``MN_AGENTS_ROOT``, else ``~/.mn/agents``."""
    return Path(os.environ.get(AGENTS_ENV) or DEFAULT_AGENTS_ROOT).expanduser()


# What a converter error is about, and the setting that points mn-prefect (and MirrorNeuron) to it.
_NEEDS = (
    ("mn-agents", "the mn-agents catalog of agent templates (looked for in {root}): set MN_AGENTS_ROOT to a folder "
                  "holding its index.json, or get it with: " + GET_CATALOG),
    ("skill", "MirrorNeuron skills: set MN_SKILLS_ROOT to the folder holding them"),
)


def is_source(document: Any) -> bool:
    return isinstance(document, dict) and document.get("apiVersion") in SOURCE_API_VERSIONS


def expand(document: dict[str, Any], root: Path) -> dict[str, Any]:
    """The runnable manifest MirrorNeuron makes of a source manifest; InvalidInput naming what is missing."""
    try:
        from mn_sdk.manifest_converter import expand_manifest_source
    except ImportError:
        raise InvalidInput([Issue("manifest.apiVersion", f"{document.get('apiVersion')} is MirrorNeuron's source "
                                  f"format, which its SDK expands: pip install mirrorneuron-python-sdk")]) from None
    catalog = agents_root()
    try:
        with _ENV_LOCK:  # the SDK reads the setting from the environment: ours, not a parent folder's catalog
            before = os.environ.get(AGENTS_ENV)
            os.environ[AGENTS_ENV] = str(catalog)
            try:
                return expand_manifest_source(document, root_dir=root)
            finally:
                if before is None:
                    os.environ.pop(AGENTS_ENV, None)
                else:
                    os.environ[AGENTS_ENV] = before
    except Exception as error:  # the converter's own errors (ManifestConversionError and what it wraps)
        message = str(error) or type(error).__name__
        needs = next((need.format(root=catalog) for marker, need in _NEEDS if marker in message.lower()), None)
        text = f"expanding the source manifest failed: {message}" + (f"; it needs {needs}" if needs else "")
        raise InvalidInput([Issue("manifest", text)]) from None
