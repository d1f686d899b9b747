"""Per-allocation health checks (docs/prefect.md, "Health checks"): the prober against real sockets on 127.0.0.1, the
failure rule, and a real mn worker that deallocates a run whose service stops answering (run cancelled, booking
released), with bad health blocks refused naming the field."""

from __future__ import annotations

import http.server
import re
import socket
import threading
import time

import anyio
import pytest
import servers
from lab import Lab
from prefect.utilities.schema_tools.validation import ValidationError, validate
from pydantic import ValidationError as ModelError

from mn_prefect.lifecycle.health import Tally, probe, watch
from mn_prefect.worker import MNWorker
from mn_prefect.worker.variables import HealthVariable, MNJobConfiguration


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        code = int(self.path.rsplit("/", 1)[1])
        self.send_response(code)
        if 300 <= code < 400:
            self.send_header("Location", "/elsewhere")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def http_port():
    """A real HTTP server on 127.0.0.1 that answers GET /code/<n> with status n."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check(**values) -> HealthVariable:
    return HealthVariable.model_validate({"port_label": "http", "timeout_s": 2, **values})


@pytest.mark.parametrize("code", [200, 204, 302])
def test_an_http_answer_2xx_or_3xx_passes(http_port, code):
    assert anyio.run(probe, _check(http=f"/code/{code}"), http_port) is None


@pytest.mark.parametrize("code", [404, 500, 503])
def test_an_http_error_answer_fails_with_its_status(http_port, code):
    assert anyio.run(probe, _check(http=f"/code/{code}"), http_port) == f"HTTP {code}"


def test_a_tcp_check_passes_on_a_listening_port_and_fails_on_a_closed_one(http_port):
    assert anyio.run(probe, _check(tcp=True), http_port) is None
    failure = anyio.run(probe, _check(tcp=True), _closed_port())
    assert failure is not None and "refused" in failure.lower()


def test_a_service_that_never_answers_fails_after_the_timeout():
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        failure = anyio.run(probe, _check(http="/healthz", timeout_s=0.5), silent.getsockname()[1])
    assert failure == "no answer within 0.5 s" and time.monotonic() - started < 5


def test_a_passing_probe_starts_the_failure_count_again():
    tally = Tally(limit=3)
    assert [tally.observe(f) for f in ("HTTP 500", "HTTP 500", None, "HTTP 500", "HTTP 500")] == [False] * 5
    assert tally.failures == 2 and tally.observe("HTTP 503") and tally.last == "HTTP 503"


def test_the_watch_ends_with_a_verdict_after_n_failures_in_a_row():
    heard: list[int] = []

    async def on_failure(tally: Tally) -> None:
        heard.append(tally.failures)

    port = _closed_port()
    verdict = anyio.run(watch, _check(tcp=True, interval_s=0.05, failures_to_deallocate=4), port, on_failure)
    assert heard == [1, 2, 3, 4]
    assert verdict.startswith(f"health check failed 4 times (TCP connect on port {port}: ")


def test_failures_before_the_run_has_started_do_not_count():
    asked: list[bool] = []

    async def started() -> bool:
        asked.append(len(asked) >= 3)  # the flow is Running from the fourth question on
        return asked[-1]

    port = _closed_port()
    verdict = anyio.run(watch, _check(tcp=True, interval_s=0.02, failures_to_deallocate=2), port, None, started)
    assert asked == [False, False, False, True, True] and verdict.startswith("health check failed 2 times")


@pytest.mark.parametrize("health, says", [
    ({"http": "/healthz", "port_label": "http", "interval_s": 0}, "job_variables.health.interval_s"),
    ({"http": "/healthz", "port_label": "http", "failures_to_deallocate": 0},
     "job_variables.health.failures_to_deallocate"),
    ({"http": "/healthz", "port_label": "web"}, "job_variables.health.port_label: 'web' is not one of the run's "
                                                "job_variables.resources.ports labels ('http')"),
    ({"port_label": "http"}, "job_variables.health: set exactly one of http (a path) or tcp: true"),
])
def test_a_bad_health_block_is_refused_naming_the_field(health, says):
    from mn_prefect.worker.worker import _invalid_configuration

    with pytest.raises(ModelError) as raised:
        MNJobConfiguration.model_validate({"command": "true", "health": health,
                                           "resources": {"ports": [{"label": "http"}]}})
    assert says in _invalid_configuration(raised.value)


def test_the_server_refuses_a_non_positive_interval_naming_it():
    variables = MNWorker.get_default_base_job_template()["variables"]
    with pytest.raises(ValidationError, match=re.escape("health.interval_s")):
        validate({"health": {"http": "/healthz", "port_label": "http", "interval_s": 0}}, variables,
                 raise_on_error=True, preprocess=True, ignore_required=True, allow_none_with_default=True)


# -- through a real worker --------------------------------------------------------------------------------------

FLEET = [{"name": "h1", "cpu_cores": 4, "memory_mb": 8192, "dynamic_port_range": [29000, 29099]}]
SERVE = "serve.py:serve"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("health"), fleet=FLEET)
    yield lab
    lab.stop()


@pytest.mark.lab
def test_a_service_failing_its_health_check_is_deallocated_after_n_probes(lab):
    deployment = lab.deploy({"resources": {"cpu": 1, "ports": [{"label": "http"}]},
                             "health": {"http": "/healthz", "port_label": "http", "interval_s": 1, "timeout_s": 1,
                                        "failures_to_deallocate": 3}}, entrypoint=SERVE)
    sick = lab.out / "serve.sick"
    run_id = lab.run(deployment, sick_when=str(sick))
    servers.wait_for(lambda: (lab.out / f"{run_id}.started").exists(), timeout=90, what="the service to start")
    time.sleep(3)  # about three passing probes: a healthy service keeps its booking
    assert lab.flow_run(run_id)["state"]["type"] == "RUNNING" and len(lab.booked(run_id)) == 1
    sick.write_text("500 from now on")
    lab.wait(run_id, states={"CANCELLED"}, timeout=60)
    assert lab.booked(run_id) == []
    deallocated = [e for e in lab.store.events(job_id=run_id) if e.kind == "allocation.deallocated"]
    assert len(deallocated) == 1 and deallocated[0].node == "h1"
    assert deallocated[0].reason.startswith("health check failed 3 times (GET /healthz on port 29")
    assert "HTTP 500" in deallocated[0].reason
    lab.wait_for_log(run_id, "mn: health check failed 3 times")


@pytest.mark.lab
def test_a_health_check_on_a_port_the_run_does_not_book_fails_the_run_naming_the_field(lab):
    deployment = lab.deploy({"resources": {"cpu": 1, "ports": [{"label": "http"}]},
                             "health": {"tcp": True, "port_label": "admin", "interval_s": 1}}, entrypoint=SERVE)
    run_id = lab.run(deployment)
    state = lab.wait(run_id, timeout=90)["state"]
    assert state["type"] == "FAILED" and "job_variables.health.port_label: 'admin'" in state["message"]
    assert lab.booked(run_id) == []


@pytest.mark.lab
def test_a_run_with_a_non_positive_interval_is_refused_by_the_server_naming_the_field(lab):
    deployment = lab.deploy({"resources": {"cpu": 1, "ports": [{"label": "http"}]}}, entrypoint=SERVE)
    response = lab.http.post(f"/deployments/{deployment}/create_flow_run", json={
        "parameters": {"out_dir": str(lab.out)},
        "job_variables": {"health": {"http": "/healthz", "port_label": "http", "interval_s": 0}}})
    assert response.status_code == 422 and "health.interval_s" in response.text
