"""A bundle worker for the tests: what it prints is set per step through its node's environment.

MN_TEST_MODE (per step): ok | fail_first (exit 3 on the first attempt, then ok) | fail (exit 4) |
fail_event (exit 0 but report workflow_step_failed) | branch:<step,...> | nonjson | sleep:<seconds> |
beacons:<seconds> (a beacon line every 0.1 s for that long, then ok) | wait_file:<path> (ok once the file exists) |
human:<seconds> (asks a person through the run store's human.jsonl, as MirrorNeuron's demo does, and waits that long
for the answer: approve goes on, reject or no answer reports workflow_step_failed).
Every launch appends a line to $MN_RUNS_ROOT/$MN_RUN_ID/launches.jsonl, so tests count launches per step.
"""
import json
import os
import sys
import time
from pathlib import Path

context = json.loads(Path(os.environ["MN_CONTEXT_FILE"]).read_text())
body = json.loads(Path(os.environ["MN_INPUT_FILE"]).read_text())
workflow = context.get("workflow") or {}
step = workflow.get("step_id") or os.environ.get("MN_WORKFLOW_STEP_ID", "?")
attempt = int(workflow.get("attempt") or 0)
mode = os.environ.get("MN_TEST_MODE", "ok")
run_dir = Path(os.environ["MN_RUNS_ROOT"]) / os.environ["MN_RUN_ID"]
run_dir.mkdir(parents=True, exist_ok=True)
with open(run_dir / "launches.jsonl", "a") as out:
    limit = next((Path(p).read_text().strip() for p in ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                                          "/sys/fs/cgroup/memory.max") if Path(p).exists()), None)
    out.write(json.dumps({"step": step, "attempt": attempt, "cwd": os.getcwd(), "job": os.environ["MN_JOB_ID"],
                          "allocation": os.environ.get("MN_ALLOCATION_JSON"), "body": body,
                          "in_container": os.path.exists("/.dockerenv"), "memory_limit": limit,
                          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                          "docker_host": os.environ.get("DOCKER_HOST"),
                          "trigger_event": os.environ.get("MN_TRIGGER_EVENT_JSON"),
                          "baked": Path("/baked.txt").read_text() if Path("/baked.txt").exists() else None}) + "\n")

result = {"step": step, "attempt": attempt}
if mode == "fail_first" and attempt <= 1:
    print("simulated failure on the first attempt", file=sys.stderr)
    sys.exit(3)
if mode == "fail":
    print("this step always fails", file=sys.stderr)
    sys.exit(4)
if mode == "nonjson":
    print("plain text, not JSON")
    sys.exit(0)
if mode.startswith("sleep:"):
    time.sleep(float(mode.split(":", 1)[1]))
if mode.startswith("wait_file:"):
    while not Path(mode.split(":", 1)[1]).exists():
        time.sleep(0.1)
if mode.startswith("beacons:"):
    prefix = os.environ["MN_AGENT_BEACON_STDOUT_PREFIX"]
    until = time.monotonic() + float(mode.split(":", 1)[1])
    while time.monotonic() < until:
        print(prefix + json.dumps({"status": "working", "message": "still here"}), flush=True)
        time.sleep(0.1)
events = [{"type": "test_step_ran", "payload": result}]
if mode.startswith("human:"):
    request_id = f"{step}-approval"
    asked = {"ts": time.time(), "run_id": os.environ["MN_RUN_ID"], "channel": "human", "type": "human_input_requested",
             "payload": {"request_id": request_id, "prompt": f"May {step} publish?", "status": "pending",
                         "allowed_decisions": ["approve", "reject"]}}
    with open(run_dir / "human.jsonl", "a") as out:
        out.write(json.dumps(asked) + "\n")
    answer, until = None, time.monotonic() + float(mode.split(":", 1)[1])
    while answer is None and time.monotonic() < until:
        for line in (run_dir / "human.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event["type"] == "human_input_received" and event["payload"]["request_id"] == request_id:
                answer = event["payload"]
        time.sleep(0.1)
    if answer is None:
        with open(run_dir / "human.jsonl", "a") as out:
            out.write(json.dumps({**asked, "type": "human_input_timeout",
                                  "payload": {"request_id": request_id, "status": "timed_out"}}) + "\n")
    result["answer"] = answer
    if not (answer or {}).get("approved"):
        events.append({"type": "workflow_step_failed", "payload": {"reason": f"not approved: {answer}"}})
if mode == "fail_event":
    events.append({"type": "workflow_step_failed", "payload": {"reason": f"{step} reports failure"}})
if mode.startswith("branch:"):
    events.append({"type": "workflow_step_branch", "payload": {"branches": mode.split(":", 1)[1].split(",")}})
print(json.dumps({"events": events, "next_state": result}))
