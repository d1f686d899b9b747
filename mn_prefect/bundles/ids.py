"""A bundle run's mn-prefect job id: ``<job name>-<8 hex>``, one per run id (docs/bundles.md, "Run store and
events"). A run id that is a Prefect flow-run id (a UUID) gives its own first 8 hex digits, as before; any other
run id (``--run-id``, or the ``mn`` command's, which begin with the bundle's id and so share their first
characters) the first 8 hex digits of its SHA-256, so that two runs never share a job id, and so one row each in
``job list``. Stdlib only: every layer may use it."""

from __future__ import annotations

import hashlib
import re

UUID = re.compile(r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}")


def run_tag(run_id: str) -> str:
    """The 8 hex digits that name ``run_id`` in its job id."""
    if UUID.fullmatch(run_id):
        return run_id.replace("-", "")[:8].lower()
    return hashlib.sha256(run_id.encode()).hexdigest()[:8]


def job_id_for(job_name: str, run_id: str) -> str:
    """The job id of the run ``run_id`` of a bundle whose job is ``job_name``."""
    return f"{job_name}-{run_tag(run_id)}"
