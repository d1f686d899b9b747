"""Durable-looking operations (``mirrorneuron.operations.v1.OperationsService``): what ``mn node drain`` and
``mn node reconcile`` start and then follow.

An operation runs in a thread of the API server that started it and keeps its events in memory (the work it
starts does not depend on it: a drain is in the store, and the reconcile flow and every ``mn-prefect node drain
--wait`` advance it too). Each event has a sequence number; a follower asks for those after the last it saw.
Item statuses are MirrorNeuron's: the ``mn`` command counts completed, migrated, ignored, skipped, recovered,
dry_run as done and ``failed`` as failed, and exits 1 when any item failed."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from mn_prefect.mn_api import cluster
from mn_prefect.mn_api.errors import ApiError, not_found
from mn_prefect.store.base import ClusterStore

TERMINAL = ("completed", "completed_with_failures", "failed")
KINDS = ("drain_node", "reconcile_node")
# A drain pass's action -> the item's status while the drain goes on ("wait": the item is deferred).
DRAIN_ITEM = {"migrated": "migrated", "ignore": "ignored", "pause": "paused_for_review", "wait": "deferred"}
RECONCILE_ITEM = {"recovered": "recovered", "paused": "paused_for_review", "blocked": "blocked", "skipped": "skipped",
                  "failed": "failed"}
# A drain is followed this long past its deadline before the operation gives up on it (the drain goes on).
DRAIN_GRACE_S = 600.0


class Operation:
    def __init__(self, kind: str, options: dict[str, Any], target: dict[str, Any]):
        self.id = f"op-{uuid.uuid4().hex[:16]}"
        self.kind, self.options = kind, options
        self.status = "running"
        self.items: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.created_at = self.updated_at = time.time()
        self.completed_at: float | None = None
        self.target = target
        self._changed = threading.Condition()
        self.emit("operation_created", status="running")

    # -- recording ----------------------------------------------------------------------------------------------

    def emit(self, kind: str, **fields: Any) -> None:
        with self._changed:
            self.updated_at = time.time()
            self.events.append({"type": kind, "operation_id": self.id, "sequence": len(self.events) + 1,
                                "timestamp": cluster.iso(self.updated_at), **fields})
            self._changed.notify_all()

    def item(self, item_id: str, status: str, *, result: Any = None, error: str | None = None) -> None:
        """Record an item's status; an event only when it changed."""
        with self._changed:  # readers (GetOperation, followers) run on other threads
            old = self.items.get(item_id)
            if old is not None and old["status"] == status and old["result"] == result:
                return
            if old is None:
                self.emit("item_started", item_id=item_id, status="running")
            self.items[item_id] = {"item_id": item_id, "status": status, "result": result, "error": error}
            self.emit("item_deferred" if status == "deferred" else "item_completed", item_id=item_id,
                      status=status, result=result, error=error)

    def defer(self) -> None:
        if self.status != "waiting":
            self.status = "waiting"
            self.emit("operation_deferred", status="waiting", counters=self.counters())

    def finish(self, error: str | None = None) -> None:
        if error is not None:  # an item too: the ``mn`` command exits 1 only when an item failed
            self.errors.append(error)
            self.item("operation", "failed", error=error)
        failed = any(i["status"] == "failed" for i in self.items.values())
        self.status = "failed" if error is not None else "completed_with_failures" if failed else "completed"
        self.completed_at = time.time()
        self.emit("operation_failed" if error is not None else "operation_completed", status=self.status,
                  counters=self.counters(), error=error)

    # -- reading ------------------------------------------------------------------------------------------------

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def counters(self) -> dict[str, int]:
        with self._changed:
            statuses = [i["status"] for i in self.items.values()]
        return {"total": len(statuses), "started": len(statuses),
                "finished": sum(s not in ("deferred", "running") for s in statuses),
                "succeeded": sum(s not in ("deferred", "running", "failed") for s in statuses),
                "failed": statuses.count("failed"), "deferred": statuses.count("deferred"),
                "skipped": statuses.count("skipped")}

    def as_json(self) -> dict[str, Any]:
        with self._changed:
            counters, items = self.counters(), dict(self.items)
        return {"operation_id": self.id, "kind": self.kind, "status": self.status, "options": self.options,
                **self.target, "counters": counters, "target_count": counters["total"], "items": items,
                "errors": self.errors, "created_at": cluster.iso(self.created_at),
                "updated_at": cluster.iso(self.updated_at), "completed_at": cluster.iso(self.completed_at),
                "version": 1}

    def follow(self, after: int, *, follow: bool, heartbeat_s: float,
               active: Callable[[], bool] = lambda: True) -> Iterator[dict[str, Any]]:
        """The events after sequence ``after``; with ``follow``, then each new one until the operation ends (a
        heartbeat each ``heartbeat_s`` of quiet), or until ``active`` says the caller left."""
        sent = max(after, 0)
        while True:
            with self._changed:
                if follow and len(self.events) <= sent and not self.terminal:
                    self._changed.wait(heartbeat_s)
                fresh = self.events[sent:]
                done = self.terminal
            yield from fresh
            sent += len(fresh)
            if not follow or (done and sent >= len(self.events)) or not active():
                return
            if not fresh:
                yield {"type": "stream_heartbeat", "operation_id": self.id, "timestamp": cluster.iso(time.time())}


