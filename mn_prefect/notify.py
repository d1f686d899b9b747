"""Signed webhook notifications (docs/events.md): ONLINE (a node healthy, a run started), OFFLINE (a node
offline, a run crashed) and DEALLOCATION (a failed health check or an expired reservation), posted as JSON to
the ``MNNotificationWebhook`` blocks named in ``MN_NOTIFY_BLOCKS``.

    notify.publish("OFFLINE", "mn.node.offline", node="gpu-1", reason="no heartbeat for 75 s")

``publish`` only queues: sender threads load the blocks and post, so a placement or a state change never waits
on a receiver. Each post is tried up to the block's ``attempts`` (3), ``retry_delay_s`` (15 s) apart, each attempt
bounded by ``timeout_s`` (10 s without a byte from the receiver); a 2xx answer delivers it, a 3xx or a 4xx other
than 408/425/429 ends it at once. When the queue is full (a receiver down for long), new notifications are
dropped with a warning. At exit the process waits up to ``EXIT_WAIT_S`` for what is queued.

What a receiver gets: a POST whose body is the ``Notification`` as compact JSON with sorted keys, and
``X-MN-Signature: sha256=<hex HMAC-SHA256 of the raw body, keyed with the block's secret>``,
``X-MN-Timestamp: <seconds since the epoch>`` (the body's ``timestamp``), ``X-MN-Delivery`` (the body's ``id``)
and ``X-MN-Attempt`` (1, 2, ...). Every attempt sends the same bytes. To accept one, a receiver

1. computes the HMAC of the raw bytes it received (before any JSON parsing) and compares it with the header in
   constant time (``verify`` below does both);
2. checks that the signed body's ``timestamp`` equals ``X-MN-Timestamp`` and is recent: the signature covers
   the body, not the headers, so the body's copy is the one to trust. The tolerance must cover the retries:
   ``attempts * (timeout_s + retry_delay_s)``, 75 s with the defaults;
3. remembers the ``id`` of what it accepted for that long and answers 2xx to a repeat without acting twice: a
   retry after an answer that was lost, or a replay.

The secret is a SecretStr: never logged, never in a repr or a dump; logs name a webhook by its URL without
credentials or query.
"""

from __future__ import annotations

import atexit
import contextvars
import hashlib
import hmac
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Union, cast
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field

from mn_prefect import settings

if TYPE_CHECKING:
    from mn_prefect.blocks import MNNotificationWebhook

Kind = Literal["ONLINE", "OFFLINE", "DEALLOCATION"]
KINDS: tuple[Kind, ...] = ("ONLINE", "OFFLINE", "DEALLOCATION")

SIGNATURE_HEADER = "X-MN-Signature"
TIMESTAMP_HEADER = "X-MN-Timestamp"
DELIVERY_HEADER = "X-MN-Delivery"
ATTEMPT_HEADER = "X-MN-Attempt"

DEFAULT_ATTEMPTS = 3
DEFAULT_RETRY_DELAY_S = 15.0
DEFAULT_TIMEOUT_S = 10.0

SENDERS = 4  # posts in flight at once: one receiver that never answers holds one sender, not all
CAPACITY = 1000  # notifications waiting to go out; beyond, a new one is dropped with a warning
BLOCKS_CACHE_S = 60.0  # a loaded block is used this long before it is loaded again (an edit takes effect)
EXIT_WAIT_S = 30.0  # at exit, how long the process waits for what is queued

# Client errors a retry may fix (timeout, too early, rate limited); any other 4xx is the receiver saying no.
_RETRYABLE_4XX = frozenset((408, 425, 429))

log = logging.getLogger(__name__)


class Notification(BaseModel):
    """What a receiver gets, as JSON (the same bytes on every attempt)."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(default_factory=lambda: uuid.uuid4().hex,
                    description="Unique per notification: a receiver acts once per id.")
    kind: Kind
    event: str = Field(min_length=1, description="What happened: mn.node.offline, mn.run.crashed, ...")
    node: str | None = None
    job_id: str | None = Field(None, description="The flow run or job it is about, if any.")
    reason: str | None = None
    timestamp: int = Field(default_factory=lambda: int(time.time()),
                           description="Seconds since the epoch; also sent as the X-MN-Timestamp header.")
    allocation: dict[str, Any] | None = Field(None, description="What the run held: node, devices, ports, ...")

    def body(self) -> bytes:
        """The exact bytes posted and signed."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


def signature(secret: str, body: bytes) -> str:
    """The ``X-MN-Signature`` value of ``body``: ``sha256=`` and the hex HMAC-SHA256 keyed with ``secret``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, header: str | None) -> bool:
    """A receiver's check: ``header`` is the signature of the raw ``body`` (compared in constant time)."""
    return header is not None and hmac.compare_digest(signature(secret, body), header)


