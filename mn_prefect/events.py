"""Prefect events for what mn-prefect changes (docs/events.md), so Automations can act on them.

    events.node_state("gpu-1", "offline", reason="no heartbeat for 75 s", from_status="disconnected")

Names: ``mn.node.<state>``, ``mn.placement.created|released|refused``, ``mn.job.<status>``,
``mn.reservation.<created|expired|released>``, ``mn.allocation.<unhealthy|deallocated>``. A node event is about
``mn.node.<name>``, a job event about ``mn.job.<id>``; the flow run is a related resource when there is one (a
plain run's booking id is its flow run id), and the payload carries the reason and the allocation.

Every function here only queues, and never raises: one thread per process posts what is queued to the Prefect
server in batches (``POST /api/events`` through Prefect's own client, with its retries), so a commit or a state
change never waits on the server and never fails because of it. The store's event log stays the source of truth:
when the queue is full (a server down for long) new events are dropped with a warning, and at exit the process
waits at most ``EXIT_WAIT_S`` for what is queued. A process with no Prefect server configured (PREFECT_API_URL)
emits nothing: Prefect would otherwise start a temporary server to receive the events.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mn_prefect.background import Background, flush_at_exit
from mn_prefect.model.bookings import owning_run

HOLD_CREATED = "mn.hold.created"  # a head-of-line hold was booked for a waiting run (or blueprint job)
HOLD_COVERED = "mn.hold.covered"  # the held run was placed on what its hold kept for it
HOLD_RELEASED = "mn.hold.released"  # a hold ended without its run landing on it (payload: why)
HOLD_BACKFILLED = "mn.hold.backfilled"  # a run was placed on held capacity, ending before the hold's start

NODE = "mn.node."
JOB = "mn.job."
RESERVATION = "mn.reservation."
QUEUE = "mn.queue."
ALLOCATION = "mn.allocation."
PLACEMENT_CREATED = "mn.placement.created"
PLACEMENT_RELEASED = "mn.placement.released"
PLACEMENT_REFUSED = "mn.placement.refused"

CAPACITY = 10_000  # events waiting to go out; beyond, a new one is dropped with a warning
BATCH = 500  # events per POST at most
LINGER_S = 0.25  # after the first event of a batch, how long the thread lets more gather before posting
TIMEOUT_S = 10.0  # one POST's timeout (Prefect's client retries on top)
EXIT_WAIT_S = 5.0  # at exit, how long the process waits for what is queued
DROPPED_SAID_EVERY_S = 60.0  # a full queue is said at most this often

Resource = dict[str, str]

log = logging.getLogger(__name__)


# -- resources ---------------------------------------------------------------------------------------------------

def node(name: str, role: str | None = None) -> Resource:
    """``mn.node.<name>``: the resource of a node event, or with ``role`` a related one."""
    return _resource(f"{NODE}{name}", name, role)


def job(job_id: str, name: str | None = None, role: str | None = None) -> Resource:
    """``mn.job.<id>``: a booking (a flow run's id, a blueprint job's id, ``<job>@<node>``...)."""
    return _resource(f"{JOB}{job_id}", name or job_id, role)


def flow_run(run_id: uuid.UUID | str, name: str | None = None) -> Resource:
    """A flow run as a related resource: the event shows in the run's event feed."""
    return _resource(f"prefect.flow-run.{run_id}", name, "flow-run")


def run_of(job_id: str | None) -> uuid.UUID | None:
    """The flow run a booking id names: a plain run is booked under its own flow run id, a system run's copy under
    ``<its id>@<node>`` (None for other ids: a blueprint job's, a reservation's)."""
    try:
        return uuid.UUID(owning_run(job_id)) if job_id else None
    except ValueError:
        return None


def _resource(resource_id: str, name: str | None, role: str | None) -> Resource:
    out = {"prefect.resource.id": resource_id}
    if name:
        out["prefect.resource.name"] = name
    if role:
        out["prefect.resource.role"] = role
    return out


# -- what happened -----------------------------------------------------------------------------------------------

