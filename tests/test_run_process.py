"""How an mn run's process starts: Prefect's engine, started by the worker itself. With no command set, Prefect's
process worker would put a workspace supervisor (a second interpreter) in between."""

import sys
import uuid

from prefect.client.schemas.objects import FlowRun

from mn_prefect.worker import MNWorker
from mn_prefect.worker.variables import MNJobConfiguration


def _prepared(values: dict) -> MNJobConfiguration:
    config = MNJobConfiguration.model_validate(values)
    config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="run"))
    return config


def test_the_pool_sets_no_command_of_its_own():
    assert MNWorker.get_default_base_job_template()["job_configuration"]["command"] == "{{ command }}"


def test_a_run_with_no_command_starts_the_engine_directly():
    config = _prepared({})
    assert config.command.split()[-2:] == ["-m", "prefect.engine"]
    assert config.command.split()[0] == sys.executable
    assert config._command_configured  # the process worker's switch: the engine itself, no supervisor


def test_a_command_the_deployment_sets_is_kept():
    config = _prepared({"command": "python -m my_launcher"})
    assert config.command == "python -m my_launcher" and config._command_configured
