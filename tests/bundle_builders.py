"""Small MirrorNeuron bundles written by the tests: steps, edges, trigger rules and failure policies, each
step run by tests/bundles/worker.py with its behaviour set through the node's environment."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from mn_prefect.bundles.bundle import load_bundle
from mn_prefect.bundles.process import run_launch
from mn_prefect.bundles.runner import BundleRun, run_environment
from mn_prefect.drivers.launchers import this_node
from mn_prefect.model.hints import env_hints
from mn_prefect.store import open_store

WORKER = Path(__file__).parent / "bundles" / "worker.py"


def step(sid: str, *, mode: str = "ok", rule: Any = None, policy: str = "fail_workflow", attempts: int = 1,
         backoff_s: float = 0.05, required: bool = True, timeout: float = 60) -> dict:
    control: dict[str, Any] = {"failure_policy": policy, "required": required, "timeout_seconds": timeout,
                               "retry": {"max_attempts": attempts, "backoff_seconds": backoff_s}}
    out: dict[str, Any] = {"id": sid, "run": sid, "control": control, "_mode": mode}
    if rule is not None:
        out["trigger_rule"] = rule
    return out


def write_bundle(root: Path, name: str, steps: list[dict], edges: list[tuple[str, str] | tuple[str, str, list]],
                 *, sink_from: str, strategy: str = "parallel", resources: dict | None = None,
                 extra_agents: list[dict] | None = None, runner: str = "MirrorNeuron.Runner.HostLocal",
                 image: str | None = None) -> Path:
    """A bundle folder under ``root``: one agent per step (agent edges along the workflow edges), plus a
    terminal sink fed by ``sink_from``; each step's agent runs with ``runner`` (and ``image``)."""
    folder = root / name
    (folder / "payloads" / "worker").mkdir(parents=True)
    shutil.copy(WORKER, folder / "payloads" / "worker" / "worker.py")
    (folder / "config").mkdir()
    (folder / "config" / "default.json").write_text(json.dumps({"identity": {"name": name}}))
    nodes, agent_edges = [], []
    for s in steps:
        nodes.append({"node_id": s["id"], "agent_type": "executor", "type": "generic",
                      "resources": resources or {"cpu_cores": 0.1, "memory_mb": 16},
                      "config": {"command": ["python3.11", "worker.py"], "upload_path": "worker",
                                 "upload_as": "worker", "workdir": "/sandbox/job/worker",
                                 "runner_module": runner, **({"image": image} if image else {}),
                                 "output_message_type": "done",
                                 "environment": {"MN_TEST_MODE": s["_mode"], "MN_WORKFLOW_STEP_ID": s["id"]}}})
    for e in edges:
        agent_edges.append({"edge_id": f"{e[0]}_to_{e[1]}", "from_node": e[0], "to_node": e[1],
                            "message_type": "done"})
    agent_edges.append({"edge_id": "to_sink", "from_node": sink_from, "to_node": "sink", "message_type": "done"})
    nodes.append({"node_id": "sink", "agent_type": "aggregator", "type": "reduce",
                  "config": {"complete_on_message": True, "complete_run": True, "terminal_sink": True}})
    nodes += extra_agents or []
    wf_edges = [{"id": f"{e[0]}->{e[1]}", "from": e[0], "to": e[1], "accepts": e[2] if len(e) > 2 else ["done"]}
                for e in edges]
    first = steps[0]["id"]
    manifest = {
        "apiVersion": "mn.workflow/v2", "kind": "Workflow", "id": name, "name": name, "job_name": name,
        "manifest_version": "1.0",
        "agents": {"entrypoints": [first], "edges": agent_edges, "nodes": nodes},
        "workflow": {"workflow_id": name, "mode": "static_dag", "source": first, "entrypoint": first,
                     "sink": sink_from, "execution": {"strategy": strategy, "max_parallel_steps": 4},
                     "steps": [{k: v for k, v in s.items() if k != "_mode"} for s in steps], "edges": wf_edges},
        "runtime": {"initial_inputs": {first: [{"seed": 1}]}},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return folder


class _Done:
    def __init__(self, result):
        self._result = result

    def result(self):
        return self._result

    def cancel(self):
        pass


def run_bundle(folder: Path, tmp_path: Path):
    """Run a bundle on this machine: each launch booked in a real store, run as a real process, released."""
    bundle = load_bundle(folder)
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    node = store.register_node(this_node(logging.getLogger(__name__))[0]).name
    root = tmp_path / "runs"
    env = run_environment(bundle, job_id="job-1", run_id="run-1", runs_root=root)
    booked_while_running = []

    def starter(launch, placement, booking):
        booked_while_running.append(bool(store.active_placements(job_id=booking)))
        return _Done(run_launch(launch, bundle.payloads, job_id="job-1", run_env=env, hints=env_hints(placement),
                                node=placement.node, placement=placement))

    outcome = BundleRun(bundle=bundle, store=store, starter=starter, job_id="job-1", run_id="run-1",
                        runs_root=root, preferred_node=node).run()
    leftover = store.active_placements()
    store.close()
    launches = [json.loads(line) for line in (root / "run-1" / "launches.jsonl").read_text().splitlines()] \
        if (root / "run-1" / "launches.jsonl").exists() else []
    assert all(booked_while_running), "every launch runs under its own booking"
    assert leftover == [], "no booking outlives the run"
    return outcome, launches


def json_in_strings(value, path="result") -> list[str]:
    """Where a string holds a JSON object or list (JSON escaped inside JSON)."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in json_in_strings(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in json_in_strings(v, f"{path}[{i}]")]
    if isinstance(value, str) and value.strip()[:1] in ("{", "["):
        try:
            json.loads(value)
        except ValueError:
            return []
        return [path]
    return []
