"""The MirrorNeuron API's own rules, without a Prefect server: the RPC catalog against MirrorNeuron's protocol
and the docs, node names across the two worlds, run events, operations, bad input, and tokens on a real
``mn-prefect mn-api serve`` over a store file (the cluster RPCs need no Prefect server)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import cli_runner
import grpc
import mn_sdk
import pytest
from builders import gpu

from mn_prefect.mn_api import catalog, names
from mn_prefect.mn_api.cluster import set_resources
from mn_prefect.mn_api.errors import ApiError, plain
from mn_prefect.mn_api.jobs import check_id, write_bundle
from mn_prefect.mn_api.operations import Operation
from mn_prefect.mn_api.runs import Snapshot, changes, taken_by_worker
from mn_prefect.model.node import NodeRecord
from mn_prefect.store import open_store

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _proto_rpcs() -> set[str]:
    from mn_sdk.proto import cluster_pb2, job_pb2, job_v2_pb2, observability_pb2, operations_pb2

    return {f"/{service.full_name}/{method.name}"
            for module in (cluster_pb2, job_pb2, job_v2_pb2, operations_pb2, observability_pb2)
            for service in module.DESCRIPTOR.services_by_name.values() for method in service.methods}


def test_the_catalog_names_every_rpc_of_the_five_services_once():
    assert [r.path for r in catalog.CATALOG] == list(dict.fromkeys(r.path for r in catalog.CATALOG))
    assert set(catalog.BY_PATH) == _proto_rpcs()
    assert len(catalog.CATALOG) == 71


def test_every_supported_rpc_has_a_handler_and_the_docs_table_is_the_catalog():
    from mn_prefect.mn_api.server import Api

    for rpc in catalog.CATALOG:
        assert callable(getattr(Api, rpc.name, None)) == rpc.supported, rpc.path
        assert rpc.maps_to and "[/" not in rpc.maps_to
    assert catalog.markdown_table() in (ROOT / "docs" / "mirrorneuron-api.md").read_text()


def _node(name: str, **extra) -> NodeRecord:
    return NodeRecord.model_validate({"name": name, "cpu_cores": 4, "memory_mb": 4096, **extra})


@pytest.mark.parametrize(("given", "found"), [
    ("gpu-1", "gpu-1"),
    ("mirror_neuron@gpu-1", "gpu-1"),
    ("mirror_neuron@192.168.4.20", "cpu-1"),
    ("mn1@192.168.4.20", "cpu-1"),
    (" cpu-1 ", "cpu-1"),
])
def test_a_node_is_found_by_its_name_or_its_mirror_neuron_id(given, found):
    nodes = [_node("gpu-1"), _node("cpu-1", labels={"mn.address": "192.168.4.20"})]
    assert names.resolve(given, nodes) == found
    assert names.mirror_neuron_id(nodes[1]) == "mirror_neuron@192.168.4.20"


@pytest.mark.parametrize(("given", "code", "words"), [
    ("gpu-9", "NOT_FOUND", "known: a, b"),
    ("mirror_neuron@10.0.0.9", "NOT_FOUND", "unknown node"),
    ("", "INVALID_ARGUMENT", "node_name"),
    ("x@10.0.0.1", "INVALID_ARGUMENT", "several nodes (a, b)"),
])
def test_a_node_name_that_finds_no_node_or_several_is_refused_with_its_reason(given, code, words):
    nodes = [_node("a", labels={"mn.address": "10.0.0.1"}), _node("b", labels={"mn.address": "10.0.0.1"})]
    with pytest.raises(ApiError) as refused:
        names.resolve(given, nodes)
    assert refused.value.code == code and words in refused.value.message


def test_messages_keep_no_markup_brackets():
    assert plain("nodes[0].x: bad [bold] or [/x]") == "nodes[0].x: bad (bold) or (/x)"


def S(status: str, **steps: str) -> Snapshot:  # noqa: N802 (a short constructor for the table below)
    return Snapshot(status=status, steps=steps, result={"ok": 1} if status == "completed" else None,
                    reason="boom" if status in ("failed", "cancelled") else None)


@pytest.mark.parametrize(("before", "after", "types"), [
    (Snapshot(), S("pending"), ["job_pending"]),
    (Snapshot(), S("running", a="running"), ["job_pending", "job_scheduled", "job_running", "workflow_step_started"]),
    (S("pending"), S("scheduled"), ["job_scheduled"]),
    (S("running", a="running"), S("running", a="completed", b="running"),
     ["workflow_step_completed", "workflow_step_started"]),
    (S("running", a="running"), S("running", a="running"), []),
    (S("running", a="running"), S("completed", a="completed"), ["workflow_step_completed", "job_completed"]),
    (S("running"), S("failed", a="failed"), ["workflow_step_failed", "job_failed"]),
    (S("pending"), S("paused"), ["job_paused"]),
    (S("paused"), S("pending"), ["job_resumed", "job_pending"]),
    (Snapshot(), S("cancelled"), ["job_pending", "job_cancelled"]),
])
def test_run_events_are_what_changed_between_two_looks_the_terminal_one_last(before, after, types):
    events = changes(before, after, "run-1", now=0)
    assert [e["type"] for e in events] == types
    assert all(e["job_id"] == "run-1" and e["timestamp"] for e in events)
    final = [e for e in events if e["type"] in ("job_completed", "job_failed", "job_cancelled")]
    if final:
        assert events[-1] is final[0]
        assert final[0].get("result") == {"ok": 1} or final[0].get("reason") == "boom"


@pytest.mark.parametrize("state, started, taken", [
    ("SCHEDULED", None, False), (None, None, False), ("PAUSED", None, False),  # no worker has it: Cancelled at once
    ("PENDING", None, True),  # a worker is starting it: a forced Cancelled could still be followed by Running
    ("RUNNING", "2026-11-27T08:00:00Z", True), ("PAUSED", "2026-11-27T08:00:00Z", True), ("CANCELLING", None, True),
])
def test_cancelling_a_run_a_worker_has_asks_the_worker_to_stop_it(state, started, taken):
    assert taken_by_worker(state, started) is taken


def test_an_operation_replays_from_a_sequence_then_follows_to_its_end_with_heartbeats():
    op = Operation("drain_node", {}, {"node_name": "n"})
    op.item("job-1", "deferred", result={"action": "wait"})
    op.defer()
    seen: list[dict] = []
    follower = threading.Thread(target=lambda: seen.extend(op.follow(1, follow=True, heartbeat_s=0.05)))
    follower.start()
    threading.Event().wait(0.2)  # the follower is waiting: heartbeats go out meanwhile
    op.item("job-1", "completed", result={"action": "wait"})
    op.item("node:n", "complete")
    op.finish()
    follower.join(5)
    assert not follower.is_alive()
    kinds = [e["type"] for e in seen if e["type"] != "stream_heartbeat"]
    assert kinds == ["item_started", "item_deferred", "operation_deferred", "item_completed", "item_started",
                     "item_completed", "operation_completed"]
    assert any(e["type"] == "stream_heartbeat" for e in seen)
    assert [e["sequence"] for e in seen if "sequence" in e] == list(range(2, 9))
    assert op.as_json()["counters"] == {"total": 2, "started": 2, "finished": 2, "succeeded": 2, "failed": 0,
                                        "deferred": 0, "skipped": 0}
    assert op.status == "completed" and list(op.follow(7, follow=False, heartbeat_s=1)) == [op.events[-1]]


def test_an_operation_that_fails_has_a_failed_item_so_the_mn_command_exits_1():
    op = Operation("reconcile_node", {}, {"node_name": "n"})
    op.finish(error="RuntimeError: store gone")
    doc = op.as_json()
    assert doc["status"] == "failed" and doc["counters"]["failed"] == 1 and doc["errors"] == ["RuntimeError: store gone"]


@pytest.mark.parametrize(("body", "field"), [
    ("{}", "resource_json"), ('{"cpu": 0}', "cpu"), ('{"cpu": 101}', "cpu"), ('{"gpu": "75"}', "gpu"),
    ('{"ram": 50}', "ram"), ("[1]", "resource_json"), ("{nope", "resource_json"), ('{"disk": true}', "disk"),
])
def test_bad_limits_name_the_field_and_change_nothing(tmp_path, body, field):
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    with pytest.raises(ApiError) as refused:
        set_resources(store, body)
    assert refused.value.code == "INVALID_ARGUMENT" and refused.value.message.startswith(f"{field}:")
    assert store.get_limits().cpu == 100 and store.get_limits().gpu == 100


@pytest.mark.parametrize("name", ["../evil.py", "/etc/passwd", "a/../../b", ""])
def test_a_payload_path_outside_payloads_is_refused(tmp_path, name):
    with pytest.raises(ApiError) as refused:
        write_bundle(tmp_path / "b", "{}", {name: b"x"}, {})
    assert refused.value.code == "INVALID_ARGUMENT" and refused.value.message.startswith("payloads:")
    assert not (tmp_path / "evil.py").exists()


def test_the_config_mn_sends_in_the_agents_environment_is_the_bundles_config(tmp_path):
    """MirrorNeuron's CLI sends a bundle's resolved configuration in each agent's MN_BLUEPRINT_CONFIG_JSON, not as
    config/default.json: the job's bundle gets it as its config, so ``${config.*}`` references resolve."""
    from mn_prefect.bundles.bundle import load_bundle
    from mn_prefect.model.issues import InvalidInput

    source = Path(__file__).resolve().parents[1] / "examples" / "bundles" / "demo_service_health"
    manifest = json.loads((source / "manifest.json").read_text())
    effective = json.loads((source / "config" / "default.json").read_text())
    for node in manifest["agents"]["nodes"]:
        node.setdefault("config", {}).setdefault("environment", {})["MN_BLUEPRINT_CONFIG_JSON"] = json.dumps(effective)
    payloads = {str(p.relative_to(source / "payloads")): p.read_bytes()
                for p in (source / "payloads").rglob("*") if p.is_file()}
    write_bundle(tmp_path / "job", json.dumps(manifest), payloads, {"llm": {"mode": "fake"}})
    bundle = load_bundle(tmp_path / "job")
    assert bundle.config["service"]["port"] == 18081 and bundle.config["llm"]["mode"] == "fake"
    assert json.loads((tmp_path / "job" / "config" / "default.json").read_text()) == effective

    bare = json.loads((source / "manifest.json").read_text())  # sent without it: refused, naming the reference
    write_bundle(tmp_path / "bare", json.dumps(bare), payloads, {})
    with pytest.raises(InvalidInput, match=r"services\[0\]\.port: \$\{config\.service\.port\} names no value"):
        load_bundle(tmp_path / "bare")


