"""Reading JSON text given by people (files, command-line options) so that its numbers stay bounded per field."""

from __future__ import annotations

import json
import sys
from typing import Any


def _integer(text: str) -> int | float:
    # int() refuses past Python's digit limit with a bare ValueError that names no field; such an integer reads as
    # an infinite float, as a float too large for one already does, and the field holding it is refused by name.
    if len(text.lstrip("-")) > sys.get_int_max_str_digits() > 0:
        return float(text)
    return int(text)


def parse_json(text: str) -> Any:
    """``json.loads`` of ``text``, except that an integer too long for ``int()`` reads as infinity (negative for
    a negative one). Raises ``json.JSONDecodeError`` and ``RecursionError`` as ``json.loads`` does."""
    return json.loads(text, parse_int=_integer)
