"""Signed notifications (docs/events.md, "Notifications"): the MNNotificationWebhook block, signing, retries and the
background sender, against real HTTP receivers on loopback and a real Prefect server."""

import http.server
import json
import logging
import socket
import subprocess
import threading
import time

import pytest
from builders import node
from pydantic import ValidationError

from mn_prefect import notify
from mn_prefect.blocks import MNNotificationWebhook
from mn_prefect.local_lab import BIN
from mn_prefect.store import open_store

SECRET = "whsec-7f3a9c-never-in-logs"


class Receiver:
    """An HTTP server on 127.0.0.1 that checks each POST's signature with SECRET and answers ``codes`` in turn
    (the last one from then on)."""

    def __init__(self, *codes: int):
        self.codes = list(codes) or [200]
        self.posts: list[dict] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts.append({"body": body, "headers": dict(self.headers), "path": self.path,
                                       "signed": notify.verify(SECRET, body, self.headers.get("X-MN-Signature"))})
                code = receiver.codes[min(len(receiver.posts), len(receiver.codes)) - 1]
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/mn"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def documents(self) -> list[dict]:
        return [json.loads(p["body"]) for p in self.posts]


class Silent:
    """A receiver that accepts every connection and never answers; counts the connections."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/hooks/mn"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(connection)

    def close(self):
        self.listener.close()
        for connection in self.held:
            connection.close()


@pytest.fixture
def receiver():
    made = []

    def make(*codes):
        made.append(Receiver(*codes))
        return made[-1]
    yield make
    for r in made:
        r.close()


@pytest.fixture(autouse=True)
def no_profile(tmp_path, monkeypatch):
    """Nothing configured unless a test says so: no MN_NOTIFY_BLOCKS, an empty mn-prefect home."""
    monkeypatch.setenv("MN_PREFECT_HOME", str(tmp_path / "mn-home"))
    monkeypatch.delenv("MN_NOTIFY_BLOCKS", raising=False)


def webhook(url, **fields):
    return MNNotificationWebhook(url=url, secret=SECRET, **{"retry_delay_s": 0.2, "timeout_s": 5, **fields})


def sent(box=None, timeout=60):
    """Wait until the outbox has delivered or given up everything queued."""
    assert (box or notify.outbox()).flush(timeout) == 0


# -- signing and retries -----------------------------------------------------------------------------------------

def test_a_failed_first_attempt_is_retried_with_the_same_signed_body(receiver):
    hook = receiver(500, 200)
    queued = notify.publish("OFFLINE", "mn.node.offline", node="gpu-1", reason="no heartbeat for 75 s",
                            to=[webhook(hook.url)])
    sent()
    first, second = hook.posts
    assert first["body"] == second["body"] == queued.body() and first["signed"] and second["signed"]
    assert first["headers"]["X-MN-Signature"] == notify.signature(SECRET, first["body"])
    assert [p["headers"]["X-MN-Attempt"] for p in hook.posts] == ["1", "2"]
    doc = hook.documents()[0]
    assert (doc["kind"], doc["event"], doc["node"], doc["reason"]) == ("OFFLINE", "mn.node.offline", "gpu-1",
                                                                       "no heartbeat for 75 s")
    assert first["headers"]["X-MN-Timestamp"] == str(doc["timestamp"]) and doc["id"] == queued.id


def test_the_signature_is_hex_hmac_sha256_of_the_raw_body():
    import hashlib
    import hmac

    body = notify.Notification(kind="ONLINE", event="mn.run.started", job_id="r1").body()
    assert notify.signature(SECRET, body) == "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    assert not notify.verify("another-secret", body, notify.signature(SECRET, body))
    assert not notify.verify(SECRET, body + b" ", notify.signature(SECRET, body))


def test_a_receiver_that_refuses_with_a_client_error_is_not_retried(receiver):
    hook = receiver(400)
    result = notify.deliver(webhook(hook.url), notify.Notification(kind="OFFLINE", event="mn.run.crashed"))
    assert (result.delivered, result.attempts, result.outcome) == (False, 1, "400") and len(hook.posts) == 1


def test_a_receiver_that_keeps_failing_gets_exactly_the_configured_attempts(receiver):
    hook = receiver(503)
    result = notify.deliver(webhook(hook.url, attempts=4, retry_delay_s=0),
                            notify.Notification(kind="DEALLOCATION", event="mn.allocation.deallocated"))
    assert (result.delivered, result.attempts) == (False, 4) and len(hook.posts) == 4


def test_a_receiver_that_never_answers_costs_the_configured_attempts_and_never_blocks_publish():
    silent = Silent()
    try:
        hook = webhook(silent.url, attempts=3, timeout_s=1.5, retry_delay_s=0.1)
        started = time.monotonic()
        queued = notify.publish("OFFLINE", "mn.node.offline", node="gpu-1", to=[hook])
        returned_after = time.monotonic() - started
        assert queued is not None and notify.outbox().flush(0) == 1  # still going out after publish returned
        assert returned_after < 1.5  # generous: one attempt alone waits 1.5 s, all of them over 4.5 s
        sent()
        assert len(silent.held) == 3  # one connection per attempt, and no fourth
    finally:
        silent.close()


def test_a_full_queue_drops_the_new_notification_with_a_warning(caplog):
    box = notify.Outbox(senders=0, capacity=1)  # nothing takes from it: the second one finds it full
    first = notify.Notification(kind="ONLINE", event="mn.node.healthy", node="a")
    second = notify.Notification(kind="OFFLINE", event="mn.node.offline", node="a")
    assert box.put(first, [webhook("http://127.0.0.1:9/x")]) is True
    assert box.put(second, [webhook("http://127.0.0.1:9/x")]) is False
    assert f"notification {second.id}" in caplog.text and "dropped" in caplog.text


def test_a_webhook_gets_only_the_events_it_names(receiver):
    hook = receiver(200)
    only_offline = webhook(hook.url, events=["offline"])
    notify.publish("ONLINE", "mn.node.healthy", node="a", to=[only_offline])
    notify.publish("OFFLINE", "mn.node.offline", node="a", to=[only_offline])
    sent()
    assert [d["kind"] for d in hook.documents()] == ["OFFLINE"]


def test_publish_with_no_webhook_configured_queues_nothing():
    assert notify.configured_blocks() == [] and notify.publish("OFFLINE", "mn.node.offline", node="a") is None


# -- the block ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["ftp://hooks.example/mn", "hooks.example/mn", "file:///etc/passwd", "http://",
                                 "javascript:alert(1)"])
def test_a_url_that_is_not_http_or_https_is_refused_naming_url(url):
    with pytest.raises(ValidationError) as refused:
        MNNotificationWebhook(url=url, secret=SECRET)
    [error] = refused.value.errors()
    assert error["loc"] == ("url",) and "http:// or https://" in error["msg"]


@pytest.mark.parametrize("fields, named", [({"events": ["ONLINE", "REBOOTED"]}, "events"), ({"events": []}, "events"),
                                           ({"secret": "  "}, "secret"), ({"attempts": 0}, "attempts"),
                                           ({"timeout_s": 0}, "timeout_s"), ({"retry_delay_s": -1}, "retry_delay_s")])
def test_bad_block_fields_are_refused_naming_them(fields, named):
    with pytest.raises(ValidationError) as refused:
        MNNotificationWebhook(**{"url": "https://hooks.example/mn", "secret": SECRET, **fields})
    assert [e["loc"] for e in refused.value.errors()] == [(named,)]


def test_the_block_defaults_to_every_event_three_attempts_fifteen_seconds_apart():
    hook = MNNotificationWebhook(url="https://hooks.example/mn", secret=SECRET)
    assert (hook.events, hook.attempts, hook.retry_delay_s) == (["ONLINE", "OFFLINE", "DEALLOCATION"], 3, 15)


def test_the_secret_never_appears_in_logs_repr_or_dumps(receiver, caplog):
    caplog.set_level(logging.DEBUG)
    hook = receiver(500, 200)
    block = webhook(hook.url)
    notify.publish("OFFLINE", "mn.run.crashed", job_id="r1", to=[block])
    notify.publish("ONLINE", "mn.run.started", job_id="r2", to=[webhook("http://127.0.0.1:9/closed", attempts=2)])
    sent()
    assert len(hook.posts) == 2 and "retrying" in caplog.text and "not delivered" in caplog.text
    logged = caplog.text + "".join(repr(r.args) for r in caplog.records)
    shown = [logged, repr(block), str(block), str(block.model_dump()), block.model_dump_json(),
             json.dumps(MNNotificationWebhook.model_json_schema())]
    assert not [text for text in shown if SECRET in text]


# -- through a real Prefect server -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prefect(prefect_server):
    """The test process's shared Prefect server: the blocks saved here have names no other module uses."""
    return prefect_server


