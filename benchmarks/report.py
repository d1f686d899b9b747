"""Writing a benchmark's table into BENCHMARKS.md between its own markers, leaving the rest alone."""

from __future__ import annotations

import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_section(path: str | Path, marker: str, body: str) -> None:
    """Replace the text between ``<!-- marker:start -->`` and ``<!-- marker:end -->`` (append if absent)."""
    path = Path(path)
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    block = f"{start}\n{body}\n{end}"
    text = path.read_text() if path.exists() else ""
    if start in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text += ("\n" if text else "") + block + "\n"
    path.write_text(text)


def print_rows(title: str, rows: list[dict]) -> None:
    """The rows as a table for people (``--json`` prints them for programs)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key, justify="right")
    for row in rows:
        table.add_row(*(f"{v:,}" if isinstance(v, int) else str(v) for v in row.values()))
    Console().print(table)


def markdown_table(header: list[str], rows: list[list[object]]) -> list[str]:
    """A Markdown table's lines: the first column left-aligned, the figures right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def report(args, title: str, rows: list[dict], summary_name: str, summary: dict) -> None:
    """The rows for people (a table and the summary line) or, with ``--json``, for programs."""
    import json

    if args.json:
        print(json.dumps({"rows": rows, summary_name: summary}, indent=2))
    else:
        print_rows(title, rows)
        print(f"{summary_name}: {summary}")


def provenance(script: str, *details: str) -> str:
    """How a table was made: ``Command: `python benchmarks/<script> <args>` (machine, Python, details, date)``."""
    command = f"python benchmarks/{script} " + " ".join(sys.argv[1:])
    facts = [platform.machine(), f"Python {platform.python_version()}", *details, time.strftime("%Y-%m-%d")]
    return f"Command: `{command}` ({', '.join(facts)})"


def load_average() -> str:
    """The machine's load averages as ``uptime`` prints them (1, 5, 15 min): what else ran beside a measurement."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.split("load average:")[-1].strip()


def require_positive(parser, args, *names: str) -> None:
    """Exit with the parser's usage error when one of the options ``names`` (attribute names) is not above 0."""
    for name in names:
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be more than 0, got {getattr(args, name):g}")


@contextmanager
def worktree(root: Path, revision: str) -> Iterator[Path]:
    """``revision`` of the repository at ``root`` checked out in a temporary worktree, removed again at the end."""
    tree = Path(tempfile.mkdtemp(prefix="mn-before-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), revision], cwd=root, check=True,
                   capture_output=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=root, capture_output=True)
