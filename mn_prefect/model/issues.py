"""Validation issues: errors as values, each with the JSON path it is about."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Issue:
    """One problem with an input, located by a JSON path such as ``nodes[2].resources.ports[1].port``."""

    path: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def child(path: str, key: str | int) -> str:
    """The path of ``key`` (an object key or a list index) under ``path``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


class InvalidInput(ValueError):
    """Raised at an edge (CLI, job variables, files) when input is invalid; carries every issue found."""

    def __init__(self, issues: list[Issue]):
        self.issues = list(issues)
        super().__init__("; ".join(str(i) for i in self.issues) or "invalid input")


class Issues:
    """A collector that validation code appends to, so that all errors are reported at once."""

    def __init__(self) -> None:
        self.items: list[Issue] = []

    def add(self, path: str, message: str) -> None:
        self.items.append(Issue(path, message))

    def extend(self, other: Issues | list[Issue]) -> None:
        self.items.extend(other.items if isinstance(other, Issues) else other)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def raise_if_any(self) -> None:
        if self.items:
            raise InvalidInput(self.items)
