"""How port labels and volume names become environment variable suffixes (SPEC section 6)."""

from __future__ import annotations

import re

_OUTSIDE = re.compile(r"[^A-Z0-9]+")


def env_suffix(name: str) -> str:
    """``my-api.v2`` -> ``MY_API_V2``: upper case, each run of other characters one ``_``, trimmed."""
    return _OUTSIDE.sub("_", name.upper()).strip("_")
