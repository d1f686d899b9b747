"""Jobs and runs (``mirrorneuron.job.v1`` / ``v2.JobService``, ``ObservabilityService.StreamEvents``).

A v2 job is a bundle the client sent (manifest and payloads), written under the server's bundle folder. Every job
of one bundle (its blueprint id) shares one deployment, ``mn-bundle-run/api-<pool>-<bundle>`` on the server's
pool, deployed as ``mn-prefect blueprint deploy`` deploys a bundle folder; its version is the digest of the
bundle's files, so a job whose bundle is unchanged reuses it as it is and a changed one makes a new version. A run
is one flow run of that deployment with the job's own folder as its ``bundle_path``, tagged ``mn-run:<run id>``
and ``mn-job:<job id>``. v1 SubmitJob does both at once. Every node reads the bundle from its folder: on several
machines the bundle folder is on storage they share (docs/mirrorneuron-api.md).

CreateJob answers at once (the ``mn`` command waits 10 s by default): the bundle is written and checked, and
when the deployment is not already the bundle's, it is deployed in the background (the job's status is
``deploying``). A StartRun meanwhile waits up to ``DEPLOY_WAIT_S`` for it, then answers with the run ``pending``
and starts it once the deployment is ready. A deployment that fails removes the job (its folder, and a
deployment it had made), and its runs fail naming why."""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

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

log = logging.getLogger("mn_prefect.mn_api")
ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
POLL_S = 0.5
PAUSE_ANSWER_S = 5.0  # how long a pause waits for the runner to say it holds (then it answers "pausing")
DEPLOY_WAIT_S = 0.5  # how long a StartRun waits for its job's deployment under way (then the run is queued)
FAILED_KEPT = 200  # failed deployments (and queued runs that failed) remembered, so a later call says why


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


