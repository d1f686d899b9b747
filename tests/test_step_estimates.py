"""A bundle step's booking says when it is expected to end (``ends_by``), as a flow run's does, so that holds reckon
when a busy node frees: what its past attempts took (learned, in the store), never past its timeout (declared, or
MirrorNeuron's 300 s: the step is stopped there), which is the estimate while nothing is learned. Steps run as real
processes from a real SQLite store."""

from __future__ import annotations

import json
import logging
import time

from bundle_builders import _Done, step, write_bundle

from mn_prefect.bundles.bundle import load_bundle
from mn_prefect.bundles.process import run_launch
from mn_prefect.bundles.runner import BundleRun, run_environment
from mn_prefect.drivers.launchers import this_node
from mn_prefect.model.hints import env_hints
from mn_prefect.placement import estimates
from mn_prefect.store import open_store


def run_once(folder, tmp_path, store, run_id: str) -> dict[str, float | None]:
    """Run the bundle; each step's booking's seconds from its start to its ends_by (None: no ends_by)."""
    bundle = load_bundle(folder)
    root = tmp_path / "runs"
    env = run_environment(bundle, job_id=f"job-{run_id}", run_id=run_id, runs_root=root)
    seen: dict[str, float | None] = {}

    def starter(launch, placement, booking):
        [booked] = store.active_placements(job_id=booking)
        seen[launch.label] = None if booked.ends_by is None else round(booked.ends_by - time.time())
        return _Done(run_launch(launch, bundle.payloads, job_id=f"job-{run_id}", run_env=env,
                                hints=env_hints(placement), node=placement.node, placement=placement))

    node = store.register_node(this_node(logging.getLogger(__name__))[0]).name
    outcome = BundleRun(bundle=bundle, store=store, starter=starter, job_id=f"job-{run_id}", run_id=run_id,
                        runs_root=root, preferred_node=node).run()
    assert outcome.state == "COMPLETED", outcome
    return seen


def test_a_steps_booking_ends_by_its_timeout_else_by_what_its_past_attempts_took(tmp_path):
    folder = write_bundle(tmp_path, "timed", [step("first", timeout=600), step("second")], [("first", "second")],
                          sink_from="second")
    manifest = folder / "manifest.json"
    doc = json.loads(manifest.read_text())
    del next(s for s in doc["workflow"]["steps"] if s["id"] == "second")["control"]["timeout_seconds"]
    manifest.write_text(json.dumps(doc))  # the second step: MirrorNeuron's default timeout, 300 s
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        first_run = run_once(folder, tmp_path, store, "run-1")
        assert 598 <= first_run["first"] <= 600 and 298 <= first_run["second"] <= 300  # nothing learned: timeouts
        learned = estimates.estimate_for(store, estimates.step_key(load_bundle(folder).spec.blueprint_id, "second"))
        assert learned.seconds is not None and learned.seconds < 60 and learned.source == "learned"
        again = run_once(folder, tmp_path, store, "run-2")  # each step ends in seconds: learned, well within
        assert again["second"] is not None and abs(again["second"] - learned.seconds) <= 2
        assert again["first"] is not None and again["first"] < 60
    finally:
        store.close()
