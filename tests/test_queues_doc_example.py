"""docs/queues.md's "Writing a flow that resumes" example, executed as written, on a real Prefect server (the
session's shared one): told of a preemption (the notice file MN_PREEMPT_NOTICE_FILE names), it sees the notice and
says it checkpointed after each finished task (MN_CHECKPOINT_FILE), and its tasks' results are persisted."""

from __future__ import annotations

import json
import re
import runpy
import time
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from mn_prefect.preemption import CHECKPOINT_FILE_VAR, NOTICE_FILE_VAR, last_checkpoint

pytestmark = pytest.mark.lab  # the session's Prefect server

DOC = Path(__file__).resolve().parents[1] / "docs" / "queues.md"


def example() -> str:
    text = DOC.read_text()
    section = text[text.index("### Writing a flow that resumes"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_resuming_flow_of_the_docs_runs_sees_its_notice_and_checkpoints(prefect_server, tmp_path, monkeypatch,
                                                                           capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    deadline = time.time() + 120
    (folder / "preempt-notice.json").write_text(json.dumps({"deadline": deadline, "by": "urgent"}))
    monkeypatch.setenv(NOTICE_FILE_VAR, str(folder / "preempt-notice.json"))
    monkeypatch.setenv(CHECKPOINT_FILE_VAR, str(folder / "checkpoint"))
    monkeypatch.setenv("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "true")
    monkeypatch.setenv("PREFECT_LOCAL_STORAGE_PATH", str(tmp_path / "results"))
    started = time.time()
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}):
        source = tmp_path / "queues_doc_example.py"  # a file of its own: Prefect reads the flow's source
        source.write_text(example())
        namespace = runpy.run_path(str(source), run_name="queues_doc_example")
        state = namespace["train"](epochs=3, return_state=True)
    assert state.is_completed(), state
    out = capsys.readouterr().out
    seconds = [int(s) for s in re.findall(r"preempted: (\d+) s left", out)]
    assert len(seconds) == 3 and all(60 <= s <= 120 for s in seconds), out  # told, its deadline ~120 s ahead
    checkpoint = last_checkpoint(folder)
    assert checkpoint is not None and started <= checkpoint <= time.time()
    assert len(list((tmp_path / "results").iterdir())) >= 3, "each finished task's result is persisted"
