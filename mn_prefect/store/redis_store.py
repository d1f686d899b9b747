"""Redis (and Redis with Sentinel) store. Commits and releases are Lua scripts: atomic on the server.

Replication to replicas is asynchronous: a failover can lose the last acknowledged writes. Commits can
ask the master to wait for replicas (``?wait_replicas=1&wait_timeout_ms=100`` on the URL), and each worker
re-asserts its own running placements with ``resync`` after a failover (docs/several-machines.md, "Redis failover").
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import orjson
import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry
from redis.sentinel import Sentinel

from mn_prefect.model.node import DEFAULT_GROUP, NodeRecord
from mn_prefect.model.node_status import check_transition
from mn_prefect.model.placement import Placement
from mn_prefect.model.queues import QueueRecord, QueueSpec
from mn_prefect.scheduler.limits import Limits
from mn_prefect.scheduler.quotas import Queues, is_account
from mn_prefect.store import admission, expiry, redis_queues, redis_scripts as scripts
from mn_prefect.store.accounts import account_of, queues_of, split_release
from mn_prefect.store.admission import Applied, CommitRead, Ticket
from mn_prefect.store.base import (
    CAPACITY,
    DUE_AT_ONCE,
    Booking,
    ChangeWatcher,
    ClusterSnapshot,
    CommitResult,
    Event,
    GroupInfo,
    HistoryEntry,
    JobRecord,
    Lease,
    NodeNotRegistered,
    StaleLease,
    StoredNode,
    StoreError,
    StoreInfo,
    StoreUnavailable,
    check_registrable,
)
from mn_prefect.store.booking import (
    NodeState,
    RecordTexts,
    demand_by_node,
    fingerprint,
    json_text,
    limits_once,
    parse_record,
    snapshot_of,
    usage_of,
)
from mn_prefect.store.changes import RedisChanges
from mn_prefect.store.dimensions import CLAIM_KINDS, VIEW_CLAIM_KINDS
from mn_prefect.store.groups import check_deletable, check_group_name, group_in_use, unknown_group
from mn_prefect.store.records import ReservationRecord
from mn_prefect.store.redis_line import ScriptLine
from mn_prefect.store.repair import plan_repair
from mn_prefect.store.urls import StoreURL

log = logging.getLogger(__name__)

T = TypeVar("T")
_TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError)


_pairs = redis_queues.pairs  # HGETALL as Lua returns it
_KINDS = json.dumps(list(CLAIM_KINDS))  # the claim kinds as the commit path's scripts take them
_VIEW_KINDS = json.dumps(list(VIEW_CLAIM_KINDS))  # those a snapshot reads
HISTORY_BATCH = 500  # history lists read per round trip by history_since


class RedisStore:
    """The store on Redis, standalone or behind Sentinel."""

    def __init__(self, url: StoreURL, *, prefix: str = "mn:"):
        self.url = url
        self.backend = "redis" if url.backend == "redis" else "redis-sentinel"
        self.prefix = url.options.get("prefix", prefix)
        self.retry_seconds = float(url.options.get("retry_seconds", 15))
        self.wait_replicas = int(url.options.get("wait_replicas", 0))
        self.wait_timeout_ms = int(url.options.get("wait_timeout_ms", 100))
        self.socket_timeout = float(url.options.get("socket_timeout", 2.0))
        # Our own _call retries through failover; redis-py's built-in retries would only add hidden waits.
        no_retry = Retry(NoBackoff(), 0)
        common: dict[str, Any] = {"username": url.username, "password": url.password, "db": int(url.database or 0), "retry": no_retry,
                  "socket_timeout": self.socket_timeout,
                  "socket_connect_timeout": float(url.options.get("connect_timeout", 2.0)), "decode_responses": True}
        if url.tls:
            common["ssl"] = True
        if url.backend == "sentinel":
            self._sentinel = Sentinel(list(url.hosts), socket_timeout=common["socket_timeout"],
                                      sentinel_kwargs={"password": url.options.get("sentinel_password"),
                                                       "socket_timeout": common["socket_timeout"], "retry": no_retry})
            assert url.master is not None  # parse_store_url refuses a sentinel URL without one
            self.client = self._sentinel.master_for(url.master, **common)
        else:
            (host, port), = url.hosts
            self.client = redis.Redis(host=host, port=port, **common)
        self._line = ScriptLine(self.client.connection_pool) if self.backend == "redis" else None
        self._pipelining = threading.local()  # .depth: how many ``pipelined`` blocks this thread is in
        self._apply = self.client.register_script(scripts.APPLY)
        self._read = self.client.register_script(scripts.READ)
        self._records = RecordTexts()
        self._read_cache = admission.ReadCache()
        self._release = self.client.register_script(scripts.RELEASE)
        self._release_node = self.client.register_script(scripts.RELEASE_NODE)
        self._put_job = self.client.register_script(scripts.PUT_JOB)
        self._due = self.client.register_script(scripts.DUE)
        self._delete_job = self.client.register_script(scripts.DELETE_JOB)
        self._acquire = self.client.register_script(scripts.ACQUIRE)
        self._renew = self.client.register_script(scripts.RENEW)
        self._release_lease = self.client.register_script(scripts.RELEASE_LEASE)
        self._register = self.client.register_script(scripts.REGISTER)
        self._delete_group = self.client.register_script(scripts.DELETE_GROUP)
        self._heartbeat = self.client.register_script(scripts.HEARTBEAT)
        self._transition = self.client.register_script(scripts.TRANSITION_NODE)
        self._snapshot = self.client.register_script(scripts.SNAPSHOT)
        self._repair_read = self.client.register_script(scripts.REPAIR_READ)
        self._repair_apply = self.client.register_script(scripts.REPAIR_APPLY)
        self.last_commit_seq: int | None = None

    def __repr__(self) -> str:
        return f"RedisStore({self.url.safe!r})"

    # -- plumbing -------------------------------------------------------------------------------------

    def _safe(self, error: BaseException) -> str:
        detail = str(error) or type(error).__name__
        if self.url.password:
            detail = detail.replace(self.url.password, "***")
        return f"{self.backend} store {self.url.safe} failed: {detail}"

    def _call(self, fn: Callable[[], T], *, retry: bool = True) -> T:
        """Retry through connection loss and failover (a new master is found via Sentinel) for a while."""
        deadline = time.monotonic() + (self.retry_seconds if retry else 0)
        delay = 0.05
        while True:
            try:
                return fn()
            except redis.AuthenticationError as error:  # a wrong password does not get better by waiting
                raise StoreUnavailable(self._safe(error)) from None
            except _TRANSIENT as error:
                if time.monotonic() >= deadline:
                    raise StoreUnavailable(self._safe(error)) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except redis.RedisError as error:
                raise StoreError(self._safe(error)) from None

    def _run(self, script: Script, args: list[Any]) -> Any:
        """A commit-path script (commit, read, release): on a standalone server over the store's one script
        line (store/redis_line.py); behind Sentinel through the client, each call on a pooled connection."""
        if self._line is None:
            return script(args=args)
        return self._line.run(script, args)

    def _command(self, *parts: Any) -> Any:
        """A plain command, over the script line where there is one (its answer as the line reads it)."""
        return self.client.execute_command(*parts) if self._line is None else self._line.command(*parts)

    @contextmanager
    def pipelined(self) -> Iterator[None]:
        """Inside, on a standalone server, a record or an event written by this thread goes ahead of its next
        call on the script line (store/redis_line.py), and a commit's script also reports the master's replicas:
        a reservation's record, its commit and the event recorded with it are one round trip, and the replica
        check after it none when the master has no replica (one, WAIT, when it has). What is still queued at
        the end is sent then."""
        if self._line is None:
            yield
            return
        line, depth = self._line, getattr(self._pipelining, "depth", 0)
        self._pipelining.depth = depth + 1
        failed = True
        try:
            yield
            failed = False
        finally:
            self._pipelining.depth = depth
            if depth == 0:  # what is still queued goes now, a failed block's too
                self._pipelining.replicas = None
                try:
                    self._call(line.flush)
                except Exception as error:
                    if not failed:
                        raise
                    log.warning("%s: writes queued ahead were not sent: %s", self.url.safe, error)
                finally:
                    line.drop_ahead()

    def _ahead(self, *command: Any) -> bool:
        """Queue ``command`` (a write) ahead of this thread's next call when it is in a ``pipelined`` block (True)."""
        if self._line is None or not getattr(self._pipelining, "depth", 0):
            return False
        self._line.write_ahead(*command)
        return True

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def close(self) -> None:
        if self._line is not None:
            self._line.close()
        self.client.close()

    def check(self) -> StoreInfo:
        try:
            info = self._call(lambda: self.client.info("server"), retry=False)
            p = self.prefix
            pipe = self.client.pipeline()
            for key in ("nodes", "active", "jobs"):
                pipe.scard(p + key) if key != "jobs" else pipe.hlen(p + key)
            pipe.xlen(p + "events")
            nodes, active, jobs, events = self._call(pipe.execute, retry=False)
            return StoreInfo(backend=self.backend, url=self.url.safe, reachable=True, version=info.get("redis_version"),
                             counts={"nodes": nodes, "active_jobs": active, "jobs": jobs, "events": events})
        except StoreError as error:
            return StoreInfo(backend=self.backend, url=self.url.safe, reachable=False, error=str(error))

    # -- nodes ----------------------------------------------------------------------------------------

    def register_node(self, record: NodeRecord, *, now: float | None = None) -> NodeRecord:
        now = time.time() if now is None else now
        check_registrable(record)
        answer = self._call(lambda: self._register(args=[
            self.prefix, record.name, record.model_dump_json(), record.status, "1" if record.scheduling_eligible else "0",
            repr(now), record.group]))
        if answer == ["unknown_group"]:
            raise unknown_group(record.group, record.name)
        status, eligible = answer
        return record.model_copy(update={"status": status, "scheduling_eligible": eligible == "1"})

    def _stored(self, name: str, raw: dict) -> StoredNode:
        record = parse_record(raw["record"], raw["status"], raw["eligible"] == "1")
        heartbeat = raw.get("heartbeat")
        return StoredNode(record=record, last_heartbeat=float(heartbeat) if heartbeat else None)

    def heartbeat(self, name: str, *, now: float | None = None) -> NodeRecord:
        now = time.time() if now is None else now
        status = self._call(lambda: self._heartbeat(args=[self.prefix, name, repr(now)]))
        if status is None:
            raise NodeNotRegistered(f"node {name!r} is not registered")
        return self._node_record(name)

    def _node_record(self, name: str) -> NodeRecord:
        stored = self.get_node(name)
        if stored is None:
            raise NodeNotRegistered(f"node {name!r} is not registered")
        return stored.record

    def set_node_status(self, name: str, status: str, *, eligible: bool | None = None) -> NodeRecord:
        key = self._key("node", name)
        if not self._call(lambda: self.client.exists(key)):
            raise NodeNotRegistered(f"node {name!r} is not registered")
        fields = {"status": status}
        if eligible is not None:
            fields["eligible"] = "1" if eligible else "0"
        pipe = self.client.pipeline()  # MULTI: the change, its version and its announcement together
        pipe.hset(key, mapping=fields)
        pipe.hincrby(key, "version", 1)
        pipe.publish(self._key("changes", CAPACITY), "1")
        self._call(pipe.execute)
        return self._node_record(name)

    def transition_node(self, name: str, to_status: str, *, from_statuses: tuple[str, ...], now: float | None = None,
                        reason: str | None = None, eligible: bool | None = None,
                        heartbeat_before: float | None = None) -> NodeRecord | None:
        check_transition(to_status, tuple(from_statuses))
        now = time.time() if now is None else now
        result = self._call(lambda: self._transition(args=[
            self.prefix, name, to_status, json.dumps(list(from_statuses)),
            "" if eligible is None else ("1" if eligible else "0"),
            "" if heartbeat_before is None else repr(float(heartbeat_before)), repr(float(now)), json.dumps(reason)]))
        if not result:
            raise NodeNotRegistered(f"node {name!r} is not registered")
        if result[0] != "ok":
            return None
        return parse_record(result[1], result[2], result[3] == "1")

    def get_node(self, name: str) -> StoredNode | None:
        raw = self._call(lambda: self.client.hgetall(self._key("node", name)))
        return self._stored(name, raw) if raw else None

    def list_nodes(self) -> list[StoredNode]:
        names = sorted(self._call(lambda: self.client.smembers(self.prefix + "nodes")))
        pipe = self.client.pipeline()
        for name in names:
            pipe.hgetall(self._key("node", name))
        return [self._stored(n, raw) for n, raw in zip(names, self._call(pipe.execute), strict=True) if raw]

    # -- groups ---------------------------------------------------------------------------------------

    def create_group(self, name: str, *, now: float | None = None) -> bool:
        check_group_name(name)
        if name == DEFAULT_GROUP:
            return False
        at = repr(time.time() if now is None else now)
        return bool(self._call(lambda: self.client.hsetnx(self.prefix + "groups", name, at)))

    def list_groups(self) -> list[GroupInfo]:
        created = self._call(lambda: self.client.hgetall(self.prefix + "groups"))
        counts = Counter(n.record.group for n in self.list_nodes())
        groups = [GroupInfo(name=DEFAULT_GROUP, nodes=counts[DEFAULT_GROUP])]
        groups += [GroupInfo(name=g, nodes=counts[g], created_at=float(t)) for g, t in created.items()]
        return sorted(groups, key=lambda g: g.name)

    def delete_group(self, name: str) -> None:
        check_deletable(name)
        answer = self._call(lambda: self._delete_group(args=[self.prefix, name]))
        if answer[0] == "unknown_group":
            raise unknown_group(name)
        if answer[0] == "in_use":
            raise group_in_use(name, answer[1:])

    # -- limits ---------------------------------------------------------------------------------------

    def get_limits(self) -> Limits:
        return _limits(self._call(lambda: self.client.hgetall(self.prefix + "limits")))

    def set_limits(self, limits: Limits) -> None:
        mapping = {"cpu": limits.cpu, "memory": limits.memory, "gpu": limits.gpu, "disk": limits.disk,
                   "per_node": json.dumps(limits.per_node)}

        def write() -> None:
            names = self.client.smembers(self.prefix + "nodes")
            pipe = self.client.pipeline()  # new limits change every node's ceilings: commits decided before re-read
            pipe.hset(self.prefix + "limits", mapping=mapping)
            for name in names:
                pipe.hincrby(self._key("node", name), "version", 1)
            pipe.publish(self._key("changes", CAPACITY), "1")
            pipe.execute()

        self._call(write)

    # -- placements -----------------------------------------------------------------------------------

    def _fence(self, lease: Lease | None) -> list[str]:
        return [lease.name, lease.owner, str(lease.epoch)] if lease else ["", "", ""]

    def commit_plan(self, job_id: str, placements: list[Placement], *, lease: Lease | None = None,
                    event: Event | None = None) -> CommitResult:
        ended: list[ReservationRecord] = []
        result = admission.commit(self, job_id, placements, lease, time.time(), self._read_cache,
                                  expire=lambda: self._expire_due(ended),
                                  event=event.model_dump_json() if event is not None else None)
        result.ended = ended
        if result.ok and not result.already_committed and self.wait_replicas:
            self._call(lambda: self.client.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms))
        return result

    def replicate(self, timeout_ms: int = 2000) -> int | None:
        """WAIT for the connected replicas. A write on the same connection first: WAIT waits for that
        connection's last write, and the replication stream carries every earlier write (any connection's) before
        it. None when a standalone master has no replica; 0 when a master behind Sentinel has none (it may have
        just lost them in a failover, and what it holds with them)."""
        wait_ms = max(1, min(timeout_ms, int(self.socket_timeout * 800)))  # answered before the socket gives up
        if self._line is not None and getattr(self._pipelining, "replicas", None) == 0:
            self._pipelining.replicas = None
            return None  # the commit just made here found no replica (its script said so): nothing to wait for

        def wait() -> int | None:
            if self._line is None:
                replicas = int(self.client.info("replication").get("connected_slaves", 0))
            else:  # the INFO text, over the line
                found = re.search(r"^connected_slaves:(\d+)", self._line.command("INFO", "replication"), re.M)
                replicas = int(found.group(1)) if found else 0
            if replicas == 0:  # behind Sentinel a master always has replicas: one with none was just replaced
                return 0 if self.backend == "redis-sentinel" else None
            pipe = self.client.pipeline(transaction=False)
            pipe.incr(self.prefix + "replicated")
            pipe.execute_command("WAIT", replicas, wait_ms)
            return int(pipe.execute()[-1])

        return self._call(wait)

    def _expire_due(self, ended: list[ReservationRecord]) -> bool:
        """End the reservations whose time is up (for a commit they would refuse); whether any was."""
        newly = expiry.expire_due(self)
        ended += newly
        return bool(newly)

    @contextmanager
    def commit_session(self) -> Iterator[RedisStore]:
        yield self  # reads are one MULTI, applies one script: nothing to hold between them

    def _cached_versions(self, nodes: list[str]) -> str:
        return json_text(self._records.known(nodes))

    def read(self, job_id: str, nodes: list[str], lease: Lease | None) -> CommitRead:
        raw = self._call(lambda: self._run(self._read, [self.prefix, job_id, self._cached_versions(nodes),
                                                  _KINDS, lease.name if lease else ""]))
        return self._parse_read(raw, nodes, lease)

    def _parse_read(self, text: str, nodes: list[str], lease: Lease | None) -> CommitRead:
        raw = orjson.loads(text)
        found = raw["nodes"] if isinstance(raw["nodes"], dict) else {}  # cjson writes an empty table as []
        states = []
        accounts = []
        for name in nodes:
            n = found.get(name)
            if n is None:
                continue
            if is_account(name):
                accounts.append(account_of(name, self._records.text(name, n["version"], n.get("record")),
                                           _pairs(n["used"]), n["version"]))
                continue
            record = self._records.record(name, n["version"], n.get("record"), n["status"], n["eligible"] == "1")
            states.append(NodeState(record=record, used={k: float(v) for k, v in _pairs(n["used"]).items()},
                                    held={kind: set(keys) if isinstance(keys, list) else set()
                                          for kind, keys in n["held"].items()},
                                    version=n["version"]))
        lease_ok = True
        if lease is not None:
            owner, epoch, expires = ((raw.get("lease") or []) + [None, None, None])[:3]
            lease_ok = owner == lease.owner and epoch == str(lease.epoch) and float(expires or 0) > time.time()
        flat = raw["limits"] if isinstance(raw["limits"], list) else []
        limits = limits_once(tuple(flat), lambda: _limits(_pairs(flat)))
        return CommitRead(states=states, limits=limits, booked=raw.get("booked") or None, lease_ok=lease_ok,
                          queues=queues_of(accounts) if any(is_account(n) for n in nodes) else None)

    def apply(self, ticket: Ticket, lease: Lease | None) -> tuple[Applied, CommitRead | None]:
        nodes = list(ticket.demands)
        # In a pipelined block on a standalone server the script also says how many replicas the master has: the
        # replica check after the commit (``replicate``) then needs no round trip when there are none.
        ask = "1" if self._line is not None and getattr(self._pipelining, "depth", 0) > 0 else ""
        result = self._call(lambda: self._run(self._apply, [
            self.prefix, ticket.job_id, ticket.fingerprint, ticket.plan_json(), ticket.placements, repr(ticket.now),
            *self._fence(lease), self._cached_versions(nodes), _KINDS, ticket.count, ticket.event or "", ask]))
        if result[0] == "ok":
            self.last_commit_seq = int(result[1])
            if ask:
                self._pipelining.replicas = int(result[2])
            return "ok", None
        if result[0] == "changed":  # the script read the state it found: decide again without another trip
            return "changed", self._parse_read(result[1], nodes, lease)
        return result[0], None

    def release(self, job_id: str, *, lease: Lease | None = None, node: str | None = None) -> int:
        if node is None:
            return self._released(lease, self._release, [self.prefix, job_id, repr(time.time()), *self._fence(lease)])
        while True:
            body, stored = self._call(lambda: self.client.hmget(self._key("booking", job_id), "placements", "demands"))
            body = body or ""
            placements = [Placement.model_validate(p) for p in json.loads(body or "[]")]
            gone = [p for p in placements if p.node == node]
            kept = [p for p in placements if p.node != node]
            charged_gone, charged_kept = split_release(json.loads(stored or "{}"), gone)
            args = [self.prefix, job_id, repr(time.time()), *self._fence(lease), node, body,
                    json.dumps({node: demand_by_node(gone)[node].as_json(), **charged_gone}) if gone else "",
                    json.dumps([k.model_dump(mode="json") for k in kept]) if kept else "",
                    json.dumps({**{n: d.as_json() for n, d in demand_by_node(kept).items()}, **charged_kept}),
                    fingerprint(kept), len(gone), len(kept)]
            count = self._released(lease, self._release_node, args)
            if count != -2:  # -2: the booking changed between the read and the script: read it again
                return count

    def _released(self, lease: Lease | None, script, args: list) -> int:
        result = int(self._call(lambda: self._run(script, args)))
        if result == -1:
            assert lease is not None  # only a fenced release can find its lease stale
            raise StaleLease(f"lease {lease.name!r} epoch {lease.epoch} is no longer current")
        return result

    def resync(self, job_id: str, placements: list[Placement]) -> CommitResult:
        """Re-assert a placement a worker knows is running (after a failover lost it); a no-op if present."""
        return self.commit_plan(job_id, placements)

    def active_jobs(self) -> list[str]:
        return sorted(self._call(lambda: self.client.smembers(self.prefix + "active")))

    def active_placements(self, *, node: str | None = None, job_id: str | None = None) -> list[Placement]:
        jobs = [job_id] if job_id is not None else self.active_jobs()
        pipe = self.client.pipeline()
        for job in jobs:
            pipe.hget(self._key("booking", job), "placements")
        out = []
        for job, body in zip(jobs, self._call(pipe.execute), strict=True):
            for p in json.loads(body or "[]"):
                placement = Placement.model_validate(p)
                if node is None or placement.node == node:
                    out.append(placement.model_copy(update={"job_id": job}))
        return out

    def _raw_snapshot(self, with_bookings: bool, group: str | None = None) -> dict:
        """Every kind of held key with the bookings (a consistent view), the view's kinds without them."""
        kinds = _KINDS if with_bookings else _VIEW_KINDS
        return json.loads(self._call(lambda: self._snapshot(args=[self.prefix, "1" if with_bookings else "0",
                                                                   kinds, group or ""])))

    def _states(self, raw: dict) -> list[NodeState]:
        nodes = raw["nodes"] if isinstance(raw["nodes"], list) else []
        states = []
        for n in sorted(nodes, key=lambda x: x["name"]):
            record = parse_record(n["record"], n["status"], n["eligible"] == "1")
            states.append(NodeState(record=record, used={k: float(v) for k, v in _pairs(n["used"]).items()},
                                    held={kind: set(_pairs(n["held"].get(kind))) for kind in CLAIM_KINDS},
                                    version=int(n["version"])))
        return states

    def snapshot(self, *, group: str | None = None) -> ClusterSnapshot:
        raw = self._raw_snapshot(False, group)
        return snapshot_of(self._states(raw), _limits(_pairs(raw["limits"])), redis_queues.from_snapshot(raw),
                           group)

    # -- queues (store/accounts.py) ------------------------------------------------------------------

    def queues(self) -> Queues:
        return self._call(lambda: redis_queues.read(self.client, self.prefix))

    def set_queue(self, spec: QueueSpec) -> QueueRecord:
        record = self._call(lambda: redis_queues.put(self.client, self.prefix, spec.name, spec))
        assert record is not None
        return record

    def delete_queue(self, name: str) -> None:
        self._call(lambda: redis_queues.put(self.client, self.prefix, name, None))

    def consistent_view(self) -> dict:
        raw = self._raw_snapshot(True)
        states = self._states(raw)
        held = []
        for n in raw["nodes"] if isinstance(raw["nodes"], list) else []:
            for kind in CLAIM_KINDS:
                held += [(kind, n["name"], k, j) for k, j in _pairs(n["held"].get(kind)).items()]
        bookings = raw["bookings"] if isinstance(raw["bookings"], list) else []
        return {
            "nodes": {s.record.name: {"record": s.record, **usage_of(s)} for s in states},
            "bookings": {b["job"]: [Placement.model_validate(p) for p in json.loads(b["placements"])] for b in bookings},
            "held": held,
            "limits": _limits(_pairs(raw["limits"])),
        }

    def repair_derived(self, *, dry_run: bool = False) -> list[str]:
        """Make the usage counters and held claims agree with the live bookings (store/repair.py): one script reads
        them all at one moment; the fixes go in with one script that first checks the state is still the one
        read (its hash), else writes nothing and the repair reads again. One line per fix (with ``dry_run``,
        per fix it would make, from the one read)."""
        kinds = json.dumps(list(CLAIM_KINDS))
        for _ in range(admission.ATTEMPTS):
            read = self._call(lambda: self._repair_read(args=[self.prefix, kinds]))
            (nodes, bookings) = json.loads(read)
            held = [(kind, name, key, job) for name, _, by_kind in nodes
                    for kind, pairs in zip(CLAIM_KINDS, by_kind, strict=True) for key, job in pairs]
            fix = plan_repair({name: {dim: float(v) for dim, v in used} for name, used, _ in nodes},
                              {job: [Placement.model_validate(x) for x in json.loads(body)] for job, body in bookings},
                              held)
            if dry_run or not fix.writes:
                return fix.lines
            fixes = json.dumps({"drop": [[kind, name, key] for kind, name, key, _ in fix.drop],
                                "add": [list(a) for a in fix.add],
                                "usage": [[name, *(x for dim, v in used.items() for x in (dim, repr(float(v))))]
                                          for name, used in fix.usage.items()]})
            digest = hashlib.sha1(read.encode()).hexdigest()
            if self._call(functools.partial(self._repair_apply, args=[self.prefix, kinds, digest, fixes])) == 1:
                return fix.lines
        raise StoreError(f"{self.backend} store {self.url.safe}: the bookings kept changing under the repair "
                         f"({admission.ATTEMPTS} reads); nothing was written, try again")

    def bookings(self) -> list[Booking]:
        return [Booking(node=n, kind=kind, key=k, job_id=j) for kind, n, k, j in self.consistent_view()["held"]]

    def changes(self, *, node: str | None = None) -> ChangeWatcher:
        return self._call(lambda: RedisChanges(self.client, self.prefix, node))

    def announce(self, topics: list[str]) -> None:
        try:
            pipe = self.client.pipeline()
            for topic in topics:
                pipe.publish(self._key("changes", topic), "1")
            self._call(pipe.execute)
        except Exception as error:  # the polls find what a lost announcement would have woken
            log.warning("could not announce %s: %s", ", ".join(topics), error)

    def history(self, job_id: str) -> list[HistoryEntry]:
        rows = self._call(lambda: self.client.lrange(self._key("history", job_id), 0, -1))
        return self._entries(job_id, rows)

    def history_since(self, since: float | None = None) -> list[HistoryEntry]:
        # Every job ever booked is in ``history_jobs`` (the commit script adds it): their lists are read in
        # pipelined batches, and the entries still live or released at or after ``since`` kept.
        jobs = sorted(self._call(lambda: self.client.smembers(self._key("history_jobs"))))
        out: list[HistoryEntry] = []
        for start in range(0, len(jobs), HISTORY_BATCH):
            batch = jobs[start:start + HISTORY_BATCH]
            pipe = self.client.pipeline(transaction=False)
            for job in batch:
                pipe.lrange(self._key("history", job), 0, -1)
            for job, rows in zip(batch, self._call(pipe.execute), strict=True):
                out += [e for e in self._entries(job, rows)
                        if since is None or e.released_at is None or e.released_at >= since]
        return out

    def _entries(self, job_id: str, rows: list) -> list[HistoryEntry]:
        out = []
        for row in rows:
            entry = json.loads(row)
            placements = entry["placements"]  # a JSON array; a string holding one in entries written before
            if isinstance(placements, str):
                placements = json.loads(placements)
            out.append(HistoryEntry(job_id=job_id, placements=[Placement.model_validate(p) for p in placements],
                                    committed_at=entry["committed_at"], released_at=entry.get("released_at")))
        return out

    # -- jobs and events ------------------------------------------------------------------------------

    def put_job(self, job: JobRecord) -> None:
        job = job.model_copy(update={"updated_at": time.time()})  # a stored one keeps its created_at (PUT_JOB)
        args = [self.prefix, job.job_id, job.model_dump_json()]
        if not self._ahead("EVAL", self._put_job.script, 0, *args):  # whole: never NOSCRIPT ahead of a commit
            self._call(lambda: self._run(self._put_job, args))

    def get_job(self, job_id: str) -> JobRecord | None:
        raw = self._call(lambda: self.client.hget(self.prefix + "jobs", job_id))
        return JobRecord.model_validate_json(raw) if raw else None

    def delete_job(self, job_id: str) -> bool:
        args = [self.prefix, job_id]  # on the script line: after what this thread queued ahead (its record)
        return bool(self._call(lambda: self._run(self._delete_job, args)))

    def list_jobs(self, *, status: str | None = None) -> list[JobRecord]:
        jobs = [JobRecord.model_validate_json(v) for v in self._call(lambda: self.client.hvals(self.prefix + "jobs"))]
        return sorted((j for j in jobs if status is None or j.status == status), key=lambda j: j.created_at)

    def reservations_due(self, now: float) -> tuple[list[JobRecord], float]:
        *rows, first = self._call(lambda: self._run(self._due, [self.prefix, repr(now), DUE_AT_ONCE]))
        return [JobRecord.model_validate_json(r) for r in rows if r], float(first) if first else math.inf

    def record_event(self, event: Event) -> None:
        command = ("XADD", self.prefix + "events", "MAXLEN", "~", scripts.EVENTS_MAXLEN, "*", "event", event.model_dump_json())
        if not self._ahead(*command):
            self._call(lambda: self._command(*command))

    def events(self, *, node: str | None = None, job_id: str | None = None, limit: int = 100) -> list[Event]:
        rows = self._call(lambda: self.client.xrevrange(self.prefix + "events", count=max(limit * 20, 1000)))
        out = []
        for _, fields in rows:
            event = Event.model_validate_json(fields["event"])
            if (node is None or event.node == node) and (job_id is None or event.job_id == job_id):
                out.append(event)
                if len(out) >= limit:
                    break
        return list(reversed(out))

    # -- leases ---------------------------------------------------------------------------------------

    def acquire_lease(self, name: str, owner: str, ttl_s: float, *, now: float | None = None) -> Lease | None:
        now = time.time() if now is None else now
        got = self._call(lambda: self._acquire(args=[self.prefix, name, owner, repr(ttl_s), repr(now)]))
        if not got:
            return None
        return Lease(name=name, owner=owner, epoch=int(got[0]), expires_at=float(got[1]))

    def renew_lease(self, lease: Lease, ttl_s: float, *, now: float | None = None) -> Lease | None:
        now = time.time() if now is None else now
        ok = self._call(lambda: self._renew(args=[self.prefix, lease.name, lease.owner, str(lease.epoch), repr(ttl_s), repr(now)]))
        return lease.model_copy(update={"expires_at": now + ttl_s}) if ok else None

    def release_lease(self, lease: Lease) -> bool:
        return bool(self._call(lambda: self._release_lease(args=[self.prefix, lease.name, lease.owner, str(lease.epoch)])))


def _limits(raw: dict) -> Limits:
    if not raw:
        return Limits()
    return Limits(cpu=int(raw.get("cpu", 100)), memory=int(raw.get("memory", 100)), gpu=int(raw.get("gpu", 100)),
                  disk=int(raw.get("disk", 100)), per_node=json.loads(raw.get("per_node") or "{}"))
