"""Queues with quotas through real workers: a queue borrows what its cohort leaves and the lender takes it back by
preemption, a higher-priority run preempts a preemptible one that comes back, and the pool's deny-list and tag
priorities. The quota's wait and the order freed capacity goes in are rules, tested in one process
(tests/test_worker_rules.py); the queue commands and their event in tests/test_queue_cli.py."""

import json
import os
import subprocess

import pytest
import servers
from lab import Lab

from mn_prefect.local_lab import BIN
from mn_prefect.model.queues import QueueSpec


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("lab"))
    yield lab
    lab.stop()


def queue_status(lab, name):
    result = subprocess.run([str(BIN / "mn-prefect"), "queue", "status", name, "--pool", lab.pool, "--json",
                             "--store-url", lab.store_url], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **lab.server.env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.lab
def test_a_higher_priority_run_preempts_a_preemptible_one_which_stops_and_comes_back(lab):
    """urgent (priority 10) needs both GPUs of gpu-1, held by a preemptible batch run; a batch run that is not
    preemptible holds gpu-2. The preemptible run, which ignores its notice, is stopped through Prefect at the end
    of its grace, urgent runs, and the evicted run is scheduled again and runs to the end; the other is never
    touched."""
    for name, priority in (("batch", 0), ("urgent", 10)):
        lab.http.post(f"/work_pools/{lab.pool}/queues", json={"name": name}).raise_for_status()
        lab.store.set_queue(QueueSpec(name=name, priority=priority))
    keep = lab.out / "keep.barrier"
    evictable = lab.run(lab.deploy({"resources": {"gpu": 2}, "preemptible": True, "preemption_grace_seconds": 2},
                                   work_queue="batch"), hold_until=str(keep))
    steady = lab.run(lab.deploy({"resources": {"gpu": 1}, "preferred_node": "gpu-2"}, work_queue="batch"),
                     hold_until=str(keep))
    servers.wait_for(lambda: len(lab.started([evictable, steady])) == 2, timeout=300, what="both batch runs started")
    first_pid = json.loads((lab.out / f"{evictable}.started").read_text())["pid"]
    urgent = lab.run(lab.deploy({"resources": {"gpu": 2}}, work_queue="urgent"), seconds=1)
    assert lab.wait(urgent, timeout=300)["state"]["type"] == "COMPLETED"
    assert lab.record(urgent)["env"]["MN_NODE"] == "gpu-1"
    assert lab.flow_run(steady)["state"]["type"] == "RUNNING"  # not preemptible: never touched
    preempted = servers.wait_for(lambda: lab.events(evictable, "mn.run.preempted"), timeout=60,
                                 what="the mn.run.preempted event")
    assert preempted[0]["payload"]["by"] == urgent and preempted[0]["payload"]["outcome"] == "killed"
    # it comes back: scheduled again, placed again once urgent is done, and started in a new process
    servers.wait_for(lambda: json.loads((lab.out / f"{evictable}.started").read_text())["pid"] != first_pid,
                     timeout=300, what="the preempted run to start again")
    keep.write_text("go")
    for run_id in (evictable, steady):
        assert lab.wait(run_id, timeout=300)["state"]["type"] == "COMPLETED"
    assert lab.record(evictable)["start"] > lab.record(urgent)["end"]


@pytest.mark.lab
def test_a_preempted_flow_checkpoints_in_its_grace_and_its_next_attempt_runs_only_the_unfinished_task(lab):
    """A preemptible flow of three tasks is preempted during its third by a priority-10 run: it sees the notice,
    says it checkpointed and is stopped well inside its 120 s grace; the same flow run is scheduled again and its
    next attempt runs only the third task (the first two come from Prefect's cache)."""
    for name, priority in (("resume-batch", 0), ("resume-urgent", 10)):
        lab.http.post(f"/work_pools/{lab.pool}/queues", json={"name": name}).raise_for_status()
        lab.store.set_queue(QueueSpec(name=name, priority=priority))
    barrier = lab.out / "resume.barrier"
    deployment = lab.deploy({"resources": {"gpu": 2}, "preemptible": True, "preemption_grace_seconds": 120},
                            entrypoint="resumable.py:resumable", work_queue="resume-batch")
    victim = lab.run(deployment, barrier=str(barrier))
    steps = lab.out / f"{victim}.steps"
    servers.wait_for(lambda: steps.exists() and "step 3" in steps.read_text(), timeout=300,
                     what="the flow's third task started")
    urgent = lab.run(lab.deploy({"resources": {"gpu": 2}}, work_queue="resume-urgent"), seconds=1)
    assert lab.wait(urgent, timeout=300)["state"]["type"] == "COMPLETED"
    [preempted] = servers.wait_for(lambda: lab.events(victim, "mn.run.preempted"), timeout=60,
                                   what="the mn.run.preempted event")
    assert preempted["payload"]["outcome"] == "checkpointed"
    barrier.write_text("go")  # Cancelled, scheduled again, placed again once urgent is done: it completes
    assert lab.wait(victim, states={"COMPLETED"}, timeout=300)["state"]["type"] == "COMPLETED"
    first, second, third, notice, *again = steps.read_text().splitlines()
    assert [first, second, third] == ["step 1", "step 2", "step 3"]
    assert notice.startswith("notice ") and float(notice.split()[1]) > 60  # told, with its deadline ahead
    assert again == ["step 3"]  # the next attempt: the third task only

    def cached_steps():  # task runs reach the server in the background of the flow run: wait for them
        runs = lab.http.post("/task_runs/filter", json={"task_runs": {"flow_run_id": {"any_": [victim]}}}).json()
        cached = [r for r in runs if r["state"]["name"] == "Cached"]
        return cached if len(cached) >= 2 else None
    cached = servers.wait_for(cached_steps, timeout=60, what="the two cached task runs of the second attempt")
    assert len(cached) == 2 and all(r["name"].startswith("step-") for r in cached)


@pytest.mark.lab
def test_a_queue_borrows_what_its_cohort_leaves_and_the_lender_takes_it_back(lab):
    """Two teams of one cohort, each entitled to one GPU: team a borrows b's while b is idle (two of its three runs
    start, though three GPUs are free), and when b's run comes, one of a's preemptible runs is evicted for it."""
    for name in ("team-a", "team-b"):
        lab.http.post(f"/work_pools/{lab.pool}/queues", json={"name": name}).raise_for_status()
        lab.store.set_queue(QueueSpec(name=name, quota={"gpu": 1}, cohort="lab"))
    barrier = lab.out / "reclaim.barrier"
    team_a = lab.deploy({"resources": {"gpu": 1}, "preemptible": True, "preemption_grace_seconds": 2},
                        work_queue="team-a")
    runs = [lab.run(team_a, hold_until=str(barrier)) for _ in range(3)]
    servers.wait_for(lambda: len(lab.started(runs)) == 2, timeout=300, what="team a's own GPU and the one it borrows")
    assert lab.store.queues().queues["team-a"].used["gpu"] == 2
    def explained():  # a worker has said why the third run waits (until then: "not looked at by a worker yet")
        status = queue_status(lab, "team-a")
        return status if status["waiting"] and "cohort lab" in status["waiting"][0]["why"] else None

    status = servers.wait_for(explained, timeout=120, interval=1, what="team a's third run explained")
    assert "cohort lab has none to lend" in status["waiting"][0]["why"] and status["borrowed"] == {"gpu": 1}
    before = set(lab.started(runs))
    b_run = lab.run(lab.deploy({"resources": {"gpu": 1}}, work_queue="team-b"), seconds=1)
    assert lab.wait(b_run, timeout=300)["state"]["type"] == "COMPLETED"
    evicted = [r for r in before if lab.events(r, "mn.run.preempted")]
    assert len(evicted) == 1  # the fewest: one GPU was owed
    barrier.write_text("go")
    for run_id in runs:  # the evicted one is Cancelled, then scheduled again, and completes in the end
        assert lab.wait(run_id, states={"COMPLETED"}, timeout=300)["state"]["type"] == "COMPLETED"
    servers.wait_for(lambda: not any(lab.store.queues().cohorts["lab"].used.values()), what="the cohort refunded")


@pytest.mark.lab
def test_the_pools_deny_list_refuses_runs_and_its_tags_give_priorities(lab):
    policy = subprocess.run([str(BIN / "mn-prefect"), "queue", "policy", "--pool", lab.pool, "--deny",
                             "tag:experimental*=no experiments on this pool", "--tag-priority", "urgent=40",
                             "--store-url", lab.store_url, "--json"], capture_output=True, text=True, timeout=120)
    assert policy.returncode == 0, policy.stderr
    deployment = lab.deploy({"resources": {"cpu": 1}})
    refused = lab.http.post(f"/deployments/{deployment}/create_flow_run", json={
        "parameters": {"out_dir": str(lab.out)}, "tags": ["experimental-3"]}).json()["id"]
    hold = lab.out / "policy.barrier"
    urgent = lab.http.post(f"/deployments/{deployment}/create_flow_run", json={
        "parameters": {"out_dir": str(lab.out), "hold_until": str(hold)}, "tags": ["urgent"]}).json()["id"]
    servers.wait_for(lambda: lab.started([urgent]), timeout=300, what="the urgent run")
    assert [(p.queue, p.priority) for p in lab.booked(urgent)] == [("default", 40)]  # the pool's default queue
    hold.write_text("go")
    failed = lab.wait(refused, timeout=300)
    assert failed["state"]["type"] == "FAILED" and not lab.started([refused]) and not lab.booked(refused)
    assert "no experiments on this pool (tag 'experimental-3' matches tag:experimental*)" in failed["state"]["message"]
    assert lab.wait(urgent, timeout=300)["state"]["type"] == "COMPLETED"
    assert json.loads(lab.record(urgent)["env"]["MN_ALLOCATION_JSON"])["priority"] == 40
    subprocess.run([str(BIN / "mn-prefect"), "queue", "policy", "--pool", lab.pool, "--clear", "--store-url",
                    lab.store_url], check=True, capture_output=True, timeout=120)