@pytest.mark.parametrize("value", ["job 1", "../x", "", "-x", "a" * 101])
def test_job_and_run_ids_are_checked(value):
    with pytest.raises(ApiError):
        check_id(value, "job_id")


class Served:
    """``mn-prefect mn-api serve`` on a store file (no Prefect server: the cluster RPCs need none)."""

    def __init__(self, tmp_path: Path, *args: str, token: str | None = None):
        self.store_url = f"sqlite:///{tmp_path / 'state.db'}"
        store = open_store(self.store_url)
        store.register_node(NodeRecord.model_validate({"name": "gpu-1", "cpu_cores": 16, "memory_mb": 65536,
                                                       "devices": [gpu("GPU-1a", 0, 24576)]}))
        store.close()
        env = {**os.environ, "MN_PREFECT_HOME": str(tmp_path / "home"), "PREFECT_API_URL": "http://127.0.0.1:9/api"}
        env.pop("MN_GRPC_AUTH_TOKEN", None)
        if token:
            env["MN_GRPC_AUTH_TOKEN"] = token
        self.proc = subprocess.Popen([str(BIN / "mn-prefect"), "mn-api", "serve", "--port", "0", "--store-url",
                                      self.store_url, *args], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        match = re.fullmatch(r"export MN_GRPC_TARGET=(\S+)\n", line)
        self.target = match.group(1) if match else None

    def stop(self) -> str:
        """SIGTERM; the server must be gone within 20 s. One that needed its stop watchdog (it dumps every thread's
        stack and exits 1 after STOP_WITHIN_S) is reported as a warning with what held it up."""
        self.proc.terminate()
        _, err = self.proc.communicate(timeout=20)
        if "Timeout (0:00:" in err:  # faulthandler's header: the watchdog stopped it
            warnings.warn(f"mn-api serve exited {self.proc.returncode} on SIGTERM:\n{err[-6000:]}", stacklevel=2)
        return err


SIGNAL_TO_ANOTHER_THREAD = """
import signal, threading, time
from mn_prefect.cli.serving import wait_until_stopped

def other():  # the kernel may give a process's SIGTERM to any of its threads: here, to this one
    time.sleep(0.3)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    time.sleep(60)

threading.Thread(target=other, daemon=True).start()
wait_until_stopped()
print("stopped")
"""


def test_a_serving_command_stops_on_a_sigterm_another_thread_received():
    """A wait on a lock (``Event.wait()``) never ran the handler of a signal delivered to another thread: the
    server went on until killed (a CI run's ``mn-api serve`` ignored its SIGTERM for 20 s)."""
    done = subprocess.run([sys.executable, "-c", SIGNAL_TO_ANOTHER_THREAD], capture_output=True, text=True,
                          timeout=30)
    assert (done.returncode, done.stdout) == (0, "stopped\n"), done.stderr


def test_with_a_token_a_call_without_it_is_unauthenticated_and_with_it_answers(tmp_path):
    served = Served(tmp_path, token="s3cret")
    try:
        assert served.target, served.stop()
        with pytest.raises(grpc.RpcError) as refused:
            mn_sdk.Client(target=served.target, auth_token="").get_system_summary()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as wrong:
            mn_sdk.Client(target=served.target, auth_token="guess").get_system_summary()
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
        summary = json.loads(mn_sdk.Client(target=served.target, auth_token="s3cret").get_system_summary())
        assert [n["name"] for n in summary["nodes"]] == ["gpu-1"] and summary["nodes"][0]["gpu_count"] == 1
    finally:
        served.stop()


def test_it_refuses_to_listen_beyond_loopback_without_a_token(tmp_path):
    served = Served(tmp_path, "--host", "0.0.0.0")
    assert served.target is None
    assert served.proc.wait(30) == 2
    err = served.stop()
    assert "--host" in err and "token" in err, err


def test_a_schedule_from_the_client_lands_where_a_bundle_carries_it_or_is_refused_naming_the_field():
    from datetime import UTC, datetime

    from mn_prefect.mn_api.errors import ApiError
    from mn_prefect.mn_api.schedules import _manifest_for, _when

    base = {"id": "b", "schedule": {"crons": ["@daily"]}, "triggers": [{"event_type": "old"}]}
    periodic = _manifest_for(base, "periodic", {"kind": "periodic", "crons": ["0 3 * * *"], "timezone": "UTC",
                                                "prohibit_overlap": True, "name": "n", "version": 1})
    assert periodic["schedule"] == {"kind": "periodic", "crons": ["0 3 * * *"], "timezone": "UTC",
                                    "prohibit_overlap": True} and "triggers" not in periodic
    event = _manifest_for(base, "event", {"kind": "event", "name": "up", "trigger": {
        "event_type": "dataset_uploaded", "filters": {"path": {"prefix": "/d/"}}}})
    assert event["triggers"] == [{"name": "up", "event_type": "dataset_uploaded",
                                  "filters": {"path": {"prefix": "/d/"}}, "enabled": True}]
    assert "schedule" not in event and "schedule" not in _manifest_for(base, "delayed", {"kind": "delayed"})
    for kind, schedule, field in (("periodic", {"window": {"duration_ms": 1}}, "schedule_json.window"),
                                  ("event", {"kind": "event"}, "schedule_json.trigger")):
        with pytest.raises(ApiError) as refused:
            _manifest_for(base, kind, schedule)
        assert refused.value.code == "INVALID_ARGUMENT" and refused.value.message.startswith(field)
    assert _when({"run_at": "2030-01-02T03:04:05"}) == datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert (_when({"delay_ms": 60_000}) - datetime.now(UTC)).total_seconds() == pytest.approx(60, abs=5)
    for bad in ({"run_at": "tomorrow"}, {}, {"delay_ms": -1}):
        with pytest.raises(ApiError):
            _when(bad)


def test_services_of_the_nodes_through_mn_and_mn_prefect_with_unreachable_nodes_critical(tmp_path):
    """`mn service list/resolve` (ListServices, ResolveService) and `mn-prefect service list/resolve` read the same
    catalog: the services the nodes declare, with their probed status; an offline node's services are critical."""
    served = Served(tmp_path)
    try:
        assert served.target, served.stop()
        store = open_store(served.store_url)
        for name, status, svc_status in (("web-1", "healthy", "passing"), ("web-2", "offline", "passing"),
                                         ("db-1", "healthy", "warning")):
            store.register_node(_node(name, services=[{"name": "web" if name.startswith("web") else "postgres",
                                                       "tags": ["blue"] if name == "web-1" else [], "port": 8080,
                                                       "status": svc_status, "check": {"http": "/healthz"}}]))
            if status == "offline":
                store.set_node_status(name, "offline")
        store.close()
        client = mn_sdk.Client(target=served.target, auth_token="")
        listed = json.loads(client.list_services(passing_only=False))["services"]
        assert [(s["id"], s["status"]) for s in listed] == [("postgres@db-1", "warning"), ("web@web-1", "passing"),
                                                            ("web@web-2", "critical")]
        resolved = json.loads(client.resolve_service("web", tags=["blue"], passing_only=True))["services"]
        assert [(s["node_id"], s["address"], s["port"]) for s in resolved] == [("mirror_neuron@web-1", "web-1", 8080)]
        with pytest.raises(grpc.RpcError) as nothing:  # `mn service resolve` exits non-zero, as mn-prefect's does
            client.resolve_service("postgres", passing_only=True)
        assert nothing.value.code() == grpc.StatusCode.NOT_FOUND and "no passing instance of postgres" in \
            nothing.value.details()
        checked = json.loads(client.check_services([{"name": "web"}, {"name": "postgres"}]))
        assert checked["ok"] is False and [s["ok"] for s in checked["services"]] == [True, False]
        with pytest.raises(grpc.RpcError) as bad:
            client.list_services(status="sick")
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "query_json.status" in bad.value.details()

        def mn_prefect(*args: str) -> subprocess.CompletedProcess:
            return cli_runner.run(["service", *args, "--store-url", served.store_url])
        everything = json.loads(mn_prefect("list", "--all", "--json").stdout)
        assert [s["id"] for s in everything] == [s["id"] for s in listed]
        assert [s["id"] for s in json.loads(mn_prefect("list", "--json").stdout)] == ["web@web-1"]
        found = mn_prefect("resolve", "web", "--node", "mirror_neuron@web-1", "--json")
        assert found.returncode == 0 and json.loads(found.stdout)["services"][0]["port"] == 8080
        none = mn_prefect("resolve", "postgres")
        assert none.returncode == 1 and "no passing instance of postgres" in none.stderr
    finally:
        served.stop()


@pytest.mark.parametrize("content", [b"", b"  \n\t\n", b"\xff\xfe\x00", None],
                         ids=["empty", "whitespace", "undecodable", "missing"])
def test_a_token_file_without_a_token_is_refused_naming_the_option_and_starts_nothing(tmp_path, monkeypatch,
                                                                                      content):
    """Serving on without the token would turn authentication off: the command exits 2 before it opens a store."""
    import mn_prefect.cli.mn_api as mn_api_cli

    started = []
    monkeypatch.setattr(mn_api_cli, "wait_until_stopped", lambda: started.append(True))  # a server must not wait
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_bytes(content)
    bad = cli_runner.run(["mn-api", "serve", "--port", "0", "--token-file", token_file,
                          "--store-url", f"sqlite:///{tmp_path / 'state.db'}"],
                         env={"MN_PREFECT_HOME": str(tmp_path / "home")})
    assert bad.returncode == 2 and "--token-file" in bad.stderr, bad.stderr
    assert started == [] and "MN_GRPC_TARGET" not in bad.stdout and not (tmp_path / "state.db").exists()


def test_a_token_file_that_is_a_folder_is_refused_naming_the_option(tmp_path):
    from mn_prefect.cli.mn_api import token_from_file
    from mn_prefect.model.issues import InvalidInput

    with pytest.raises(InvalidInput) as refused:
        token_from_file(tmp_path)
    assert [i.path for i in refused.value.issues] == ["--token-file"]
