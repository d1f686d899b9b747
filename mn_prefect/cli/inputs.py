"""Command-line inputs: files become typed models here, once, with every problem as a path-named issue."""

from __future__ import annotations

from pathlib import Path

from mn_prefect.model.blueprint import Blueprint, load_json_file, parse_blueprint
from mn_prefect.model.issues import Issue, Issues
from mn_prefect.model.node import NodeRecord, parse_nodes
from mn_prefect.model.placement import Placement, parse_active
from mn_prefect.scheduler.limits import Limits, parse_limits


def read_blueprint(path: Path) -> tuple[Blueprint | None, list[Issue]]:
    raw, problems = load_json_file(path)
    if problems:
        return None, problems
    return parse_blueprint(raw)


def read_nodes(path: Path, issues: Issues) -> list[NodeRecord]:
    raw, problems = load_json_file(path)
    if problems:
        issues.extend(problems)
        return []
    return parse_nodes(raw, path.name, issues)


def read_active(path: Path | None, issues: Issues) -> list[Placement]:
    if path is None:
        return []
    raw, problems = load_json_file(path)
    if problems:
        issues.extend(problems)
        return []
    return parse_active(raw, path.name, issues)


def read_limits(text: str | None, issues: Issues) -> Limits | None:
    if not text:
        return None
    return parse_limits(text, "--limits", issues)
