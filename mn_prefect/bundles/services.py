"""The services a bundle run offers while it runs (the manifest's ``services``), registered with their health.

MirrorNeuron's service bundle declares them::

    "services": [{"id": "demo-health", "name": "demo-health", "address": "127.0.0.1", "port": 18081,
                  "tags": ["blueprint"], "checks": [{"type": "http", "path": "/health", "interval_ms": 500,
                  "timeout_ms": 500, "failures_before_critical": 2, "required": true}]}]

(``port`` is usually ``${config.service.port}``, resolved from the bundle's config like every binding.) For the life
of the run, ``ServiceWatch`` keeps one ``ServiceRecord`` per service in the store, on the run's own node, and probes
its checks from there at their intervals: ``critical`` until a check passes (Consul's default), ``passing`` while the
required checks pass, ``critical`` again after ``failures_before_critical`` failures in a row. When the run ends the
records say ``deregistered``. A run killed before it could say so (cancelled, its node lost) stops renewing its
records' lease (``LEASE_S``, renewed every ``RENEW_S``), and a lapsed record is no longer offered: a TTL, as Consul
gives a service whose agent is gone. ``mn-prefect service list`` and MirrorNeuron's ``mn service list/resolve`` show them
beside the services the nodes declare.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

import anyio

from mn_prefect.lifecycle.health import Tally, probe_port, service_status
from mn_prefect.model.issues import Issues
from mn_prefect.model.scalars import MAX_QUANTITY, shown, too_long_digits
from mn_prefect.store.base import ClusterStore
from mn_prefect.store.records import ServiceRecord, ServiceStatus, put_record, service_record_id

LEASE_S = 15.0  # how long a record stands without its run renewing it
RENEW_S = 5.0


@dataclass(frozen=True)
class Check:
    kind: str  # http or tcp
    path: str | None
    port: int
    address: str
    interval_s: float
    timeout_s: float
    failures: int
    required: bool


@dataclass(frozen=True)
class BundleService:
    id: str
    name: str
    address: str
    port: int | None
    tags: tuple[str, ...] = ()
    checks: tuple[Check, ...] = field(default_factory=tuple)


def _port(raw: Any, where: str, issues: Issues) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, str) and not raw.isascii():  # int() reads other scripts' digits
        issues.add(where, f"{raw!r} is not a port number written in ASCII digits")
        return None
    try:
        port = int(raw)
    except (TypeError, ValueError, OverflowError):  # text, ".." digits past Python's limit, infinity
        issues.add(where, f"{shown(raw)} is not a port number (is its ${{config...}} binding set?)")
        return None
    if not 1 <= port <= 65535:
        issues.add(where, f"{shown(port)} is not a port number (1-65535)")
        return None
    return port


def _number(raw: Any, default: float, where: str, issues: Issues) -> float:
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw <= MAX_QUANTITY:
        issues.add(where, f"must be a positive number of at most {MAX_QUANTITY:g}, got {shown(raw)}")
        return default
    return float(raw)


def parse_services(document: dict[str, Any], issues: Issues) -> list[BundleService]:
    """The manifest's ``services`` (after bindings); every problem is an issue naming its field."""
    raw = document.get("services")
    if raw is None:
        return []
    if not isinstance(raw, list):
        issues.add("services", "must be a list of services ({id, name, address, port, tags, checks})")
        return []
    found: list[BundleService] = []
    for i, item in enumerate(raw):
        where = f"services[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name") or item.get("id"), str):
            issues.add(where, "must be an object with a name")
            continue
        name = item.get("name") or item["id"]
        address = item.get("address") or "127.0.0.1"
        port = _port(item.get("port"), f"{where}.port", issues)
        tags = item.get("tags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            issues.add(f"{where}.tags", "must be a list of strings")
            tags = []
        checks = []
        raw_checks = item.get("checks") or []
        if not isinstance(raw_checks, list):
            issues.add(f"{where}.checks", "must be a list of checks")
            raw_checks = []
        for j, check in enumerate(raw_checks):
            cwhere = f"{where}.checks[{j}]"
            if not isinstance(check, dict) or check.get("type", "http") not in ("http", "tcp"):
                issues.add(cwhere, "must be an object of type http or tcp")
                continue
            if check.get("port", port) is None:
                issues.add(f"{cwhere}.port", "a check needs a port (its own, or the service's)")
                continue
            check_port = _port(check.get("port", port), f"{cwhere}.port", issues)
            if check_port is None:
                continue
            kind = check.get("type", "http")
            path = check.get("path", "/") if kind == "http" else None
            if path is not None and (not isinstance(path, str) or not path.startswith("/")):
                issues.add(f"{cwhere}.path", "must start with /")
                continue
            checks.append(Check(kind=kind, path=path, port=check_port, address=check.get("address") or address,
                                interval_s=_number(check.get("interval_ms"), 10_000, f"{cwhere}.interval_ms",
                                                   issues) / 1000,
                                timeout_s=_number(check.get("timeout_ms"), 2_000, f"{cwhere}.timeout_ms", issues)
                                / 1000,
                                failures=int(_number(check.get("failures_before_critical"), 3,
                                                     f"{cwhere}.failures_before_critical", issues)),
                                required=check.get("required", True) is not False))
        ident = item.get("id") or name
        if too_long_digits(ident):  # str() of it raises past Python's digit limit
            issues.add(f"{where}.id", "must be an id of at most 64 digits")
            continue
        found.append(BundleService(id=str(ident), name=name, address=address, port=port,
                                   tags=tuple(tags), checks=tuple(checks)))
    return found


class ServiceWatch:
    """The run's services in the store for its life, probed from this process (see the module's note)."""

    def __init__(self, store: ClusterStore, services: list[BundleService], *, run_id: str, job_id: str,
                 node: str | None, logger: Any):
        self.store, self.services, self.run_id, self.job_id = store, services, run_id, job_id
        self.node, self.log = node, logger
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mn-service-watch", daemon=True)
        self._status: dict[str, ServiceStatus] = {s.id: ("critical" if s.checks else "passing") for s in services}
        self._tallies = {(s.id, i): Tally(limit=c.failures) for s in services for i, c in enumerate(s.checks)}
        self._failing: dict[tuple[str, int], str | None] = {}
        self._notes: dict[str, str | None] = {}  # what each record last said, and when it was written
        self._written: dict[str, float] = {}

    def start(self) -> ServiceWatch:
        for service in self.services:
            self._write(service, self._status[service.id], "registered")
        if self.services:
            self._thread.start()  # the checks, and the records' lease
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        for service in self.services:
            self._write(service, "deregistered", "the run ended")

    def _write(self, service: BundleService, status: ServiceStatus, note: str | None = None) -> None:
        put_record(self.store, ServiceRecord(
            job_id=service_record_id(self.run_id, service.id), run_id=self.run_id, bundle_job_id=self.job_id,
            name=service.name, service_id=service.id, node=self.node, address=service.address, port=service.port,
            tags=list(service.tags), status=status, note=note,
            checks=[{"type": c.kind, "path": c.path, "port": c.port, "required": c.required} for c in service.checks],
            expires_at=None if status == "deregistered" else time.time() + LEASE_S))
        self._notes[service.id], self._written[service.id] = note, time.monotonic()

    def _loop(self) -> None:
        due = {(s.id, i): 0.0 for s in self.services for i, _ in enumerate(s.checks)}
        while not self._stop.wait(0.1):
            now = time.monotonic()
            for service in self.services:
                changed = False
                for i, check in enumerate(service.checks):
                    if due[(service.id, i)] > now:
                        continue
                    due[(service.id, i)] = now + check.interval_s
                    try:
                        failure = anyio.run(probe_port, check.port, check.path, check.timeout_s, check.address)
                    except Exception as error:  # a probe must never take the run down
                        failure = f"{type(error).__name__}: {error}"
                    self._failing[(service.id, i)] = failure
                    before = self._status[service.id]
                    after = cast(ServiceStatus, service_status(before, self._tallies[(service.id, i)], failure)) \
                        if check.required else before
                    if after != before:
                        self._status[service.id], changed = after, True
                if changed:
                    reasons = [f for (sid, _), f in self._failing.items() if sid == service.id and f]
                    self.log.info("service %s is %s%s", service.name, self._status[service.id],
                                  f" ({reasons[0]})" if reasons and self._status[service.id] != "passing" else "")
                    self._write(service, self._status[service.id], reasons[0] if reasons else None)
                elif now - self._written.get(service.id, 0.0) >= RENEW_S:
                    self._write(service, self._status[service.id], self._notes.get(service.id))  # the lease
