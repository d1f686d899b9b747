"""Runtime estimates: the rule (declared wins, then a timeout, then the p90 of the last 20 completed runs, else
unknown) and its words; the history each key keeps in the store (SQLite here, Redis and PostgreSQL in the full
suite); and the worker's release of a completed run teaching its deployment how long the booking was held."""

from __future__ import annotations

import logging
import math
import uuid
from types import SimpleNamespace

import anyio
import pytest
from builders import node
from prefect.client.schemas.objects import StateType

from mn_prefect.model.estimates import (
    HISTORY_SIZE,
    MAX_RUNTIME_S,
    MAX_RUNTIME_SECONDS,
    Estimate,
    check_max_runtime,
    duration_words,
    estimate_of,
    limit_message,
    nearest_rank,
    p90,
    read_max_runtime,
)
from mn_prefect.model.issues import Issues
from mn_prefect.model.resources import resource_request
from mn_prefect.placement import estimates
from mn_prefect.placement.placing import Placer
from mn_prefect.scheduler import Ask
from mn_prefect.store import open_store
from mn_prefect.store.records import RuntimeHistoryRecord, get_record

# -- the rule ---------------------------------------------------------------------------------------------------

RULE = [
    # declared, timeout, history, expected (seconds, source, samples, is_limit)
    (600, 1800, [5, 6, 7], (600, "declared", 0, False)),
    (None, 1800, [5, 6, 7], (1800, "timeout", 0, True)),
    (None, None, [30.0], (30, "learned", 1, False)),
    (None, None, list(range(1, 11)), (9, "learned", 10, False)),   # p90 of 1..10 by nearest rank: the 9th
    (None, None, [100, 1, 2, 3], (100, "learned", 4, False)),      # ceil(0.9 * 4) = 4: the largest
    (None, None, [], (None, "unknown", 0, False)),
]


@pytest.mark.parametrize(("declared", "timeout", "history", "expected"), RULE)
def test_declared_wins_then_the_timeout_then_what_was_learned(declared, timeout, history, expected):
    estimate = estimate_of(declared, timeout, history)
    assert (estimate.seconds, estimate.source, estimate.samples, estimate.is_limit) == expected


def test_only_the_last_twenty_runs_are_learned_from():
    old_and_slow = [10_000.0] * 5
    recent = [float(s) for s in range(1, HISTORY_SIZE + 1)]
    estimate = estimate_of(None, None, old_and_slow + recent)
    assert estimate.samples == HISTORY_SIZE and estimate.seconds == 18  # ceil(0.9 * 20) = 18th of 1..20


def test_a_declared_limit_is_a_limit_and_a_declared_estimate_is_not():
    assert estimate_of(60, None, [], is_limit=True).is_limit
    assert not estimate_of(60, None, []).is_limit


@pytest.mark.parametrize(("values", "percentile", "expected"), [
    ([3.0], 90, 3.0), ([1, 2], 90, 2), ([1, 2], 50, 1), (list(range(1, 21)), 90, 18), ([5, 1, 4, 2, 3], 100, 5),
])
def test_nearest_rank(values, percentile, expected):
    assert nearest_rank(values, percentile) == expected


@pytest.mark.parametrize(("estimate", "words"), [
    (Estimate(720, "learned", samples=14), "about 12 min, learned from 14 runs (p90)"),
    (Estimate(45, "learned", samples=1), "about 45 s, learned from 1 run (p90)"),
    (Estimate(7200, "declared"), "declared 2 h"),
    (Estimate(7200, "declared", is_limit=True), "declared 2 h, a limit: the run is stopped then"),
    (Estimate(1800, "timeout", is_limit=True), "at most 30 min (its timeout)"),
    (Estimate(None, "unknown"), "unknown"),
])
def test_an_estimate_in_words(estimate, words):
    assert estimate.describe() == words


@pytest.mark.parametrize(("seconds", "words"), [
    (0.5, "0.5 s"), (45, "45 s"), (89, "89 s"), (90, "1.5 min"), (720, "12 min"), (5400, "1.5 h"),
    (7200, "2 h"), (9000, "2.5 h"), (36 * 3600, "36 h"), (3 * 86400, "3 d"),
])
def test_durations_in_words(seconds, words):
    assert duration_words(seconds) == words


def test_an_estimate_as_json_has_its_seconds_and_source():
    assert Estimate(60, "declared").as_json() == {"seconds": 60, "source": "declared", "samples": 0,
                                                  "is_limit": False}


def test_the_limit_message_names_the_field_and_the_seconds():
    message = limit_message(5400)
    assert "max_runtime_seconds=5400" in message and "1.5 h" in message and message.startswith("mn: ")


