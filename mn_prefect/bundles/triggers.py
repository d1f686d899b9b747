"""A bundle's ``triggers`` as Prefect automations that run its deployment when a matching event arrives.

MirrorNeuron's trigger (``{"name": "dataset-uploaded", "event_type": "dataset_uploaded", "filters": {"path":
{"prefix": "/demo/"}}, "enabled": true}``) becomes one automation per trigger: a reactive Prefect event trigger on
the event's name, whose action runs the bundle's ``mn-bundle-run/<name>`` deployment with the event as the run's
``trigger`` parameter. The run's steps see it as ``MN_TRIGGER_EVENT_JSON`` (``{"event", "id", "occurred",
"payload"}``).

Filters match the event's payload. Prefect matches events on their resource's labels, so an event that mn-prefect
emits (``mn-prefect event emit``, the MirrorNeuron API's ``EmitTriggerEvent``) carries each top-level scalar of its
payload as the label ``mn.payload.<field>``; a filter on ``field`` is a match on that label: a value (equality) or
``{"prefix": "..."}``. Any other Prefect event of that name starts the run when it carries those labels too (and
always, for a trigger without filters).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from mn_prefect.model.issues import Issues
from mn_prefect.model.scalars import as_object

PAYLOAD_LABEL = "mn.payload."
EVENT_RESOURCE = "mn.event."
TRIGGER_PARAMETER = "trigger"
TRIGGER_ENV = "MN_TRIGGER_EVENT_JSON"
# A Prefect event name: dotted words (MirrorNeuron's event types are single words such as dataset_uploaded).
_EVENT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_FIELD = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$")


@dataclass(frozen=True)
class BundleTrigger:
    name: str
    event_type: str
    match: dict[str, str | list[str]] = field(default_factory=dict)
    enabled: bool = True


def _label_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def _match(filters: Any, where: str, issues: Issues) -> dict[str, str | list[str]]:
    if filters is None:
        return {}
    if not isinstance(filters, dict):
        issues.add(where, "must be an object mapping payload fields to a value or {\"prefix\": ...}")
        return {}
    match: dict[str, str | list[str]] = {}
    for name, rule in filters.items():
        path = f"{where}.{name}"
        if not _FIELD.match(str(name)):
            issues.add(path, "a filter names one top-level payload field (letters, digits, _ and -)")
            continue
        if isinstance(rule, (str, int, float, bool)):
            match[PAYLOAD_LABEL + name] = _label_value(rule)
        elif isinstance(rule, dict) and set(rule) == {"prefix"} and isinstance(rule["prefix"], str):
            match[PAYLOAD_LABEL + name] = rule["prefix"] + "*"
        elif isinstance(rule, dict) and set(rule) == {"equals"} and isinstance(rule["equals"], (str, int, float, bool)):
            match[PAYLOAD_LABEL + name] = _label_value(rule["equals"])
        else:
            issues.add(path, f"{json.dumps(rule)}: mn-prefect matches a value, {{\"equals\": value}} or "
                             "{\"prefix\": \"text\"}")
    return match


def parse_triggers(document: dict[str, Any], issues: Issues) -> list[BundleTrigger]:
    """The manifest's ``triggers`` (a list, or one object); every problem is an issue naming its field."""
    raw = document.get("triggers")
    if raw is None:
        return []
    items = [raw] if isinstance(raw, dict) else raw
    if not isinstance(items, list):
        issues.add("triggers", "must be a list of triggers ({name, event_type, filters, enabled})")
        return []
    triggers: list[BundleTrigger] = []
    names: set[str] = set()
    for i, item in enumerate(items):
        where = f"triggers[{i}]"
        if not isinstance(item, dict):
            issues.add(where, "must be an object ({name, event_type, filters, enabled})")
            continue
        trigger = as_object(item.get("trigger"))  # MirrorNeuron's nested form: {trigger: {event_type, filters}}
        event_type = item.get("event_type") or trigger.get("event_type")
        if not isinstance(event_type, str) or not _EVENT_NAME.match(event_type):
            issues.add(f"{where}.event_type", "the name of the event that starts a run is required "
                                              "(letters, digits, '_', '-' and '.')")
            continue
        name = item.get("name") or event_type
        if not isinstance(name, str):
            issues.add(f"{where}.name", "must be text")
            continue
        if name in names:
            issues.add(f"{where}.name", f"{name!r} names another trigger of this bundle too")
        names.add(name)
        enabled = item.get("enabled", True)
        if not isinstance(enabled, bool):
            issues.add(f"{where}.enabled", "must be true or false")
        filters = item.get("filters", trigger.get("filters"))
        triggers.append(BundleTrigger(name=name, event_type=event_type, match=_match(filters, f"{where}.filters",
                                                                                      issues),
                                      enabled=enabled is not False))
    return triggers


def event_parameter_template() -> dict[str, Any]:
    """The ``trigger`` parameter of a triggered run: Prefect renders it from the event that fired."""
    template = ('{"event": {{ event.event | tojson }}, "id": "{{ event.id }}", '
                '"occurred": "{{ event.occurred.isoformat() }}", "payload": {{ event.payload | tojson }}}')
    # json around jinja: Prefect renders the text, then parses it, so the run gets an object, not a string.
    return {"__prefect_kind": "json", "value": {"__prefect_kind": "jinja", "template": template}}


def automation_prefix(deployment_name: str) -> str:
    """How the names of a deployment's trigger automations begin (``<deployment> on <event> (<trigger>)``)."""
    return f"{deployment_name} on "


