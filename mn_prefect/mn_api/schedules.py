"""MirrorNeuron's schedules and trigger events (``mirrorneuron.job.v1.JobService``: CreateSchedule ... ListTriggerEvents),
on a bundle's Prefect deployment.

A schedule is a bundle the client sent, kept like a v2 job (``<bundles root>/<schedule id>``, deployed as
``mn-bundle-run/<schedule id>``), with ``schedule.json`` beside its manifest saying what the client asked for. What
runs it is Prefect's own:

- ``periodic``: the bundle's ``schedule`` (cron schedules on the deployment, ``prohibit_overlap`` a concurrency
  limit of 1), so Prefect's scheduler makes the runs;
- ``delayed``: one Scheduled flow run at ``run_at`` (or ``delay_ms`` from now);
- ``event``: the bundle's ``triggers`` (a Prefect automation that runs the deployment on the event).

Pause and resume pause the deployment (Prefect makes no runs of a paused deployment) and switch its automations off
and on; a delayed schedule's waiting run is held in Paused. Delete removes the deployment, its automations, its
runs that have not started and the bundle. Run-now starts a run at once with the payload as its trigger event.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from mn_prefect.mn_api import runs
from mn_prefect.mn_api.cluster import json_object
from mn_prefect.mn_api.errors import ApiError, invalid, not_found, refused
from mn_prefect.mn_api.jobs import Jobs, check_id, manifest_object

KINDS = ("periodic", "delayed", "event")
SCHEDULE_FILE = "schedule.json"
SCHEDULE_TAG = "mn-schedule:"
PERIODIC_KEYS = ("kind", "crons", "cron", "timezone", "missed_policy", "catchup_limit", "prohibit_overlap", "enabled")


def _upcoming(flow_run: Any, now: datetime) -> bool:
    """A run the schedule has not sent off yet: waiting for a start time still to come."""
    state = flow_run.state_type.value if flow_run.state_type else None
    return state in ("SCHEDULED", "PAUSED") and flow_run.start_time is None and \
        flow_run.expected_start_time is not None and flow_run.expected_start_time > now


# A flow run's state as MirrorNeuron's dispatch ledger words it
_DISPATCH_STATUS = {"SCHEDULED": "submitted", "PENDING": "submitted", "PAUSED": "paused", "RUNNING": "running",
                    "CANCELLING": "cancelled", "CANCELLED": "cancelled", "COMPLETED": "completed", "FAILED": "failed",
                    "CRASHED": "failed"}


def _dispatch_status(flow_run: Any) -> str:
    return _DISPATCH_STATUS.get(flow_run.state_type.value if flow_run.state_type else "", "submitted")


def _run_id(flow_run: Any) -> str:
    return next((t[len(runs.RUN_TAG):] for t in flow_run.tags if t.startswith(runs.RUN_TAG)), str(flow_run.id))


def _now() -> datetime:
    return datetime.now(UTC)


def _when(schedule: dict[str, Any]) -> datetime:
    """A delayed schedule's time: ``run_at`` (ISO 8601; UTC when it names no zone) or ``delay_ms`` from now."""
    if schedule.get("run_at"):
        try:
            when = datetime.fromisoformat(str(schedule["run_at"]).replace("Z", "+00:00"))
        except ValueError:
            raise invalid("schedule_json.run_at", f"{schedule['run_at']!r} is not an ISO 8601 time") from None
        return when if when.tzinfo else when.replace(tzinfo=UTC)
    delay = schedule.get("delay_ms")
    if isinstance(delay, (int, float)) and not isinstance(delay, bool) and delay >= 0:
        return _now() + timedelta(milliseconds=delay)
    raise invalid("schedule_json", "a delayed schedule needs run_at (an ISO 8601 time) or delay_ms (>= 0)")


