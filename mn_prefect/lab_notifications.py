"""The lab's example of Automations and signed notifications (docs/events.md, "Automations"): a webhook receiver
on a loopback port of ``mn-prefect up`` that keeps each signed notification, and the Automation that makes Prefect
send one through an ``MNNotificationWebhook`` block whenever a node goes offline."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

from mn_prefect.http_serving import READ_TIMEOUT_S, Bounded

AUTOMATION_NAME = "mn: node offline notifies the lab"
WEBHOOK_BLOCK = "mn-lab-node-offline"
# The notification's body: Prefect renders it (Jinja) from the event that fired the Automation, and the block
# turns it into a signed mn notification (notify.from_automation).
NOTIFICATION_BODY = ('{"event": {{ event.event | tojson }}, "node": {{ event.resource.name | tojson }}, '
                     '"reason": {{ event.payload.reason | tojson }}}')
MAX_NOTIFICATION_BYTES = 1 << 20  # a notification's body at most; one larger is refused unread


class _Receiving(Bounded, ThreadingHTTPServer):
    """The receiver's server: a read timeout on each connection and a cap on how many are served at once."""


class NotificationReceiver:
    """The lab's notification receiver, on a free loopback port in this process. Each POST signed with
    ``secret`` (the ``X-MN-Signature`` of mn_prefect.notify) is appended to ``path`` (one JSON document a line)
    and said with ``say``; one with a wrong signature is refused (401) and said, not kept. Each delivery id is
    kept once, so a retry after a lost answer is not acted on twice."""

    def __init__(self, path: Path, say: Callable[[str], None], secret: str | None = None):
        from mn_prefect import notify

        lock = threading.Lock()
        self.secret = secret or uuid.uuid4().hex
        key, seen = self.secret, set()

        class Handler(BaseHTTPRequestHandler):
            timeout = READ_TIMEOUT_S  # a client that sends slowly, or never, is dropped

            def do_POST(self) -> None:  # noqa: N802 (the name http.server calls)
                length = self.headers.get("Content-Length") or "0"
                if not length.isascii() or not length.isdigit() or int(length) > MAX_NOTIFICATION_BYTES:
                    say(f"[red]notification refused: Content-Length {length[:20]!r}[/] (a size of at most "
                        f"{MAX_NOTIFICATION_BYTES} bytes)")
                    self.send_response(400 if not length.isascii() or not length.isdigit() else 413)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    return
                raw = self.rfile.read(int(length))
                body = raw.decode(errors="replace")
                signed = notify.verify(key, raw, self.headers.get(notify.SIGNATURE_HEADER))
                delivery = self.headers.get(notify.DELIVERY_HEADER)
                if not signed:
                    say(f"[red]notification refused: bad signature[/] ({len(raw)} bytes)")
                with lock:
                    fresh = signed and delivery not in seen
                    if signed:  # an unsigned post records nothing: it cannot stand in for a genuine one
                        seen.add(delivery)
                    if fresh:
                        with path.open("a") as out:
                            out.write(" ".join(body.split()) + "\n")
                if fresh:
                    say(f"[bold]notification[/] (signature verified; from the Automation {AUTOMATION_NAME!r}): "
                        f"{body}")
                self.send_response(204 if signed else 401)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the line above says it; no access log on the lab's console

        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.server = _Receiving(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/node-offline"
        threading.Thread(target=self.server.serve_forever, name="mn-lab-webhook", daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def create_node_offline_automation(api_url: str, webhook_url: str, secret: str) -> str:
    """The example Automation on the server at ``api_url``: every ``mn.node.offline`` event makes Prefect send
    an OFFLINE notification (NOTIFICATION_BODY) through the ``MNNotificationWebhook`` block WEBHOOK_BLOCK, which
    posts it to ``webhook_url`` signed with ``secret``. One of that name is replaced. Returns the Automation's
    id."""
    from prefect.client.orchestration import get_client
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from mn_prefect import events
    from mn_prefect.blocks import MNNotificationWebhook

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        block = MNNotificationWebhook.model_validate({"url": webhook_url, "secret": secret, "events": ["OFFLINE"],
                                                      "retry_delay_s": 5})
        block_id = cast(uuid.UUID, block.save(WEBHOOK_BLOCK, overwrite=True))  # sync here: the UUID itself
        for old in client.read_automations_by_name(AUTOMATION_NAME):
            client.delete_automation(old.id)
        automation = AutomationCore(
            name=AUTOMATION_NAME,
            description="mn-prefect up's example: a node going offline calls the lab's webhook (see docs/events.md, "
                        "Automations).",
            trigger=EventTrigger(expect={f"{events.NODE}offline"}, match={"prefect.resource.id": f"{events.NODE}*"},
                                 posture=Posture.Reactive, threshold=1),
            actions=[SendNotification(block_document_id=block_id, subject="OFFLINE", body=NOTIFICATION_BODY)])
        return str(client.create_automation(automation))


def delete_node_offline_automation(api_url: str) -> None:
    """Remove the example Automation (its webhook receiver goes with the lab)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(AUTOMATION_NAME):
            client.delete_automation(old.id)