def automations(triggers: list[BundleTrigger], deployment_id: uuid.UUID, deployment_name: str) -> list[Any]:
    """One Prefect automation per trigger, owned by the deployment (Prefect removes them with it)."""
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return [AutomationCore(
        name=f"{automation_prefix(deployment_name)}{t.event_type} ({t.name})",
        description=f"mn-prefect: bundle trigger {t.name!r} of {deployment_name}",
        enabled=t.enabled,
        trigger=EventTrigger(expect={t.event_type}, match=ResourceSpecification(dict(t.match)),
                             posture=Posture.Reactive, threshold=1, within=timedelta(0)),
        actions=[RunDeployment(source="selected", deployment_id=deployment_id,
                               parameters={TRIGGER_PARAMETER: event_parameter_template()})],
        owner_resource=f"prefect.deployment.{deployment_id}",
    ) for t in triggers]


def apply_triggers(client, triggers: list[BundleTrigger], deployment_id: uuid.UUID, deployment_name: str) -> int:
    """Replace the deployment's automations with those of ``triggers``: how many there are now."""
    client.delete_resource_owned_automations(f"prefect.deployment.{deployment_id}")
    for automation in automations(triggers, deployment_id, deployment_name):
        client.create_automation(automation)
    return len(triggers)


BUNDLE_FLOW_NAME = "mn-bundle-run"  # the bundle runner flow's name (bundles/flows.py), its automations' prefix


def run_deployment_id(automation: Any) -> uuid.UUID | None:
    """The deployment a bundle trigger's automation runs (its RunDeployment action), or None."""
    for action in getattr(automation, "actions", None) or []:
        if getattr(action, "type", None) == "run-deployment" and getattr(action, "deployment_id", None):
            return action.deployment_id
    return None


def bundle_automations(client) -> list[Any]:
    """Every automation mn-prefect made for a bundle's triggers (named ``mn-bundle-run/<deployment> on ...``)."""
    return [a for a in client.read_automations() if a.name.startswith(f"{BUNDLE_FLOW_NAME}/") and " on " in a.name]


def remove_orphaned_automations(client) -> list[str]:
    """Delete each bundle trigger's automation whose deployment no longer exists (deleted in Prefect: the UI,
    ``prefect deployment delete``), which would otherwise fire into a 404: the names of those removed."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    found = [(a, run_deployment_id(a)) for a in bundle_automations(client)]
    wanted = sorted({d for _, d in found if d is not None}, key=str)
    alive = {d.id for d in client.read_deployments(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=wanted)))} if wanted else set()
    removed = []
    for automation, deployment_id in found:
        if deployment_id is not None and deployment_id not in alive:
            client.delete_automation(automation.id)
            removed.append(automation.name)
    return removed


def event_resource(payload: dict[str, Any], source: str) -> dict[str, str]:
    """The resource of an event mn-prefect emits: its id, its source, and the payload's top-level scalars as
    ``mn.payload.<field>`` labels (what trigger filters match)."""
    resource = {"prefect.resource.id": f"{EVENT_RESOURCE}{uuid.uuid4()}", "mn.source": source}
    for name, value in payload.items():
        if isinstance(value, (str, int, float, bool)) and _FIELD.match(str(name)):
            resource[PAYLOAD_LABEL + name] = _label_value(value)
    return resource


def parse_trigger_parameter(raw: Any) -> dict[str, Any] | None:
    """The ``trigger`` parameter a run was started with (rendered text, or already an object), or None."""
    if raw in (None, ""):
        return None
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return {"event": None, "payload": raw}
    return value if isinstance(value, dict) else {"event": None, "payload": value}


def check_event_type(event_type: Any, where: str = "EVENT_TYPE") -> str:
    from mn_prefect.model.issues import InvalidInput, Issue

    if not isinstance(event_type, str) or not _EVENT_NAME.match(event_type):
        raise InvalidInput([Issue(where, f"{event_type!r} is not an event name (letters, digits, '_', '-', '.')")])
    return event_type


def emit_trigger_event(client, event_type: str, payload: dict[str, Any] | None = None, *,
                       source: str = "mn-prefect") -> dict[str, Any]:
    """Send one event to the Prefect server now (``POST /events``), as the triggers of bundles match it: the
    event as sent (its ``id`` names it in the event feed)."""
    from datetime import UTC, datetime

    from mn_prefect.model.issues import InvalidInput, Issue

    check_event_type(event_type)
    payload = payload or {}
    if not isinstance(payload, dict):
        raise InvalidInput([Issue("payload", "must be a JSON object")])
    event = {"id": str(uuid.uuid4()), "occurred": datetime.now(UTC).isoformat(), "event": event_type,
             "resource": event_resource(payload, source), "related": [], "payload": payload}
    client.request("POST", "/events", json=[event]).raise_for_status()
    return event


def list_trigger_events(client, limit: int = 100) -> list[dict[str, Any]]:
    """The latest events mn-prefect emitted for triggers, newest first."""
    body = {"filter": {"resource": {"id_prefix": [EVENT_RESOURCE]}, "order": "DESC"}, "limit": max(1, min(limit, 50))}
    response = client.request("POST", "/events/filter", json=body)
    response.raise_for_status()
    events = response.json().get("events", [])
    return [{"id": e["id"], "event": e["event"], "occurred": e["occurred"], "payload": e.get("payload", {}),
             "source": e["resource"].get("mn.source")} for e in events][:limit]
