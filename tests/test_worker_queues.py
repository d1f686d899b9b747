"""Queues with quotas through real workers: runs of a Prefect work queue are charged to it, wait with the quota's
reason while it is full, and start as its runs end; a queue without settings is not held back."""

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
def test_a_full_queue_holds_its_runs_back_and_says_why_while_others_run(lab):
    for name in ("train", "serve"):
        lab.http.post(f"/work_pools/{lab.pool}/queues", json={"name": name}).raise_for_status()
    set_train = subprocess.run([str(BIN / "mn-prefect"), "queue", "set", "train", "--quota", "gpu=1", "--store-url",
                                lab.store_url], capture_output=True, text=True, timeout=120,
                               env={**os.environ, **lab.server.env})
    assert set_train.returncode == 0, set_train.stderr
    body = {"filter": {"event": {"prefix": ["mn.queue.updated"]}, "any_resource": {"id": ["mn.queue.train"]},
                       "occurred": {"since": lab.since}}, "limit": 5}
    announced = servers.wait_for(lambda: lab.http.post("/events/filter", json=body).json().get("events"), timeout=60,
                                 what="the mn.queue.updated event")
    assert announced[0]["payload"]["spec"]["quota"] == {"gpu": 1.0}
    train = lab.deploy({"resources": {"gpu": 1}}, work_queue="train")
    serve = lab.deploy({"resources": {"gpu": 1}, "priority": 3}, work_queue="serve")
    barrier = lab.out / "queues.barrier"
    trained = [lab.run(train, hold_until=str(barrier)) for _ in range(3)]
    servers.wait_for(lambda: len(lab.started(trained)) == 1, timeout=300, what="train's one run within its quota")
    # The fleet has three GPUs: two are free, but train may hold one. serve has no settings: it is not held back.
    served = lab.run(serve, hold_until=str(barrier))
    servers.wait_for(lambda: lab.started([served]), timeout=300, what="serve's run on a free GPU")
    [first] = lab.started(trained)
    assert [(p.queue, p.priority, p.preemptible) for p in lab.booked(first)] == [("train", 0, False)]
    assert [(p.queue, p.priority) for p in lab.booked(served)] == [("serve", 3)]

    def explained():
        status = queue_status(lab, "train")
        waiting = {w["id"]: w["why"] for w in status["waiting"]}
        return status if all("quota: queue train" in waiting.get(r, "") for r in trained if r != first) else None

    status = servers.wait_for(explained, timeout=120, interval=1, what="queue status explaining both waiting runs")
    assert status["used"]["gpu"] == 1 and len(status["waiting"]) == 2
    assert "asks 1 GPU with 1 of its quota of 1 in use" in status["waiting"][0]["why"]
    assert len(lab.started(trained)) == 1  # still: the quota held while they were explained
    barrier.write_text("go")
    for run_id in [*trained, served]:
        assert lab.wait(run_id, timeout=300)["state"]["type"] == "COMPLETED"
    records = [lab.record(r) for r in trained]
    spans = sorted((r["start"], r["end"]) for r in records)
    assert all(a[1] <= b[0] + 0.5 for a, b in zip(spans, spans[1:], strict=False))  # one at a time
    servers.wait_for(lambda: not any(lab.store.queues().queues["train"].used.values()), what="the quota refunded")