@pytest.fixture
def on_server(prefect):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect.api_url}):
        yield prefect


@pytest.mark.lab
def test_the_block_is_saved_to_the_prefect_server_and_loaded_back(on_server):
    MNNotificationWebhook(url="https://hooks.example/mn", secret=SECRET, events=["OFFLINE"], attempts=5,
                          retry_delay_s=2).save("saved", overwrite=True)
    loaded = MNNotificationWebhook.load("saved")
    assert (loaded.url, loaded.events, loaded.attempts, loaded.retry_delay_s) == ("https://hooks.example/mn",
                                                                                   ["OFFLINE"], 5, 2)
    assert loaded.secret.get_secret_value() == SECRET and SECRET not in repr(loaded)


@pytest.mark.lab
def test_publish_loads_the_blocks_named_in_mn_notify_blocks(on_server, receiver, monkeypatch):
    hook = receiver(200)
    webhook(hook.url).save("by-name", overwrite=True)
    monkeypatch.setenv("MN_NOTIFY_BLOCKS", "by-name")
    assert notify.publish("DEALLOCATION", "mn.reservation.expired", node="a", job_id="res-1") is not None
    sent()
    [doc] = hook.documents()
    assert (doc["kind"], doc["job_id"]) == ("DEALLOCATION", "res-1") and hook.posts[0]["signed"]


