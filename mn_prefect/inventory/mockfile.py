"""Mock inventory files (JSON or TOML): declare nodes and devices on machines without the hardware."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from mn_prefect.model.issues import InvalidInput, Issue


def read_inventory_file(path: str | Path) -> Any:
    """The raw content: one node record (laid over the detected machine) or ``{"nodes": [...]}`` / a list."""
    path = Path(path)
    name = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise InvalidInput([Issue(name, f"cannot read the inventory file: {error.strerror or error}")]) from None
    if not text.strip():
        raise InvalidInput([Issue(name, "the inventory file is empty")])
    try:
        if path.suffix.lower() == ".toml":
            return tomllib.loads(text)
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidInput([Issue(name, f"malformed JSON at line {error.lineno} column {error.colno}: {error.msg}")]) from None
    except tomllib.TOMLDecodeError as error:
        raise InvalidInput([Issue(name, f"malformed TOML: {error}")]) from None
