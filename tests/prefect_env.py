"""The worker tests' lab: the same processes ``mn-prefect up`` starts (mn_prefect.local_lab)."""

from __future__ import annotations

from pathlib import Path

import servers

from mn_prefect.local_lab import BIN, PrefectServer as _PrefectServer, start_worker as _start_worker, stop_process

__all__ = ["BIN", "PrefectServer", "stop_process", "start_worker"]


class PrefectServer(_PrefectServer):
    def __init__(self, *args, **kwargs):
        servers.lab_only("a Prefect server")
        super().__init__(*args, **kwargs)


def start_worker(server: PrefectServer, pool: str, node: dict, store_url: str, workdir: Path,
                 extra_env: dict | None = None, api_url: str | None = None):
    """``api_url``: where the worker sends its Prefect API calls (a proxy in front of ``server``)."""
    env = {**server.env, "PREFECT_API_URL": api_url} if api_url else server.env
    return _start_worker(env, pool, node, store_url, workdir, extra_env=extra_env)