@pytest.mark.parametrize(("value", "says"), [
    (0, "more than 0"), (-5, "more than 0"), (math.nan, "finite"), (math.inf, "finite"), ("60", "string"),
    (True, "boolean"), (MAX_RUNTIME_S + 1, "ten years"), ([60], "array"),
])
def test_a_declared_runtime_that_is_no_positive_finite_number_is_refused_naming_the_field(value, says):
    issues = Issues()
    assert read_max_runtime(value, "job_variables.max_runtime_seconds", issues) is None
    (issue,) = issues.items
    assert issue.path == "job_variables.max_runtime_seconds" and says in issue.message


@pytest.mark.parametrize("value", [1, 0.5, 3600, MAX_RUNTIME_S])
def test_a_positive_runtime_of_at_most_ten_years_is_read_as_seconds(value):
    issues = Issues()
    assert read_max_runtime(value, "x", issues) == float(value) and not issues


# -- in the store -------------------------------------------------------------------------------------------------

KEY = estimates.deployment_key("0b5d3c1e-0000-4000-8000-000000000001")


def test_the_keys_name_what_runs_again():
    assert KEY == "deployment:0b5d3c1e-0000-4000-8000-000000000001"
    assert estimates.step_key("demo_dag", "train") == "step:demo_dag/train"
    assert estimates.agent_key("pipeline", "worker") == "agent:pipeline/worker"
    assert estimates.run_key(SimpleNamespace(deployment_id="d-1")) == "deployment:d-1"
    assert estimates.run_key(SimpleNamespace(deployment_id=None)) is None


def test_a_key_with_no_completed_run_has_no_history_and_an_unknown_estimate(store):
    assert estimates.history(store, KEY) == []
    assert estimates.estimate_for(store, KEY).source == "unknown"
    assert estimates.estimate_for(store, None).source == "unknown"


def test_durations_are_kept_per_key_oldest_first_the_last_twenty_with_the_count(store):
    for seconds in range(1, 26):
        assert estimates.record_duration(store, KEY, float(seconds))
    estimates.record_duration(store, "step:b/s", 3.0)
    assert estimates.history(store, KEY) == [float(s) for s in range(6, 26)]
    record = get_record(store, "runtime:" + KEY, RuntimeHistoryRecord)
    assert record is not None and record.count == 25 and record.key == KEY
    assert estimates.history(store, "step:b/s") == [3.0]


def test_the_estimate_is_learned_from_the_key_s_history_unless_one_is_declared(store):
    for seconds in (60.0, 70.0, 80.0):
        estimates.record_duration(store, KEY, seconds)
    learned = estimates.estimate_for(store, KEY)
    assert (learned.seconds, learned.source, learned.samples) == (80.0, "learned", 3)
    assert estimates.estimate_for(store, KEY, timeout=30).source == "timeout"
    declared = estimates.estimate_for(store, KEY, declared=10, timeout=30, is_limit=True)
    assert (declared.seconds, declared.source, declared.is_limit) == (10.0, "declared", True)


@pytest.mark.parametrize("seconds", [-1.0, math.nan, math.inf])
def test_a_duration_that_is_no_sample_is_not_recorded(store, seconds):
    assert not estimates.record_duration(store, KEY, seconds)
    assert estimates.history(store, KEY) == []


def _ask(name: str) -> Ask:
    return Ask(agent_id=name, request=resource_request({"cpu": 1}))


def test_the_time_a_booking_was_held_runs_from_its_commit_to_its_release(store):
    store.register_node(node("n1"))
    booking = str(uuid.uuid4())
    assert Placer(store).place(booking, [_ask(booking)]).placed
    store.release(booking)
    (entry,) = store.history(booking)
    assert entry.released_at is not None
    assert estimates.held_seconds(store, booking) == entry.released_at - entry.committed_at
    assert estimates.held_seconds(store, "never-booked") is None


def test_a_booking_still_held_counts_to_now(store):
    store.register_node(node("n1"))
    booking = str(uuid.uuid4())
    assert Placer(store).place(booking, [_ask(booking)]).placed
    (entry,) = store.history(booking)
    assert estimates.held_seconds(store, booking, now=entry.committed_at + 42) == pytest.approx(42)


# -- the worker's release ---------------------------------------------------------------------------------------------

class _Client:
    """What the releaser reads of a run from Prefect: its deployment and its state."""

    def __init__(self, state: StateType | None, deployment_id: uuid.UUID | None):
        self.run = SimpleNamespace(deployment_id=deployment_id,
                                   state=None if state is None else SimpleNamespace(type=state))

    async def read_flow_run(self, flow_run_id):
        return self.run


