"""Usage accounting (mn_prefect.ops.accounting, ``mn-prefect usage``, ``mn_usage_*_total``): what bookings used,
from the store's booking history, counted once per booking, agreeing with the bookings' lifetimes to the second;
reservations and holds counted for their owner; bad input refused by name before the store is opened."""

from __future__ import annotations

import csv
import io
import json
import time
import uuid
from datetime import UTC, date, datetime

import pytest
from builders import gpu, node
from cli_runner import run

from mn_prefect.model.bookings import FlowRun
from mn_prefect.model.node import Device
from mn_prefect.model.placement import Allocation, DeviceShare, PlacedResources, Placement
from mn_prefect.ops import accounting
from mn_prefect.ops.metrics import ClusterCollector
from mn_prefect.placement import bookings
from mn_prefect.store import open_store
from mn_prefect.store.records import FlowRunRecord, ReservationRecord, get_record, put_record

T0 = 1_700_000_000.0  # the clock the bookings are made and released by


class Clock:
    def __init__(self, monkeypatch, at: float = T0):
        self.at = at
        monkeypatch.setattr(time, "time", lambda: self.at)

    def __call__(self) -> float:
        return self.at


def _prepare(store) -> None:
    store.create_group("gpus")
    store.register_node(node("n1", cpu=16, memory=65536, group="gpus",
                             devices=[gpu("g0", 0, 16384), gpu("g1", 1, 16384), gpu("g2", 2, 40960)]))
    store.register_node(node("n2", cpu=16, memory=65536))


@pytest.fixture
def sqlite_store(tmp_path):
    s = open_store(f"sqlite:///{tmp_path}/s.db")
    _prepare(s)
    yield s
    s.close()


@pytest.fixture
def any_store(store):  # every backend (tests/conftest.py: redis and postgresql are lab tests)
    _prepare(store)
    return store


def _device(store, node_name: str, device_id: str) -> Device:
    stored = store.get_node(node_name)
    return next(d for d in stored.record.devices if d.id == device_id)


def book(store, job: str, *, node: str = "n1", cpu: float = 2, memory: float = 4096, gpus: tuple[str, ...] = (),
         shares: tuple[DeviceShare, ...] = (), queue: str | None = None, group: str | None = "gpus",
         **extra) -> Placement:
    devices = tuple(_device(store, node, d) for d in (*gpus, *(s.id for s in shares)))
    placement = Placement(agent_id=job, node=node, job_id=job, queue=queue, group=group,
                          resources=PlacedResources(cpu_cores=cpu, memory_mb=memory, gpu_count=len(gpus)),
                          allocation=Allocation(devices=devices, shares=shares), **extra)
    result = store.commit_plan(job, [placement])
    assert result.ok, result
    return placement


def release(store, job: str) -> int:
    return bookings.release(store, FlowRun(job), "run_ended")


def run_id() -> str:
    return str(uuid.uuid4())


# -- lifetimes to the second ------------------------------------------------------------------------------------------

def test_usage_agrees_with_the_bookings_lifetimes_to_the_second(any_store, monkeypatch):
    store, clock = any_store, Clock(monkeypatch)
    a, b, c = run_id(), run_id(), run_id()
    book(store, a, gpus=("g0", "g1"), cpu=4, memory=8192, queue="research")  # 2 GPUs, 2 x 16 GB
    clock.at = T0 + 100
    book(store, b, shares=(DeviceShare(id="g2", shares=0.25, memory_mb=10240),), cpu=1, memory=1024,
         queue="research")
    clock.at = T0 + 200
    book(store, c, node="n2", cpu=8, memory=2048, group="default", queue="batch")
    clock.at = T0 + 3700
    assert release(store, a) == 1
    clock.at = T0 + 1900
    assert release(store, b) == 1  # another worker's clock: its own release time counts
    clock.at = T0 + 7200  # c still live: counted up to now

    lifetimes = {job: sum(((e.released_at or T0 + 7200) - e.committed_at) for e in store.history(job))
                 for job in (a, b, c)}
    assert lifetimes == {a: 3700, b: 1800, c: 7000}
    data = accounting.report(store, since=0, until=T0 + 7200, by=("queue",))
    rows = {row["queue"]: row for row in data["rows"]}
    assert rows["research"]["bookings"] == 2 and rows["batch"]["bookings"] == 1
    assert rows["research"]["gpu_seconds"] == 2 * 3700 + 0.25 * 1800
    assert rows["research"]["gpu_memory_mb_seconds"] == 2 * 16384 * 3700 + 10240 * 1800
    assert rows["research"]["cpu_seconds"] == 4 * 3700 + 1 * 1800
    assert rows["research"]["memory_mb_seconds"] == 8192 * 3700 + 1024 * 1800
    assert rows["research"]["booked_seconds"] == 3700 + 1800
    assert rows["batch"] == {"queue": "batch", "bookings": 1, "gpu_seconds": 0, "gpu_memory_mb_seconds": 0,
                             "cpu_seconds": 8 * 7000, "memory_mb_seconds": 2048 * 7000, "booked_seconds": 7000}
    assert data["total"]["booked_seconds"] == sum(lifetimes.values())

    # a window cuts each lifetime at its edges
    window = accounting.report(store, since=T0 + 1000, until=T0 + 2000, by=("queue",))
    rows = {row["queue"]: row for row in window["rows"]}
    assert rows["research"]["booked_seconds"] == 1000 + 900 and rows["batch"]["booked_seconds"] == 1000
    assert rows["research"]["gpu_seconds"] == 2 * 1000 + 0.25 * 900


