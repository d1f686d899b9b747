"""The one rule for the names of nodes, resource groups, queues and runs.

Such a name is a key in SQL, Redis and the run store's folders, a word in a shell command and a cell of a table
row, so it is kept to letters, digits, ``.``, ``_`` and ``-``: no separators (``/``), no line breaks or escape
sequences, never ``.`` or ``..``.
"""

from __future__ import annotations

import re

MAX_NAME = 128
MAX_GROUP_NAME = 63  # groups have been 1-63 characters from the start (docs/operating.md)
# Starting with a letter or digit also keeps a name from reading as a command-line option or a store account (@...).
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHOWN = 80  # characters of a bad name an error shows


def name_rule(limit: int = MAX_NAME) -> str:
    """The rule in words, for error messages and help text."""
    return f"1-{limit} letters, digits, '.', '_' or '-', starting with a letter or digit, no '..'"


def follows_name_rule(name: object, limit: int = MAX_NAME) -> bool:
    """Whether ``name`` is a string of at most ``limit`` characters that follows the rule."""
    return isinstance(name, str) and len(name) <= limit and SAFE_NAME.fullmatch(name) is not None and ".." not in name


def shown_name(name: object) -> str:
    """``repr(name)``, cut to its first characters when it is long."""
    if isinstance(name, str) and len(name) > _SHOWN:
        return f"{name[:_SHOWN]!r}... ({len(name)} characters)"
    return repr(name)


def name_issue(name: object, kind: str, limit: int = MAX_NAME) -> str | None:
    """Why ``name`` cannot be the name of a ``kind`` ("node", "group", ...), or None when it can."""
    if follows_name_rule(name, limit):
        return None
    return f"{shown_name(name)} is not a valid {kind} name ({name_rule(limit)})"


# The validation context of a record read back from a store: its names were checked when it was written, and one
# an older release let in must not make the whole store unreadable (it can still be listed and removed).
STORED = {"stored": True}


def check_model_name(name: str, kind: str, context: object, limit: int = MAX_NAME) -> str:
    """``name`` for a model's field validator: ValueError when it breaks the rule, unless read from a store
    (``context`` is the validation context, :data:`STORED` there)."""
    if isinstance(context, dict) and context.get("stored"):
        return name
    if why := name_issue(name, kind, limit):
        raise ValueError(why)
    return name
