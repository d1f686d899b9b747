"""A short fault campaign (benchmarks/faults.py) on SQLite and on Redis behind Sentinel: every kind of fault each
backend has is injected at least once, and no invariant is ever violated (store audit sound, every booking owned
or released in time, reservations keep their capacity, no run stuck waiting, nothing lost at the end).

The long campaign and its figures are in BENCHMARKS.md ("Fault campaign")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import faults  # noqa: E402

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_a_short_fault_campaign_finds_no_invariant_violated(backend):
    [campaign] = faults.main(["--backend", backend, "--faults", "20", "--workers", "3", "--seed", "7",
                              "--every", "2.5", "--bound", "45", "--drain", "45", "--json"])
    injected = {}
    for result in campaign["faults"]:
        if "skipped" not in result["details"]:
            injected[result["kind"]] = injected.get(result["kind"], 0) + 1
    assert set(injected) == set(faults.BACKEND_KINDS[backend]), injected
    violations = [(r["kind"], r["details"], v) for r in campaign["faults"] for v in r["violations"]]
    assert violations == []
    assert campaign["final"]["lost"] == [] and campaign["final"]["final_violations"] == []