def node_state(name: str, status: str, *, reason: str | None, from_status: str | None = None,
               eligible: bool | None = None) -> bool:
    """``mn.node.<status>``: node ``name`` is now ``status`` (from ``from_status``), with the reason."""
    return emit(f"{NODE}{status}", node(name), payload={"node": name, "from": from_status, "to": status,
                                                        "reason": reason, "scheduling_eligible": eligible})


def service_state(name: str, service: str, status: str, *, from_status: str, reason: str | None) -> bool:
    """``mn.service.<status>`` (passing, warning, critical): a probed service of node ``name`` changed status.
    Its own name, not ``mn.node.*``: an Automation on node states does not fire on it."""
    return emit(f"mn.service.{status}", node(name), payload={"node": name, "service": service,
                                                              "from": from_status, "to": status, "reason": reason})


def placement(what: str, node_name: str, booking: str, *, reason: str | None,
              allocation: dict[str, Any] | None = None, run_id: uuid.UUID | str | None = None,
              run_name: str | None = None, related: Sequence[Resource] = ()) -> bool:
    """``mn.placement.<what>`` (created, released) about the node, with the booking's job and flow run related."""
    run = run_id or run_of(booking)
    return emit(f"mn.placement.{what}", node(node_name),
                related=[*([flow_run(run, run_name)] if run else []), job(booking, role="job"), *related],
                payload={"node": node_name, "booking": booking, "reason": reason, "allocation": allocation})


def refused(booking: str, *, reason: str | None, status: str, stage: str, node_name: str | None = None,
            run_id: uuid.UUID | str | None = None, run_name: str | None = None, related: Sequence[Resource] = (),
            details: dict[str, Any] | None = None) -> bool:
    """``mn.placement.refused`` about the job: no node takes it now (``stage`` placement, ``status``
    runnable_later / not_runnable), or its node refused to start it as placed (``stage`` launch)."""
    run = run_id or run_of(booking)
    return emit(PLACEMENT_REFUSED, job(booking, run_name),
                related=[*([flow_run(run, run_name)] if run else []),
                         *([node(node_name, "node")] if node_name else []), *related],
                payload={"booking": booking, "status": status, "stage": stage, "reason": reason, "node": node_name,
                         **(details or {})})


def job_status(status: str, job_id: str, *, reason: str | None, node_name: str | None = None,
               run_id: uuid.UUID | str | None = None, name: str | None = None,
               data: dict[str, Any] | None = None) -> bool:
    """``mn.job.<status>`` (submitted, placed, waiting, rescheduled, paused, failed, completed...) about the job,
    with its flow run (a plain run's, or a blueprint job's coordinator run) and node related."""
    run = run_id or run_of(job_id)
    return emit(f"{JOB}{status}", job(job_id, name),
                related=[*([flow_run(run)] if run else []), *([node(node_name, "node")] if node_name else [])],
                payload={"job_id": job_id, "status": status, "reason": reason, "node": node_name, **(data or {})})


def allocation(what: str, job_id: str, *, node_name: str | None, reason: str | None,
               held: dict[str, Any] | None = None, data: dict[str, Any] | None = None) -> bool:
    """``mn.allocation.<what>`` (unhealthy, deallocated) about the job whose allocation it is, with what it held."""
    run = run_of(job_id)
    return emit(f"{ALLOCATION}{what}", job(job_id),
                related=[*([flow_run(run)] if run else []), *([node(node_name, "node")] if node_name else [])],
                payload={"job_id": job_id, "node": node_name, "reason": reason, "allocation": held, **(data or {})})


def reservation(what: str, reservation_id: str, *, name: str | None, nodes: Sequence[str], reason: str | None,
                payload: dict[str, Any]) -> bool:
    """``mn.reservation.<what>`` (created, extended, expired, released, refused) about the reservation, its nodes
    related (a refused one's: those it tried, if any)."""
    return emit(f"{RESERVATION}{what}", _resource(f"{RESERVATION}{reservation_id}", name or reservation_id, None),
                related=[node(n, "node") for n in nodes], payload={"reservation": reservation_id, "reason": reason,
                                                                   **payload})


