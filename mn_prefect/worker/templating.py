"""Prefect's templating of the pool's job template, its failures named: a job variable whose dotted name runs
through another's value (``env.A`` beside ``env.A.B``), or a value with a ``{{ prefect.blocks... }}`` or
``{{ prefect.variables... }}`` placeholder that is malformed or names nothing, makes Prefect raise TypeError,
ValueError or ObjectNotFound; the worker would fail the run's placement again at every poll. Here they become a
ValidationError naming the job variables concerned, which the worker turns into the run's failure."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError


def _placeholders(values: dict[str, Any]) -> list[str]:
    """The job variables whose values hold a Prefect block or variable placeholder."""
    found = []
    for key, value in values.items():
        try:
            text = json.dumps(value, default=str)
        except (TypeError, ValueError, RecursionError):
            text = ""
        if "prefect.blocks" in text or "prefect.variables" in text:
            found.append(str(key))
    return found


def templating_error(title: str, values: dict[str, Any], error: Exception) -> ValidationError:
    """``error``, raised by Prefect templating ``values`` into the pool's template, as a ValidationError whose
    entries name the job variables that caused it."""
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    dotted = [str(k) for k in values if "." in str(k)]
    if isinstance(error, TypeError) and dotted:
        where, what = dotted, f"dotted job variable names that run through one another's values ({detail})"
    else:
        where = _placeholders(values) or ["(template)"]
        what = f"a Prefect placeholder that cannot be resolved ({type(error).__name__}: {detail})"
    return ValidationError.from_exception_data(title, [
        {"type": PydanticCustomError("templating", "{detail}", {"detail": what}), "loc": (name,), "input": None}
        for name in where])
