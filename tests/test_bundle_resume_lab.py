"""A preemptible bundle run through a real Prefect server and a real ``mn`` worker: preempted by a priority-10 run
while its second step waits, that step hears of it (MN_PREEMPT_NOTICE_FILE) and says it checkpointed; the same flow
run is scheduled again and resumes from its step ledger: its first step is not run again, the second runs again
and finds its checkpoint in MN_CHECKPOINT_DIR. The ledger's rules in one process: tests/test_bundle_resume.py."""

from __future__ import annotations

import json
import uuid

import pytest
import servers
from bundle_builders import step
from lab import Lab, nodes
from test_bundle_resume import resumable_bundle

from mn_prefect.bundles.bundle import load_bundle
from mn_prefect.bundles.deploy import deploy_bundle
from mn_prefect.bundles.runner import new_ids
from mn_prefect.model.queues import QueueSpec

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    home = tmp_path_factory.mktemp("bundle-resume-lab")
    lab = Lab(home, fleet=[nodes(home / "scratch")[0]])  # gpu-1 alone: two GPUs
    yield lab
    lab.stop()


def test_a_preempted_bundle_run_resumes_at_its_interrupted_step_with_its_checkpoint(lab, tmp_path):
    for name, priority in (("bundle-batch", 0), ("bundle-urgent", 10)):
        lab.http.post(f"/work_pools/{lab.pool}/queues", json={"name": name}).raise_for_status()
        lab.store.set_queue(QueueSpec(name=name, priority=priority))
    barrier, runs = tmp_path / "train.barrier", tmp_path / "runs"
    folder = resumable_bundle(tmp_path, "resume_lab", [step("prepare", timeout=600),
                                                       step("train", mode=f"checkpoint:{barrier}", timeout=600)],
                              [("prepare", "train")], sink_from="train")
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: lab.server.api_url}), get_client(sync_client=True) as client:
        deployment, _ = deploy_bundle(client, load_bundle(folder), lab.pool, runs_root=str(runs))
    # The run's own booking is what a preemption frees (its steps' bookings are never preemptible): here both GPUs.
    created = lab.http.post(f"/deployments/{deployment}/create_flow_run", json={
        "work_queue_name": "bundle-batch", "idempotency_key": uuid.uuid4().hex,
        "job_variables": {"resources": {"gpu": 2}, "preemptible": True, "preemption_grace_seconds": 30}})
    created.raise_for_status()
    victim = created.json()["id"]
    run_dir = runs / victim
    launches = run_dir / "launches.jsonl"

    def lines():
        return [json.loads(line) for line in launches.read_text().splitlines()] if launches.exists() else []

    progress = run_dir / "checkpoints" / "train" / "progress"
    servers.wait_for(lambda: progress.exists(), timeout=300, what="the train step's first checkpoint")
    urgent = lab.run(lab.deploy({"resources": {"gpu": 2}}, work_queue="bundle-urgent"), seconds=1)
    assert lab.wait(urgent, timeout=300)["state"]["type"] == "COMPLETED"
    [preempted] = servers.wait_for(lambda: lab.events(victim, "mn.run.preempted"), timeout=60,
                                   what="the mn.run.preempted event")
    assert preempted["payload"]["outcome"] == "checkpointed" and preempted["payload"]["by"] == urgent
    # Cancelled, scheduled again, placed again once urgent is done: its train step starts again
    servers.wait_for(lambda: [e["step"] for e in lines() if "notice" not in e].count("train") == 2, timeout=300,
                     what="the train step run again")
    barrier.write_text("go")
    assert lab.wait(victim, states={"COMPLETED"}, timeout=300)["state"]["type"] == "COMPLETED"
    seen = lines()
    assert [e["step"] for e in seen if "notice" not in e] == ["prepare", "train", "train"], "prepare is not run again"
    [notice] = [e for e in seen if "notice" in e]
    assert notice["checkpointed"] is True and 0 < notice["notice"] <= 30
    first, again = [e for e in seen if e["step"] == "train" and "notice" not in e]
    assert first["found"] is None and again["found"] == "launch 1"
    assert not progress.parent.parent.exists(), "the run is over for good: its checkpoints are removed"
    assert again["body"] == first["body"] and again["checkpoint_dir"] == first["checkpoint_dir"]
    assert first["pid"] != again["pid"]
    lab.wait_for_log(victim, "step prepare completed in an earlier attempt of this run")
    job_id, _ = new_ids(None, victim, "resume_lab")
    servers.wait_for(lambda: not [p for p in lab.store.active_placements() if p.job_id in (victim, job_id)
                                  or p.job_id.startswith(f"{job_id}#")], timeout=60, what="every booking released")
    assert json.loads((run_dir / "mn_job.json").read_text())["status"] == "completed"