@pytest.fixture
def sqlite_store(tmp_path):
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store.register_node(node("n1"))
    yield store
    store.close()


def _released(store, state: StateType | None, because: str = "run_ended",
              deployment_id: uuid.UUID | None = None, monkeypatch=None) -> tuple[str, str]:
    """Place a run on n1, end it in ``state`` and have n1's releaser release it: (its booking, its key)."""
    from mn_prefect.worker import releasing

    monkeypatch.setattr(releasing.visibility, "emit_placement", lambda *args, **kwargs: None)
    deployment_id = deployment_id or uuid.uuid4()
    run_id = uuid.uuid4()
    placer = Placer(store)
    assert placer.place(str(run_id), [_ask(str(run_id))]).placed

    async def in_store(fn, *args, **kwargs):
        return fn(*args, **kwargs)

    logger = logging.getLogger("test")
    releaser = releasing.Releaser(store=store, placer=placer, node="n1", in_store=in_store,
                                  client=lambda: _Client(state, deployment_id), work_pool=lambda: None,
                                  logger=logger, run_logger=lambda run: logger, forget=lambda run_id: None)
    anyio.run(lambda: releaser.release(run_id, "the run ended", because))  # type: ignore[arg-type]
    assert store.active_placements(job_id=str(run_id)) == []
    return str(run_id), estimates.deployment_key(deployment_id)


def test_a_completed_run_s_release_records_how_long_it_held_its_booking(sqlite_store, monkeypatch):
    booking, key = _released(sqlite_store, StateType.COMPLETED, monkeypatch=monkeypatch)
    (entry,) = sqlite_store.history(booking)
    assert estimates.history(sqlite_store, key) == [entry.released_at - entry.committed_at]


def test_completed_runs_of_one_deployment_add_up_in_one_history(sqlite_store, monkeypatch):
    deployment = uuid.uuid4()
    for _ in range(3):
        _, key = _released(sqlite_store, StateType.COMPLETED, deployment_id=deployment, monkeypatch=monkeypatch)
    assert len(estimates.history(sqlite_store, key)) == 3


@pytest.mark.parametrize("state", [StateType.FAILED, StateType.CRASHED, StateType.CANCELLED, StateType.RUNNING, None])
def test_a_run_that_did_not_complete_is_no_sample(sqlite_store, monkeypatch, state):
    _, key = _released(sqlite_store, state, monkeypatch=monkeypatch)
    assert estimates.history(sqlite_store, key) == []


@pytest.mark.parametrize("because", ["preempted", "health_check", "node_lost", "not_started"])
def test_a_release_for_another_reason_than_the_run_s_end_is_no_sample(sqlite_store, monkeypatch, because):
    _, key = _released(sqlite_store, StateType.COMPLETED, because=because, monkeypatch=monkeypatch)
    assert estimates.history(sqlite_store, key) == []


# -- a declared limit stops the run ----------------------------------------------------------------------------

class _RunClient:
    """The run as Prefect holds it: its state, and the states the worker sets."""

    def __init__(self, state: StateType = StateType.RUNNING):
        self.state, self.set = state, []
        self.cancelled = anyio.Event()

    async def read_flow_run(self, flow_run_id):
        return SimpleNamespace(id=flow_run_id, state=SimpleNamespace(type=self.state))

    async def set_flow_run_state(self, flow_run_id, state, force=False):
        self.set.append(state)
        self.state = StateType.CANCELLING
        self.cancelled.set()


class _Launcher:
    """A driver whose run goes on until it is cancelled (``forever``) or ends at once."""

    name = "host_local"

    def __init__(self, client: _RunClient, forever: bool):
        self.client, self.forever = client, forever

    async def launch(self, launch, task_status):
        if self.forever:
            await self.client.cancelled.wait()  # the worker ends a Cancelling run's process
        return "ended"


def _launching(client: _RunClient, forever: bool, waited: list):
    from mn_prefect.worker.launching import Launching

    async def sleep(seconds):  # the limit's time passes at once; what was waited for is kept
        waited.append(seconds)

    logger = logging.getLogger("test")
    return Launching(launchers={"host_local": _Launcher(client, forever)}, store_env={}, node=lambda: node("n1"),
                     client=lambda: client, work_pool=lambda: None, logger=logger, run_logger=lambda run: logger,
                     sleep=sleep)


