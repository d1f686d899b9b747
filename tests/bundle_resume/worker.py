"""A bundle worker for the resume tests (tests/test_bundle_resume*.py), set per step by MN_TEST_MODE:

ok | checkpoint:<barrier>: reads what an earlier attempt left in $MN_CHECKPOINT_DIR/progress, writes
``launch <n>`` there (n: one more than it found), then waits for the barrier file; told meanwhile that its run is
preempted (mn_prefect.preemption()), it notes the notice and says it checkpointed (mn_prefect.checkpointed()).

Every launch appends a line to $MN_RUNS_ROOT/$MN_RUN_ID/launches.jsonl (step, attempt, body, checkpoint folder,
what it found there), and a ``notice <seconds left>`` line when it is told.

checkpoint-fail: writes its checkpoint as above, then fails (exit 1).
"""
import json
import os
import time
from pathlib import Path

context = json.loads(Path(os.environ["MN_CONTEXT_FILE"]).read_text())
body = json.loads(Path(os.environ["MN_INPUT_FILE"]).read_text())
workflow = context.get("workflow") or {}
step = workflow.get("step_id") or os.environ.get("MN_WORKFLOW_STEP_ID", "?")
mode = os.environ.get("MN_TEST_MODE", "ok")
run_dir = Path(os.environ["MN_RUNS_ROOT"]) / os.environ["MN_RUN_ID"]
checkpoints = Path(os.environ["MN_CHECKPOINT_DIR"])
progress = checkpoints / "progress"
found = progress.read_text() if progress.exists() else None


def note(**fields) -> None:
    with open(run_dir / "launches.jsonl", "a") as out:
        out.write(json.dumps({"step": step, **fields}) + "\n")


note(attempt=workflow.get("attempt"), body=body, checkpoint_dir=str(checkpoints), found=found,
     notice_file=os.environ.get("MN_PREEMPT_NOTICE_FILE"), pid=os.getpid())
if mode.startswith("checkpoint:"):
    barrier = Path(mode.split(":", 1)[1])
    n = int(found.split()[1]) + 1 if found else 1
    progress.write_text(f"launch {n}")
    told = False
    while not barrier.exists():
        if not told and os.environ.get("MN_PREEMPT_NOTICE_FILE"):
            from mn_prefect import checkpointed, preemption

            notice = preemption()
            if notice is not None:
                told = True
                note(notice=round(notice.seconds_left), checkpointed=checkpointed())
        time.sleep(0.1)
if mode == "checkpoint-fail":
    progress.write_text("launch 1")
    raise SystemExit(1)
result = {"step": step, "found": found}
print(json.dumps({"events": [{"type": "test_step_ran", "payload": result}], "next_state": result}))
