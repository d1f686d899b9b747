"""A bundle run resumes from its step ledger: when the same flow run runs again (after a preemption: Cancelled,
then Scheduled again), the launches its earlier attempts completed are not run again, their recorded results are
replayed into the engine, and the interrupted step runs again with its checkpoint folder (MN_CHECKPOINT_DIR) as
it left it. In one process, with real worker processes and a real SQLite store; through a real Prefect server and
workers, preempted by a priority-10 run, in tests/test_bundle_resume_lab.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from bundle_builders import step, write_bundle

from mn_prefect.bundles.bundle import load_bundle
from mn_prefect.bundles.process import (
    CHECKPOINT_DIR_VAR,
    _preemption_folders,
    checkpoint_dir,
    environment,
    run_launch,
)
from mn_prefect.bundles.runner import JOURNAL_FILE, BundleRun, run_environment
from mn_prefect.drivers.launchers import this_node
from mn_prefect.model.hints import env_hints
from mn_prefect.preemption import CHECKPOINT_FILE_VAR, NOTICE_FILE_VAR
from mn_prefect.store import open_store
from mn_prefect.workflow.engine import Engine

RESUME_WORKER = Path(__file__).parent / "bundle_resume" / "worker.py"
JOB, RUN = "job-1", "run-1"


def resumable_bundle(root: Path, name: str, steps: list[dict], edges, *, sink_from: str, strategy: str = "serial",
                     image: str | None = None) -> Path:
    """write_bundle's bundle, each step run by tests/bundle_resume/worker.py with this interpreter."""
    runner = "MirrorNeuron.Runner.DockerWorker" if image else "MirrorNeuron.Runner.HostLocal"
    folder = write_bundle(root, name, steps, edges, sink_from=sink_from, strategy=strategy, runner=runner, image=image)
    shutil.copy(RESUME_WORKER, folder / "payloads" / "worker" / "worker.py")
    manifest = json.loads((folder / "manifest.json").read_text())
    for node in manifest["agents"]["nodes"]:
        if "command" in node.get("config", {}):
            node["config"]["command"] = [sys.executable, "worker.py"]
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return folder


class _Box:
    """One launch running in a thread: its process group is killed on cancel, as the flow's starter does."""

    def __init__(self) -> None:
        self.value = None
        self.pid: int | None = None
        self.thread: threading.Thread | None = None

    def result(self):
        return self.value

    def cancel(self) -> None:
        if self.pid is not None and self.value is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Preempted(BaseException):
    """Stands in for the TerminationSignal a cancelled flow run's process gets."""


class Runs:
    """A bundle run by BundleRun as the mn-bundle-run flow runs it: real processes, real store, one run folder."""

    def __init__(self, folder: Path, tmp_path: Path):
        self.bundle = load_bundle(folder)
        self.store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
        self.node = self.store.register_node(this_node(logging.getLogger(__name__))[0]).name
        self.root = tmp_path / "runs"
        self.env = run_environment(self.bundle, job_id=JOB, run_id=RUN, runs_root=self.root)
        self.boxes: list[_Box] = []

    def starter(self, launch, placement, booking):
        box = _Box()

        def go():
            box.value = run_launch(launch, self.bundle.upload_roots, job_id=JOB, run_env=self.env,
                                   hints=env_hints(placement), node=placement.node, placement=placement,
                                   on_start=lambda pid: setattr(box, "pid", pid))

        box.thread = threading.Thread(target=go, daemon=True)
        box.thread.start()
        self.boxes.append(box)
        return box

    def run(self, flow_run_id: str | None, *, stop_when=None) -> BundleRun:
        """One attempt of flow run ``flow_run_id``; with ``stop_when``, interrupted (Preempted) once it holds."""
        stopped = []

        def clock() -> float:
            if stop_when is not None and not stopped and stop_when():
                stopped.append(True)
                raise Preempted()
            return time.time()

        run = BundleRun(bundle=self.bundle, store=self.store, starter=self.starter, job_id=JOB, run_id=RUN,
                        runs_root=self.root, preferred_node=self.node, flow_run_id=flow_run_id, clock=clock)
        if stop_when is None:
            run.run()
            return run
        with pytest.raises(Preempted):
            run.run()
        for box in self.boxes:  # the stopped step's process is killed, its thread ends
            if box.thread is not None:
                box.thread.join(10)
        assert self.store.active_placements() == [], "no booking outlives an interrupted attempt"
        return run

    @property
    def run_dir(self) -> Path:
        return self.root / RUN

    def launches(self) -> list[dict]:
        path = self.run_dir / "launches.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def ran(self) -> list[str]:
        return [entry["step"] for entry in self.launches() if "notice" not in entry]

    def journal(self) -> list[dict]:
        path = self.run_dir / JOURNAL_FILE
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def checkpoint(self, step_id: str) -> Path:
        return self.run_dir / "checkpoints" / step_id / "progress"