@pytest.mark.lab
def test_a_node_that_goes_offline_is_notified_signed(prefect, receiver, tmp_path):
    """End to end: the `node states` sweep marks a silent node offline, and the webhook named in
    MN_NOTIFY_BLOCKS gets a signed OFFLINE for it before the command exits."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    hook = receiver(500, 200)
    with temporary_settings(updates={PREFECT_API_URL: prefect.api_url}):
        webhook(hook.url, events=["OFFLINE"]).save("ops", overwrite=True)
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    store.register_node(node("silent"), now=time.time() - 1000)
    store.register_node(node("alive"))
    env = {**prefect.env, "MN_NOTIFY_BLOCKS": "ops", "MN_PREFECT_HOME": str(tmp_path / "home"),
           "MN_DISCONNECT_GRACE_SECONDS": "1"}
    changes = []
    for _ in range(2):  # disconnected, then offline once it was disconnected for the grace
        result = subprocess.run([str(BIN / "mn-prefect"), "node", "states", "--store-url", url, "--json"], env=env,
                                capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr
        changes += [c["to_status"] for c in json.loads(result.stdout)]
        time.sleep(1.2)
    assert changes == ["disconnected", "offline"]
    assert [p["signed"] for p in hook.posts] == [True, True], result.stderr  # the first answered 500, the retry 200
    [doc] = {p["body"]: json.loads(p["body"]) for p in hook.posts}.values()
    assert (doc["kind"], doc["event"], doc["node"]) == ("OFFLINE", "mn.node.offline", "silent")
    assert "timeout" in doc["reason"] and SECRET not in result.stdout + result.stderr
    store.close()


@pytest.mark.lab
def test_leaving_maintenance_notifies_online(on_server, receiver, tmp_path, monkeypatch):
    from mn_prefect.lifecycle import set_maintenance

    hook = receiver(200)
    webhook(hook.url).save("ops-online", overwrite=True)
    monkeypatch.setenv("MN_NOTIFY_BLOCKS", "ops-online")
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store.register_node(node("n1"))
    set_maintenance(store, "n1", True, "firmware")
    set_maintenance(store, "n1", False, "done")
    sent()
    assert [(d["kind"], d["event"], d["node"], d["reason"]) for d in hook.documents()] == [
        ("ONLINE", "mn.node.healthy", "n1", "done")]
    store.close()


@pytest.mark.parametrize(("body", "subject", "expected"), [
    ('{"event": "mn.node.offline", "node": "gpu-1", "reason": "no heartbeat"}', "OFFLINE",
     {"kind": "OFFLINE", "event": "mn.node.offline", "node": "gpu-1", "reason": "no heartbeat"}),
    ('{"event": "mn.allocation.deallocated", "job_id": "r1"}', "Prefect automated notification",
     {"kind": "DEALLOCATION", "event": "mn.allocation.deallocated", "job_id": "r1"}),
    ("disk almost full on cpu-1", "online", {"kind": "ONLINE", "event": "mn.automation",
                                              "reason": "disk almost full on cpu-1"}),
])
def test_an_automation_message_becomes_a_notification(body, subject, expected):
    got = notify.from_automation(body, subject).model_dump()
    assert {k: got[k] for k in expected} == expected


def test_an_automation_sends_through_the_block_signed_and_retried(receiver):
    """What Prefect's send-notification action calls: the block's notify(), with the block's retries."""
    import anyio

    got = receiver(503, 200)
    hook = webhook(got.url)
    with hook.raise_on_failure():
        anyio.run(hook.notify, '{"event": "mn.node.offline", "node": "n1"}', "OFFLINE")
    assert [p["signed"] for p in got.posts] == [True, True]
    assert json.loads(got.posts[-1]["body"])["node"] == "n1"


