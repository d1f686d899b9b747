"""How port labels and volume names become environment variable suffixes (docs/resources.md, "Environment hints")."""

from __future__ import annotations

import re

_OUTSIDE = re.compile(r"[^A-Z0-9]+")


def env_suffix(name: str) -> str:
    """``my-api.v2`` -> ``MY_API_V2``: upper case, each run of other characters one ``_``, trimmed."""
    return _OUTSIDE.sub("_", name.upper()).strip("_")


# Environment names a step or agent may set or pass on (MirrorNeuron's HostLocal runner): POSIX-ish, no '=' (it
# would split the name) and no NUL. One rule for ``config.environment`` keys and ``config.pass_env`` entries,
# checked where the blueprint is parsed, so ``blueprint validate`` and ``blueprint run`` refuse the same names.
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def env_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be an environment variable name, or None when it can."""
    if not isinstance(name, str) or not ENV_NAME.match(name):
        return f"{name!r} is not a valid environment variable name (letters, digits, _ . -; not starting " \
               "with a digit; no '=')"
    return None