def states(run: BundleRun) -> dict[str, str]:
    return {sid: s["state"] for sid, s in run.outcome().steps.items()}


def test_the_same_flow_run_resumes_at_the_interrupted_step_with_its_checkpoint(tmp_path):
    """a completes, b writes its checkpoint and is interrupted with the run; the flow run's next attempt takes a
    from the ledger (not run again: b gets the same message), runs b again, which finds its checkpoint, and c."""
    barrier = tmp_path / "barrier"
    folder = resumable_bundle(tmp_path, "linear", [step("a"), step("b", mode=f"checkpoint:{barrier}"), step("c")],
                              [("a", "b"), ("b", "c")], sink_from="c")
    lab = Runs(folder, tmp_path)
    first = lab.run("flow-run-1", stop_when=lambda: lab.checkpoint("b").exists())
    assert first.outcome().state == "CANCELLED" and lab.ran() == ["a", "b"]
    assert [e["label"] for e in lab.journal()] == ["a"], "the interrupted step is not recorded as done"
    assert lab.checkpoint("b").read_text() == "launch 1", "the checkpoint outlives the attempt that wrote it"

    barrier.write_text("go")
    second = lab.run("flow-run-1")
    assert second.outcome().state == "COMPLETED"
    assert states(second) == {"a": "completed", "b": "completed", "c": "completed"}
    assert lab.ran() == ["a", "b", "b", "c"], "a is not run again"
    assert second.resumed == ["a"]
    b_first, b_again = [e for e in lab.launches() if e["step"] == "b"]
    assert b_again["found"] == "launch 1"
    assert not (lab.run_dir / "checkpoints").exists(), "a run over for good leaves no checkpoint behind"
    assert (lab.run_dir / "launches.jsonl").exists(), "the rest of its run folder stays"
    assert b_again["body"] == b_first["body"], "b gets a's recorded output, as the first time"
    assert b_again["attempt"] == b_first["attempt"] == 1, "an interrupted attempt is not a failed one"
    assert b_again["checkpoint_dir"] == b_first["checkpoint_dir"] == str(lab.run_dir / "checkpoints" / "b")
    assert second.outcome().result["last_message"]["agent_id"] == "c"


def test_a_failed_run_is_over_for_good_and_its_checkpoints_are_removed(tmp_path):
    """A run whose step fails ends Failed, not put back: its steps' checkpoint folders go with it."""
    folder = resumable_bundle(tmp_path, "failing", [step("a", mode="checkpoint-fail")], [], sink_from="a")
    lab = Runs(folder, tmp_path)
    run = lab.run("flow-run-1")
    assert run.outcome().state == "FAILED" and lab.ran() == ["a"]
    assert not (lab.run_dir / "checkpoints").exists()


