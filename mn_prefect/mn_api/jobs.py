"""Jobs and runs (``mirrorneuron.job.v1`` / ``v2.JobService``, ``ObservabilityService.StreamEvents``).

A v2 job is a bundle the client sent (manifest and payloads), written under the server's bundle folder and
deployed as ``mn-bundle-run/<job id>`` on the server's pool, exactly as ``mn-prefect blueprint deploy`` deploys a
bundle folder; a run is one flow run of that deployment, tagged ``mn-run:<run id>`` and ``mn-job:<job id>``.
v1 SubmitJob does both at once. Every nodes reads the bundle from its folder: on several machines the bundle
folder is on storage they share (docs/mirrorneuron-api.md)."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from mn_prefect.mn_api import runs
from mn_prefect.mn_api.cluster import iso, json_object
from mn_prefect.mn_api.errors import ApiError, from_invalid_input, invalid, not_found, refused
from mn_prefect.model.issues import InvalidInput
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import (
    RunControlRecord,
    WorkflowRecord,
    get_record,
    put_record,
    run_control_id,
)

ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
POLL_S = 0.5
PAUSE_ANSWER_S = 5.0  # how long a pause waits for the runner to say it holds (then it answers "pausing")


def check_id(value: str, field: str) -> str:
    if not ID.fullmatch(value):
        raise invalid(field, f"{value!r} is not an id: letters, digits, '_', '.', '-', at most 100, starting with "
                             f"a letter or digit")
    return value


def manifest_object(manifest_json: str) -> dict[str, Any]:
    """The manifest a request carries, as a JSON object; INVALID_ARGUMENT naming manifest_json when it is missing
    (an empty request body) or not an object. Whether it has agents is the bundle check's (``load_bundle``)."""
    if not manifest_json.strip():
        raise invalid("manifest_json", "is required: the job's manifest, a JSON object with its agents")
    return json_object(manifest_json, "manifest_json")


