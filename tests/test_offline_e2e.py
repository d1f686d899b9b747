"""A node whose worker dies goes offline end to end: the `node states` sweep, run as its own process against a real
lab, emits ``mn.node.offline`` to the Prefect server's events API and posts a signed OFFLINE notification to a real
HTTP receiver named by MN_NOTIFY_BLOCKS. Runs lost with their worker through real workers (placed again, put back
or crashed by the sweeps' own timer) and Prefect's answers to a paused run; what each sweep decides for each kind
of lost run is tested in one process (tests/test_sweep_rules.py)."""

import http.server
import json
import subprocess
import threading
import time
from datetime import UTC, datetime

import pytest
import servers
from lab import Lab

from mn_prefect import notify
from mn_prefect.blocks import MNNotificationWebhook
from mn_prefect.local_lab import BIN

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab

SECRET = "whsec-e2e-offline-9d41"
BLOCK = "ops-offline"
TIMEOUT_S, GRACE_S = 4, 2  # the sweep's limits; the living worker beats every second, well inside them
FLEET = [{"name": "e2e-dies", "cpu_cores": 4, "memory_mb": 8192},
         {"name": "e2e-lives", "cpu_cores": 4, "memory_mb": 8192}]


class Receiver:
    """An HTTP server on 127.0.0.1 that keeps every POST with whether its X-MN-Signature is the HMAC-SHA256 of the
    raw body keyed with SECRET, and answers 200."""

    def __init__(self) -> None:
        self.posts: list[dict] = []
        posts = self.posts

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                posts.append({"document": json.loads(body),
                              "signed": notify.verify(SECRET, body, self.headers.get("X-MN-Signature"))})
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/mn"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _lab(home):
    return Lab(home, fleet=FLEET, worker_env={"MN_HEARTBEAT_SECONDS": "1", "MN_ORPHAN_PENDING_SECONDS": "3"})


@pytest.fixture
def dying_lab(tmp_path):
    """A lab of its own, for the test that kills one of its workers."""
    lab = _lab(tmp_path / "lab")
    yield lab
    lab.stop()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The lab the sweep tests share: each parks and moves runs of its own, on nodes whose workers all live."""
    lab = _lab(tmp_path_factory.mktemp("lab"))
    yield lab
    lab.stop()


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.close()


def offline_events(lab: Lab, name: str, since: str) -> list[dict]:
    body = {"filter": {"event": {"prefix": ["mn.node.offline"]}, "any_resource": {"id": [f"mn.node.{name}"]},
                       "occurred": {"since": since}}, "limit": 50}
    return lab.http.post("/events/filter", json=body).json().get("events", [])


def _parked_run(lab, deployment: str) -> str:
    """A run of ``deployment`` due never (2099): no worker's poll takes it on its own; the test moves it."""
    never = datetime(2099, 1, 1, tzinfo=UTC).isoformat()
    response = lab.http.post(f"/deployments/{deployment}/create_flow_run", json={
        "parameters": {"out_dir": str(lab.out)}, "state": {"type": "SCHEDULED", "state_details": {"scheduled_time": never}}})
    response.raise_for_status()
    return response.json()["id"]


def _force_state(lab, run: str, kind: str, name: str | None = None) -> None:
    lab.http.post(f"/flow_runs/{run}/set_state", json={"state": {"type": kind, "name": name or kind.title()},
                                                        "force": True}).raise_for_status()