def test_a_release_retried_or_made_twice_counts_once_and_a_new_booking_again(sqlite_store, monkeypatch):
    store, clock = sqlite_store, Clock(monkeypatch)
    job = run_id()
    book(store, job, cpu=1, memory=0)
    clock.at = T0 + 60
    assert release(store, job) == 1
    clock.at = T0 + 90
    assert release(store, job) == 0  # retried, or another worker: nothing left, nothing counted
    clock.at = T0 + 100
    book(store, job, cpu=1, memory=0)  # the run placed again (re-queued): a booking of its own
    clock.at = T0 + 130
    release(store, job)
    data = accounting.report(store, since=0, until=T0 + 1000, by=("owner",))
    assert data["rows"] == [{"owner": job, "bookings": 2, "gpu_seconds": 0, "gpu_memory_mb_seconds": 0,
                             "cpu_seconds": 90, "memory_mb_seconds": 0, "booked_seconds": 90}]


def test_usage_survives_reopening_the_store(tmp_path, monkeypatch):
    clock = Clock(monkeypatch)
    url = f"sqlite:///{tmp_path}/s.db"
    store = open_store(url)
    _prepare(store)
    job = run_id()
    book(store, job, gpus=("g0",), queue="q")
    clock.at = T0 + 42
    release(store, job)
    store.close()
    store = open_store(url)
    try:
        data = accounting.report(store, since=0, until=T0 + 100, by=("queue",))
    finally:
        store.close()
    assert data["rows"][0]["gpu_seconds"] == 42


# -- labels, reservations, holds ---------------------------------------------------------------------------------

def test_labels_come_from_the_runs_record_and_tags_count_under_each(sqlite_store, monkeypatch):
    store, clock = sqlite_store, Clock(monkeypatch)
    a, b = run_id(), run_id()
    for job, deployment, tags in ((a, "dep-1", ["team-a", "nightly"]), (b, "dep-2", [])):
        put_record(store, FlowRunRecord(job_id=job, node="n1", queue="q", deployment_id=deployment, flow_id="f",
                                        tags=tags))
        book(store, job, cpu=1, memory=0)
    clock.at = T0 + 10
    by_tag = accounting.report(store, since=0, until=clock.at, by=("tag",))
    assert {r["tag"]: r["cpu_seconds"] for r in by_tag["rows"]} == {"team-a": 10, "nightly": 10, "-": 10}
    assert by_tag["total"]["cpu_seconds"] == 20  # each booking once
    by_deployment = accounting.report(store, since=0, until=clock.at, by=("deployment", "flow", "pool", "kind"))
    assert sorted((r["deployment"], r["flow"], r["pool"], r["kind"]) for r in by_deployment["rows"]) == [
        ("dep-1", "f", "gpus", "flow_run"), ("dep-2", "f", "gpus", "flow_run")]