def safe_url(url: str) -> str:
    """``url`` as logs show it: scheme, host, port and path, without credentials or query (a token may be there)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:  # a port that is no number: the URL is refused anyway, show no more of it
        port = None
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}{parts.path}"


def from_automation(body: str, subject: str | None = None) -> Notification:
    """The notification an Automation's "send a notification" action asks for. A ``body`` that is a JSON object
    gives the fields it names (``event``, ``node``, ``job_id``, ``reason``, ``allocation``; ``kind`` too); any
    other body is the ``reason`` of an ``mn.automation`` notification. The kind is the body's, else the
    ``subject`` when it is a kind's name, else the one the event implies (offline or crashed: OFFLINE,
    deallocated or expired: DEALLOCATION), else ONLINE."""
    try:
        fields = json.loads(body)
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        fields = {"reason": body}
    event = str(fields.get("event") or "mn.automation")
    kind = str(fields.get("kind") or (subject or "")).strip().upper()
    if kind not in KINDS:
        kind = _kind_of(event)
    allocation = fields.get("allocation")

    def text(key: str) -> str | None:
        return str(fields[key]) if fields.get(key) is not None else None

    return Notification(kind=kind, event=event, node=text("node"), job_id=text("job_id"),
                        reason=text("reason"), allocation=allocation if isinstance(allocation, dict) else None)


def _kind_of(event: str) -> Kind:
    last = event.rsplit(".", 1)[-1]
    if last in ("offline", "crashed", "lost", "failed"):
        return "OFFLINE"
    if last in ("deallocated", "expired"):
        return "DEALLOCATION"
    return "ONLINE"


@dataclass(frozen=True)
class DeliveryResult:
    delivered: bool
    attempts: int
    outcome: str  # "200", "500", "ReadTimeout: timed out", ...


def deliver(webhook: MNNotificationWebhook, notification: Notification, *,
            sleep: Callable[[float], None] = time.sleep) -> DeliveryResult:
    """Post ``notification`` to ``webhook``, retrying as the block says. Blocks: the sender threads call it."""
    body = notification.body()
    headers = {"Content-Type": "application/json", "User-Agent": "mn-prefect",
               SIGNATURE_HEADER: signature(webhook.secret.get_secret_value(), body),
               TIMESTAMP_HEADER: str(notification.timestamp), DELIVERY_HEADER: notification.id}
    where = safe_url(webhook.url)
    what = f"{notification.kind} notification {notification.id} ({notification.event})"
    outcome = "not tried"
    with httpx.Client(timeout=webhook.timeout_s, follow_redirects=False) as client:
        for attempt in range(1, webhook.attempts + 1):
            try:
                code = client.post(webhook.url, content=body, headers={**headers, ATTEMPT_HEADER: str(attempt)}
                                   ).status_code
            except httpx.HTTPError as error:
                outcome, final = f"{type(error).__name__}: {error}", False
            else:
                outcome = str(code)
                if 200 <= code < 300:
                    log.info("%s delivered to %s (attempt %d)", what, where, attempt)
                    return DeliveryResult(True, attempt, outcome)
                final = 300 <= code < 400 or (400 <= code < 500 and code not in _RETRYABLE_4XX)
            if final:
                log.warning("%s refused by %s: it answered %s; not retried", what, where, outcome)
                return DeliveryResult(False, attempt, outcome)
            if attempt < webhook.attempts:
                log.warning("%s to %s failed on attempt %d of %d (%s); retrying in %g s", what, where, attempt,
                            webhook.attempts, outcome, webhook.retry_delay_s)
                sleep(webhook.retry_delay_s)
    log.warning("%s to %s not delivered after %d attempts (last: %s)", what, where, webhook.attempts, outcome)
    return DeliveryResult(False, webhook.attempts, outcome)


Target = Union[str, "MNNotificationWebhook"]  # a block's name, or a block


def load_webhooks(names: Sequence[str]) -> list[MNNotificationWebhook]:
    """The blocks named ``names`` from the Prefect server (each kept ``BLOCKS_CACHE_S``); one that cannot be
    loaded is left out with a warning. Blocks: the sender threads call it."""
    from prefect.settings import get_current_settings

    from mn_prefect.blocks import MNNotificationWebhook

    if not get_current_settings().api.url:  # else Prefect would start a temporary server with no blocks in it
        log.warning("notification blocks %s are named but no Prefect server is configured (PREFECT_API_URL): "
                    "nothing sent", ", ".join(names))
        return []
    now = time.monotonic()
    found = []
    for name in names:
        with _cache_lock:
            cached = _cache.get(name)
        if cached is not None and now - cached[0] < BLOCKS_CACHE_S:
            found.append(cached[1])
            continue
        try:
            # Sync: a sender thread runs in the caller's context, which may be an async flow's.
            block = cast(Any, MNNotificationWebhook).load(name, _sync=True)
        except Exception as error:
            log.warning("could not load the notification block %r: %s: %s", name, type(error).__name__, error)
            continue
        with _cache_lock:
            _cache[name] = (now, block)
        found.append(block)
    return found


def _import_loader() -> None:
    """Import what loading blocks takes here, in the caller's thread (once; a process that talks to Prefect has
    it already): a sender thread still importing Prefect when the process exits could not finish, and the
    notification would be lost."""
    import prefect.client.orchestration  # noqa: F401

    import mn_prefect.blocks  # noqa: F401


_cache: dict[str, tuple[float, MNNotificationWebhook]] = {}
_cache_lock = threading.Lock()


class Outbox:
    """Notifications waiting to go out, and the threads that send them: ``put`` never waits."""

    def __init__(self, *, senders: int = SENDERS, capacity: int = CAPACITY,
                 resolve: Callable[[Sequence[str]], list[MNNotificationWebhook]] = load_webhooks):
        self._queue: queue.Queue[tuple[Notification, tuple[Target, ...], contextvars.Context]] = queue.Queue(capacity)
        self._senders = senders
        self._resolve = resolve
        self._lock = threading.Condition()
        self._pending = 0  # queued or being sent
        self._started = False

    def put(self, notification: Notification, targets: Sequence[Target]) -> bool:
        """Queue ``notification`` for ``targets`` (block names are loaded by the sender); False when the queue is
        full and it was dropped."""
        with self._lock:
            if not self._started:
                for n in range(self._senders):
                    threading.Thread(target=self._send_forever, name=f"mn-notify-{n}", daemon=True).start()
                self._started = True
            try:
                # The caller's context goes along: the Prefect settings (server, profile) it loads blocks with.
                self._queue.put_nowait((notification, tuple(targets), contextvars.copy_context()))
            except queue.Full:
                log.warning("%s notification %s (%s) dropped: %d notifications already wait to go out",
                            notification.kind, notification.id, notification.event, self._queue.maxsize)
                return False
            self._pending += 1
        return True

    def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` seconds for everything queued to be delivered or given up; how many are left."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._pending and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)
            return self._pending

    def _send_forever(self) -> None:
        while True:
            notification, targets, context = self._queue.get()
            try:
                context.run(self._send, notification, targets)
            except Exception as error:  # a sender thread outlives any one notification
                log.warning("%s notification %s not sent: %s: %s", notification.kind, notification.id,
                            type(error).__name__, error)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()

    def _send(self, notification: Notification, targets: tuple[Target, ...]) -> None:
        names = [t for t in targets if isinstance(t, str)]
        webhooks = [t for t in targets if not isinstance(t, str)] + (self._resolve(names) if names else [])
        for webhook in webhooks:
            if notification.kind in webhook.events:
                deliver(webhook, notification)


_outbox: Outbox | None = None
_outbox_lock = threading.Lock()


def outbox() -> Outbox:
    """The process's outbox, started on first use; at exit the process waits up to ``EXIT_WAIT_S`` for it."""
    global _outbox
    with _outbox_lock:
        if _outbox is None:
            _outbox = Outbox()
            atexit.register(_flush_at_exit, _outbox)
        return _outbox


