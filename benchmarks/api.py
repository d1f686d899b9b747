"""The Prefect API from benchmarks: the server on SQLite answers 503 when busy, so requests are retried."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

FLOWS = Path(__file__).resolve().parent / "flows"


def request(client, method: str, url: str, **kwargs):
    for attempt in range(30):
        response = client.request(method, url, **kwargs)
        if response.status_code not in (429, 503):
            return response
        time.sleep(0.2 * (attempt + 1))
    return response


def deploy_short(env: dict[str, str], pool: str, name: str, job_variables: dict,
                 entrypoint: str = "short.py:short") -> str:
    """Deploy benchmarks/flows/short.py (or another ``entrypoint`` in benchmarks/flows) on ``pool`` (in a separate
    process, against the server of ``env``); the deployment's id."""
    done = subprocess.run(
        [str(Path(sys.executable).parent / "python"), "-c",
         "from prefect.flows import Flow;"
         f"print(Flow.from_source(source={str(FLOWS)!r}, entrypoint={entrypoint!r})"
         f".deploy(name={name!r}, work_pool_name={pool!r}, print_next_steps=False, job_variables={job_variables!r}))"],
        env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]