def _manifest_for(manifest: dict[str, Any], kind: str, schedule: dict[str, Any]) -> dict[str, Any]:
    """The manifest with the client's schedule put where a bundle carries it (``schedule`` or ``triggers``)."""
    manifest = {k: v for k, v in manifest.items() if k not in ("schedule", "triggers")}
    if kind == "periodic":
        if schedule.get("window"):
            raise invalid("schedule_json.window", "mn-prefect does not cancel a run at the end of a window; give "
                                                  "the bundle's steps a timeout (control.timeout_seconds) instead")
        manifest["schedule"] = {k: schedule[k] for k in PERIODIC_KEYS if k in schedule}
    elif kind == "event":
        trigger = schedule.get("trigger")
        if not isinstance(trigger, dict):
            raise invalid("schedule_json.trigger", "an event schedule needs trigger: {event_type, filters}")
        manifest["triggers"] = [{"name": schedule.get("name") or trigger.get("event_type"),
                                 "event_type": trigger.get("event_type"), "filters": trigger.get("filters") or {},
                                 "enabled": True}]
    return manifest


def _kept_in_prefect(client, made_here: set[str]) -> list[dict[str, Any]]:
    """The bundle deployments' cron schedules and trigger automations that no schedule of this server made, as
    MirrorNeuron's schedule records (an automation whose deployment is gone is removed first)."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    from mn_prefect.bundles.flows import BUNDLE_FLOW_NAME
    from mn_prefect.bundles.triggers import bundle_automations, remove_orphaned_automations, run_deployment_id

    remove_orphaned_automations(client)
    deployments = client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=[BUNDLE_FLOW_NAME])))
    by_id = {d.id: d for d in deployments}
    kept: list[dict[str, Any]] = []
    for deployment in sorted(deployments, key=lambda d: d.name):
        if deployment.name in made_here or not deployment.schedules:
            continue
        crons = [getattr(s.schedule, "cron", None) or str(s.schedule) for s in deployment.schedules]
        timezone = next((getattr(s.schedule, "timezone", None) for s in deployment.schedules), None) or "UTC"
        active = not deployment.paused and any(s.active for s in deployment.schedules)
        kept.append({"schedule_id": deployment.name, "id": deployment.name, "name": deployment.name,
                     "kind": "periodic", "status": "active" if active else "paused",
                     "schedule": {"kind": "periodic", "crons": crons, "timezone": timezone},
                     "deployment": f"{BUNDLE_FLOW_NAME}/{deployment.name}", "deployment_id": str(deployment.id),
                     "managed_by": "prefect", "source": {"deployment": f"{BUNDLE_FLOW_NAME}/{deployment.name}"},
                     "created_at": deployment.created.isoformat() if deployment.created else None})
    for automation in sorted(bundle_automations(client), key=lambda a: a.name):
        deployment = by_id.get(run_deployment_id(automation))
        if deployment is None or deployment.name in made_here:
            continue
        trigger = automation.trigger
        event_type = next(iter(sorted(getattr(trigger, "expect", None) or [])), None)
        name = automation.name.rsplit(" (", 1)[1].rstrip(")") if " (" in automation.name else event_type
        key = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{deployment.name}.{name}")[:100]
        match = getattr(trigger, "match", None)
        match = dict(getattr(match, "root", match) or {})
        kept.append({"schedule_id": key, "id": key, "name": name, "kind": "event",
                     "status": "active" if automation.enabled else "paused",
                     "schedule": {"kind": "event", "trigger": {"event_type": event_type, "match": match}},
                     "deployment": f"{BUNDLE_FLOW_NAME}/{deployment.name}", "deployment_id": str(deployment.id),
                     "automation_id": str(automation.id), "automation": automation.name, "managed_by": "prefect",
                     "source": {"deployment": f"{BUNDLE_FLOW_NAME}/{deployment.name}"}, "created_at": None})
    return kept


class Schedules:
    def __init__(self, jobs: Jobs):
        self.jobs = jobs

    # -- files -------------------------------------------------------------------------------------------------

    def _folder(self, schedule_id: str) -> Path:
        folder = self.jobs.bundles_root / check_id(schedule_id, "schedule_id")
        if not (folder / SCHEDULE_FILE).is_file():
            raise not_found(f"unknown schedule {schedule_id!r}: no schedule was created with that id")
        return folder

    def _read(self, schedule_id: str) -> dict[str, Any]:
        return json.loads((self._folder(schedule_id) / SCHEDULE_FILE).read_text())

    def _write(self, record: dict[str, Any]) -> None:
        folder = self.jobs.bundles_root / record["schedule_id"]
        record["updated_at"] = _now().isoformat()
        temporary = folder / f".{SCHEDULE_FILE}.{uuid.uuid4().hex[:6]}"
        temporary.write_text(json.dumps(record, indent=2))
        temporary.replace(folder / SCHEDULE_FILE)

    # -- create ------------------------------------------------------------------------------------------------

    def create(self, manifest_json: str, payloads: dict[str, bytes], schedule_json: str,
               source_json: str) -> dict[str, Any]:
        schedule = json_object(schedule_json or "{}", "schedule_json")
        source = json_object(source_json or "{}", "source_json")
        kind = schedule.get("kind", "periodic")
        if kind not in KINDS:
            raise invalid("schedule_json.kind", f"{kind!r}: one of {', '.join(KINDS)}")
        when = _when(schedule) if kind == "delayed" else None
        schedule_id = check_id(str(schedule.get("id") or f"sch-{time.time_ns():x}"), "schedule_json.id")
        folder = self.jobs.bundles_root / schedule_id
        if folder.exists():
            raise ApiError("ALREADY_EXISTS", f"schedule or job {schedule_id!r} exists")
        manifest = _manifest_for(manifest_object(manifest_json), kind, schedule)
        staged = self.jobs._stage(schedule_id, json.dumps(manifest), payloads, "{}")
        staged.rename(folder)
        record = {"schedule_id": schedule_id, "id": schedule_id, "name": schedule.get("name") or schedule_id,
                  "kind": kind, "status": "active", "schedule": schedule, "source": source,
                  "created_at": _now().isoformat(), "run_at": when.isoformat() if when else None}
        try:
            self._write(record)
            with self.jobs.prefect_client() as client:
                job = self.jobs._deploy(client, schedule_id, folder)
                if when is not None:
                    from prefect.states import Scheduled

                    run = client.create_flow_run_from_deployment(
                        job["deployment_id"], state=Scheduled(scheduled_time=when),
                        tags=[SCHEDULE_TAG + schedule_id, runs.JOB_TAG + schedule_id])
                    record["flow_run_id"] = str(run.id)
                    self._write(record)
        except BaseException:
            self._remove(schedule_id, folder)
            raise
        return self.get(schedule_id)

    # -- read --------------------------------------------------------------------------------------------------

    def _deployment(self, client, schedule_id: str):
        from prefect.exceptions import ObjectNotFound

        try:
            return client.read_deployment_by_name(f"mn-bundle-run/{schedule_id}")
        except ObjectNotFound:
            raise refused(f"schedule {schedule_id!r} has no deployment any more (mn-bundle-run/{schedule_id} was "
                          "deleted in Prefect); delete the schedule") from None

    def _runs(self, client, deployment_id) -> list[Any]:
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
        from prefect.client.schemas.sorting import FlowRunSort

        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                                     sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=50)

    def _automations(self, client, schedule_id: str) -> list[Any]:
        """The deployment's trigger automations."""
        from mn_prefect.bundles.triggers import automation_prefix

        prefix = automation_prefix(f"mn-bundle-run/{schedule_id}")
        return [a for a in client.read_automations() if a.name.startswith(prefix)]

    def get(self, schedule_id: str) -> dict[str, Any]:
        record = self._read(schedule_id)
        with self.jobs.prefect_client() as client:
            deployment = self._deployment(client, schedule_id)
            flow_runs = self._runs(client, deployment.id)
            automations = self._automations(client, schedule_id) if record["kind"] == "event" else []
        upcoming = sorted((r for r in flow_runs if r.state_type and r.state_type.value in ("SCHEDULED", "PAUSED")
                           and r.start_time is None), key=lambda r: r.expected_start_time or _now())
        started = [r for r in flow_runs if r.start_time is not None]
        now = _now()
        dispatched = sorted((r for r in flow_runs if not _upcoming(r, now)), key=lambda r: r.created or now)
        return {**record, "version": 1, "deployment": f"mn-bundle-run/{schedule_id}",
                "deployment_id": str(deployment.id), "paused": bool(deployment.paused),
                "next_runs": [{"flow_run_id": str(r.id), "scheduled_at": r.expected_start_time.isoformat()
                               if r.expected_start_time else None, "state": r.state_type.value if r.state_type else None}
                              for r in upcoming[:5]],
                "recent_runs": [{"flow_run_id": str(r.id), "state": r.state_type.value if r.state_type else None,
                                 "started_at": r.start_time.isoformat() if r.start_time else None}
                                for r in started[:5]],
                "automations": [{"id": str(a.id), "name": a.name, "enabled": a.enabled} for a in automations],
                # MirrorNeuron's dispatch ledger: each run the schedule has sent off (a cron run once due, run-now,
                # a matching event), oldest first, and the count
                "counters": {"dispatched": len(dispatched)},
                "dispatches": [{"job_id": schedule_id, "run_id": _run_id(r), "flow_run_id": str(r.id),
                                "status": _dispatch_status(r), "dispatched_at": (r.created or now).isoformat()}
                               for r in dispatched]}

    def list(self, query_json: str) -> dict[str, Any]:
        """The schedules this server made, then every other schedule and trigger mn-prefect keeps for a bundle
        (``mn-prefect blueprint deploy`` of a bundle with a ``schedule`` or ``triggers``): each cron-scheduled
        bundle deployment is a ``periodic`` schedule and each trigger automation an ``event`` one, with
        ``managed_by: prefect`` (change them in Prefect: its UI, ``prefect deployment schedule``)."""
        query = json_object(query_json or "{}", "query_json")
        found = []
        if self.jobs.bundles_root.is_dir():
            for folder in sorted(self.jobs.bundles_root.iterdir()):
                path = folder / SCHEDULE_FILE
                if folder.name.startswith(".") or not path.is_file():
                    continue
                found.append(json.loads(path.read_text()))
        with self.jobs.prefect_client() as client:
            found += _kept_in_prefect(client, {r["schedule_id"] for r in found})
        found = [r for r in found if (not query.get("kind") or r["kind"] == query["kind"])
                 and (not query.get("status") or r["status"] == query["status"])]
        return {"data": found, "count": len(found), "version": 1}

    # -- change ------------------------------------------------------------------------------------------------

    def _switch(self, schedule_id: str, status: str, reason: str) -> dict[str, Any]:
        from prefect.states import Paused, Scheduled

        record = self._read(schedule_id)
        if record["status"] == status:
            return {**self.get(schedule_id), "changed": False}
        active = status == "active"
        with self.jobs.prefect_client() as client:
            deployment = self._deployment(client, schedule_id)
            (client.resume_deployment if active else client.pause_deployment)(deployment.id)
            for automation in self._automations(client, schedule_id):
                (client.resume_automation if active else client.pause_automation)(automation.id)
            if record["kind"] == "delayed" and record.get("flow_run_id"):
                run = client.read_flow_run(record["flow_run_id"])
                waiting = run.start_time is None and run.state_type and run.state_type.value in ("SCHEDULED", "PAUSED")
                if waiting:
                    when = datetime.fromisoformat(record["run_at"])
                    state: Any = Scheduled(scheduled_time=max(when, _now())) if active else Paused(
                        reschedule=False, timeout_seconds=365 * 86400)
                    client.set_flow_run_state(run.id, state, force=True)
        record.update(status=status, reason=reason or None)
        self._write(record)
        return {**self.get(schedule_id), "changed": True}

    def pause(self, schedule_id: str, reason: str) -> dict[str, Any]:
        return self._switch(schedule_id, "paused", reason)

    def resume(self, schedule_id: str, reason: str) -> dict[str, Any]:
        return self._switch(schedule_id, "active", reason)

    def update(self, schedule_id: str, attrs_json: str, reason: str) -> dict[str, Any]:
        """Only a schedule's name changes in place; anything else is a new schedule (delete, then create)."""
        attrs = json_object(attrs_json or "{}", "attrs_json")
        other = sorted(set(attrs) - {"name"})
        if other:
            raise invalid(f"attrs_json.{other[0]}", "only name changes in place; delete the schedule and create "
                                                    "it again with the new settings")
        record = self._read(schedule_id)
        if "name" in attrs:
            record["name"] = str(attrs["name"])
            self._write(record)
        return self.get(schedule_id)

    def _remove(self, schedule_id: str, folder: Path) -> None:
        """The deployment (its automations and its runs that have not started) and the bundle: best effort, so a
        half-made schedule leaves nothing behind."""
        from prefect.exceptions import ObjectNotFound

        try:
            with self.jobs.prefect_client() as client:
                try:
                    deployment = client.read_deployment_by_name(f"mn-bundle-run/{schedule_id}")
                except ObjectNotFound:
                    deployment = None
                if deployment is not None:
                    for run in self._runs(client, deployment.id):
                        if run.start_time is None and run.state_type and run.state_type.value in ("SCHEDULED",
                                                                                                   "PAUSED"):
                            client.delete_flow_run(run.id)
                    client.delete_resource_owned_automations(f"prefect.deployment.{deployment.id}")
                    client.delete_deployment(deployment.id)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def delete(self, schedule_id: str, reason: str) -> dict[str, Any]:
        record = self._read(schedule_id)
        self._remove(schedule_id, self._folder(schedule_id))
        return {"schedule_id": schedule_id, "id": schedule_id, "kind": record["kind"], "status": "deleted",
                "reason": reason or None, "version": 1}

    def dispatch(self, schedule_id: str, payload_json: str, reason: str) -> dict[str, Any]:
        """Run-now: one run at once, the payload as its trigger event (``MN_TRIGGER_EVENT_JSON``)."""
        payload = json_object(payload_json or "{}", "payload_json")
        self._read(schedule_id)
        event = {"event": "mn.schedule.dispatched", "id": str(uuid.uuid4()), "occurred": _now().isoformat(),
                 "payload": payload, "reason": reason or "manual"}
        with self.jobs.prefect_client() as client:
            deployment = self._deployment(client, schedule_id)
            run = client.create_flow_run_from_deployment(
                deployment.id, parameters={"trigger": event},
                tags=[SCHEDULE_TAG + schedule_id, runs.JOB_TAG + schedule_id])
        return {"schedule_id": schedule_id, "job_id": schedule_id, "flow_run_id": str(run.id),
                "flow_run_name": run.name, "status": "dispatched", "event_id": event["id"], "version": 1}

    # -- trigger events ----------------------------------------------------------------------------------------

    def emit(self, event_type: str, payload_json: str, source: str) -> dict[str, Any]:
        from mn_prefect.bundles.triggers import emit_trigger_event
        from mn_prefect.model.issues import InvalidInput

        payload = json_object(payload_json or "{}", "payload_json")
        try:
            with self.jobs.prefect_client() as client:
                event = emit_trigger_event(client, event_type, payload, source=source or "mn")
        except InvalidInput as error:
            raise invalid("event_type", error.issues[0].message) from None
        return {"event_id": event["id"], "event_type": event_type, "status": "emitted", "occurred": event["occurred"],
                "version": 1}

    def events(self, limit: int) -> dict[str, Any]:
        from mn_prefect.bundles.triggers import list_trigger_events

        with self.jobs.prefect_client() as client:
            found = list_trigger_events(client, limit or 100)
        return {"data": found, "count": len(found), "version": 1}
