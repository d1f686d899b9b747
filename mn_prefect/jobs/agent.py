"""The ``mn-agent`` flow: one attempt of one blueprint agent, run on the node its job booked for it.

The ``mn`` worker starts this flow with the agent's allocation in the environment (MN_ALLOCATION_JSON and
the other hints); the command's output goes to the run's logs line by line and its exit code decides the
run's state.
"""

from __future__ import annotations

import os

from prefect import flow, get_run_logger

from mn_prefect.jobs.command import AGENT_VAR, ATTEMPT_VAR, JOB_VAR, agent_environment, run_command

AGENT_FLOW_NAME = "mn-agent"


class AgentFailed(RuntimeError):
    pass


@flow(name=AGENT_FLOW_NAME, log_prints=True, retries=0)
def mn_agent(job_id: str, agent_id: str, command: list[str], environment: dict[str, str] | None = None,
             pass_env: list[str] | None = None, workdir: str | None = None,
             timeout_seconds: float | None = None, attempt: int = 1) -> dict:
    """Run the agent's ``command`` (argv) with only ``pass_env`` of the worker's environment, the MN_ hints
    and ``environment``; fail when it exits non-zero or runs past ``timeout_seconds``."""
    logger = get_run_logger()
    env = agent_environment(os.environ, pass_env or [], environment or {})
    env.update({JOB_VAR: job_id, AGENT_VAR: agent_id, ATTEMPT_VAR: str(attempt)})

    def line(stream: str, text: str) -> None:
        (logger.warning if stream == "stderr" else logger.info)("%s", text)

    result = run_command(command, env=env, workdir=workdir, timeout_s=timeout_seconds, on_line=line,
                         on_start=lambda pid: logger.info("agent %s (attempt %d) started as pid %d on %s",
                                                          agent_id, attempt, pid, env.get("MN_NODE", "?")))
    summary = {"agent_id": agent_id, "exit_code": result.exit_code, "seconds": round(result.seconds, 3),
               "timed_out": result.timed_out}
    if not result.ok:
        raise AgentFailed(f"agent {agent_id} {result.describe()}")
    logger.info("agent %s %s after %.1f s", agent_id, result.describe(), result.seconds)
    return summary
