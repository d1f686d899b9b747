"""The schema an ``mn`` pool carries (its base job template's variables), shaped from pydantic's schema of
``MNVariables`` (worker/variables.py): readable names, no null switches, canonical fields only in the form, and the
server's rules for what the form does not show (the aliases of docs/resources.md, numbers written as strings)."""

from __future__ import annotations

import copy
from typing import Any

from mn_prefect.model.amounts import SIZE_UNITS
from mn_prefect.model.resources import MAX_DEVICE_COUNT, SCALAR_FIELDS

# What the form shows for a quantity, and what the server accepts for one (see pool_schema).
_FORM_QUANTITY = {"type": "number", "minimum": 0}
_FORM_COUNT = {"type": "integer", "minimum": 0, "maximum": MAX_DEVICE_COUNT}
_WHOLE = r"^\s*\d+\s*$"
# Amounts with units (model/amounts.py): millicores for CPU ("500m"), decimal and binary units for sizes ("4G",
# "512Mi", "4 GiB"); the worker's parser reads them and names the field of a malformed one.
_CORES = r"^\s*(\d+(\.\d*)?|\.\d+)\s*m?\s*$"
_SIZE = r"^\s*(\d+(\.\d*)?|\.\d+)\s*([kKmMgGtTpPeE][iI]?)?[bB]?\s*$"
_SERVER_QUANTITY = {"if": {"anyOf": [{"type": "string", "pattern": _CORES}, {"type": "null"}]}, "then": True,
                    "else": {"type": "number", "minimum": 0}}
_SERVER_SIZE = {"if": {"anyOf": [{"type": "string", "pattern": _SIZE}, {"type": "null"}]}, "then": True,
                "else": {"type": "number", "minimum": 0}}
_SERVER_COUNT = {"if": {"anyOf": [{"type": "string", "pattern": _WHOLE}, {"type": "null"}]}, "then": True,
                 "else": {"type": "integer", "minimum": 0, "maximum": MAX_DEVICE_COUNT}}

# The aliases of docs/resources.md (model/resources.py's SCALAR_FIELDS): accepted from prefect.yaml and the API, not
# shown in the form.
_QUANTITY_ALIASES = tuple(key for name, (kind, keys) in SCALAR_FIELDS.items() if kind == "quantity"
                          for key, unit in keys.items() if key != name and unit not in SIZE_UNITS)
_SIZE_ALIASES = tuple(key for name, (kind, keys) in SCALAR_FIELDS.items() if kind == "quantity"
                      for key, unit in keys.items() if key != name and unit in SIZE_UNITS)
_COUNT_ALIASES = tuple(key for name, (kind, keys) in SCALAR_FIELDS.items() if kind == "count"
                       for key in keys if key != name)

_NAMES = {"ResourcesVariable": "Resources", "ConstraintVariable": "Constraint", "BookingVariable": "Booking",
          "SystemCopyVariable": "SystemCopy", "DeviceInput": "Device", "PortInput": "Port",
          "VolumeInput": "Volume", "HealthVariable": "Health"}
_QUANTITY_FIELDS = {"Resources": ("cpu_cores",)}
_SIZE_FIELDS = {"Resources": ("memory_mb", "disk_mb"), "Device": ("min_memory_mb", "memory_mb")}
_COUNT_FIELDS = {"Resources": ("gpu_count",)}
_RESOURCES_ID = "urn:mn-prefect:pool-schema:resources"


def _rename_refs(node: Any) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#/definitions/"):
                name = value.rsplit("/", 1)[1]
                value = f"#/definitions/{_NAMES.get(name, name)}"
            out[key] = _rename_refs(value)
        return out
    if isinstance(node, list):
        return [_rename_refs(v) for v in node]
    return node


