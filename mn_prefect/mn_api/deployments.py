"""MirrorNeuron's deployments (``mirrorneuron.job.v1.JobService``: DeployJob ... FailDeployment) on Prefect.

A deployment is a bundle kept under a stable key, version by version: ``<bundles root>/<key>/v<N>`` holds each
version's bundle and ``<bundles root>/<key>/deployment.json`` the rollout's state. In Prefect it is one deployment,
``mn-bundle-run/<key>``, whose version label and default bundle are the stable version's; each version's runs are
flow runs of it with that version's bundle, tagged ``mn-deployment:<key>``, ``mn-version:v<N>`` and, for a canary,
``mn-canary`` (filter the runs list by them). What happens when is decided in mn_prefect.bundles.rollout; this
module reads the runs, carries the decisions out and keeps the state. The API server advances every rollout under
way each second (``advance_all``), so that a healthy canary is promoted or a failing version failed with nobody
asking.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mn_prefect.bundles import rollout
from mn_prefect.bundles.rollout import CancelRuns, Deployment, Effect, MakeStable, RolloutRefused, RunSeen, StartRuns
from mn_prefect.mn_api import runs
from mn_prefect.mn_api.cluster import json_object
from mn_prefect.mn_api.errors import ApiError, from_invalid_input, not_found, refused
from mn_prefect.mn_api.jobs import Jobs, check_id, manifest_object
from mn_prefect.model.issues import InvalidInput

STATE_FILE = "deployment.json"
DEPLOYMENT_TAG = "mn-deployment:"
VERSION_TAG = "mn-version:"
CANARY_TAG = "mn-canary"
WAIT_S = 300.0
# What MirrorNeuron's clients send as the update policy when they are given none (mn_sdk.deployment_policy()).
CLIENT_DEFAULTS = {"strategy": "rolling", "canary": 0, "max_parallel": 1, "auto_promote": False, "auto_revert": False}


def _now() -> datetime:
    return datetime.now(UTC)


def _section(doc: dict[str, Any], name: str) -> dict[str, Any]:
    value = doc.get(name)
    return value if isinstance(value, dict) else {}


class Deployments:
    def __init__(self, jobs: Jobs):
        self.jobs = jobs
        self._lock = threading.RLock()  # one change at a time: the watcher and the RPCs share the state files

    # -- files -------------------------------------------------------------------------------------------------

    def _folder(self, key: str) -> Path:
        return self.jobs.bundles_root / key

    def _read(self, key: str) -> Deployment | None:
        path = self._folder(key) / STATE_FILE
        return Deployment.model_validate_json(path.read_text()) if path.is_file() else None

    def _find(self, id_or_key: str) -> Deployment:
        state = self._read(check_id(id_or_key, "id_or_key")) if id_or_key else None
        if state is None:
            raise not_found(f"unknown deployment {id_or_key!r}: no bundle was deployed under that key")
        return state

    def _write(self, state: Deployment) -> None:
        folder = self._folder(state.key)
        temporary = folder / f".{STATE_FILE}.{uuid.uuid4().hex[:6]}"
        temporary.write_text(state.model_dump_json(indent=2))
        temporary.replace(folder / STATE_FILE)

    def _keys(self) -> list[str]:
        root = self.jobs.bundles_root
        return sorted(f.name for f in root.iterdir() if (f / STATE_FILE).is_file()) if root.is_dir() else []

    # -- Prefect -----------------------------------------------------------------------------------------------

    def _seen(self, client, key: str) -> tuple[dict[str, RunSeen], dict[str, Any]]:
        """Each of the deployment's runs by run id: (what the rules read, the flow run)."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

        flow_runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[DEPLOYMENT_TAG + key])))
        seen, by_run = {}, {}
        for flow_run in flow_runs:
            run_id = next((t[len(runs.RUN_TAG):] for t in flow_run.tags if t.startswith(runs.RUN_TAG)), None)
            if run_id is None:
                continue
            state = flow_run.state_type.value if flow_run.state_type else None
            seen[run_id] = RunSeen(state=state, started=flow_run.start_time)
            by_run[run_id] = flow_run
        return seen, by_run

    def _deploy_version(self, client, key: str, number: int) -> str:
        """``mn-bundle-run/<key>`` on the version's bundle, labelled with it: (Prefect deployment id)."""
        from mn_prefect.bundles.deploy import deploy_bundle

        bundle = self.jobs._load(self._folder(key) / f"v{number}")
        try:
            with self.jobs._deploying:
                deployment_id, _ = deploy_bundle(client, bundle, self.jobs.pool, name=key, version=f"v{number}",
                                                   lifecycle="register")
        except ValueError as error:
            raise refused(str(error)) from None
        return str(deployment_id)

    def _carry_out(self, client, state: Deployment, effects: list[Effect]) -> None:
        """The rules' effects, in order; a version's new runs get their flow-run ids in ``state``."""
        seen, by_run = self._seen(client, state.key) if any(isinstance(e, CancelRuns) for e in effects) else ({}, {})
        for effect in effects:
            if isinstance(effect, StartRuns):
                deployment = client.read_deployment_by_name(f"mn-bundle-run/{state.key}")
                version = state.version(effect.version)
                assert version is not None
                for planned in version.runs:
                    if planned.run_id not in effect.run_ids or planned.flow_run_id:
                        continue
                    tags = [DEPLOYMENT_TAG + state.key, VERSION_TAG + f"v{effect.version}", runs.RUN_TAG + planned.run_id,
                            runs.JOB_TAG + state.key] + ([CANARY_TAG] if effect.canary else [])
                    flow_run = client.create_flow_run_from_deployment(
                        deployment.id, tags=tags,
                        parameters={"bundle_path": str(self._folder(state.key) / f"v{effect.version}"),
                                    "run_id": planned.run_id})
                    planned.flow_run_id = str(flow_run.id)
            elif isinstance(effect, CancelRuns):
                version = state.version(effect.version)
                assert version is not None
                for planned in version.runs:
                    flow_run = by_run.get(planned.run_id)
                    if flow_run is None or flow_run.state_type is None or flow_run.state_type.value in (
                            "COMPLETED", "FAILED", "CRASHED", "CANCELLED", "CANCELLING"):
                        continue
                    runs.cancel_flow_run(client, flow_run, effect.reason)
            elif isinstance(effect, MakeStable):
                self._deploy_version(client, state.key, effect.version)

    # -- the view ------------------------------------------------------------------------------------------------

    def _view(self, state: Deployment, seen: dict[str, RunSeen], by_run: dict[str, Any]) -> dict[str, Any]:
        now = _now()
        latest = state.versions[-1] if state.versions else None
        stable = state.stable
        versions = []
        for version in state.versions:
            run_views = []
            for planned in version.runs:
                health, why = rollout.run_health(seen.get(planned.run_id), state.policy, now)
                flow_run = by_run.get(planned.run_id)
                run_views.append({"run_id": planned.run_id, "flow_run_id": planned.flow_run_id,
                                  "state": seen[planned.run_id].state if planned.run_id in seen else None,
                                  "health": health, "health_detail": why,
                                  "flow_run_name": flow_run.name if flow_run is not None else None})
            versions.append({**version.model_dump(mode="json", exclude={"runs"}), "runs": run_views})
        return {"deployment_id": state.key, "id": state.key, "deployment_key": state.key, "key": state.key,
                "status": state.status, "status_description": state.status_description,
                "version": latest.version if latest else None, "stable_version": stable.version if stable else None,
                "job_id": latest.runs[0].run_id if latest and latest.runs else None,
                "policy": state.policy.model_dump(mode="json"), "versions": versions,
                "prefect_deployment": f"mn-bundle-run/{state.key}",
                "created_at": state.created_at.isoformat(), "updated_at": state.updated_at.isoformat(),
                "interface_version": 1}

    def _answer(self, client, state: Deployment) -> dict[str, Any]:
        seen, by_run = self._seen(client, state.key)
        return self._view(state, seen, by_run)

    # -- deploy --------------------------------------------------------------------------------------------------

    def deploy(self, manifest_json: str, payloads: dict[str, bytes], key: str, policy_json: str, *,
               wait: bool, update: bool = False) -> dict[str, Any]:
        """DeployJob (and UpdateDeployment, which needs the key to exist): a new version of the bundle."""
        manifest = manifest_object(manifest_json)
        key = check_id(key or str(_section(manifest, "deployment").get("key") or "") or f"dep-{time.time_ns():x}",
                       "deployment_key")
        given = {k: v for k, v in json_object(policy_json or "{}", "update_policy_json").items() if k != "version"}
        # The client's policy over the manifest's own (policies.update). MirrorNeuron's clients always send one; one
        # that says nothing but their defaults leaves the manifest's ("version" is the interface's, not a field).
        if given == CLIENT_DEFAULTS:
            given = {}
        policy_doc = {**_section(_section(manifest, "policies"), "update"), **given}
        try:
            policy = rollout.parse_policy(policy_doc, "update_policy")
        except InvalidInput as error:
            raise from_invalid_input(error) from None
        folder = self._folder(key)
        with self._lock:
            state = self._read(key)
            if state is None and update:
                raise not_found(f"unknown deployment {key!r}: deploy it first (mn deployment deploy)")
            if state is None and folder.exists():
                raise ApiError("ALREADY_EXISTS", f"{key!r} is a job or schedule of this server, not a deployment")
            number = rollout.next_version(state)
            staged = self.jobs._stage(f"{key}-v{number}", json.dumps(manifest), payloads, "{}")
            folder.mkdir(parents=True, exist_ok=True)
            staged.rename(folder / f"v{number}")
            tag = str(manifest.get("version") or "")
            new_state, effects = rollout.deploy(state, key, policy, _now(), tag=tag)
            try:
                with self.jobs.prefect_client() as client:
                    if state is None:
                        self._deploy_version(client, key, number)  # the Prefect deployment the runs come from
                    self._carry_out(client, new_state, effects)
            except BaseException:
                shutil.rmtree(folder / f"v{number}", ignore_errors=True)
                if state is None:
                    shutil.rmtree(folder, ignore_errors=True)
                raise
            self._write(new_state)
        return self._settle(key) if wait else self.get(key)

    def _settle(self, key: str, timeout: float = WAIT_S) -> dict[str, Any]:
        """``wait``: until the version rolled out is stable, awaits promotion or failed (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            view = self.advance(key)
            if view["status"] != "running" or time.monotonic() > deadline:
                return view
            time.sleep(0.5)

    # -- the rollout under way -------------------------------------------------------------------------------------

    def advance(self, key: str) -> dict[str, Any]:
        with self._lock, self.jobs.prefect_client() as client:
            state = self._find(key)
            seen, by_run = self._seen(client, key)
            new_state, effects = rollout.advance(state, seen, _now())
            if new_state is not state:
                self._carry_out(client, new_state, effects)
                self._write(new_state)
                seen, by_run = self._seen(client, key)
            return self._view(new_state, seen, by_run)

    def advance_all(self) -> None:
        """Each deployment with a rollout under way, one step (the API server calls this each second)."""
        for key in self._keys():
            state = self._read(key)
            if state is not None and state.rolling_out is not None and state.status != "paused":
                self.advance(key)

    # -- read ------------------------------------------------------------------------------------------------------

    def get(self, id_or_key: str) -> dict[str, Any]:
        state = self._find(id_or_key)
        with self.jobs.prefect_client() as client:
            return self._answer(client, state)

    def list(self, query_json: str) -> dict[str, Any]:
        query = json_object(query_json or "{}", "query_json")
        found = []
        for key in self._keys():
            state = self._read(key)
            if state is None or (query.get("status") and state.status != query["status"]):
                continue
            latest = state.versions[-1] if state.versions else None
            found.append({"deployment_id": key, "deployment_key": key, "status": state.status,
                          "status_description": state.status_description,
                          "version": latest.version if latest else None,
                          "stable_version": state.stable.version if state.stable else None,
                          "strategy": state.policy.strategy, "updated_at": state.updated_at.isoformat()})
        return {"data": found, "count": len(found), "version": 1}

    # -- act -------------------------------------------------------------------------------------------------------

    def _act(self, id_or_key: str, decide) -> dict[str, Any]:
        with self._lock, self.jobs.prefect_client() as client:
            state = self._find(id_or_key)
            seen, _ = self._seen(client, state.key)
            try:
                new_state, effects = decide(state, seen, _now())
            except RolloutRefused as error:
                raise refused(str(error)) from None
            self._carry_out(client, new_state, effects)
            self._write(new_state)
            return self._answer(client, new_state)

    def promote(self, id_or_key: str) -> dict[str, Any]:
        return self._act(id_or_key, rollout.promote)

    def fail(self, id_or_key: str, reason: str) -> dict[str, Any]:
        return self._act(id_or_key, lambda state, seen, now: rollout.fail(state, reason, now))

    def pause(self, id_or_key: str, reason: str) -> dict[str, Any]:
        return self._act(id_or_key, lambda state, seen, now: (rollout.pause(state, now), []))

    def resume(self, id_or_key: str, reason: str) -> dict[str, Any]:
        return self._act(id_or_key, lambda state, seen, now: (rollout.resume(state, now), []))

    def rollback(self, id_or_key: str, version: str, tag: str, reason: str) -> dict[str, Any]:
        """A new version running an older version's bundle (copied), rolled out without canaries."""
        with self._lock:
            state = self._find(id_or_key)
            try:
                source = rollout.rollback_source(state, version, tag)
            except RolloutRefused as error:
                raise refused(str(error)) from None
            number = rollout.next_version(state)
            folder = self._folder(state.key)
            shutil.copytree(folder / f"v{source.version}", folder / f"v{number}")
            new_state, effects = rollout.deploy(state, state.key, state.policy, _now(), tag=source.tag,
                                                source=source.version)
            rolled = new_state.version(number)
            assert rolled is not None
            rolled.reason = f"rollback to v{source.version}" + (f": {reason}" if reason else "")
            try:
                with self.jobs.prefect_client() as client:
                    self._carry_out(client, new_state, effects)
                    self._write(new_state)
                    return self._answer(client, new_state)
            except BaseException:
                shutil.rmtree(folder / f"v{number}", ignore_errors=True)
                raise
