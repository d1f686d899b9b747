"""One signed webhook notification: what a receiver gets (``Notification``), its signature, and posting it to
one webhook with retries (``deliver``). ``mn_prefect.notify`` queues notifications and sends them through the
``MNNotificationWebhook`` blocks (``mn_prefect.blocks``); both build on this module, which knows neither."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr

Kind = Literal["ONLINE", "OFFLINE", "DEALLOCATION"]
KINDS: tuple[Kind, ...] = ("ONLINE", "OFFLINE", "DEALLOCATION")

SIGNATURE_HEADER = "X-MN-Signature"
TIMESTAMP_HEADER = "X-MN-Timestamp"
DELIVERY_HEADER = "X-MN-Delivery"
ATTEMPT_HEADER = "X-MN-Attempt"

DEFAULT_ATTEMPTS = 3
DEFAULT_RETRY_DELAY_S = 15.0
DEFAULT_TIMEOUT_S = 10.0

# Client errors a retry may fix (timeout, too early, rate limited); any other 4xx is the receiver saying no.
_RETRYABLE_4XX = frozenset((408, 425, 429))

log = logging.getLogger("mn_prefect.notify")  # one logger for notifications, wherever sent


class Webhook(Protocol):
    """Where ``deliver`` posts, and how it retries (an ``MNNotificationWebhook`` block)."""

    url: str
    secret: SecretStr
    attempts: int
    retry_delay_s: float
    timeout_s: float


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


def deliver(webhook: Webhook, notification: Notification, *,
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
