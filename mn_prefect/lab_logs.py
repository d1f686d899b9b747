"""The errors a lab's Prefect server wrote to its log, counted and named, so that ``up`` and ``down`` can say them in
one line ("the lab's Prefect server logged 17 errors (17 'database is locked'): see .../server.log") instead of
leaving them in a file nobody opens.

An error is a line the server logged at level ERROR (``12:00:00.000 | ERROR   | logger - message``); it is named
by what its traceback (the lines up to the next logged line) says: a known cause where one appears (``database is
locked``...), else the traceback's last exception line, else the logged message."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

KNOWN = ("database is locked", "Connection reset by peer", "Connection refused", "too many clients",
         "could not serialize access", "deadlock detected", "timed out")
_LOGGED = re.compile(r"^\d\d:\d\d:\d\d\.\d+ \| (?P<level>[A-Z]+)\s*\| (?P<logger>[^ ]+) - (?P<message>.*)$")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?(?P<name>[A-Za-z_]\w*(?:Error|Exception|Exit|Timeout)\w*)(?:: ?(?P<text>.*))?$")
_IDS = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
MAX_NAME = 80
MAX_READ = 64 * 1024 * 1024  # a log larger than this is read from its last 64 MB


@dataclass(frozen=True)
class ServerErrors:
    path: Path
    by_name: Counter[str]

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def sentence(self, top: int = 3) -> str:
        """One line for a person; empty when the server logged no error."""
        if not self.total:
            return ""
        named = ", ".join(f"{count} '{name}'" for name, count in self.by_name.most_common(top))
        more = len(self.by_name) - top
        return (f"the lab's Prefect server logged {self.total} error(s) ({named}"
                f"{f', and {more} other kind(s)' if more > 0 else ''}): see {self.path}")


def server_errors(path: Path) -> ServerErrors:
    """The ERROR lines of the server's log at ``path``, by name (none when it does not exist)."""
    try:
        with path.open("rb") as log:
            size = log.seek(0, 2)
            log.seek(max(0, size - MAX_READ))
            text = log.read().decode("utf-8", "replace")
    except OSError:
        return ServerErrors(path, Counter())
    counts: Counter[str] = Counter()
    block: list[str] | None = None
    message = ""
    for line in text.splitlines():
        logged = _LOGGED.match(line)
        if logged:
            if block is not None:
                counts[_name(message, block)] += 1
            block, message = ([], logged["message"]) if logged["level"] in ("ERROR", "CRITICAL") else (None, "")
        elif block is not None:
            block.append(line)
    if block is not None:
        counts[_name(message, block)] += 1
    return ServerErrors(path, counts)


def _name(message: str, block: list[str]) -> str:
    body = "\n".join(block)
    for cause in KNOWN:
        if cause.lower() in body.lower() or cause.lower() in message.lower():
            return cause
    exceptions = [m for line in block if (m := _EXCEPTION.match(line.strip()))]
    last = exceptions[-1] if exceptions else None
    name = (f"{last['name']}: {last['text']}" if last['text'] else last['name']) if last else message
    name = _IDS.sub("<id>", name).strip()
    return name if len(name) <= MAX_NAME else name[:MAX_NAME - 3] + "..."
