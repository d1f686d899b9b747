"""Options and helpers every command group shares."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from mn_prefect import settings
from mn_prefect.model.issues import InvalidInput, Issue

EXIT_INVALID = 2
EXIT_REFUSED = 1

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for programs instead of tables.")]
StoreURLArg = Annotated[str | None, typer.Option(
    "--store-url", help="Store URL (default: MN_STORE_URL, else the lab's store in ~/.mn-prefect/config, "
                        "else the SQLite file under ~/.mn-prefect).")]
GroupOpt = Annotated[str | None, typer.Option(
    "--group", help="Only the nodes of this resource group (an mn pool's group has the pool's name).")]
VerboseFlag = Annotated[bool, typer.Option(
    "--verbose", "-v", help="Say which store and which Prefect server the command talks to, and where each "
                            "setting came from (flag, env, profile, default).")]

_verbose = False
# The settings a command resolved, so an error can say which store or server it was and why that one.
_resolved: dict[str, settings.Setting] = {}


def _say(line: str) -> None:
    from mn_prefect.cli.render import errors

    errors.print(line, soft_wrap=True, highlight=False)


def _describe(setting: settings.Setting) -> str:
    from mn_prefect.store.urls import redact

    return f"{redact(setting.value)} (from {setting.source})" if setting.value else "none configured"


def apply_settings(verbose: bool) -> None:
    """Run before any command: put the profile's Prefect server into PREFECT_API_URL (Prefect's clients read
    the environment), keep Prefect from starting a temporary server when none is configured, and with
    ``--verbose`` say which server it is."""
    global _verbose
    _verbose = verbose
    try:
        api = settings.prefect_api_url()
    except settings.ProfileError as error:
        raise InvalidInput([Issue(str(settings.profile_path()), str(error))]) from None
    _resolved["server"] = api
    if api.value and settings.API_URL_VAR not in os.environ:
        os.environ[settings.API_URL_VAR] = api.value
    if api.value is None and not any(v in os.environ for v in ("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE",
                                                                "PREFECT_SERVER_EPHEMERAL_ENABLED")):
        # Without a server, Prefect may start a throwaway one (its own profile can allow it): say so instead.
        os.environ["PREFECT_SERVER_EPHEMERAL_ENABLED"] = "false"
    if verbose:
        _say(f"Prefect server: {_describe(api)}" if api.value else
             "Prefect server: none in PREFECT_API_URL or the profile (Prefect's own profile may name one)")


def open_store_option(url: str | None):
    """The store named by ``--store-url`` (else MN_STORE_URL, the profile, the default); a bad URL is an input
    error naming where it came from."""
    from mn_prefect.store import open_store

    try:
        setting = settings.store_url(url)
    except settings.ProfileError as error:
        raise InvalidInput([Issue(str(settings.profile_path()), str(error))]) from None
    _resolved["store"] = setting
    if _verbose:
        _say(f"store: {_describe(setting)}")
    try:
        return open_store(setting.value)
    except ValueError as error:
        raise InvalidInput([Issue(setting.source if setting.source.startswith("--") else
                                  f"store URL from {setting.source}", str(error))]) from None


def explain_error(error: BaseException) -> str | None:
    """A message for a store that failed or a Prefect server that is missing or unreachable, naming which one
    and where its URL came from; None for any other error."""
    from mn_prefect.store import StoreError

    text = str(error)
    if isinstance(error, StoreError):
        store = _resolved.get("store")
        if store is None or store.value is None:
            return None
        from mn_prefect.store.urls import redact

        return f"{text} (store URL from {store.source})" if redact(store.value) in text else \
            f"{text} (store {_describe(store)})"
    server = _resolved.get("server") or settings.Setting(os.environ.get(settings.API_URL_VAR), "none")
    if isinstance(error, ValueError) and "No Prefect API URL provided" in text:
        return ("no Prefect server configured: set PREFECT_API_URL, or start a lab with `mn-prefect up` "
                f"(it records its server in {settings.profile_path()})")
    import httpx

    if isinstance(error, httpx.TransportError) or (isinstance(error, RuntimeError) and "Failed to reach API" in text):
        where = _describe(server) if server.value else "(the one in Prefect's own profile)"
        return f"cannot reach the Prefect server {where}: {text}"
    return None
