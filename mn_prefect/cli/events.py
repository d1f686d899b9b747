"""``mn-prefect event ...``: send the events that start bundles' triggered runs, and list them."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from mn_prefect.cli import render
from mn_prefect.cli.options import JsonFlag
from mn_prefect.model.issues import InvalidInput, Issue

event_app = typer.Typer(help="Events that start bundles' triggered runs (a bundle's `triggers`).",
                        no_args_is_help=True)


def _payload(text: str) -> dict[str, Any]:
    if text.startswith("@"):
        from pathlib import Path

        try:
            text = Path(text[1:]).read_text()
        except OSError as error:
            raise InvalidInput([Issue("--payload-json", f"cannot read {text[1:]}: {error.strerror}")]) from None
    try:
        value = json.loads(text) if text else {}
    except ValueError as error:
        raise InvalidInput([Issue("--payload-json", f"not JSON: {error}")]) from None
    if not isinstance(value, dict):
        raise InvalidInput([Issue("--payload-json", "must be a JSON object")])
    return value


@event_app.command("emit")
def event_emit(
    event_type: Annotated[str, typer.Argument(metavar="EVENT_TYPE", help="The event's name (a trigger's event_type).")],
    payload_json: Annotated[str, typer.Option("--payload-json", help="The payload: a JSON object, or @file.json.")] = "",
    source: Annotated[str, typer.Option("--source", help="Who sends it (the label mn.source).")] = "mn-prefect",
    as_json: JsonFlag = False,
) -> None:
    """Send an event to the Prefect server: every bundle trigger on EVENT_TYPE whose filters match the payload
    starts a run of its bundle, with the event as the run's input (MN_TRIGGER_EVENT_JSON)."""
    from prefect.client.orchestration import get_client

    from mn_prefect.bundles.triggers import check_event_type, emit_trigger_event

    check_event_type(event_type)
    payload = _payload(payload_json)
    with get_client(sync_client=True) as client:
        event = emit_trigger_event(client, event_type, payload, source=source)
    if as_json:
        render.print_json({"event_id": event["id"], "event": event_type, "payload": payload, "status": "emitted"})
    else:
        render.console.print(f"emitted {event_type} (event {event['id']})", soft_wrap=True)


@event_app.command("list")
def event_list(limit: Annotated[int, typer.Option("--limit", min=1, max=50, help="How many, newest first.")] = 20,
               as_json: JsonFlag = False) -> None:
    """The latest events sent with `event emit` (or MirrorNeuron's `mn event emit`), newest first."""
    from prefect.client.orchestration import get_client

    from mn_prefect.bundles.triggers import list_trigger_events

    with get_client(sync_client=True) as client:
        events = list_trigger_events(client, limit)
    render.json_or_table(events, as_json, "trigger events", ("occurred", "event", "source", "payload", "id"),
                         ((e["occurred"], e["event"], e["source"] or "", json.dumps(e["payload"])[:80], e["id"])
                          for e in events))
