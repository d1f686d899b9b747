"""Reading numbers, strings and lists out of raw JSON with path-named errors."""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Collection
from typing import Any

from mn_prefect.model.issues import Issues

# Larger than any real machine (about a billion cores / petabytes in MB) and still exact in a float.
MAX_QUANTITY = 1e12

_MISSING = object()

# Far longer than any real quantity written out, far shorter than Python's digit limit.
_MAX_NUMBER_CHARS = 64
_LONG_DIGITS = re.compile(rf"\d{{{_MAX_NUMBER_CHARS + 1}}}")


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def shown(value: Any) -> str:
    """``repr(value)`` for a message, or a description of it where repr() would raise: an integer past Python's
    digit limit, or a list or object holding one."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**_MAX_NUMBER_CHARS:
        return f"a number of more than {_MAX_NUMBER_CHARS} digits"
    try:
        return repr(value)
    except (ValueError, RecursionError):
        return f"{'an' if type_name(value)[0] in 'aeiou' else 'a'} {type_name(value)} holding a number of more than "\
               f"{_MAX_NUMBER_CHARS} digits"


def too_long_digits(value: Any) -> bool:
    """Whether ``value`` is an integer, or text with a run of digits, longer than any real quantity or version part
    (``int()`` and ``str()`` of one past Python's digit limit raise a bare ValueError)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return bool(abs(value) >= 10**_MAX_NUMBER_CHARS)
    if isinstance(value, str):
        return _LONG_DIGITS.search(value) is not None
    return False


def _not_ascii(value: str, path: str, issues: Issues, what: str) -> bool:
    """Whether ``value`` holds a character outside ASCII (Python's int() and float() read other scripts' digits,
    "١٢" as 12, and their spaces): such a string is refused, naming ``path``."""
    if not value.isascii():
        issues.add(path, f"must be {what} written in ASCII digits, got the string {value!r}")
        return True
    if "_" in value:  # int() and float() read "1_0_0" as 100
        issues.add(path, f"must be {what} written without underscores, got the string {value!r}")
        return True
    if len(value) > _MAX_NUMBER_CHARS:  # int() refuses past Python's digit limit with a bare ValueError
        issues.add(path, f"must be {what} of at most {_MAX_NUMBER_CHARS} characters, got {len(value)}")
        return True
    return False


def read_number(value: Any, path: str, issues: Issues, *, allow_strings: bool = True) -> float | None:
    """A finite, non-negative number; numeric strings ("8", "8.5") are accepted when allowed, in ASCII digits
    only."""
    if isinstance(value, bool):
        issues.add(path, f"must be a number, got {type_name(value)}")
        return None
    if isinstance(value, str) and allow_strings:
        if _not_ascii(value, path, issues, "a number"):
            return None
        try:
            number = float(value.strip())
        except ValueError:
            issues.add(path, f"must be a number, got the string {value!r}")
            return None
    elif isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:
            issues.add(path, f"is too large (at most {MAX_QUANTITY:g})")
            return None
    else:
        issues.add(path, f"must be a number, got {type_name(value)}")
        return None
    if math.isnan(number):
        issues.add(path, "must be a number, got NaN")
        return None
    if number < 0:
        issues.add(path, f"must not be negative, got {value!r}")
        return None
    if number > MAX_QUANTITY:
        # infinity: JSON's 1e999, or an integer past Python's digit limit (model/json_text.py)
        got = "" if math.isinf(number) else f", got {value!r}"
        issues.add(path, f"is too large (at most {MAX_QUANTITY:g}){got}")
        return None
    return number


def read_int(
    value: Any,
    path: str,
    issues: Issues,
    *,
    minimum: int = 0,
    maximum: int | None = None,
    allow_strings: bool = True,
    what: str = "an integer",
) -> int | None:
    """An integer within ``minimum..maximum``; integral floats (2.0) and numeric strings (in ASCII digits) are
    accepted."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or (
        isinstance(value, str) and not allow_strings
    ):
        issues.add(path, f"must be {what}, got {type_name(value)}")
        return None
    number: int | float
    if isinstance(value, str):
        if _not_ascii(value, path, issues, what):
            return None
        try:
            number = int(value.strip())
        except ValueError:
            try:  # "2.0" reads like the number 2.0: integral, so accepted; "2.5" is refused below
                number = float(value.strip())
            except ValueError:
                issues.add(path, f"must be {what}, got the string {value!r}")
                return None
    else:
        number = value
    if isinstance(number, float):
        if not math.isfinite(number) or number != int(number):
            issues.add(path, f"must be {what}, got {value!r}")
            return None
        number = int(number)
    limit = maximum if maximum is not None else int(MAX_QUANTITY)
    if number < minimum or number > limit:
        if abs(number) > 10**_MAX_NUMBER_CHARS:  # repr() past Python's digit limit raises a bare ValueError
            value = f"a number of more than {_MAX_NUMBER_CHARS} digits"
        if maximum is not None:
            issues.add(path, f"must be between {minimum} and {maximum}, got {value!r}")
        elif number < minimum:
            issues.add(path, f"must be at least {minimum}, got {value!r}")
        else:
            issues.add(path, f"is too large (at most {limit}), got {value!r}")
        return None
    return number


def read_string(value: Any, path: str, issues: Issues, *, allow_empty: bool = False) -> str | None:
    if not isinstance(value, str):
        issues.add(path, f"must be a string, got {type_name(value)}")
        return None
    if not allow_empty and not value.strip():
        issues.add(path, "must not be empty")
        return None
    return value


def read_string_list(value: Any, path: str, issues: Issues) -> list[str] | None:
    """A list of non-empty strings; a single string is read as a one-item list."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        issues.add(path, f"must be a list of strings, got {type_name(value)}")
        return None
    out: list[str] = []
    ok = True
    for i, item in enumerate(value):
        text = read_string(item, f"{path}[{i}]", issues)
        if text is None:
            ok = False
        else:
            out.append(text)
    return out if ok else None


def read_bool(value: Any, path: str, issues: Issues) -> bool | None:
    if not isinstance(value, bool):
        issues.add(path, f"must be true or false, got {type_name(value)}")
        return None
    return value


def check_keys(raw: dict[str, Any], allowed: Collection[str], path: str, issues: Issues) -> None:
    """Unknown keys are errors here (used inside ``resources``, where a typo books the wrong device)."""
    for key in raw:
        if key not in allowed:
            hint = ", ".join(sorted(allowed))
            issues.add(f"{path}.{key}" if path else str(key), f"unknown key (allowed: {hint})")


def as_object(value: Any) -> dict[str, Any]:
    """``value`` when it is an object, else an empty one (for optional sections of a document)."""
    return value if isinstance(value, dict) else {}


def as_string(value: Any, default: str) -> str:
    """``value`` when it is a string, else ``default``."""
    return value if isinstance(value, str) else default


def is_uuid(text: str) -> bool:
    """Whether ``text`` is a UUID (a flow run's id), as opposed to a blueprint job's or a step's booking id."""
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True