def test_an_undelivered_automation_notification_fails_the_action(receiver):
    import anyio
    from prefect.blocks.abstract import NotificationError

    hook = webhook(receiver(404).url)
    with hook.raise_on_failure(), pytest.raises(NotificationError, match="not delivered after 1 attempt"):
        anyio.run(hook.notify, "anything", None)


def test_the_lab_receiver_keeps_only_signed_notifications_and_each_once(tmp_path):
    from mn_prefect.lab_notifications import NotificationReceiver

    said: list[str] = []
    lab = NotificationReceiver(tmp_path / "n.jsonl", said.append, secret=SECRET)
    try:
        note = notify.Notification(kind="OFFLINE", event="mn.node.offline", node="n1")
        signed = {notify.SIGNATURE_HEADER: notify.signature(SECRET, note.body()), notify.DELIVERY_HEADER: note.id}
        forged = {notify.SIGNATURE_HEADER: notify.signature("not-the-secret", note.body())}
        codes = [httpx_post(lab.url, note.body(), headers).status_code for headers in (forged, signed, signed)]
    finally:
        lab.stop()
    assert codes == [401, 204, 204]  # the repeat is answered, not kept again
    assert [json.loads(line)["id"] for line in (tmp_path / "n.jsonl").read_text().splitlines()] == [note.id]
    assert "bad signature" in said[0] and len(said) == 2


def httpx_post(url: str, body: bytes, headers: dict):
    import httpx

    return httpx.post(url, content=body, headers=headers, timeout=10)


def test_a_forged_post_with_a_genuine_delivery_id_does_not_suppress_the_genuine_one(tmp_path):
    from mn_prefect.lab_notifications import NotificationReceiver

    lab = NotificationReceiver(tmp_path / "n.jsonl", [].append, secret=SECRET)
    try:
        note = notify.Notification(kind="OFFLINE", event="mn.node.offline", node="n1")
        forged = {notify.SIGNATURE_HEADER: "sha256=00", notify.DELIVERY_HEADER: note.id}  # sent first
        signed = {notify.SIGNATURE_HEADER: notify.signature(SECRET, note.body()), notify.DELIVERY_HEADER: note.id}
        codes = [httpx_post(lab.url, note.body(), headers).status_code for headers in (forged, signed)]
    finally:
        lab.stop()
    assert codes == [401, 204]
    assert [json.loads(line)["id"] for line in (tmp_path / "n.jsonl").read_text().splitlines()] == [note.id]


@pytest.mark.parametrize(("length", "code"), [("abc", 400), ("-1", 400), ("99999999999", 413)])
def test_the_lab_receiver_refuses_a_bad_content_length_unread_and_keeps_answering(tmp_path, length, code):
    import socket

    from mn_prefect.lab_notifications import NotificationReceiver

    said: list[str] = []
    lab = NotificationReceiver(tmp_path / "n.jsonl", said.append, secret=SECRET)
    try:
        port = lab.server.server_address[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(f"POST /node-offline HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
            answer = conn.recv(4096).decode()
        assert answer.startswith(f"HTTP/1.0 {code}") or answer.startswith(f"HTTP/1.1 {code}"), answer
        note = notify.Notification(kind="OFFLINE", event="mn.node.offline", node="n1")
        signed = {notify.SIGNATURE_HEADER: notify.signature(SECRET, note.body()), notify.DELIVERY_HEADER: note.id}
        assert httpx_post(lab.url, note.body(), signed).status_code == 204  # the receiver goes on
    finally:
        lab.stop()
    assert "Content-Length" in said[0] and not (tmp_path / "n.jsonl").read_text().count("\n") > 1