def _launch(launching, job_variables: dict):
    from mn_prefect.model.placement import Placement
    from mn_prefect.worker.variables import MNJobConfiguration

    configuration = MNJobConfiguration.model_validate({"command": "true", **job_variables})
    run = SimpleNamespace(id=uuid.uuid4(), name="brave-fox")
    return anyio.run(lambda: launching.launch(run, configuration, Placement(agent_id="r", node="n1"), None,
                                              run_process=None))


def test_a_run_past_its_declared_limit_is_cancelled_with_a_message_naming_the_limit():
    client, waited = _RunClient(), []
    assert _launch(_launching(client, True, waited), {"max_runtime_seconds": 90, "max_runtime_is_limit": True}) \
        == "ended"
    (state,) = client.set
    assert waited == [90] and state.type == StateType.CANCELLING
    assert "max_runtime_seconds=90" in state.message and "max_runtime_is_limit" in state.message


def test_a_declared_runtime_that_is_no_limit_never_stops_the_run():
    client, waited = _RunClient(), []
    assert _launch(_launching(client, False, waited), {"max_runtime_seconds": 90}) == "ended"
    assert waited == [] and client.set == []


def test_a_run_that_ended_before_its_limit_is_not_cancelled():
    client, waited = _RunClient(StateType.COMPLETED), []
    launching = _launching(client, False, waited)
    assert not anyio.run(lambda: launching.stop_at_limit(SimpleNamespace(id=uuid.uuid4()), 90))
    assert client.set == []


# -- blueprint agents ---------------------------------------------------------------------------------------------

def _job(state: str, started_at: float = 100.0, ended_at: float | None = 160.0):
    from mn_prefect.model.policies import RetryPolicy
    from mn_prefect.store.records import AgentRun, AgentTrack, JobState

    policy = RetryPolicy(attempts=1, interval_ms=1000, delay_ms=0, mode="fail")
    copy = AgentTrack(agent_id="w@n1", source_agent_id="w", node="n1", booking="job-1", status="completed",
                      runs=[AgentRun(run_id="r1", attempt=1, state=state, started_at=started_at, ended_at=ended_at)],
                      restart=policy, reschedule=policy)
    return JobState(job_id="job-1", job_name="pipeline", job_type="system", agents={"w@n1": copy})


def test_a_completed_agent_run_teaches_its_agent_how_long_it_ran(sqlite_store):
    assert estimates.record_agent_run(sqlite_store, _job("COMPLETED"), "w@n1") == 60.0
    assert estimates.history(sqlite_store, estimates.agent_key("pipeline", "w")) == [60.0]  # the copy's agent


@pytest.mark.parametrize("state", ["FAILED", "CANCELLED", "CRASHED", "RUNNING"])
def test_an_agent_run_that_did_not_complete_is_no_sample(sqlite_store, state):
    assert estimates.record_agent_run(sqlite_store, _job(state), "w@n1") is None
    assert estimates.history(sqlite_store, estimates.agent_key("pipeline", "w")) == []


def test_an_agent_s_timeout_is_its_estimate_else_its_learned_runtime(sqlite_store):
    from builders import agent, blueprint

    timed, free = blueprint(agent("timed", config={"command": ["true"], "timeout_seconds": 120}), agent("free")).agents
    estimates.record_duration(sqlite_store, estimates.agent_key("test", "free"), 30.0)
    assert estimates.agent_estimate(sqlite_store, "test", timed) == Estimate(120, "timeout", is_limit=True)
    assert estimates.agent_estimate(sqlite_store, "test", free) == Estimate(30.0, "learned", samples=1)


# -- the API by its brief names: p90 and check_max_runtime --------------------------------------------------------

P90 = [
    # durations (oldest first), p90 by nearest rank of the last HISTORY
    ([], None),
    ([7.0], 7.0),
    ([float(n) for n in range(1, 11)], 9.0),
    ([1000.0] + [1.0] * HISTORY_SIZE, 1.0),  # the oldest falls out of the last 20
]


@pytest.mark.parametrize(("durations", "expected"), P90)
def test_p90_is_the_nearest_rank_of_the_last_twenty(durations, expected):
    assert p90(durations) == expected


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, True, "60", None, MAX_RUNTIME_S + 1])
def test_check_max_runtime_refuses_a_bad_value_naming_its_field(value):
    with pytest.raises(ValueError, match="^max_runtime_s: "):
        check_max_runtime(value, "max_runtime_s")


def test_check_max_runtime_gives_seconds_as_a_float():
    assert check_max_runtime(90, "f") == 90.0
    assert check_max_runtime(MAX_RUNTIME_SECONDS, "f") == float(MAX_RUNTIME_SECONDS)
