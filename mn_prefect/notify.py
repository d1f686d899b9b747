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
   constant time (``verify`` does both);
2. checks that the signed body's ``timestamp`` equals ``X-MN-Timestamp`` and is recent: the signature covers
   the body, not the headers, so the body's copy is the one to trust. The tolerance must cover the retries:
   ``attempts * (timeout_s + retry_delay_s)``, 75 s with the defaults;
3. remembers the ``id`` of what it accepted for that long and answers 2xx to a repeat without acting twice: a
   retry after an answer that was lost, or a replay.

The secret is a SecretStr: never logged, never in a repr or a dump; logs name a webhook by its URL without
credentials or query.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Union, cast

from mn_prefect import settings
from mn_prefect.background import Background, flush_at_exit
from mn_prefect.webhook import (  # the wire format, re-exported: notify.Notification, notify.verify, ...
    ATTEMPT_HEADER as ATTEMPT_HEADER,
    DEFAULT_ATTEMPTS as DEFAULT_ATTEMPTS,
    DEFAULT_RETRY_DELAY_S as DEFAULT_RETRY_DELAY_S,
    DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S,
    DELIVERY_HEADER as DELIVERY_HEADER,
    KINDS as KINDS,
    SIGNATURE_HEADER as SIGNATURE_HEADER,
    TIMESTAMP_HEADER as TIMESTAMP_HEADER,
    DeliveryResult as DeliveryResult,
    Kind as Kind,
    Notification as Notification,
    deliver as deliver,
    from_automation as from_automation,
    safe_url as safe_url,
    signature as signature,
    verify as verify,
)

if TYPE_CHECKING:
    from mn_prefect.blocks import MNNotificationWebhook

SENDERS = 4  # posts in flight at once: one receiver that never answers holds one sender, not all
CAPACITY = 1000  # notifications waiting to go out; beyond, a new one is dropped with a warning
BLOCKS_CACHE_S = 60.0  # a loaded block is used this long before it is loaded again (an edit takes effect)
EXIT_WAIT_S = 30.0  # at exit, how long the process waits for what is queued

log = logging.getLogger(__name__)


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

_Queued = tuple[Notification, tuple[Target, ...], contextvars.Context]  # with the caller's context


class Outbox:
    """Notifications waiting to go out, and the threads that send them (a ``Background`` queue): ``put`` never
    waits."""

    def __init__(self, *, senders: int = SENDERS, capacity: int = CAPACITY,
                 resolve: Callable[[Sequence[str]], list[MNNotificationWebhook]] = load_webhooks):
        self._box: Background[_Queued] = Background(self._send_one, name="mn-notify-{n}", capacity=capacity,
                                                    threads=senders, on_drop=self._said_dropped,
                                                    on_error=self._said_failed)
        self._resolve = resolve

    def put(self, notification: Notification, targets: Sequence[Target]) -> bool:
        """Queue ``notification`` for ``targets`` (block names are loaded by the sender); False when the queue is
        full and it was dropped."""
        # The caller's context goes along: the Prefect settings (server, profile) it loads blocks with.
        return self._box.put((notification, tuple(targets), contextvars.copy_context()))

    def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` seconds for everything queued to be delivered or given up; how many are left."""
        return self._box.flush(timeout_s)

    def _said_dropped(self, item: _Queued) -> None:
        notification = item[0]
        log.warning("%s notification %s (%s) dropped: %d notifications already wait to go out",
                    notification.kind, notification.id, notification.event, self._box.capacity)

    @staticmethod
    def _said_failed(items: list[_Queued], error: Exception) -> None:
        for notification, _, _ in items:  # a sender thread outlives any one notification
            log.warning("%s notification %s not sent: %s: %s", notification.kind, notification.id,
                        type(error).__name__, error)

    def _send_one(self, items: list[_Queued]) -> None:
        for notification, targets, context in items:
            context.run(self._send, notification, targets)

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
            flush_at_exit(_outbox.flush, EXIT_WAIT_S, _said_left)
        return _outbox


def _said_left(left: int) -> None:
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