def test_a_node_whose_worker_is_killed_goes_offline_with_an_event_and_a_signed_notification(dying_lab, receiver,
                                                                                             tmp_path):
    lab = dying_lab
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: lab.server.api_url}):
        MNNotificationWebhook(url=receiver.url, secret=SECRET, retry_delay_s=0.5).save(BLOCK, overwrite=True)
    since = datetime.now(UTC).isoformat()
    dead = lab.worker_of("e2e-dies")
    dead.kill()  # SIGKILL: no goodbye, its heartbeats just stop
    dead.wait(10)
    killed_at = time.time()

    env = {**lab.server.env, "MN_STORE_URL": lab.store_url, "MN_NOTIFY_BLOCKS": BLOCK,
           "MN_HEARTBEAT_TIMEOUT_SECONDS": str(TIMEOUT_S), "MN_DISCONNECT_GRACE_SECONDS": str(GRACE_S),
           "MN_PREFECT_HOME": str(tmp_path / "mn-home")}
    swept: list[dict] = []
    time.sleep(max(0.0, killed_at + TIMEOUT_S + GRACE_S + 1 - time.time()))
    for _ in range(10):  # one sweep suffices; more only if this machine ran it before the limits had passed
        result = subprocess.run([str(BIN / "mn-prefect"), "node", "states", "--json"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        swept.extend(json.loads(result.stdout))
        if ("e2e-dies", "offline") in {(c["node"], c["to_status"]) for c in swept}:
            break
        time.sleep(1)
    assert [c["to_status"] for c in swept if c["node"] == "e2e-dies"] == ["disconnected", "offline"], swept
    assert "e2e-lives" not in {c["node"] for c in swept}  # its worker still beats: no sweep touched it

    [event] = servers.wait_for(lambda: offline_events(lab, "e2e-dies", since), timeout=20, interval=0.5,
                               what="mn.node.offline in Prefect's events API")
    assert event["resource"]["prefect.resource.id"] == "mn.node.e2e-dies"
    assert (event["payload"]["node"], event["payload"]["to"]) == ("e2e-dies", "offline")
    assert "no heartbeat" in event["payload"]["reason"]

    # The sweep process waits for its outbox at exit: the notification is in before it returned.
    offline = [p for p in receiver.posts if p["document"]["kind"] == "OFFLINE"]
    assert [(p["document"]["event"], p["document"]["node"], p["signed"]) for p in offline] == [
        ("mn.node.offline", "e2e-dies", True)]
    assert "no heartbeat" in offline[0]["document"]["reason"]


@pytest.fixture
def quick_lab(tmp_path):
    """Workers beat every second and judge silence after 4 s (+2 s grace): the live one's sweep is what acts."""
    lab = Lab(tmp_path / "lab", fleet=FLEET, worker_env={
        "MN_HEARTBEAT_SECONDS": "1", "MN_HEARTBEAT_TIMEOUT_SECONDS": str(TIMEOUT_S),
        "MN_DISCONNECT_GRACE_SECONDS": str(GRACE_S)})
    yield lab
    lab.stop()


def test_a_run_placed_on_a_node_that_dies_before_starting_it_is_placed_again_by_a_live_worker(quick_lab):
    """The stall this guards against: a run (the reconcile flow's own, say) committed to a node whose worker dies
    before starting it stays Scheduled with a booking there forever, so nothing sweeps the silent node. The live
    worker judges silent nodes itself and places the run again, with no reconcile flow and no `node states`."""
    from mn_prefect.model.placement import PlacedResources, Placement

    lab = quick_lab
    deployment = lab.deploy({"resources": {"cpu_cores": 1}})
    later = datetime.fromtimestamp(time.time() + 600, UTC).isoformat()
    created = lab.http.post(f"/deployments/{deployment}/create_flow_run", json={
        "parameters": {"out_dir": str(lab.out)}, "state": {"type": "SCHEDULED", "state_details": {
            "scheduled_time": later}}})
    created.raise_for_status()
    run_id = created.json()["id"]
    # As if a worker had placed it on e2e-dies just before that node's worker died.
    booked = Placement(agent_id="stalled", node="e2e-dies", job_id=run_id, resources=PlacedResources(cpu_cores=1))
    assert lab.store.commit_plan(run_id, [booked]).ok
    dead = lab.worker_of("e2e-dies")
    dead.kill()
    dead.wait(10)
    lab.http.post(f"/flow_runs/{run_id}/set_state", json={"force": True, "state": {
        "type": "SCHEDULED", "state_details": {"scheduled_time": datetime.now(UTC).isoformat()}}}).raise_for_status()

    done = lab.wait(run_id, timeout=180)
    assert done["state"]["type"] == "COMPLETED", done["state"]
    assert lab.record(run_id)["env"]["MN_NODE"] == "e2e-lives"
    assert lab.store.get_node("e2e-dies").record.status in ("disconnected", "offline")
    # The worker's log lines reach Prefect in batches, after the run's own may have: wait for the line.
    try:
        servers.wait_for(lambda: any("placing it again" in line and "e2e-dies" in line for line in lab.logs(run_id)),
                         timeout=30, interval=0.5, what="the worker's 'placing it again' line")
    except TimeoutError as error:
        raise AssertionError(f"{error}; the run's logs: {lab.logs(run_id)}") from None
    # The new booking ends with the run (its worker releases it right after); the old one went before it.
    servers.wait_for(lambda: lab.booked(run_id) == [], timeout=60, what="the run's booking to be released")


def test_runs_left_pending_are_put_back_or_crashed_while_the_worker_gets_no_poll_through(tmp_path):
    """The sweeps do not wait for a poll: a worker whose polls sit in the client's retries (the API away when each
    began) still puts back a run that a killed worker left Pending on its node, and, as the pool's announcer, marks
    Crashed a run left Pending with no booking. Here the worker polls once at its start and not again for an hour
    (no wake-ups either), so only the sweeps' own timer can do either."""
    from mn_prefect.model.resources import resource_request
    from mn_prefect.placement.placing import place_and_commit
    from mn_prefect.scheduler import Ask
    from mn_prefect.store.records import FlowRunRecord, put_record

    node = {"name": "no-polls", "cpu_cores": 2, "memory_mb": 4096}
    lab = Lab(tmp_path / "lab", fleet=[node], worker_env={
        "PREFECT_WORKER_QUERY_SECONDS": "3600", "MN_WAKEUPS": "off", "MN_ORPHAN_PENDING_SECONDS": "2"})
    try:
        log = lab.home / "worker-no-polls.log"
        servers.wait_for(lambda: "wake-ups are off" in log.read_text(), timeout=90, what="the worker's setup")
        deployment = lab.deploy({"resources": {"cpu": 1}})
        run = _parked_run(lab, deployment)
        booked = place_and_commit(lab.store, run, [Ask(agent_id="orphan", request=resource_request({"cpu_cores": 1}),
                                                       preferred_node="no-polls")], group=lab.pool)
        assert booked.placed
        _force_state(lab, run, "PENDING")  # what the killed worker left: Pending, with no flow process
        put_back = lab.wait(run, states={"SCHEDULED"}, timeout=60)
        assert "stopped before it started; it starts again" in (put_back["state"]["message"] or ""), put_back
        assert lab.booked(run), "its booking on its node is kept for the next poll"

        unbooked = _parked_run(lab, deployment)
        put_record(lab.store, FlowRunRecord(job_id=unbooked, node="no-polls"))  # placed once; its booking is gone
        _force_state(lab, unbooked, "PENDING", "Submitting")
        crashed = lab.wait(unbooked, timeout=60)
        assert crashed["state"]["type"] == "CRASHED", crashed["state"]
        assert "ended before the run started" in crashed["state"]["message"]
        assert lab.flow_run(run)["state"]["type"] == "SCHEDULED"  # still: no poll has come to start it
        assert lab.workers[0].poll() is None
    finally:
        lab.stop()


def test_proposing_pending_for_a_run_paused_meanwhile_declines_it_instead_of_ending_the_worker(lab):
    """The reconcile paused the run (its node lost) between a worker's poll and its Pending: the server answers
    with a Pause signal, which used to escape the worker's task group and stop the worker (exit 1)."""
    import asyncio
    import logging

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from mn_prefect.worker.worker import propose_pending

    deployment = lab.deploy({"resources": {"cpu": 1}})
    answers = {}
    for kind in ("PAUSED", "CANCELLED", "SCHEDULED"):
        run = _parked_run(lab, deployment)
        if kind != "SCHEDULED":
            _force_state(lab, run, kind)

        async def propose(run=run):
            async with get_client() as client:
                return await propose_pending(client, run, "placed", logging.getLogger("test"))

        with temporary_settings({PREFECT_API_URL: lab.server.api_url}):
            state = asyncio.run(propose())
        answers[kind] = state.type.value if state is not None else None
        _force_state(lab, run, "CANCELLED")
    assert answers == {"PAUSED": None, "CANCELLED": None, "SCHEDULED": "PENDING"}


def test_a_run_paused_between_its_pending_and_submitting_is_not_started_and_the_worker_lives_on(lab):
    """The reconcile paused the run (its node lost) after its worker's Pending, before Prefect's Submitting: the
    server answers Submitting with a Pause signal, which used to end the worker (exit 1). Now the run is not
    started, and its booking is left to the recovery that paused it."""
    import asyncio

    import anyio
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from mn_prefect.worker.launching import PausedBeforeStart
    from mn_prefect.worker.variables import MNJobConfiguration
    from mn_prefect.worker.worker import MNWorker

    deployment = lab.deploy({"resources": {"cpu": 1}})
    run = _parked_run(lab, deployment)
    for kind in ("PENDING", "PAUSED"):
        _force_state(lab, run, kind)

    async def submit():
        worker = MNWorker(work_pool_name=lab.pool)
        async with get_client() as client:
            worker._client = client
            flow_run = await client.read_flow_run(run)
            await worker._propose_submitting_state(flow_run)  # raised Pause before
            async with anyio.create_task_group() as group:
                ready = await group.start(worker.run, flow_run, MNJobConfiguration.model_construct())
            return ready

    with temporary_settings({PREFECT_API_URL: lab.server.api_url}):
        ready = asyncio.run(submit())
    assert isinstance(ready, PausedBeforeStart)
    assert lab.flow_run(run)["state"]["type"] == "PAUSED"
    assert not (lab.out / f"{run}.started").exists()
    _force_state(lab, run, "CANCELLED")


def test_a_worker_started_while_its_store_is_away_waits_for_it(tmp_path):
    """The store restarts while a worker starts (a supervisor restarted both): the worker waits for it and
    registers its node, rather than exiting."""
    import prefect_env

    pg = servers.PostgresServer()
    try:
        lab = Lab(tmp_path / "lab", store_url=pg.create_database("waits"), fleet=[])
        try:
            pg.stop()
            node = {"name": "waits", "cpu_cores": 2, "memory_mb": 4096}
            lab.workers.append(prefect_env.start_worker(lab.server, lab.pool, node, lab.store_url, lab.home))
            log = lab.home / "worker-waits.log"
            servers.wait_for(lambda: "the store is not reachable yet" in log.read_text(), timeout=60,
                             what="the worker to say it waits for the store")
            pg.start()
            servers.wait_for(lambda: [n.record.name for n in lab.store.list_nodes()] == ["waits"], timeout=60,
                             interval=0.5, what="the worker to register once the store is back")
            assert lab.workers[-1].poll() is None  # still running
        finally:
            lab.stop()
    finally:
        pg.cleanup()


def test_a_worker_restarted_while_the_prefect_api_is_away_registers_its_node_at_once(tmp_path):
    """A worker restarted while the Prefect server is down (killed, restarting) rejoins the cluster at once when its
    pool's group is in the store already: its node is healthy and heartbeats before the API is back, so the lifecycle
    sweeps never take a live node offline for want of a server it does not need to register."""
    import prefect_env

    lab = Lab(tmp_path / "lab", fleet=[], worker_env={"MN_HEARTBEAT_SECONDS": "1"})
    try:
        lab.store.create_group(lab.pool)  # an earlier worker of the pool made it
        node = {"name": "api-away", "cpu_cores": 2, "memory_mb": 4096}
        nowhere = f"http://127.0.0.1:{servers.free_port()}/api"
        started = time.time()
        lab.workers.append(prefect_env.start_worker(lab.server, lab.pool, node, lab.store_url, lab.home,
                                                    extra_env=lab.worker_env, api_url=nowhere))

        def beating() -> bool:
            stored = lab.store.get_node("api-away")
            return stored is not None and stored.record.status == "healthy" and (stored.last_heartbeat or 0) > started

        servers.wait_for(beating, timeout=90, interval=0.5, what="the node to register and heartbeat")
        log = (lab.home / "worker-api-away.log").read_text()
        assert "Unable to reach the Prefect API while starting up" in log  # the API was away indeed
        assert "read_work_pool failed" not in log  # registration did not wait on the API's retries
        assert lab.workers[-1].poll() is None
    finally:
        lab.stop()
