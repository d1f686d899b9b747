"""The states of runs, jobs and the store's records, and which of them are final: each set defined once here.

Prefect's run states are written as their names (``"COMPLETED"``); Prefect's ``StateType`` is a ``str`` enum,
so ``state.type in TERMINAL_RUN_STATES`` works on either. No Prefect import: the model stays free of it.
"""

from __future__ import annotations

from typing import Literal, get_args

# -- Prefect flow runs --------------------------------------------------------------------------------------

RunState = Literal["SCHEDULED", "PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "CRASHED", "PAUSED",
                   "CANCELLING"]
RUN_STATES: tuple[str, ...] = get_args(RunState)
TERMINAL_RUN_STATES: frozenset[str] = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})
"""A flow run in one of these is over: nothing more runs, its booking may go."""

# -- blueprint jobs (the coordinator's record) and their agents ---------------------------------------------

JobStatus = Literal["pending", "waiting", "running", "completed", "failed", "cancelled"]
JOB_STATUSES: tuple[str, ...] = get_args(JobStatus)
FINISHED_JOB_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled"})
"""A blueprint job, or a workflow engine, that is over."""

AgentStatus = Literal["pending", "running", "restarting", "blocked", "paused", "completed", "failed", "stopped"]
AGENT_STATUSES: tuple[str, ...] = get_args(AgentStatus)
FINISHED_AGENT_STATUSES: frozenset[str] = frozenset({"completed", "failed", "stopped"})

# -- bundle workflow runs and their steps -------------------------------------------------------------------

WorkflowStatus = Literal["pending", "running", "completed", "failed", "cancelled", "crashed"]
WORKFLOW_STATUSES: tuple[str, ...] = get_args(WorkflowStatus)
FINISHED_WORKFLOW_STATUSES: frozenset[str] = FINISHED_JOB_STATUSES | {"crashed"}
"""A workflow run that is over; ``crashed``: its process died and a later sweep released its bookings."""

WorkflowOutcome = Literal["RUNNING", "COMPLETED", "FAILED", "CANCELLED"]
"""A workflow run's outcome as its flow run reports it (a finished engine's status, upper case)."""

StepState = Literal["pending", "blocked", "queued", "running", "retry_wait", "completed", "partial", "skipped",
                    "failed", "cancelled"]
StepOutcome = Literal["success", "failed", "partial", "skipped", "mapped"]

StepResultStatus = Literal["done"]

# -- plain flow runs the worker placed (what the reconciler and drains act on) ------------------------------

FlowRunStatus = Literal["placed", "rescheduled", "paused", "failed", "migrating", "migrated", "preempted"]
FLOW_RUN_STATUSES: tuple[str, ...] = get_args(FlowRunStatus)

# -- drains -------------------------------------------------------------------------------------------------

DrainStatus = Literal["active", "complete", "cancelled"]
DRAIN_STATUSES: tuple[str, ...] = get_args(DrainStatus)