def _flush_at_exit(box: Outbox) -> None:
    left = box.flush(EXIT_WAIT_S)
    if left:
        log.warning("%d notifications still going out after %g s at exit: not sent", left, EXIT_WAIT_S)


def configured_blocks() -> list[str]:
    """The notification block names ``settings.notify_blocks`` gives (comma- or space-separated)."""
    value = settings.notify_blocks().value or ""
    return [name for name in value.replace(",", " ").split() if name]


def publish(kind: Kind, event: str, *, node: str | None = None, job_id: str | None = None, reason: str | None = None,
            allocation: dict[str, Any] | None = None,
            to: Sequence[MNNotificationWebhook] | None = None) -> Notification | None:
    """Queue a notification for the configured blocks (or the blocks ``to``) and return at once; None when
    nothing was queued (none configured, or the queue is full). Never raises: a notification must not fail
    the state change or placement it reports."""
    try:
        targets: Sequence[Target] = list(to) if to is not None else configured_blocks()
        if not targets:
            return None
        if to is None:
            _import_loader()
        notification = Notification(kind=kind, event=event, node=node, job_id=job_id, reason=reason,
                                    allocation=allocation)
        return notification if outbox().put(notification, targets) else None
    except Exception as error:
        log.warning("%s notification (%s) not sent: %s: %s", kind, event, type(error).__name__, error)
        return None