def write_bundle(folder: Path, manifest_json: str, payloads: dict[str, bytes], config: dict[str, Any]) -> None:
    """The bundle as the client sent it: manifest.json, payloads/<path> for each payload, the resolved
    configuration as config/overwrite.json. INVALID_ARGUMENT for a missing manifest or a payload path that leaves
    payloads/."""
    manifest = manifest_object(manifest_json)
    (folder / "payloads").mkdir(parents=True)
    base = (folder / "payloads").resolve()
    for name, data in payloads.items():
        target = (base / name).resolve()
        if not name or name.startswith("/") or not target.is_relative_to(base) or target == base:
            raise invalid("payloads", f"{name!r} is not a path inside payloads/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    effective = submitted_config(manifest)
    if config or effective:
        (folder / "config").mkdir()
    if effective:
        (folder / "config" / "default.json").write_text(json.dumps(effective, indent=2))
    if config:
        (folder / "config" / "overwrite.json").write_text(json.dumps(config, indent=2))


def submitted_config(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The bundle's configuration as MirrorNeuron's CLI resolved it (config/default.json and the run's overrides),
    which it sends in every agent's environment as MN_BLUEPRINT_CONFIG_JSON rather than as the bundle's config
    files: the config the manifest's ``${config.*}`` references (a service's port) are read from. None where the
    agents carry none, or disagree."""
    agents = manifest.get("agents")
    nodes = agents.get("nodes") if isinstance(agents, dict) else None
    values = set()
    for node in nodes if isinstance(nodes, list) else []:
        config = node.get("config") if isinstance(node, dict) else None
        environment = config.get("environment") if isinstance(config, dict) else None
        values.add(environment.get("MN_BLUEPRINT_CONFIG_JSON") if isinstance(environment, dict) else None)
    if len(values) != 1 or not isinstance(text := next(iter(values)), str):
        return None
    try:
        found = json.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, dict) and found else None


class Jobs:
    def __init__(self, store: ClusterStore, prefect_client: Callable[[], Any], *, pool: str, bundles_root: Path,
                 ui_url: str | None):
        self.store, self.prefect_client, self.pool = store, prefect_client, pool
        self.bundles_root, self.ui_url = bundles_root, ui_url
        # One deploy at a time: concurrent deployment writes of the same flow make a Prefect server on SQLite
        # answer 503, and its clients back off for up to half a minute; one after another each takes a second.
        self._deploying = threading.Lock()

    # -- v2 jobs: bundles deployed -----------------------------------------------------------------------------

    def _load(self, folder: Path):
        from mn_prefect.bundles.bundle import load_bundle

        try:
            return load_bundle(folder)
        except InvalidInput as error:
            raise from_invalid_input(error, "invalid manifest: ") from None

    def _stage(self, job_id: str, manifest_json: str, payloads: dict[str, bytes], config_json: str) -> Path:
        """The bundle written and checked in a fresh folder beside the jobs' (removed again when refused)."""
        config = json_object(config_json or "{}", "resolved_configuration_json")
        self.bundles_root.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{job_id}-", dir=self.bundles_root))
        try:
            write_bundle(staged, manifest_json, payloads, config)
            self._load(staged)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        return staged

    def _deploy(self, client, job_id: str, folder: Path) -> dict[str, Any]:
        from mn_prefect.bundles.deploy import deploy_bundle

        bundle = self._load(folder)
        try:
            with self._deploying:
                deployment_id, name = deploy_bundle(client, bundle, self.pool, name=job_id)
        except ValueError as error:
            raise refused(str(error)) from None
        return self._job_view(bundle, job_id, str(deployment_id), name, folder)

    def _job_view(self, bundle, job_id: str, deployment_id: str, deployment: str, folder: Path) -> dict[str, Any]:
        spec = bundle.spec
        return {"job_id": job_id, "blueprint_id": spec.blueprint_id, "job_name": spec.job_name,
                "graph_id": bundle.document.get("graph_id") or spec.blueprint_id, "status": "active",
                "steps": len(spec.steps), "deployment_id": deployment_id, "deployment": deployment, "pool": self.pool,
                "bundle_path": str(folder), "version": 1}

    def create(self, job_id: str, manifest_json: str, payloads: dict[str, bytes], config_json: str) -> dict[str, Any]:
        """v2 CreateJob: ALREADY_EXISTS for a job id in use (UpdateJob replaces a job's bundle)."""
        job_id = check_id(job_id or f"job-{time.time_ns():x}", "job_id")
        folder = self.bundles_root / job_id
        if folder.exists():
            raise ApiError("ALREADY_EXISTS", f"job {job_id!r} exists; update it (mn blueprint run --job-id {job_id})")
        staged = self._stage(job_id, manifest_json, payloads, config_json)
        staged.rename(folder)
        try:
            with self.prefect_client() as client:
                return self._deploy(client, job_id, folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def update(self, job_id: str, manifest_json: str, payloads: dict[str, bytes], attrs_json: str) -> dict[str, Any]:
        """v2 UpdateJob: with a manifest, the job's bundle is replaced (checked first) and redeployed."""
        folder = self._folder(job_id)
        attrs = json_object(attrs_json or "{}", "attrs_json")
        if manifest_json:
            config = attrs.get("resolved_configuration") or {}
            staged = self._stage(job_id, manifest_json, payloads, json.dumps(config))
            old = folder.with_name(f".{job_id}-old-{time.time_ns():x}")
            folder.rename(old)
            staged.rename(folder)
            shutil.rmtree(old, ignore_errors=True)
        with self.prefect_client() as client:
            return self._deploy(client, job_id, folder)

    def _folder(self, job_id: str) -> Path:
        folder = self.bundles_root / check_id(job_id, "job_id")
        if not (folder / "manifest.json").is_file():
            raise not_found(f"unknown job {job_id!r}: no job was created with that id")
        return folder

    def get_job(self, job_id: str) -> dict[str, Any]:
        folder = self._folder(job_id)
        with self.prefect_client() as client:
            deployment = client.read_deployment_by_name(f"mn-bundle-run/{job_id}")
        view = self._job_view(self._load(folder), job_id, str(deployment.id), f"mn-bundle-run/{job_id}", folder)
        return {**view, "runs": [r["run_id"] for r in self.list_runs(job_id)["data"]]}

    def list_jobs(self) -> dict[str, Any]:
        jobs = []
        if self.bundles_root.is_dir():
            for folder in sorted(self.bundles_root.iterdir()):
                if folder.name.startswith(".") or not (folder / "manifest.json").is_file():
                    continue
                try:
                    jobs.append(self._job_view(self._load(folder), folder.name, "", f"mn-bundle-run/{folder.name}",
                                               folder))
                except ApiError:
                    continue  # a folder that no longer loads is not a job this server can run
        return {"data": jobs, "version": 1}

    def start_run(self, job_id: str, run_id: str, inputs_json: str) -> dict[str, Any]:
        """v2 StartRun: one flow run of the job's deployment, with the client's run id and inputs."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

        self._folder(job_id)
        run_id = check_id(run_id or f"{job_id}-{time.time_ns():x}", "run_id")
        inputs = json_object(inputs_json or "{}", "inputs_json")
        with self.prefect_client() as client:
            taken = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[runs.RUN_TAG + run_id])), limit=1)
            if taken:
                raise ApiError("ALREADY_EXISTS", f"run {run_id!r} exists (flow run {taken[0].id})")
            deployment = client.read_deployment_by_name(f"mn-bundle-run/{job_id}")
            flow_run = client.create_flow_run_from_deployment(
                deployment.id, parameters={"run_id": run_id, "overrides": inputs or None},
                tags=[runs.RUN_TAG + run_id, runs.JOB_TAG + job_id])
        url = f"{self.ui_url}/runs/flow-run/{flow_run.id}" if self.ui_url else None
        return {"job_id": job_id, "run_id": run_id, "status": "pending", "flow_run_id": str(flow_run.id),
                "flow_run_name": flow_run.name, "flow_run_url": url, "version": 1}

    def submit(self, manifest_json: str, payloads: dict[str, bytes]) -> str:
        """v1 SubmitJob: a job and its one run; the v1 job id is the run id."""
        job = self.create("", manifest_json, payloads, "{}")
        return self.start_run(job["job_id"], "", "{}")["run_id"]

    def list_runs(self, job_id: str) -> dict[str, Any]:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

        with self.prefect_client() as client:
            flow_runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[runs.JOB_TAG + job_id])))
            found = [runs.find(self.store, client, str(f.id), ui_url=self.ui_url) for f in flow_runs]
        return {"data": [r.view() for r in found], "version": 1}

    # -- runs (v1 job ids are run ids) ---------------------------------------------------------------------------

    def find(self, given: str, client, field: str = "job_id") -> runs.Run:
        return runs.find(self.store, client, given, ui_url=self.ui_url, field=field)

    def get(self, given: str) -> dict[str, Any]:
        """v1 GetJob / v2 GetRun: the run with a summary and its events so far (newest first)."""
        with self.prefect_client() as client:
            run = self.find(given, client)
        view = run.view()
        events = runs.changes(runs.Snapshot(), run.snapshot(), run.run_id)
        return {"job": view, "summary": {"job_id": run.run_id, "status": view["status"],
                                         "submitted_at": view["submitted_at"], "updated_at": view["updated_at"],
                                         "failure": view["failure"],
                                         "recovery": {"status": None, "requires_review": False}},
                "prefect": {"flow_run_id": view["flow_run_id"], "flow_run_name": view["flow_run_name"],
                            "state": view["prefect_state"], "url": view["flow_run_url"]},
                "recent_events": list(reversed(events)), "version": 1}

    def list(self, limit: int, include_terminal: bool) -> dict[str, Any]:
        rows = runs.list_runs(self.store)
        if not include_terminal:
            rows = [r for r in rows if r["status"] not in runs.FINAL]
        return {"data": rows[:limit] if limit > 0 else rows, "version": 1}

    def cancel(self, given: str) -> str:
        """The run cancelled (``runs.cancel_flow_run``: Cancelling once a worker has it, Cancelled when none took
        it); FAILED_PRECONDITION for a run that is over."""
        with self.prefect_client() as client:
            run = self.find(given, client)
            if run.status in runs.FINAL or run.flow_run_id is None:
                raise refused(f"job {given!r} is over ({run.status}): there is nothing to cancel")
            flow_run = run.flow_run if run.flow_run is not None else client.read_flow_run(run.flow_run_id)
            taken = runs.cancel_flow_run(client, flow_run, "cancelled through the MirrorNeuron API",
                                         before_start="cancelled through the MirrorNeuron API before it started")
        return "cancelling" if taken else "cancelled"

    def pause(self, given: str) -> str:
        """A run that has not started is Paused in Prefect (no worker starts it until it is resumed); a running
        bundle run starts no new step (its running steps go on) until it is resumed."""
        from prefect.states import Paused

        with self.prefect_client() as client:
            run = self.find(given, client)
            if run.status == "paused":
                return "paused"
            if run.state_type == "SCHEDULED":
                client.set_flow_run_state(run.flow_run_id, Paused(message="paused through the MirrorNeuron API"),
                                          force=True)
                return "paused"
        if run.status == "running" and run.workflow is not None:
            self._control(run.workflow.run_id, "paused")
            return "paused" if self._held(run.workflow.job_id) else "pausing"
        what = "a blueprint job" if run.blueprint_job is not None else f"{run.status}"
        raise refused(f"job {given!r} is {what}: mn-prefect pauses a bundle run, or a run before it starts; cancel "
                      f"it to stop it")

    def _control(self, run_id: str, status: Literal["paused", "running"]) -> None:
        """What a running bundle run's runner reads each second: hold new steps, or go on."""
        what = "paused" if status == "paused" else "resumed"
        put_record(self.store, RunControlRecord(job_id=run_control_id(run_id), run_id=run_id, status=status,
                                                reason=f"{what} through the MirrorNeuron API"))

    def _held(self, job_id: str, timeout: float = PAUSE_ANSWER_S) -> bool:
        """Whether the run's runner says it holds new steps, within ``timeout`` (it reads a pause each second)."""
        deadline = time.monotonic() + timeout
        while True:
            record = get_record(self.store, job_id, WorkflowRecord)
            if record is None or record.held or record.status != "running" or time.monotonic() > deadline:
                return record is not None and record.held
            time.sleep(0.2)

    def resume(self, given: str) -> str:
        from prefect.states import Scheduled

        with self.prefect_client() as client:
            run = self.find(given, client)
            if run.state_type == "PAUSED" and getattr(run.flow_run, "start_time", None) is not None:
                raise refused(f"job {given!r} is waiting for a person: answer its request (mn blueprint human "
                              f"respond, or Resume in the Prefect UI)")
            if run.state_type == "PAUSED":
                client.set_flow_run_state(run.flow_run_id, Scheduled(message="resumed through the MirrorNeuron API"),
                                          force=True)
                return "resumed"
        if run.paused and run.workflow is not None:
            self._control(run.workflow.run_id, "running")
            return "resumed"
        raise refused(f"job {given!r} is not paused ({run.status})")

    # -- events ---------------------------------------------------------------------------------------------------

    def events(self, given: str, *, follow: bool, heartbeat_s: float, limit: int,
               active: Callable[[], bool] = lambda: True) -> Iterator[dict[str, Any]]:
        """The run's events from its start; with ``follow``, each change until its terminal event (a heartbeat
        after each ``heartbeat_s`` of quiet), or until ``active`` says the caller left."""
        with self.prefect_client() as client:
            run = self.find(given, client)
            seen = runs.Snapshot()
            sent, quiet_since = 0, time.monotonic()
            while True:
                now = run.snapshot()
                fresh = runs.changes(seen, now, run.run_id)
                seen = now
                for event in fresh:
                    yield event
                    sent += 1
                    if limit and sent >= limit and not follow:
                        return
                if fresh:
                    quiet_since = time.monotonic()
                if not follow or now.status in runs.FINAL or not active():
                    return
                if time.monotonic() - quiet_since >= heartbeat_s:
                    quiet_since = time.monotonic()
                    yield {"type": "stream_heartbeat", "job_id": run.run_id, "timestamp": iso(time.time()),
                           "version": 1}
                time.sleep(POLL_S)
                run = self.find(run.flow_run_id or given, client)