def bundle_digest(folder: Path) -> str:
    """``bundle-<16 hex>``: the SHA-256 of every file of the bundle folder (its path and bytes), the version of the
    bundle's deployment."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return f"bundle-{digest.hexdigest()[:16]}"


def shared_deployment_name(pool: str, blueprint_id: str) -> str:
    """The deployment every job of the bundle ``blueprint_id`` runs from on ``pool`` (the flow's name aside): not
    the name ``mn-prefect blueprint deploy`` gives the same bundle, whose deployment it would take over."""
    return f"api-{pool}-{blueprint_id.replace('_', '-')}"


@dataclass
class QueuedRun:
    """A run started while its job's deployment was being made: started once the deployment is ready."""

    run_id: str
    job_id: str
    inputs: dict[str, Any]
    status: str = "pending"  # then failed or cancelled when it never became a flow run
    reason: str | None = None
    created: float = field(default_factory=time.time)


@dataclass
class Deploying:
    """A job's deployment under way in the background, or one that failed (``error``)."""

    job_id: str
    folder: Path
    deployment: str  # the full name
    version: str
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    deployment_id: str | None = None
    queued: list[QueuedRun] = field(default_factory=list)


class Jobs:
    def __init__(self, store: ClusterStore, prefect_client: Callable[[], Any], *, pool: str, bundles_root: Path,
                 ui_url: str | None):
        self.store, self.prefect_client, self.pool = store, prefect_client, pool
        self.bundles_root, self.ui_url = bundles_root, ui_url
        # One deploy at a time: concurrent deployment writes of the same flow make a Prefect server on SQLite
        # answer 503, and its clients back off for up to half a minute; one after another each takes a second.
        self._deploying = threading.Lock()
        self._state = threading.Lock()  # guards the two tables below
        self._pending: dict[str, Deploying] = {}  # job id -> its deployment under way, or failed
        self._queued: dict[str, QueuedRun] = {}  # run id -> a run waiting for its job's deployment, or failed
        self._pools_checked: set[str] = set()

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
                deployment_id, name = deploy_bundle(client, bundle, self.pool, name=job_id, lifecycle="register")
        except ValueError as error:
            raise refused(str(error)) from None
        return self._job_view(bundle, job_id, str(deployment_id), name, folder)

    def _job_view(self, bundle, job_id: str, deployment_id: str, deployment: str, folder: Path,
                  status: str = "active") -> dict[str, Any]:
        spec = bundle.spec
        return {"job_id": job_id, "blueprint_id": spec.blueprint_id, "job_name": spec.job_name,
                "graph_id": bundle.document.get("graph_id") or spec.blueprint_id, "status": status,
                "steps": len(spec.steps), "deployment_id": deployment_id, "deployment": deployment, "pool": self.pool,
                "bundle_path": str(folder), "version": 1}

    def _check_pool(self, client) -> None:
        """FAILED_PRECONDITION when the server's pool is not an ``mn`` pool (once per pool and process)."""
        if self.pool in self._pools_checked:
            return
        from prefect.exceptions import ObjectNotFound

        try:
            work_pool = client.read_work_pool(self.pool)
        except ObjectNotFound:
            raise refused(f"work pool {self.pool!r} does not exist: start a worker on it (prefect worker start "
                          f"--type mn --pool {self.pool})") from None
        if work_pool.type != "mn":
            raise refused(f"--pool: work pool {self.pool!r} is of type {work_pool.type!r}; bundles need an mn pool")
        self._pools_checked.add(self.pool)

    @staticmethod
    def _read_deployment(client, name: str):
        from prefect.exceptions import ObjectNotFound

        try:
            return client.read_deployment_by_name(f"mn-bundle-run/{name}")
        except ObjectNotFound:
            return None

    def create(self, job_id: str, manifest_json: str, payloads: dict[str, bytes], config_json: str) -> dict[str, Any]:
        """v2 CreateJob: ALREADY_EXISTS for a job id in use (UpdateJob replaces a job's bundle). Answers once the
        bundle is written and checked: its deployment, unless already the bundle's, is made in the background."""
        job_id = check_id(job_id or f"job-{time.time_ns():x}", "job_id")
        folder = self.bundles_root / job_id
        with self._state:
            under_way = job_id in self._pending and self._pending[job_id].error is None
        if folder.exists() or under_way:
            raise ApiError("ALREADY_EXISTS", f"job {job_id!r} exists; update it (mn blueprint run --job-id {job_id})")
        staged = self._stage(job_id, manifest_json, payloads, config_json)
        staged.rename(folder)
        try:
            return self._ready_or_deploying(job_id, folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def _ready_or_deploying(self, job_id: str, folder: Path) -> dict[str, Any]:
        """The job's view: its bundle's deployment when that is already this bundle (status ``active``), else
        with the deployment started in the background (status ``deploying``)."""
        bundle = self._load(folder)
        name = shared_deployment_name(self.pool, bundle.spec.blueprint_id)
        version = bundle_digest(folder)
        with self.prefect_client() as client:
            self._check_pool(client)
            current = self._read_deployment(client, name)
        if current is not None and current.version == version:
            return self._job_view(bundle, job_id, str(current.id), f"mn-bundle-run/{name}", folder)
        pending = Deploying(job_id=job_id, folder=folder, deployment=f"mn-bundle-run/{name}", version=version)
        with self._state:
            self._pending[job_id] = pending
        context = contextvars.copy_context()  # Prefect's settings as this call has them (temporary_settings)
        threading.Thread(target=context.run, args=(self._deploy_in_background, pending),
                         name=f"mn-api-deploy-{job_id}", daemon=True).start()
        return self._job_view(bundle, job_id, "", pending.deployment, folder, status="deploying")

    def _deploy_in_background(self, pending: Deploying) -> None:
        """Make (or update) the job's deployment, then start the runs queued for it; on failure, remove what the
        job had: its folder and a deployment it made; its queued runs fail naming why."""
        from mn_prefect.bundles.deploy import deploy_bundle

        name = pending.deployment.split("/", 1)[1]
        try:
            bundle = self._load(pending.folder)
            with self._deploying, self.prefect_client() as client:
                current = self._read_deployment(client, name)
                if current is not None and current.version == pending.version:
                    deployment_id = str(current.id)  # another job of the same bundle made it meanwhile
                else:
                    try:
                        deployment_id = str(deploy_bundle(client, bundle, self.pool, name=name,
                                                          version=pending.version)[0])
                    except BaseException:
                        if current is None:  # nothing of a half-made deployment is left behind
                            made = self._read_deployment(client, name)
                            if made is not None:
                                client.delete_deployment(made.id)
                        raise
        except Exception as error:
            reason = error.message if isinstance(error, ApiError) else str(error) if isinstance(error, ValueError) \
                else f"{type(error).__name__}: {error}"
            log.warning("deploying job %s failed: %s", pending.job_id, reason)
            shutil.rmtree(pending.folder, ignore_errors=True)
            with self._state:
                pending.error = reason
                for run in pending.queued:
                    run.status, run.reason = "failed", f"its job's deployment failed: {reason}"
                pending.queued = []
                pending.done.set()
                self._forget_old()
            return
        with self._state:
            pending.deployment_id = deployment_id
            queued, pending.queued = pending.queued, []
            pending.done.set()
        for run in queued:
            try:
                with self.prefect_client() as client:
                    self._create_run(client, pending.job_id, deployment_id, pending.folder, run.run_id, run.inputs)
            except Exception as error:
                log.warning("starting run %s of job %s failed: %s", run.run_id, pending.job_id, error)
                with self._state:
                    run.status, run.reason = "failed", f"it could not be started: {type(error).__name__}: {error}"
                continue
            with self._state:
                self._queued.pop(run.run_id, None)
        with self._state:
            self._pending.pop(pending.job_id, None)
            self._forget_old()

    def _forget_old(self) -> None:
        """Keep the last FAILED_KEPT failed deployments and runs (the caller holds ``_state``)."""
        failed = [k for k, d in self._pending.items() if d.error is not None]
        over = [k for k, r in self._queued.items() if r.status != "pending"]
        for table, keys in ((self._pending, failed), (self._queued, over)):
            for key in keys[:max(len(keys) - FAILED_KEPT, 0)]:  # oldest first: dicts keep their order
                table.pop(key, None)

    def update(self, job_id: str, manifest_json: str, payloads: dict[str, bytes], attrs_json: str) -> dict[str, Any]:
        """v2 UpdateJob: with a manifest, the job's bundle is replaced (checked first); its deployment is the
        bundle's, reused or made again in the background as CreateJob does."""
        folder = self._folder(job_id)
        attrs = json_object(attrs_json or "{}", "attrs_json")
        if manifest_json:
            config = attrs.get("resolved_configuration") or {}
            staged = self._stage(job_id, manifest_json, payloads, json.dumps(config))
            old = folder.with_name(f".{job_id}-old-{time.time_ns():x}")
            folder.rename(old)
            staged.rename(folder)
            shutil.rmtree(old, ignore_errors=True)
        return self._ready_or_deploying(job_id, folder)

    def _deployment_of(self, client, job_id: str, folder: Path):
        """The Prefect deployment the job's runs come from: its bundle's, else (a job made before jobs shared
        one) ``mn-bundle-run/<job id>``; None when there is neither."""
        bundle = self._load(folder)
        return (self._read_deployment(client, shared_deployment_name(self.pool, bundle.spec.blueprint_id))
                or self._read_deployment(client, job_id))

    def _failed(self, job_id: str) -> Deploying | None:
        with self._state:
            pending = self._pending.get(job_id)
        return pending if pending is not None and pending.error is not None else None

    def _folder(self, job_id: str) -> Path:
        folder = self.bundles_root / check_id(job_id, "job_id")
        if (failed := self._failed(job_id)) is not None:
            raise refused(f"job {job_id!r} could not be deployed ({failed.error}); nothing of it was kept: create "
                          f"it again")
        if not (folder / "manifest.json").is_file():
            raise not_found(f"unknown job {job_id!r}: no job was created with that id")
        return folder

    def get_job(self, job_id: str) -> dict[str, Any]:
        folder = self._folder(job_id)
        bundle = self._load(folder)
        with self._state:
            pending = self._pending.get(job_id)
        if pending is not None and not pending.done.is_set():
            view = self._job_view(bundle, job_id, "", pending.deployment, folder, status="deploying")
        else:
            with self.prefect_client() as client:
                deployment = self._deployment_of(client, job_id, folder)
            view = self._job_view(bundle, job_id, str(deployment.id) if deployment else "",
                                  f"mn-bundle-run/{deployment.name}" if deployment else "", folder,
                                  status="active" if deployment else "undeployed")
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
        """v2 StartRun: one flow run of the job's deployment, with the client's run id and inputs, reading the
        job's own bundle folder. While the deployment is being made, the run is queued (``pending``, no flow run
        yet) and started once it is ready."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

        folder = self._folder(job_id)
        run_id = check_id(run_id or f"{job_id}-{time.time_ns():x}", "run_id")
        inputs = json_object(inputs_json or "{}", "inputs_json")
        with self._state:
            pending = self._pending.get(job_id)
            if run_id in self._queued:
                raise ApiError("ALREADY_EXISTS", f"run {run_id!r} exists (waiting for its job's deployment)")
        if pending is not None and not pending.done.wait(DEPLOY_WAIT_S):
            with self._state:
                if not pending.done.is_set():
                    run = QueuedRun(run_id=run_id, job_id=job_id, inputs=inputs)
                    pending.queued.append(run)
                    self._queued[run_id] = run
                    return {"job_id": job_id, "run_id": run_id, "status": "pending", "flow_run_id": None,
                            "flow_run_name": None, "flow_run_url": None, "deployment": pending.deployment,
                            "deployment_status": "deploying", "version": 1}
        folder = self._folder(job_id)  # FAILED_PRECONDITION when its deployment failed meanwhile
        with self.prefect_client() as client:
            taken = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[runs.RUN_TAG + run_id])), limit=1)
            if taken:
                raise ApiError("ALREADY_EXISTS", f"run {run_id!r} exists (flow run {taken[0].id})")
            deployment_id = pending.deployment_id if pending is not None else None
            if deployment_id is None:
                deployment = self._deployment_of(client, job_id, folder)
                if deployment is None:
                    raise refused(f"job {job_id!r} has no deployment (it was removed from Prefect): update the job "
                                  f"to deploy it again")
                deployment_id = str(deployment.id)
            flow_run = self._create_run(client, job_id, deployment_id, folder, run_id, inputs)
        url = f"{self.ui_url}/runs/flow-run/{flow_run.id}" if self.ui_url else None
        return {"job_id": job_id, "run_id": run_id, "status": "pending", "flow_run_id": str(flow_run.id),
                "flow_run_name": flow_run.name, "flow_run_url": url, "version": 1}

    @staticmethod
    def _create_run(client, job_id: str, deployment_id: str, folder: Path, run_id: str, inputs: dict[str, Any]):
        return client.create_flow_run_from_deployment(
            UUID(deployment_id), parameters={"bundle_path": str(folder), "run_id": run_id, "overrides": inputs or None},
            tags=[runs.RUN_TAG + run_id, runs.JOB_TAG + job_id])

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
        with self._state:
            waiting = [self._queued_view(r) for r in self._queued.values() if r.job_id == job_id]
        return {"data": [r.view() for r in [*waiting, *found]], "version": 1}

    # -- runs (v1 job ids are run ids) ---------------------------------------------------------------------------

    def find(self, given: str, client, field: str = "job_id") -> runs.Run:
        with self._state:
            queued = self._queued.get(given.strip())
        if queued is not None:
            return self._queued_view(queued)
        return runs.find(self.store, client, given, ui_url=self.ui_url, field=field)

    def _queued_view(self, queued: QueuedRun) -> runs.Run:
        return runs.Run(run_id=queued.run_id, job_id=queued.job_id, ui_url=self.ui_url,
                        outcome=None if queued.status == "pending" else queued.status, failure=queued.reason,
                        created=queued.created)

    def get(self, given: str) -> dict[str, Any]:
        """v1 GetJob / v2 GetRun: the run with a summary and its events so far (newest first)."""
        with self.prefect_client() as client:
            run = self.find(given, client)
        view = run.view()
        events = runs.changes(runs.Snapshot(), run.snapshot(), run.run_id)
        for event in events:  # the result once, as the view shows it
            if "result" in event:
                event["result"] = view["result"]
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
        with self._state:
            queued = self._queued.get(given.strip())
            if queued is not None and queued.status == "pending":  # not a flow run yet: it never will be
                queued.status, queued.reason = "cancelled", "cancelled through the MirrorNeuron API before it started"
                for pending in self._pending.values():
                    pending.queued = [r for r in pending.queued if r is not queued]
                return "cancelled"
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