def _no_null_toggle(prop: dict[str, Any]) -> dict[str, Any]:
    """``X or null, default null`` (pydantic's Optional) becomes X with no default: the form shows an empty X
    (not an X/None switch and a None), and the server still accepts null for a field without a default."""
    if prop.get("default", ...) is not None:
        return prop
    options = prop.get("anyOf")
    if not options or len(options) != 2 or {"type": "null"} not in options:
        return {k: v for k, v in prop.items() if k != "default"}
    (kept,) = [o for o in options if o != {"type": "null"}]
    out = {k: v for k, v in prop.items() if k not in ("anyOf", "default")}
    return {**kept, **out}


def pool_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The pool's variables schema, from pydantic's: readable names, no null switches, canonical fields only in
    the form, and the server's rules for what the form does not show (aliases, numbers written as strings).

    How one schema serves both: the Prefect UI resolves every ``#/definitions/NAME`` against the top-level
    definitions, while the server's JSON Schema validator resolves it inside the nearest ``$id``. So inside
    Resources (which has an ``$id``), ``#/definitions/Quantity`` (CPU) and ``#/definitions/Size`` (memory, disk)
    are number inputs in the form and, for the server, a number or a numeric string (or an amount with a unit:
    "500m" of CPU, "4G" of memory).
    """
    schema = _rename_refs(copy.deepcopy(schema))
    definitions = {_NAMES.get(name, name): d for name, d in schema.pop("definitions", {}).items()}
    for name, definition in definitions.items():
        definition["additionalProperties"] = False  # inside the request an unknown key is a typo: refuse it
        properties = definition.get("properties", {})
        for key in list(properties):
            properties[key] = _no_null_toggle(properties[key])
        for key in _QUANTITY_FIELDS.get(name, ()):
            properties[key] = _as_ref(properties[key], "Quantity")
        for key in _SIZE_FIELDS.get(name, ()):
            properties[key] = _as_ref(properties[key], "Size")
        for key in _COUNT_FIELDS.get(name, ()):
            properties[key] = _as_ref(properties[key], "Count")
    resources = definitions["Resources"]
    for key in ("devices", "ports", "volumes"):  # inline, so the refs inside Resources are only Quantity and Count
        item = resources["properties"][key]["items"]
        resources["properties"][key]["items"] = copy.deepcopy(definitions.pop(item["$ref"].rsplit("/", 1)[1]))
    # Aliases: validated by the server, absent from the form (which renders "properties" only).
    resources["patternProperties"] = {
        f"^({'|'.join(_QUANTITY_ALIASES)})$": {"$ref": "#/definitions/Quantity"},
        f"^({'|'.join(_SIZE_ALIASES)})$": {"$ref": "#/definitions/Size"},
        f"^({'|'.join(_COUNT_ALIASES)})$": {"$ref": "#/definitions/Count"},
    }
    del resources["additionalProperties"]
    resources["unevaluatedProperties"] = False  # names the unknown key, not the alias patterns
    resources["$id"] = _RESOURCES_ID
    resources["definitions"] = {"Quantity": _SERVER_QUANTITY, "Size": _SERVER_SIZE, "Count": _SERVER_COUNT}
    definitions["Quantity"] = dict(_FORM_QUANTITY)
    definitions["Size"] = dict(_FORM_QUANTITY)
    definitions["Count"] = dict(_FORM_COUNT)
    for key in list(schema.get("properties", {})):
        schema["properties"][key] = _no_null_toggle(schema["properties"][key])
    # Every field carries its place in the form: a Prefect server on PostgreSQL keeps the template as JSONB, which
    # does not keep the keys' order, and the UI orders fields by "position" where they have one.
    for properties in [schema["properties"], *(d.get("properties", {}) for d in definitions.values()),
                       *(resources["properties"][key]["items"].get("properties", {}) for key in ("devices", "ports",
                                                                                                  "volumes"))]:
        for position, prop in enumerate(properties.values()):
            prop["position"] = position
    schema["definitions"] = definitions
    return schema


def _as_ref(prop: dict[str, Any], name: str) -> dict[str, Any]:
    keep = {k: v for k, v in prop.items() if k in ("title", "description", "examples")}
    return {"$ref": f"#/definitions/{name}", **keep}