@pytest.mark.lab
def test_freed_capacity_goes_by_priority_then_fair_share_not_by_arrival(lab):
    """Runs that each need both GPUs of gpu-1 wait behind one that holds them; when it ends they start one at a
    time: the high-priority run first, then the queue that has had nothing over the one that just ran, though
    that one's run arrived first."""
    for name in ("heavy", "light"):
        lab.http.post(f"/work_pools/{lab.pool}/queues", json={"name": name}).raise_for_status()
        lab.store.set_queue(QueueSpec(name=name))
    set_half_life = subprocess.run([str(BIN / "mn-prefect"), "queue", "fair-share", "--half-life", "600",
                                    "--store-url", lab.store_url, "--json"], capture_output=True, text=True,
                                   timeout=120)
    assert set_half_life.returncode == 0 and json.loads(set_half_life.stdout)["half_life_s"] == 600
    both = {"resources": {"gpu": 2}}
    heavy, light = lab.deploy(both, work_queue="heavy"), lab.deploy(both, work_queue="light")
    urgent = lab.deploy({**both, "priority": 10}, work_queue="heavy")
    barrier = lab.out / "order.barrier"
    first = lab.run(heavy, hold_until=str(barrier))
    servers.wait_for(lambda: lab.started([first]), timeout=300, what="heavy's first run on gpu-1")

    def heavy_has_a_past():
        standings = json.loads(subprocess.run(
            [str(BIN / "mn-prefect"), "queue", "fair-share", "--store-url", lab.store_url, "--json"],
            capture_output=True, text=True, timeout=120).stdout)["queues"]
        return {q["queue"]: q["past"] for q in standings}["heavy"] > 0

    servers.wait_for(heavy_has_a_past, timeout=120, interval=2, what="the announcer to count heavy's use")
    waiting = [lab.run(heavy, seconds=1), lab.run(light, seconds=1), lab.run(urgent, seconds=1)]
    servers.wait_for(lambda: all("mn " in (lab.flow_run(r)["state"]["message"] or "") for r in waiting), timeout=120,
                     what="the three runs told to wait")
    barrier.write_text("go")
    for run_id in [first, *waiting]:
        assert lab.wait(run_id, timeout=300)["state"]["type"] == "COMPLETED"
    starts = {r: lab.record(r)["start"] for r in waiting}
    assert sorted(waiting, key=starts.get) == [waiting[2], waiting[1], waiting[0]]  # urgent, light, heavy


@pytest.mark.lab
def test_a_higher_priority_run_preempts_a_preemptible_one_which_stops_and_comes_back(lab):
    """urgent (priority 10) needs both GPUs of gpu-1, held by a preemptible batch run; a batch run that is not
    preemptible holds gpu-2. The preemptible run is stopped through Prefect, urgent runs, and the evicted run is
    scheduled again and runs to the end; the other is never touched."""
    for name, priority in (("batch", 0), ("urgent", 10)):
        lab.http.post(f"/work_pools/{lab.pool}/queues", json={"name": name}).raise_for_status()
        lab.store.set_queue(QueueSpec(name=name, priority=priority))
    keep = lab.out / "keep.barrier"
    evictable = lab.run(lab.deploy({"resources": {"gpu": 2}, "preemptible": True}, work_queue="batch"),
                        hold_until=str(keep))
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
    assert preempted[0]["payload"]["by"] == urgent
    # it comes back: scheduled again, placed again once urgent is done, and started in a new process
    servers.wait_for(lambda: json.loads((lab.out / f"{evictable}.started").read_text())["pid"] != first_pid,
                     timeout=300, what="the preempted run to start again")
    keep.write_text("go")
    for run_id in (evictable, steady):
        assert lab.wait(run_id, timeout=300)["state"]["type"] == "COMPLETED"
    assert lab.record(evictable)["start"] > lab.record(urgent)["end"]


@pytest.mark.lab
def test_a_queue_borrows_what_its_cohort_leaves_and_the_lender_takes_it_back(lab):
    """Two teams of one cohort, each entitled to one GPU: team a borrows b's while b is idle (two of its three runs
    start, though three GPUs are free), and when b's run comes, one of a's preemptible runs is evicted for it."""
    for name in ("team-a", "team-b"):
        lab.http.post(f"/work_pools/{lab.pool}/queues", json={"name": name}).raise_for_status()
        lab.store.set_queue(QueueSpec(name=name, quota={"gpu": 1}, cohort="lab"))
    barrier = lab.out / "reclaim.barrier"
    team_a = lab.deploy({"resources": {"gpu": 1}, "preemptible": True}, work_queue="team-a")
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
