"""What preemption cost each queue: runs preempted (checkpointed or killed) and the work their next attempts had to
do again, in GPU-seconds and CPU-seconds (the run's booked GPUs and cores times the time since its last
checkpoint, else since it started). Read from the flow runs' records, which carry them from attempt to attempt."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import FlowRunRecord, list_records


@dataclass
class Losses:
    checkpointed: int = 0
    killed: int = 0
    lost_gpu_s: float = 0.0
    lost_cpu_s: float = 0.0

    @property
    def preempted(self) -> int:
        return self.checkpointed + self.killed

    def as_json(self) -> dict[str, float | int]:
        return {"preempted": self.preempted, **asdict(self), "lost_gpu_s": round(self.lost_gpu_s, 3),
                "lost_cpu_s": round(self.lost_cpu_s, 3)}


def losses_by_queue(store: ClusterStore) -> dict[str, Losses]:
    """Per work queue ("" for runs placed from none): what preemption cost its runs so far."""
    out: dict[str, Losses] = {}
    for record in list_records(store, FlowRunRecord):
        if not (record.preempted_checkpointed or record.preempted_killed):
            continue
        losses = out.setdefault(record.queue or "", Losses())
        losses.checkpointed += record.preempted_checkpointed
        losses.killed += record.preempted_killed
        losses.lost_gpu_s += record.lost_gpu_s
        losses.lost_cpu_s += record.lost_cpu_s
    return out