def test_in_a_parallel_run_every_branch_that_completed_is_kept_and_only_the_interrupted_one_runs_again(tmp_path):
    barrier = tmp_path / "barrier"
    folder = resumable_bundle(tmp_path, "fan", [step("a"), step("b"), step("c", mode=f"checkpoint:{barrier}"),
                                                step("d", rule="all_success")],
                              [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")], sink_from="d", strategy="parallel")
    lab = Runs(folder, tmp_path)
    lab.run("flow-run-1", stop_when=lambda: lab.checkpoint("c").exists() and
            {"a", "b"} <= {e["label"] for e in lab.journal()})
    barrier.write_text("go")
    second = lab.run("flow-run-1")
    assert second.outcome().state == "COMPLETED" and set(states(second).values()) == {"completed"}
    ran = Counter(lab.ran())
    assert (ran["a"], ran["b"], ran["c"]) == (1, 1, 2) and ran["d"] >= 1  # d also runs on b's message, blocked
    assert sorted(second.resumed) == ["a", "b"]


def test_a_new_flow_run_with_the_same_run_id_runs_every_step(tmp_path):
    """The ledger a run resumes from is its own flow run's: another flow run of the same --run-id starts over."""
    folder = resumable_bundle(tmp_path, "linear", [step("a"), step("b")], [("a", "b")], sink_from="b")
    lab = Runs(folder, tmp_path)
    lab.run("flow-run-1")
    again = lab.run("flow-run-2")
    assert again.outcome().state == "COMPLETED" and again.resumed == []
    assert lab.ran() == ["a", "b", "a", "b"]


def test_a_run_that_is_not_a_flow_run_keeps_no_ledger(tmp_path):
    folder = resumable_bundle(tmp_path, "linear", [step("a")], [], sink_from="a")
    lab = Runs(folder, tmp_path)
    lab.run(None)
    lab.run(None)
    assert lab.ran() == ["a", "a"] and not (lab.run_dir / JOURNAL_FILE).exists()


def test_a_failed_launch_is_not_recorded_and_runs_again_on_the_next_attempt(tmp_path):
    """flaky fails its first attempt and completes its second: the ledger keeps the second (and after); the flow
    run run again (Prefect's retry of a finished run) runs the failed attempt again, and nothing else."""
    folder = write_bundle(tmp_path, "retry", [step("flaky", mode="fail_first", attempts=2), step("after")],
                          [("flaky", "after")], sink_from="after")
    lab = Runs(folder, tmp_path)
    lab.run("flow-run-1")
    assert [(e["label"], e["attempt"]) for e in lab.journal()] == [("flaky", 2), ("after", 1)]
    again = lab.run("flow-run-1")
    assert again.outcome().state == "COMPLETED" and again.resumed == ["flaky", "after"]
    assert [(e["step"], e["attempt"]) for e in lab.launches()] == [("flaky", 1), ("flaky", 2), ("after", 1),
                                                                   ("flaky", 1)]


def test_a_ledger_line_cut_short_or_of_another_flow_run_is_ignored(tmp_path):
    folder = resumable_bundle(tmp_path, "linear", [step("a"), step("b")], [("a", "b")], sink_from="b")
    lab = Runs(folder, tmp_path)
    lab.run("flow-run-1")
    lines = (lab.run_dir / JOURNAL_FILE).read_text().splitlines()
    (lab.run_dir / JOURNAL_FILE).write_text(lines[0] + "\n" + lines[1][:40])  # b's line cut by a kill
    again = lab.run("flow-run-1")
    assert again.outcome().state == "COMPLETED" and again.resumed == ["a"] and lab.ran() == ["a", "b", "b"]


def _launch(folder: Path, step_id: str):
    bundle = load_bundle(folder)
    engine = Engine(bundle.spec, job_id=JOB, run_id=RUN)
    engine.start(time.time())
    [launch] = [l for l in engine.take(time.time()) if l.label == step_id]
    return bundle, launch


def test_each_step_has_one_checkpoint_folder_in_the_run_store_and_a_host_step_hears_of_its_preemption(tmp_path):
    folder = resumable_bundle(tmp_path, "one", [step("train")], [], sink_from="train")
    bundle, launch = _launch(folder, "train")
    run_env = run_environment(bundle, job_id=JOB, run_id=RUN, runs_root=tmp_path / "runs")
    runner_env = {"PATH": os.environ["PATH"], NOTICE_FILE_VAR: "/n/notice", CHECKPOINT_FILE_VAR: "/n/checkpoint",
                  "OTHER": "not passed"}
    env = environment(launch, {k: k for k in ("input", "context", "message", "body")}, tmp_path, job_id=JOB,
                      run_env=run_env, hints={}, environ=runner_env)
    assert env[CHECKPOINT_DIR_VAR] == str(tmp_path / "runs" / RUN / "checkpoints" / "train")
    assert env[NOTICE_FILE_VAR] == "/n/notice" and env[CHECKPOINT_FILE_VAR] == "/n/checkpoint"
    assert "OTHER" not in env
    assert checkpoint_dir(run_env, "gather[2]") == tmp_path / "runs" / RUN / "checkpoints" / "gather[2]"
    assert checkpoint_dir(run_env, "a/../b").name == "a%2F..%2Fb", "a step id is one folder of the run's"
    assert checkpoint_dir(run_env, "..").parent == tmp_path / "runs" / RUN / "checkpoints"
    assert checkpoint_dir({}, "train") is None


def test_a_step_in_a_container_gets_its_checkpoint_folder_and_the_runners_preemption_files_mounted(tmp_path):
    folder = resumable_bundle(tmp_path, "boxed", [step("train")], [], sink_from="train", image="busybox:1")
    bundle, launch = _launch(folder, "train")
    run_env = run_environment(bundle, job_id=JOB, run_id=RUN, runs_root=tmp_path / "runs")
    notices = tmp_path / "node" / "runs" / "flow-run-1"
    notices.mkdir(parents=True)
    runner_env = {NOTICE_FILE_VAR: str(notices / "preempt-notice.json"), CHECKPOINT_FILE_VAR: str(notices / "cp")}
    env = environment(launch, {k: k for k in ("input", "context", "message", "body")}, tmp_path, job_id=JOB,
                      run_env=run_env, hints={}, environ=runner_env)
    assert env[CHECKPOINT_DIR_VAR].endswith("/checkpoints/train") and env[NOTICE_FILE_VAR] == runner_env[NOTICE_FILE_VAR]
    assert _preemption_folders(env) == [str(notices)]  # mounted at its own path (the run store's folder is too)
    assert _preemption_folders({NOTICE_FILE_VAR: str(tmp_path / "gone" / "n")}) == []