class Operations:
    """The operations this server started, by id."""

    def __init__(self, store: ClusterStore, prefect_client: Callable[[], Any]):
        self.store = store
        self.prefect_client = prefect_client
        self._by_id: dict[str, Operation] = {}
        self._lock = threading.Lock()

    def get(self, operation_id: str) -> Operation:
        with self._lock:
            operation = self._by_id.get(operation_id)
        if operation is None:
            raise not_found(f"unknown operation {operation_id!r} (operations live in the API server that "
                            f"started them)")
        return operation

    def start(self, kind: str, options: dict[str, Any]) -> Operation:
        """Check the request and start the work; a refused request raises ApiError and starts nothing."""
        if kind == "drain_node":
            node, reason, deadline_s, dry_run = cluster.check_drain_options(self.store, options)
            operation = Operation(kind, options, {"node_name": node, "reason": reason, "dry_run": dry_run})
            if dry_run:
                work: Callable[[], None] = lambda: self._preview_drain(operation, node, deadline_s)
            else:
                started = cluster.begin_drain(self.store, node, reason, deadline_s)  # refused: nothing started
                work = lambda: self._follow_drain(operation, node, started["deadline"])
        elif kind == "reconcile_node":
            node = cluster.node_name(self.store, str(options.get("node_name") or ""))
            dry_run = bool(options.get("dry_run"))
            operation = Operation(kind, options, {"node_name": node, "reason": options.get("reason") or "",
                                                  "dry_run": dry_run})
            work = lambda: self._reconcile(operation, node, dry_run)
        else:
            raise ApiError("UNIMPLEMENTED", f"operation kind {kind!r} is not part of mn-prefect's MirrorNeuron API "
                                            f"(it runs {', '.join(KINDS)}); cancel or clear runs from the Prefect "
                                            f"UI or `prefect flow-run cancel`")
        with self._lock:
            self._by_id[operation.id] = operation
        operation.emit("operation_started", status="running")
        threading.Thread(target=self._run, args=(operation, work), name=f"mn-api-{operation.id}", daemon=True).start()
        return operation

    def _run(self, operation: Operation, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as error:  # the operation says what went wrong; the server goes on
            operation.finish(error=f"{type(error).__name__}: {error}")

    def _preview_drain(self, operation: Operation, node: str, deadline_s: float) -> None:
        actions = cluster.drain_preview(self.store, node, deadline_s)["actions"]
        for action in actions:
            operation.item(action["job_id"], "dry_run", result=action)
        operation.item(f"node:{node}", "dry_run", result={"node": node, "would_status": "complete" if all(
            a["action"] in ("ignore", "migrated") for a in actions) else "draining", "actions": len(actions)})
        operation.finish()

    def _follow_drain(self, operation: Operation, node: str, deadline: float) -> None:
        from mn_prefect.ops.flows import drain_until_done

        def each_pass(data: dict[str, Any]) -> None:
            for action in data.get("actions", []):
                operation.item(action["job_id"], DRAIN_ITEM.get(action["action"], action["action"]), result=action)
            if any(i["status"] == "deferred" for i in operation.items.values()):
                operation.defer()

        with self.prefect_client() as client:
            data = drain_until_done(self.store, client, node, timeout_s=max(deadline - time.time(), 0) + DRAIN_GRACE_S,
                                    on_pass=each_pass)
        each_pass({"actions": [a for a in data.get("actions", []) if a["action"] != "wait"]})
        status = data["status"]
        for item_id, item in list(operation.items.items()):
            if item["status"] == "deferred":  # what the drain waited for has left the node
                operation.item(item_id, "completed" if status == "complete" else "failed", result=item["result"],
                               error=None if status == "complete" else f"the drain ended: {status}")
        if status == "complete":
            operation.item(f"node:{node}", "complete", result={"node": node, "node_status": "maintenance"})
        elif status.startswith("ended"):
            operation.item(f"node:{node}", "cancelled", result={"node": node, "status": status})
        else:
            operation.item(f"node:{node}", "failed", error=f"the drain of {node} did not complete: {status}")
        operation.finish()

    def _reconcile(self, operation: Operation, node: str, dry_run: bool) -> None:
        from mn_prefect.ops.flows import reconcile_once

        with self.prefect_client() as client:
            report = reconcile_once(self.store, client, node=node, dry_run=dry_run)
        if not report.get("leader", True):
            operation.item(f"node:{node}", "skipped", result={"reason": "another reconcile pass holds the "
                                                                        "reconciler lease; it acts instead"})
        for action in report["actions"]:
            status = "dry_run" if dry_run else RECONCILE_ITEM.get(action["action"], action["action"])
            operation.item(action["job_id"], status, result=action,
                           error=action["reason"] if status == "failed" else None)
        if not operation.items:
            operation.item(f"node:{node}", "completed", result={"checked": report["checked"]})
        operation.finish()
