"""``mn-prefect mn-api serve``: the MirrorNeuron API, for the ``mn`` command and ``mn_sdk.Client``."""

from __future__ import annotations

import faulthandler
import os
import threading
from pathlib import Path
from typing import Annotated

import typer

from mn_prefect.cli import render
from mn_prefect.cli.jobs import DEFAULT_POOL, POOL_VAR
from mn_prefect.cli.options import StoreURLArg, open_store_option
from mn_prefect.cli.serving import wait_until_stopped
from mn_prefect.model.issues import InvalidInput, Issue

mn_api_app = typer.Typer(help="The MirrorNeuron API: MirrorNeuron's own `mn` command and Python SDK drive "
                              "mn-prefect through it.", no_args_is_help=True)

TOKEN_VAR = "MN_GRPC_AUTH_TOKEN"  # the variable MirrorNeuron's clients send their token from
# Once asked to stop, the server is gone within this many seconds: past it, every thread's stack goes to stderr
# (what held the exit up) and the process exits with status 1.
STOP_WITHIN_S = 15


def token_from_file(path: Path) -> str:
    """The token in ``path``, stripped. A missing, unreadable, empty or whitespace-only file is an InvalidInput
    naming --token-file: serving on without a token would turn authentication off."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise InvalidInput([Issue("--token-file", f"{path}: no such file")]) from None
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidInput([Issue("--token-file", f"{path} cannot be read: {error}")]) from None
    if not token:
        raise InvalidInput([Issue("--token-file", f"{path} holds no token (it is empty or only whitespace): write "
                                                  "the token clients must send into it")])
    return token


def bundles_root_default() -> Path:
    from mn_prefect.settings import home

    return home() / "mn-api" / "jobs"


@mn_api_app.command("serve")
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on; beyond loopback a token is required.")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port (0: a free one; MirrorNeuron's "
                                                                       "default is 55051).")] = 55051,
    pool: Annotated[str, typer.Option("--pool", envvar=POOL_VAR, help="The mn work pool that jobs sent through the "
                                                                      "API are deployed on.")] = DEFAULT_POOL,
    bundles_root: Annotated[Path | None, typer.Option(
        "--bundles-root", help="Where the bundles clients send are written (every node reads them there: shared "
                               "storage on several machines). Default: ~/.mn-prefect/mn-api/jobs.")] = None,
    token_file: Annotated[Path | None, typer.Option(
        "--token-file", help=f"A file holding the token clients must send (default: {TOKEN_VAR}, if set).")] = None,
    store_url: StoreURLArg = None,
) -> None:
    """Answer MirrorNeuron's gRPC services from this store and Prefect server until stopped (Ctrl-C, SIGTERM)."""
    token = token_from_file(token_file) if token_file else (os.environ.get(TOKEN_VAR) or "").strip()

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    from mn_prefect.mn_api.server import Api, build_server

    store = open_store_option(store_url)
    api = Api(store, lambda: get_client(sync_client=True), pool=pool,
              bundles_root=(bundles_root or bundles_root_default()).expanduser().resolve(), ui_url=PREFECT_UI_URL.value())
    server, bound = build_server(api, host, port, token=token or None)
    stop = threading.Event()  # ends the rollouts' watcher
    threading.Thread(target=api.watch_rollouts, args=(stop,), name="mn-api-rollouts", daemon=True).start()
    render.errors.print(f"MirrorNeuron API on {host}:{bound} (pool {pool}, Prefect {PREFECT_API_URL.value() or 'none'}"
                        f"{', token required' if token else ''}); Ctrl-C stops it", soft_wrap=True)
    print(f"export MN_GRPC_TARGET={host}:{bound}", flush=True)
    try:
        wait_until_stopped()
    finally:
        stop.set()
        faulthandler.dump_traceback_later(STOP_WITHIN_S, exit=True)
        server.stop(grace=2).wait()
        store.close()
