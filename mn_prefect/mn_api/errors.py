"""What the API answers when a request cannot be done: a gRPC status the ``mn`` command turns into its own
error line and exit code (NOT_FOUND and INVALID_ARGUMENT exit 2, FAILED_PRECONDITION 1), with a plain message.

The ``mn`` command prints the message as rich markup (with ``--debug``): a ``[word]`` would vanish and a
``[/word]`` would break its error display, so messages keep brackets only around digits (``nodes[0]``)."""

from __future__ import annotations

import re

from mn_prefect.model.issues import InvalidInput

NOT_FOUND = "NOT_FOUND"
INVALID_ARGUMENT = "INVALID_ARGUMENT"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
UNAVAILABLE = "UNAVAILABLE"
UNIMPLEMENTED = "UNIMPLEMENTED"
UNAUTHENTICATED = "UNAUTHENTICATED"


class ApiError(Exception):
    """A refused request: ``code`` is a grpc.StatusCode name; nothing was changed."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = plain(message)


def not_found(message: str) -> ApiError:
    return ApiError(NOT_FOUND, message)


def invalid(field: str, message: str) -> ApiError:
    return ApiError(INVALID_ARGUMENT, f"{field}: {message}")


def refused(message: str) -> ApiError:
    return ApiError(FAILED_PRECONDITION, message)


def from_invalid_input(error: InvalidInput, prefix: str = "") -> ApiError:
    """Every issue, ``field: message`` joined by ``; `` (a manifest's paths as the bundle checks name them)."""
    text = "; ".join(f"{issue.path}: {issue.message}" for issue in error.issues)
    return ApiError(INVALID_ARGUMENT, f"{prefix}{text}")


def plain(text: str) -> str:
    """``text`` with brackets around anything but digits turned to parentheses (see the module's note)."""
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(0) if m.group(1).isdigit() else f"({m.group(1)})", text)
