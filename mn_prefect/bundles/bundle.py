"""A MirrorNeuron bundle on disk (docs/bundles.md, "The bundle folder and its manifest"): ``manifest.json``,
``payloads/``, ``config/``.

``load_bundle`` reads a bundle folder or a manifest file, merges ``config/default.json`` + ``overwrite.json`` +
``--set`` overrides as MirrorNeuron's CLI does, applies ``manifest_config_bindings`` and parses the manifest
once into a ``WorkflowSpec``. Problems come back as issues with their paths; nothing is written.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mn_prefect.bundles.schedule import parse_schedule
from mn_prefect.bundles.services import parse_services
from mn_prefect.bundles.source import expand, is_source
from mn_prefect.bundles.triggers import parse_triggers
from mn_prefect.model.issues import InvalidInput, Issue, Issues
from mn_prefect.model.json_text import parse_json
from mn_prefect.workflow.manifest import WorkflowSpec, parse_workflow

MANIFEST = "manifest.json"
DEFAULT_RUNS_ROOT = "~/.mn/runs"


@dataclass(frozen=True)
class Bundle:
    root: Path  # the folder holding manifest.json, payloads/ and config/
    manifest_path: Path
    document: dict[str, Any]  # the manifest after config bindings
    config: dict[str, Any]  # the merged blueprint config
    spec: WorkflowSpec
    source_format: bool = False  # expanded from MirrorNeuron's source format (mn_prefect.bundles.source)

    @property
    def payloads(self) -> Path:
        return self.root / "payloads"

    @property
    def upload_roots(self) -> tuple[Path, ...]:
        """Where upload paths are read from: payloads/, and for a source-format blueprint then its top folder (where
        it keeps config/ and examples/, which MirrorNeuron's submission stages with its payloads)."""
        return (self.payloads, self.root) if self.source_format else (self.payloads,)


def deep_merge(base: Any, override: Any) -> Any:
    """Objects merge key by key; anything else in ``override`` replaces ``base``."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = deep_merge(base.get(key), value) if key in base else copy.deepcopy(value)
        return out
    return copy.deepcopy(override)


def _read_json(path: Path, label: str, issues: Issues) -> Any:
    try:
        return parse_json(path.read_text(encoding="utf-8"))
    except RecursionError:
        issues.add(label, f"{path} is nested too deeply")
    except FileNotFoundError:
        issues.add(label, f"{path} not found")
    except json.JSONDecodeError as error:
        issues.add(label, f"{path} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}")
    except OSError as error:
        issues.add(label, f"{path} cannot be read: {error.strerror}")
    return None


def parse_set(items: list[str] | tuple[str, ...], issues: Issues) -> dict[str, Any]:
    """``--set a.b=value`` overrides (the value is JSON when it parses, else a string) as one nested object."""
    out: dict[str, Any] = {}
    for i, item in enumerate(items):
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            issues.add(f"--set[{i}]", f"expected KEY.PATH=VALUE, got {item!r}")
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        cursor = out
        parts = key.split(".")
        for part in parts[:-1]:
            cursor = cursor.setdefault(part, {})
            if not isinstance(cursor, dict):
                issues.add(f"--set[{i}]", f"{key!r} conflicts with an earlier --set")
                break
        else:
            cursor[parts[-1]] = value
    return out


def _get(doc: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc


def _put(doc: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        nxt = doc.get(part)
        if not isinstance(nxt, dict):
            nxt = doc[part] = {}
        doc = nxt
    doc[parts[-1]] = value


# The operator-lifecycle sections that name config values in place (``"port": "${config.service.port}"``).
CONFIG_REF_SECTIONS = ("services", "triggers", "schedule")
_CONFIG_REF = re.compile(r"\$\{config\.([A-Za-z0-9_.\-]+)\}")


def resolve_config_refs(value: Any, config: dict[str, Any], path: str, issues: Issues) -> Any:
    """``value`` with each ``${config.a.b}`` replaced by that config value: a string that is only the reference
    takes the value itself (a number stays a number), one with text around it the value as text; a reference to
    nothing is an issue naming where it is."""
    if isinstance(value, dict):
        return {k: resolve_config_refs(v, config, f"{path}.{k}", issues) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_config_refs(v, config, f"{path}[{i}]", issues) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${config." not in value:
        return value
    def lookup(match: re.Match[str]) -> Any:
        found = _get(config, match.group(1))
        if found is None:
            issues.add(path, f"{match.group(0)} names no value of the bundle's config")
        return found

    whole = _CONFIG_REF.fullmatch(value)
    if whole is not None:
        found = lookup(whole)
        return value if found is None else found
    return _CONFIG_REF.sub(lambda m: m.group(0) if (found := lookup(m)) is None
                           else found if isinstance(found, str) else json.dumps(found), value)


def apply_bindings(document: dict[str, Any], config: dict[str, Any], issues: Issues) -> dict[str, Any]:
    """``config.manifest_config_bindings``: copy config values into manifest paths (docs/bundles.md)."""
    bindings = config.get("manifest_config_bindings") or []
    if not isinstance(bindings, list):
        issues.add("config.manifest_config_bindings", "must be a list")
        return document
    out = copy.deepcopy(document)
    for i, binding in enumerate(bindings):
        where = f"config.manifest_config_bindings[{i}]"
        if not isinstance(binding, dict):
            issues.add(where, "must be an object with config_path and manifest_path")
            continue
        source = binding.get("config_path", binding.get("from"))
        target = binding.get("manifest_path", binding.get("to"))
        if not isinstance(source, str) or not isinstance(target, str):
            issues.add(where, "needs config_path (or from) and manifest_path (or to) strings")
            continue
        value = _get(config, source)
        if value is None and not binding.get("allow_null"):
            continue
        if binding.get("stringify") and not isinstance(value, str):
            value = json.dumps(value)
        _put(out, target, value)
    return out


def locate(path: Path) -> tuple[Path, Path] | Issue:
    """(bundle root, manifest file) for a bundle folder or a manifest file."""
    if path.is_dir():
        manifest = path / MANIFEST
        if not manifest.is_file():
            return Issue("PATH", f"{path} is a folder without {MANIFEST}: not a MirrorNeuron bundle")
        return path, manifest
    if path.is_file():
        return path.parent, path
    return Issue("PATH", f"{path} does not exist")


def load_bundle(path: str | Path, overrides: dict[str, Any] | None = None) -> Bundle:
    """The bundle at ``path`` parsed for running; raises InvalidInput with every problem."""
    issues = Issues()
    found = locate(Path(path).expanduser())
    if isinstance(found, Issue):
        raise InvalidInput([found])
    root, manifest_path = found
    raw = _read_json(manifest_path, "manifest", issues)
    config: dict[str, Any] = {}
    for name in ("default.json", "overwrite.json"):
        config_file = root / "config" / name
        if config_file.is_file():
            layer = _read_json(config_file, f"config/{name}", issues)
            if layer is not None and not isinstance(layer, dict):
                issues.add(f"config/{name}", "must be a JSON object")
            elif layer is not None:
                config = deep_merge(config, layer)
    if overrides:
        config = deep_merge(config, overrides)
    issues.raise_if_any()
    if not isinstance(raw, dict):
        raise InvalidInput([Issue("manifest", "must be a JSON object")])
    source_format = is_source(raw)
    if source_format:
        raw = expand(raw, root)
    document = apply_bindings(raw, config, issues)
    for section in CONFIG_REF_SECTIONS:
        if section in document:
            document[section] = resolve_config_refs(document[section], config, section, issues)
    issues.raise_if_any()
    spec, problems = parse_workflow(document)
    problems = list(problems)
    scheduling = Issues()
    parse_schedule(document, scheduling)
    parse_triggers(document, scheduling)
    parse_services(document, scheduling)
    problems += scheduling.items
    if spec is not None:
        roots = (root / "payloads", root) if source_format else (root / "payloads",)
        for agent in spec.agents.values():
            for rel in [agent.upload_path, *(u.source for u in agent.upload_paths)]:
                holder = next((r for r in roots if rel and (r / rel).exists()), None)
                if rel and holder is None:
                    problems.append(Issue(f"agents.nodes[{agent.node_id}].config.upload_path",
                                          f"payloads/{rel} does not exist in the bundle {root}"))
                elif rel and holder is not None and not (holder / rel).resolve().is_relative_to(holder.resolve()):
                    where = "payloads/" if holder == roots[0] else ""
                    problems.append(Issue(f"agents.nodes[{agent.node_id}].config.upload_path",
                                          f"{where}{rel} escapes the bundle through a link"))
            problems += _sandbox_issues(agent, roots, root)
            if agent.build is not None and not (root / "payloads" / agent.build / "Dockerfile").is_file():
                problems.append(Issue(f"agents.nodes[{agent.node_id}].config.build",
                                      f"payloads/{agent.build}/Dockerfile does not exist: the image is built from it"))
    if problems or spec is None:
        raise InvalidInput(problems)
    return Bundle(root=root.resolve(), manifest_path=manifest_path.resolve(), document=document, config=config,
                  spec=spec, source_format=source_format)


def _sandbox_issues(agent, roots: tuple[Path, ...], root: Path) -> list[Issue]:
    """A step stays in its sandbox: its workdir inside it (the manifest's parser keeps its upload targets there),
    and no link in an uploaded folder to a place outside the bundle (it would be copied in as a way out)."""
    from mn_prefect.bundles.process import SandboxEscape, sandbox_relative

    field = f"agents.nodes[{agent.node_id}].config"
    issues: list[Issue] = []
    rel = sandbox_relative(agent)
    if isinstance(rel, SandboxEscape):
        issues.append(Issue(f"{field}.workdir", rel.why))
    inside = root.resolve()
    for source in [agent.upload_path, *(u.source for u in agent.upload_paths)]:
        holder = next((r for r in roots if source and (r / source).is_dir()), None)
        if holder is None:
            continue
        for folder, dirs, files in os.walk(holder / source):
            for name in dirs + files:
                path = Path(folder) / name
                if path.is_symlink() and not path.resolve().is_relative_to(inside):
                    shown = path.relative_to(holder)
                    issues.append(Issue(f"{field}.upload_path", f"{shown} is a link to a place outside the bundle"))
    return issues


def runs_root(value: str | None = None) -> Path:
    """``--runs-root``, else ``MN_RUNS_ROOT``, else ``~/.mn/runs`` (MirrorNeuron's default)."""
    return Path(value or os.environ.get("MN_RUNS_ROOT") or DEFAULT_RUNS_ROOT).expanduser().resolve()


def declared_runs_root(bundle: Bundle) -> str | None:
    """The run store every agent's ``config.environment`` names in ``MN_RUNS_ROOT``, where they agree (None
    otherwise). MirrorNeuron's CLI writes it into a submitted manifest (its shared storage), and its runtime keeps
    the run store there: the steps write their files (``human.jsonl``, ``final_artifact.json``) there whatever the
    runner's own default, so the runner's gate and records must look there too."""
    named = {agent.environment.get("MN_RUNS_ROOT") for agent in bundle.spec.agents.values()}
    return next(iter(named)) if len(named) == 1 and None not in named and "" not in named else None


def run_config(bundle: Bundle, run_id: str, root: Path) -> dict[str, Any]:
    """The config a run's workers see as ``MN_BLUEPRINT_CONFIG_JSON``: with the run's identity and outputs."""
    return deep_merge(bundle.config, {"identity": {"run_id": run_id},
                                      "outputs": {"run_root": str(root), "write_run_store": True}})