def audit_repaired(kind: str, subject: str | None, fix: str, *, nodes: Sequence[str] = ()) -> bool:
    """``mn.audit.repaired``: one fix ``store audit --repair`` made (about the booking or reservation it fixed, or
    the store itself for its derived state), its nodes related."""
    return emit("mn.audit.repaired", _resource(f"mn.audit.{subject or 'store'}", subject or "store", None),
                related=[node(n, "node") for n in nodes], payload={"kind": kind, "subject": subject, "fix": fix})


def queue_changed(what: str, name: str, payload: dict[str, Any]) -> bool:
    """``mn.queue.<what>`` (updated, deleted, policy) about queue ``name`` (a pool's name for ``policy``)."""
    return emit(f"{QUEUE}{what}", _resource(f"{QUEUE}{name}", name, None), payload={"queue": name, **payload})


def emit(event: str, resource: Resource, related: Sequence[Resource] = (),
         payload: dict[str, Any] | None = None) -> bool:
    """Queue one event for the Prefect server; whether it was queued (False: no server configured, or the
    queue is full). Never raises: an event must not fail the change it reports."""
    try:
        api_url = _api_url()
        if not api_url:
            return False
        return emitter().put(_Queued(event, resource, tuple(related), payload or {}, time.time(), api_url,
                                     contextvars.copy_context()))
    except Exception as error:
        log.warning("event %s not emitted: %s: %s", event, type(error).__name__, error)
        return False


def _api_url() -> str | None:
    """The Prefect server this context talks to (Prefect's settings: environment, profile, temporary settings)."""
    global _current_settings
    if _current_settings is None:  # imported once: a commit path calls this per event
        if "prefect.settings" not in sys.modules and not _prefect_settings_here():
            return None  # nothing could name a server: a store command need not load Prefect (half a second)
        from prefect.settings.context import get_current_settings

        _current_settings = get_current_settings
    settings = _current_settings()
    if settings is not _url_of[0]:  # a settings context is entered (or left): read its URL once
        _url_of[:] = [settings, settings.api.url or None]
    return _url_of[1]


_current_settings: Any = None
_url_of: list[Any] = [None, None]  # the settings object last asked, and its API URL (it holds the object: no id reuse)