def test_reservations_and_holds_count_for_their_owner(sqlite_store, monkeypatch):
    store, clock = sqlite_store, Clock(monkeypatch)
    reservation = "rsv-" + uuid.uuid4().hex[:12]
    put_record(store, ReservationRecord(job_id=reservation, name="training-week", expires_at=T0 + 10_000,
                                        group="gpus"))
    book(store, reservation, gpus=("g0",), cpu=4, memory=0, reserves=reservation)
    inside = run_id()  # a run inside the reservation takes its capacity: nothing counted again
    book(store, inside, gpus=(), cpu=2, memory=0, reservation=reservation)
    held_run, hold = run_id(), "hold-" + uuid.uuid4().hex[:12]
    put_record(store, FlowRunRecord(job_id=held_run, node="n2", queue="research", deployment_id="d"))
    store.commit_plan(hold, [Placement(agent_id=hold, node="n2", job_id=hold, hold=hold, hold_for=held_run,
                                       hold_queue="research",
                                       resources=PlacedResources(cpu_cores=3, gpu_count=1))])
    clock.at = T0 + 100
    data = accounting.report(store, since=0, until=clock.at, by=("kind", "owner", "queue", "deployment"))
    rows = {(r["kind"], r["owner"]): r for r in data["rows"]}
    assert set(rows) == {("reservation", "training-week"), ("hold", held_run)}
    assert rows[("reservation", "training-week")]["gpu_seconds"] == 100
    assert rows[("reservation", "training-week")]["cpu_seconds"] == 400
    assert rows[("reservation", "training-week")]["gpu_memory_mb_seconds"] == 16384 * 100
    held = rows[("hold", held_run)]
    assert (held["queue"], held["deployment"], held["gpu_seconds"], held["cpu_seconds"]) == ("research", "d", 100, 300)


def test_mig_slices_count_their_share_of_the_gpu():
    whole = Device(id="g", memory_total_mb=81920)
    mig = Device(id="s", parent="g", mig_profile="3g.40gb", memory_total_mb=40960)
    p = Placement(agent_id="a", node="n", allocation=Allocation(devices=(whole, mig)))
    assert accounting.rates(p) == accounting.UsageRates(gpus=1 + 3 / 7, gpu_memory_mb=81920 + 40960)


# -- Prometheus counters ------------------------------------------------------------------------------------------

def _samples(collector) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in collector.collect() for s in f.samples
            if s.name.startswith("mn_usage_")}


def test_counters_count_each_booking_once_across_scrapes_and_a_fresh_process(sqlite_store, monkeypatch):
    store, clock = sqlite_store, Clock(monkeypatch)
    job, live = run_id(), run_id()
    book(store, job, gpus=("g0",), cpu=2, memory=0, queue="q")
    clock.at = T0 + 50
    first = _samples(ClusterCollector(store))
    key = ("mn_usage_gpu_seconds_total", (("pool", "gpus"), ("queue", "q")))
    assert first[key] == 50  # live: up to now
    collector = ClusterCollector(store)
    clock.at = T0 + 80
    release(store, job)
    book(store, live, cpu=1, memory=0, queue="q")
    clock.at = T0 + 90
    assert _samples(collector)[key] == 80
    clock.at = T0 + 100_000  # the release is long past: never counted twice, nor lost
    again = _samples(collector)
    assert again[key] == 80
    assert again[("mn_usage_cpu_seconds_total", (("pool", "gpus"), ("queue", "q")))] == 2 * 80 + 1 * (100_000 - 80)
    assert _samples(ClusterCollector(store)) == again  # another process: the same totals, from the store


# -- the command ------------------------------------------------------------------------------------------------------

