"""A preemptible run's side of preemption: the notice it is given, and the checkpoints it reports.

When a run of higher priority needs what a preemptible run holds, the run is first told, not stopped: its node's
worker writes the file named by ``MN_PREEMPT_NOTICE_FILE`` with the deadline, and ``preemption()`` answers
until when the run may go on. The run then persists what it has done (a Prefect task whose result is persisted
is not run again on the next attempt) and says so with ``checkpointed()``: it is stopped at once, well before the
deadline, and counted "preempted, checkpointed". A run that never says so is stopped at the deadline ("preempted,
killed"). Either way the same flow run is scheduled again.

``checkpointed()`` is also worth calling whenever a run has persisted its work, notice or not: among the runs a
waiting one may evict, those with the least work since their last checkpoint go first.

    from mn_prefect import checkpointed, preemption

    @flow
    def train():
        for epoch in range(100):
            step(epoch)             # a task with a persisted result
            checkpointed()
            if preemption() is not None:
                return              # stop here; the next attempt resumes after the last finished step

Outside a run that mn-prefect placed, ``preemption()`` is None and ``checkpointed()`` does nothing.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

NOTICE_FILE_VAR = "MN_PREEMPT_NOTICE_FILE"
CHECKPOINT_FILE_VAR = "MN_CHECKPOINT_FILE"
NOTICE_FILE = "preempt-notice.json"
CHECKPOINT_FILE = "checkpoint"


@dataclass(frozen=True)
class Notice:
    """The run has been preempted: it may go on until ``deadline`` (epoch seconds), for run ``by``."""

    deadline: float
    by: str | None = None

    @property
    def seconds_left(self) -> float:
        return max(0.0, self.deadline - time.time())


def preemption() -> Notice | None:
    """The notice this run was given, or None while it may run on (or outside a placed run)."""
    path = os.environ.get(NOTICE_FILE_VAR)
    if not path:
        return None
    return read_notice(Path(path))


def checkpointed() -> bool:
    """Record that this run has just persisted its work (False outside a placed run)."""
    path = os.environ.get(CHECKPOINT_FILE_VAR)
    if not path:
        return False
    _write_atomically(Path(path), f"{time.time():.6f}\n")
    return True


# -- the node's side: the files, under the run's folder -------------------------------------------------------------

def read_notice(path: Path) -> Notice | None:
    try:
        data = json.loads(path.read_text())
        deadline = float(data["deadline"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not math.isfinite(deadline):
        return None
    by = data.get("by")
    return Notice(deadline=deadline, by=str(by) if by is not None else None)


def write_notice(folder: Path, notice: Notice) -> Path:
    path = folder / NOTICE_FILE
    _write_atomically(path, json.dumps({"deadline": notice.deadline, "by": notice.by}) + "\n")
    return path


def last_checkpoint(folder: Path) -> float | None:
    """When the run in ``folder`` last said it checkpointed (epoch seconds), or None."""
    try:
        value = float((folder / CHECKPOINT_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return value if math.isfinite(value) else None


def runs_root() -> Path:
    """Where this machine keeps the runs' folders (``run_folder``)."""
    from mn_prefect import settings

    return settings.home() / "runs"


def run_folder(run_id: str) -> Path:
    """This machine's folder for a run's notice and checkpoint files (removed when the run ends here); a container
    run gets it at the same path, read-write."""
    return runs_root() / run_id


def run_files(folder: Path) -> dict[str, str]:
    """The variables that name a run's notice and checkpoint files (the folder is made)."""
    folder.mkdir(parents=True, exist_ok=True)
    return {NOTICE_FILE_VAR: str(folder / NOTICE_FILE), CHECKPOINT_FILE_VAR: str(folder / CHECKPOINT_FILE)}


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)
