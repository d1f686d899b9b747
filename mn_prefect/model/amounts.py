"""Amounts as people write them, read once for every request (job variables, ``@requires``, blueprints, ``plan``,
``reserve``, queues' quotas): memory, disk and GPU memory as a number in the key's unit (``memory_mb: 4096``,
``memory_gb: 4``) or as a string with a unit (``"512M"``, ``"4G"``, ``"4GB"``, ``"4Gi"``, ``"4GiB"``, ``"1.5T"``,
``"4 gb"``); CPU as a number of cores or, as Kubernetes writes it, millicores (``"500m"``).

Units read as Kubernetes reads them: ``k M G T P E`` are powers of 1000 bytes, ``Ki Mi Gi Ti Pi Ei`` powers of
1024, a trailing ``B`` changes nothing, and case does not matter (``"4g"`` is ``"4G"``). The grammar's MB is
2**20 bytes (what the inventory counts, and 1024 MB make the ``memory_gb`` key's GB), so ``"4Gi"`` is 4096 MB and
``"4G"`` (4 * 10**9 bytes) about 3815 MB. Pure: no Prefect, no store.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from mn_prefect.model.issues import Issues
from mn_prefect.model.scalars import MAX_QUANTITY, read_number

Unit = Literal["", "cores", "millicores", "cpu", "mb", "gb"]
"""The unit of a key's bare number: a count (``""``), cores, thousandths of a core, ``cpu``'s legacy rule (above
``CPU_MILLICORE_THRESHOLD`` it is millicores), MB or GB (1024 MB)."""

# MirrorNeuron's old rule: a bare `cpu` above this is a millicore figure.
CPU_MILLICORE_THRESHOLD = 64
BYTES_PER_MB = 2**20
SIZE_UNITS = ("mb", "gb")
_PREFIXES = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5, "e": 6}
# A number and letters after it (the sign too, to say "negative" rather than "not a number"), in ASCII only.
_WITH_LETTERS = re.compile(r"(?P<sign>[-+]?)(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[A-Za-z]+)",
                           re.ASCII)
SIZE_FORMS = ("a string with a unit: 512M, 4G, 4GB, 4Gi, 4GiB, 1.5T (k M G T P E: powers of 1000 bytes; "
              "Ki Mi Gi Ti Pi Ei: powers of 1024; any case)")
CPU_FORMS = "a string of millicores such as 500m"


def bytes_per(unit: str) -> int | None:
    """Bytes in one ``unit`` (``"G"``, ``"gib"``, ``"Ki"``, ``"B"``...), or None when it is not one."""
    text = unit.lower()
    if text.endswith("b"):
        text = text[:-1]
    binary = text.endswith("i")
    if binary:
        text = text[:-1]
    if text not in _PREFIXES or (binary and not text):
        return None
    power = _PREFIXES[text]
    return int(1024**power if binary else 1000**power)


def in_key_unit(amount: float, unit: Unit) -> float:
    """``amount`` (cores or MB, as ``read_amount`` returns it) in ``unit``, the key's own."""
    if unit == "gb":
        return amount / 1024
    if unit == "millicores":
        return amount * 1000
    return amount


def read_amount(value: Any, path: str, issues: Issues, unit: Unit) -> float | None:
    """An amount in the grammar's canonical unit (cores for CPU units, MB for ``mb`` and ``gb``): a number in the
    key's ``unit`` (a numeric string counts as one), or a string with a unit of its own; None with an issue at
    ``path`` naming the accepted forms when it is neither."""
    size = unit in SIZE_UNITS
    with_unit = _WITH_LETTERS.fullmatch(value.strip()) if isinstance(value, str) else None
    if with_unit is None:
        if isinstance(value, str) and _is_word(value):
            issues.add(path, f"must be a number, got the string {value!r} (a number of {_unit_words(unit)}, or "
                             f"{SIZE_FORMS if size else CPU_FORMS})")
            return None
        number = read_number(value, path, issues)
        return None if number is None else _canonical(number, unit)
    if with_unit["sign"] == "-":
        issues.add(path, f"must not be negative, got {value!r}")
        return None
    number = float(with_unit["number"])
    letters = with_unit["unit"]
    if size:
        per = bytes_per(letters)
        if per is None:
            issues.add(path, f"has an unknown unit {letters!r} in {value!r}: write a number of {_unit_words(unit)}, "
                             f"or {SIZE_FORMS}")
            return None
        amount = number * per / BYTES_PER_MB
    elif letters == "m":  # Kubernetes' millicores
        amount = number / 1000
    else:
        issues.add(path, f"must be a number of cores or {CPU_FORMS}, got the string {value!r}")
        return None
    if amount > MAX_QUANTITY:
        issues.add(path, f"is too large (at most {MAX_QUANTITY:g} {'MB' if size else 'cores'}), got {value!r}")
        return None
    return amount


def _is_word(value: str) -> bool:
    """Whether ``value`` holds letters but is not a number with a unit (nor a number ``float()`` reads, such as
    ``1e3`` or ``inf``, which ``read_number`` judges)."""
    text = value.strip()
    if not text.isascii() or not re.search(r"[A-Za-z]", text):
        return False
    try:
        float(text)
    except ValueError:
        return True
    return False


def _canonical(number: float, unit: Unit) -> float:
    if unit == "millicores" or (unit == "cpu" and number > CPU_MILLICORE_THRESHOLD):
        return number / 1000.0
    if unit == "gb":
        return number * 1024
    return number


def _unit_words(unit: Unit) -> str:
    return {"": "", "cores": "cores", "millicores": "millicores", "cpu": "cores", "mb": "MB", "gb": "GB"}[unit]