def test_usage_command_json_csv_and_table(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    store = open_store(url)
    _prepare(store)
    job = run_id()
    put_record(store, FlowRunRecord(job_id=job, node="n1", queue="q", deployment_id="dep", tags=["t"]))
    book(store, job, gpus=("g0",), cpu=2, memory=1024, queue="q")
    time.sleep(0.05)
    release(store, job)
    seconds = store.history(job)[0].released_at - store.history(job)[0].committed_at
    store.close()

    out = run(["usage", "--store-url", url, "--since", "1h", "--by", "queue,deployment,tag", "--json"])
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["by"] == ["queue", "deployment", "tag"]
    [row] = data["rows"]
    assert (row["queue"], row["deployment"], row["tag"], row["bookings"]) == ("q", "dep", "t", 1)
    assert row["gpu_seconds"] == pytest.approx(seconds, abs=1e-3)
    assert row["cpu_seconds"] == pytest.approx(2 * seconds, abs=2e-3)

    out = run(["usage", "--store-url", url, "--since", "all", "--by", "pool,node", "--csv"])
    assert out.returncode == 0, out.stderr
    [row] = list(csv.DictReader(io.StringIO(out.stdout)))
    assert (row["pool"], row["node"], row["bookings"]) == ("gpus", "n1", "1")
    assert float(row["gpu_seconds"]) == pytest.approx(seconds, abs=1e-3)

    out = run(["usage", "--store-url", url])
    assert out.returncode == 0, out.stderr
    assert "usage from" in out.stdout and "GPU-h" in out.stdout and "q" in out.stdout and "total" in out.stdout


@pytest.mark.parametrize(("args", "option", "words"), [
    (["--since", "yesterday"], "--since", "neither a duration"),
    (["--since", "7x"], "--since", "neither a duration"),
    (["--since", "2999-01-01"], "--since", "in the future"),
    (["--by", "queue,team"], "--by", "unknown key 'team'"),
    (["--by", ","], "--by", "names no key"),
    (["--json", "--csv"], "--csv", "not both"),
])
def test_bad_input_is_refused_by_name_and_nothing_is_opened(tmp_path, args, option, words):
    url = f"sqlite:///{tmp_path}/never.db"
    out = run(["usage", "--store-url", url, *args])
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert option in out.stderr and words in out.stderr
    assert not (tmp_path / "never.db").exists()  # nothing opened, nothing written


def test_since_forms():
    now = datetime(2024, 5, 8, tzinfo=UTC).timestamp()
    assert accounting.parse_since("7d", now) == now - 7 * 86400
    assert accounting.parse_since("90m", now) == now - 5400
    assert accounting.parse_since("2024-05-01", now) == datetime(2024, 5, 1, tzinfo=UTC).timestamp()
    assert accounting.parse_since("2024-05-01T08:00+02:00", now) == datetime(2024, 5, 1, 6, tzinfo=UTC).timestamp()
    assert accounting.parse_since("all", now) == 0
    assert accounting.day_window(date(2024, 5, 1)) == (datetime(2024, 5, 1, tzinfo=UTC).timestamp(),
                                                       datetime(2024, 5, 2, tzinfo=UTC).timestamp())


# -- through the worker: the run's deployment, flow and tags reach the report -----------------------------------

def test_a_placed_runs_deployment_flow_and_tags_label_its_usage(tmp_path, monkeypatch):
    from harness import Harness
    from prefect.states import Completed

    pool = Harness(tmp_path, [node("gpu-1", 16, 65536, devices=[gpu("GPU-1a", 0, 24576)])], monkeypatch=monkeypatch)
    try:
        deployment = pool.prefect.deploy({"resources": {"gpu": 1}})
        flow_run = pool.prefect.run(deployment, tags=("team-a", "nightly"))
        assert pool.poll() == {flow_run.id: "gpu-1"}
        record = get_record(pool.store, str(flow_run.id), FlowRunRecord)
        assert (record.deployment_id, record.flow_id, record.tags) == (str(deployment), str(pool.prefect.flow_id),
                                                                        ["nightly", "team-a"])
        pool.end(flow_run.id, Completed())
        [entry] = pool.store.history(str(flow_run.id))
        assert entry.released_at is not None
        data = accounting.report(pool.store, since=0, until=time.time(), by=("deployment", "tag"))
        assert {(r["deployment"], r["tag"]) for r in data["rows"]} == {(str(deployment), "team-a"),
                                                                       (str(deployment), "nightly")}
        assert data["total"]["gpu_seconds"] == pytest.approx(entry.released_at - entry.committed_at, abs=1e-3)
    finally:
        pool.close()


# -- the daily artifact ------------------------------------------------------------------------------------------

class ArtifactClient:
    """Prefect's client as far as the artifacts go: the latest version of each key, and what was created."""

    def __init__(self):
        self.created: list = []

    def read_latest_artifacts(self, artifact_filter, limit):
        [key] = artifact_filter.key.any_
        return [a for a in reversed(self.created) if a.key == key][:limit]

    def create_artifact(self, artifact):
        self.created.append(artifact)


def test_a_day_of_usage_is_one_table_artifact_written_once(sqlite_store, monkeypatch):
    from mn_prefect.ops.flows import publish_usage_day

    store = sqlite_store
    day = date(2024, 5, 1)
    start, _ = accounting.day_window(day)
    clock = Clock(monkeypatch, start - 1800)  # booked the evening before: only its part in the day counts
    job = run_id()
    put_record(store, FlowRunRecord(job_id=job, node="n1", queue="q", deployment_id="dep"))
    book(store, job, gpus=("g0",), cpu=2, memory=1024, queue="q")
    clock.at = start + 5400
    release(store, job)
    clock.at = start + 86400 + 60
    client = ArtifactClient()
    assert publish_usage_day(store, client, flow_run_id=None, day=day) == "mn-usage-2024-05-01"
    assert publish_usage_day(store, client, flow_run_id=None, day=day) is None  # nothing changed: no new version
    [artifact] = client.created
    assert artifact.type == "table"
    assert artifact.data[0] == {"queue": "q", "pool": "gpus", "deployment": "dep", "bookings": 1, "gpu_hours": 1.5,
                                "gpu_memory_gb_hours": 24.0, "cpu_core_hours": 3.0, "memory_gb_hours": 1.5}
    assert artifact.data[-1]["queue"] == "total" and artifact.data[-1]["gpu_hours"] == 1.5
