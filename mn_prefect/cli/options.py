"""Options and helpers every command group shares."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from mn_prefect.model.issues import InvalidInput, Issue

EXIT_INVALID = 2
EXIT_REFUSED = 1

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for programs instead of tables.")]
StoreURLArg = Annotated[Optional[str], typer.Option(
    "--store-url", help="Store URL (default: MN_STORE_URL, else the SQLite file under ~/.mn-prefect).")]


def open_store_option(url: str | None):
    """The store named by ``--store-url`` (or the default); a bad URL is an input error naming the option."""
    from mn_prefect.store import open_store

    try:
        return open_store(url)
    except ValueError as error:
        raise InvalidInput([Issue("--store-url", str(error))]) from None
