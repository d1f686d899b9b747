"""A blueprint job's edge: the blueprint is parsed once (``load``), and a job whose agents cannot run is
refused whole (``runnable``) before anything is booked or started.

What no node can offer is the scheduler's business (``not_runnable``); this module covers what mn-prefect
itself cannot run: catalog agents, runner modules and runtime drivers it has no runner for, and commands
or workdirs missing on this machine (the same checks run again on the agent's node before it starts).
"""

from __future__ import annotations

import os
from typing import Any

from mn_prefect.jobs.command import CommandRefused, check_workdir, resolve_program
from mn_prefect.model.blueprint import Agent, Blueprint, parse_blueprint
from mn_prefect.model.issues import InvalidInput


class BlueprintInvalid(InvalidInput):
    """A blueprint that does not validate; ``issues`` holds every problem with its path."""

    def __str__(self) -> str:
        return f"invalid blueprint: {super().__str__()}"


def load(raw: Any) -> Blueprint:
    """The blueprint, or BlueprintInvalid listing every problem with its path."""
    blueprint, issues = parse_blueprint(raw)
    if blueprint is None or issues:
        raise BlueprintInvalid(issues)
    return blueprint


# MirrorNeuron runner modules mn-prefect can stand in for, and the runtime driver each means.
RUNNERS = {"MirrorNeuron.Runner.HostLocal": "host_local"}
RUNTIME_DRIVERS = ("host_local", "docker")


def agent_refusal(agent: Agent, *, local: bool = True) -> str | None:
    """Why ``agent`` cannot run under mn-prefect, or None. ``local``: also check the command and workdir
    against this machine."""
    if agent.uses:
        return (f"uses catalog agent {agent.uses!r}, and no agent catalog is installed here "
                "(give the agent a config.command instead)")
    config = agent.config
    if config.runner_module is not None and config.runner_module not in RUNNERS:
        return (f"config.runner_module {config.runner_module!r} has no runner in mn-prefect "
                f"(known: {', '.join(RUNNERS)})")
    driver = agent.resources.runtime_driver
    if driver is not None and driver not in RUNTIME_DRIVERS:
        return f"resources.runtime_driver {driver!r} has no runner in mn-prefect (known: {', '.join(RUNTIME_DRIVERS)})"
    if not config.command:
        kind = f" (agent type {agent.agent_type!r} is built into MirrorNeuron)" if agent.agent_type else ""
        return f"config.command is missing: nothing to run{kind}"
    if local:
        try:
            check_workdir(config.workdir)
            resolve_program(config.command, config.workdir, os.environ.get("PATH"))
        except CommandRefused as refused:
            return str(refused)
    return None


def refusals(blueprint: Blueprint, *, local: bool = True) -> dict[str, str]:
    """Every agent that cannot run, with the reason (empty: the job may start)."""
    out = {}
    for agent in blueprint.agents:
        why = agent_refusal(agent, local=local)
        if why is not None:
            out[agent.agent_id] = why
    return out


def runnable(blueprint: Blueprint, *, local: bool = True) -> Blueprint:
    """``blueprint`` when mn-prefect can run every agent; JobRefused naming each one it cannot, and why."""
    reasons = refusals(blueprint, local=local)
    if reasons:
        raise JobRefused(blueprint.job_name, reasons)
    return blueprint


class JobRefused(RuntimeError):
    def __init__(self, job_name: str, reasons: dict[str, str]):
        self.reasons = reasons
        detail = "; ".join(f"agent {agent}: {why}" for agent, why in reasons.items())
        super().__init__(f"job {job_name!r} refused, nothing was booked or started: {detail}")
