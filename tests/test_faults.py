"""A short fault campaign (benchmarks/faults.py) on SQLite: every kind of fault the backend has is injected at least
once, and no invariant is ever violated (store audit sound, every booking owned or released in time, reservations
keep their capacity, no run stuck waiting, nothing lost at the end). tests/test_faults_redis.py runs the same on
Redis behind Sentinel; the two are separate modules so that they run side by side.

The long campaign and its figures are in BENCHMARKS.md ("Fault campaign")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import faults  # noqa: E402

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab


def short_campaign(backend: str) -> None:
    """Each kind once (the campaign injects every kind first, in a random order), then one more at random."""
    kinds = faults.BACKEND_KINDS[backend]
    [campaign] = faults.main(["--backend", backend, "--faults", str(len(kinds) + 1), "--workers", "3", "--seed", "7",
                              "--every", "2.5", "--bound", "45", "--drain", "45", "--json"])
    injected: dict[str, int] = {}
    for result in campaign["faults"]:
        if "skipped" not in result["details"]:
            injected[result["kind"]] = injected.get(result["kind"], 0) + 1
    assert set(injected) == set(kinds), injected
    violations = [(r["kind"], r["details"], v) for r in campaign["faults"] for v in r["violations"]]
    assert violations == []
    assert campaign["final"]["lost"] == [] and campaign["final"]["final_violations"] == []


def test_a_short_fault_campaign_on_sqlite_finds_no_invariant_violated():
    short_campaign("sqlite")