def _prefect_settings_here() -> bool:
    """Whether any source Prefect could read its API URL from exists: ``PREFECT_API_URL``, a ``.env``,
    ``prefect.toml`` or ``pyproject.toml`` in the working directory, or a profiles file. Asked afresh each time
    (a caller may set the environment later); Prefect itself is imported only where one exists."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    here = Path.cwd()
    if any((here / name).exists() for name in (".env", "prefect.toml", "pyproject.toml")):
        return True
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect")
    return Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser().exists()


# -- the queue and the thread that posts it ----------------------------------------------------------------------

@dataclass(frozen=True)
class _Queued:
    event: str
    resource: Resource
    related: tuple[Resource, ...]
    payload: dict[str, Any]
    occurred: float
    api_url: str
    context: contextvars.Context  # the caller's Prefect settings (server, key) go along


Post = Callable[[str, bytes], None]


class _Poster:
    """Posts a batch (a JSON array of events) to a server's ``POST /events`` through Prefect's client (its auth,
    TLS settings and retries), one client per server kept open: making one takes tens of milliseconds."""

    def __init__(self) -> None:
        self._clients: dict[str, Any] = {}

    def __call__(self, api_url: str, body: bytes) -> None:
        from prefect.client.orchestration import get_client

        client = self._clients.get(api_url)
        if client is None:  # made in the caller's context: its settings (key, TLS) are the ones used
            client = self._clients[api_url] = get_client(sync_client=True,
                                                         httpx_settings={"timeout": TIMEOUT_S}).__enter__()
        client.request("POST", "/events", content=body, headers={"Content-Type": "application/json"}
                       ).raise_for_status()


class Emitter:
    """Events waiting to go out and the one thread that posts them in batches (a ``Background`` queue): ``put``
    never waits. Counts what it ``sent``, ``dropped`` (queue full) and ``failed`` (the server refused or did not
    answer)."""

    def __init__(self, *, capacity: int = CAPACITY, batch: int = BATCH, linger_s: float = LINGER_S,
                 post: Post | None = None):
        self._box: Background[_Queued] = Background(self._post_batch, name="mn-events", capacity=capacity,
                                                     batch=batch, linger_s=linger_s, on_drop=self._said_dropped)
        self._post: Post = post or _Poster()
        self._failing = False  # the last batch failed: say so once, not per batch
        self._dropped_said = -math.inf  # when a full queue was last said
        self.sent = self.failed = 0

    @property
    def dropped(self) -> int:
        return self._box.dropped

    @property
    def pending(self) -> int:
        """Events queued or being posted now: the backlog."""
        return self._box.pending

    def put(self, item: _Queued) -> bool:
        return self._box.put(item)

    def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` seconds for everything queued to be posted or given up; how many are left."""
        return self._box.flush(timeout_s)

    def _said_dropped(self, item: _Queued) -> None:
        if time.monotonic() - self._dropped_said >= DROPPED_SAID_EVERY_S:
            self._dropped_said = time.monotonic()
            log.warning("Prefect events dropped: %d already wait to go out (%d dropped so far); the "
                        "store's event log has them", self._box.capacity, self.dropped)

    def _post_batch(self, items: list[_Queued]) -> None:
        for group in _by_server(items):
            try:
                group[0].context.run(self._send, group)
            except Exception as error:  # the thread outlives any one batch
                log.warning("%d event(s) not posted: %s: %s", len(group), type(error).__name__, error)

    def _send(self, items: list[_Queued]) -> None:
        from prefect.settings import get_current_settings

        limit = get_current_settings().server.events.maximum_size_bytes
        bodies = [body for item in items if (body := _body(item, limit)) is not None]
        try:
            if bodies:
                self._post(items[0].api_url, b"[" + b",".join(bodies) + b"]")
        except Exception as error:
            self.failed += len(items)
            if not self._failing:
                log.warning("Prefect events not posted to %s (%s: %s); dropping them while it fails, the store's "
                            "event log has them", items[0].api_url, type(error).__name__, error)
            self._failing = True
            return
        self.sent += len(bodies)
        self.failed += len(items) - len(bodies)
        if self._failing:
            log.info("Prefect events reach %s again", items[0].api_url)
        self._failing = False


def _by_server(items: list[_Queued]) -> list[list[_Queued]]:
    groups: dict[str, list[_Queued]] = {}
    for item in items:
        groups.setdefault(item.api_url, []).append(item)
    return list(groups.values())


def _body(item: _Queued, limit: int) -> bytes | None:
    """The event as the server takes it (Prefect's event schema, as JSON); None, with a warning, for one the
    server would refuse: one bad event must not take its batch down with it."""
    event = {"id": str(uuid.uuid4()), "occurred": datetime.fromtimestamp(item.occurred, UTC).isoformat(),
             "event": item.event, "resource": item.resource, "related": list(item.related), "payload": item.payload}
    try:
        body = json.dumps(event, separators=(",", ":"), allow_nan=False, default=str).encode()
    except (TypeError, ValueError) as error:
        log.warning("event %s not emitted: its payload is not JSON: %s", item.event, error)
        return None
    if len(body) > limit:
        log.warning("event %s not emitted: %d bytes, more than the server's %d", item.event, len(body), limit)
        return None
    return body


_emitter: Emitter | None = None
_emitter_lock = threading.Lock()


def emitter() -> Emitter:
    """The process's emitter, started on first use; at exit the process waits up to ``EXIT_WAIT_S`` for it."""
    global _emitter
    with _emitter_lock:
        if _emitter is None:
            _emitter = Emitter()
            flush_at_exit(_emitter.flush, EXIT_WAIT_S, _said_left)
        return _emitter


def _said_left(left: int) -> None:
    log.warning("%d Prefect event(s) still queued after %g s at exit: not sent", left, EXIT_WAIT_S)
