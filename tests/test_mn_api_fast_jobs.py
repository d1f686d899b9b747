"""CreateJob answers at once and jobs of one bundle share its deployment, through a real in-process gRPC server
whose Prefect client is a table of deployments and flow runs (fast: no Prefect server). A deployment that is slow
is made in the background (the job ``deploying``, its runs queued then started); one whose bundle is unchanged is
reused as it is; a changed bundle is a new version of the same deployment; a deployment that fails leaves nothing
behind and its runs fail naming why. Job ids of bundle runs are one per run id."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from mn_sdk.proto import job_pb2, job_v2_pb2
from prefect.exceptions import ObjectNotFound

from mn_prefect.bundles.ids import job_id_for
from mn_prefect.mn_api import server as mn_server
from mn_prefect.mn_api.jobs import shared_deployment_name
from mn_prefect.store import open_store

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "examples" / "bundles" / "demo_dag_linear"
V2 = "/mirrorneuron.job.v2.JobService/"
FAST_S = 1.5  # what a call that does not wait for Prefect's writes must answer within, even on a busy machine


class Prefect:
    """What the API asks of Prefect's client: deployments upserted by flow and name, flow runs by tag. Each
    deployment write takes ``write_s``; ``fail_on`` names a call that raises (after the deployment was made)."""

    def __init__(self, write_s: float = 0.0, fail_on: str | None = None):
        self.write_s, self.fail_on = write_s, fail_on
        self.deployments: dict[str, SimpleNamespace] = {}  # "flow/name" -> deployment
        self.flow_runs: list[SimpleNamespace] = []
        self.writes: list[str] = []
        self.lock = threading.Lock()

    def __call__(self):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read_work_pool(self, name):
        return SimpleNamespace(name=name, type="mn")

    def create_flow_from_name(self, name):
        return name

    def create_deployment(self, *, flow_id, name, version=None, parameters=None, **_):
        time.sleep(self.write_s)
        with self.lock:
            key = f"{flow_id}/{name}"
            self.writes.append(key)
            old = self.deployments.get(key)
            self.deployments[key] = SimpleNamespace(id=old.id if old else uuid.uuid4(), name=name, version=version,
                                                    parameters=parameters or {})
            return self.deployments[key].id

    def read_deployment_by_name(self, name):
        with self.lock:
            if name not in self.deployments:
                raise ObjectNotFound(None)
            return self.deployments[name]

    def delete_deployment(self, deployment_id):
        with self.lock:
            self.deployments = {k: d for k, d in self.deployments.items() if d.id != deployment_id}

    def delete_resource_owned_automations(self, resource_id):
        if self.fail_on == "automations":
            raise RuntimeError("the automations API is away")

    def create_flow_run_from_deployment(self, deployment_id, *, parameters, tags):
        with self.lock:
            deployment = next(d for d in self.deployments.values() if d.id == deployment_id)  # (a UUID)
            run = SimpleNamespace(id=uuid.uuid4(), name=f"run-{len(self.flow_runs)}", tags=tags,
                                  parameters={**deployment.parameters, **parameters}, deployment_id=deployment_id,
                                  state=None, state_type=None, start_time=None, created=None)
            self.flow_runs.append(run)
            return run

    def read_flow_runs(self, *, flow_run_filter, limit=None):
        wanted = set(flow_run_filter.tags.all_)
        with self.lock:
            return [r for r in self.flow_runs if wanted <= set(r.tags)][:limit]

    def read_flow_run(self, flow_run_id):
        found = [r for r in self.flow_runs if str(r.id) == str(flow_run_id)]
        if not found:
            raise ObjectNotFound(None)
        return found[0]


def serve(tmp_path: Path, prefect: Prefect):
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    api = mn_server.Api(store, prefect, pool="gpu", bundles_root=tmp_path / "bundles", ui_url=None)
    server, port = mn_server.build_server(api, "127.0.0.1", 0, token=None)
    return store, server, grpc.insecure_channel(f"127.0.0.1:{port}")


@pytest.fixture
def slow(tmp_path):
    prefect = Prefect(write_s=0.8)  # a busy SQLite Prefect: two deployment writes outlast a StartRun's wait
    store, server, channel = serve(tmp_path, prefect)
    yield prefect, channel, tmp_path / "bundles"
    channel.close()
    server.stop(0)
    store.close()


def call(channel, method: str, request, response=job_v2_pb2.JsonResponse) -> tuple[dict, float]:
    """(the answer's JSON, seconds it took)."""
    rpc = channel.unary_unary(V2 + method if "/" not in method else method,
                              request_serializer=type(request).SerializeToString,
                              response_deserializer=response.FromString)
    started = time.perf_counter()
    answer = rpc(request, timeout=30)
    took = time.perf_counter() - started
    text = answer.result_json if hasattr(answer, "result_json") else answer.job_json
    return json.loads(text), took


def manifest(note: str = "") -> str:
    doc = json.loads((BUNDLE / "manifest.json").read_text())
    if note:
        doc["description"] = note
    return json.dumps(doc)


def payloads() -> dict[str, bytes]:
    return {str(p.relative_to(BUNDLE / "payloads")): p.read_bytes()
            for p in (BUNDLE / "payloads").rglob("*") if p.is_file()}


def create(channel, job_id: str, note: str = "") -> tuple[dict, float]:
    return call(channel, "CreateJob", job_v2_pb2.CreateJobRequest(job_id=job_id, manifest_json=manifest(note),
                                                                  payloads=payloads()))


def start(channel, job_id: str, run_id: str) -> tuple[dict, float]:
    return call(channel, "StartRun", job_v2_pb2.StartRunRequest(job_id=job_id, run_id=run_id))


def get_run(channel, run_id: str) -> dict:
    return call(channel, "GetRun", job_v2_pb2.RunRequest(run_id=run_id))[0]


def wait_for(check, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)
    return found


def runs_of(prefect: Prefect, run_id: str) -> list:
    return [r for r in prefect.flow_runs if f"mn-run:{run_id}" in r.tags]


def test_create_job_answers_at_once_and_its_run_starts_once_the_deployment_is_ready(slow):
    prefect, channel, bundles = slow
    job, took = create(channel, "job_ddl-0001")
    assert took < FAST_S and job["status"] == "deploying", (took, job)
    assert job["deployment"] == f"mn-bundle-run/{shared_deployment_name('gpu', 'demo_dag_linear')}"

    run, took = start(channel, "job_ddl-0001", "demo_dag_linear-20260101T000000Z-a1")
    assert took < FAST_S and run["status"] == "pending" and run["flow_run_id"] is None, (took, run)
    assert get_run(channel, run["run_id"])["status"] == "pending"  # what `mn blueprint run` polls meanwhile

    flow_run = wait_for(lambda: runs_of(prefect, run["run_id"]))[0]
    assert flow_run.parameters["bundle_path"] == str(bundles / "job_ddl-0001")  # the job's own folder
    assert "mn-job:job_ddl-0001" in flow_run.tags
    assert get_run(channel, run["run_id"])["flow_run_id"] == str(flow_run.id)


def test_jobs_of_an_unchanged_bundle_reuse_its_deployment_and_a_changed_one_makes_a_new_version(slow):
    prefect, channel, _ = slow
    create(channel, "job_ddl-0001")
    start(channel, "job_ddl-0001", "r1")
    wait_for(lambda: runs_of(prefect, "r1"))
    writes = len(prefect.writes)
    first_version = prefect.deployments[f"mn-bundle-run/{shared_deployment_name('gpu', 'demo_dag_linear')}"].version

    again, took = create(channel, "job_ddl-0002")  # `mn blueprint run` again: a new job id, the same bundle
    run, took_run = start(channel, "job_ddl-0002", "r2")
    assert (again["status"], run["status"]) == ("active", "pending") and run["flow_run_id"], (again, run)
    assert took < FAST_S and took_run < FAST_S, (took, took_run)
    assert len(prefect.writes) == writes  # nothing deployed again

    changed, _ = create(channel, "job_ddl-0003", note="a changed bundle")
    assert changed["status"] == "deploying"
    start(channel, "job_ddl-0003", "r3")
    wait_for(lambda: runs_of(prefect, "r3"))
    bundle_deployments = [k for k in prefect.deployments if k.startswith("mn-bundle-run/")]
    assert bundle_deployments == [again["deployment"]]  # one deployment for the bundle, whatever the jobs
    versions = {runs_of(prefect, r)[0].deployment_id for r in ("r1", "r2", "r3")}
    assert len(versions) == 1
    assert first_version.startswith("bundle-") and prefect.deployments[again["deployment"]].version != first_version


def test_a_deployment_that_fails_leaves_nothing_and_its_runs_say_why(tmp_path):
    prefect = Prefect(write_s=0.8, fail_on="automations")  # the deployment is made, then its triggers fail
    store, server, channel = serve(tmp_path, prefect)
    try:
        job, took = create(channel, "job_ddl-0009")
        assert job["status"] == "deploying" and took < FAST_S
        run, _ = start(channel, "job_ddl-0009", "r9")
        assert run["status"] == "pending"
        failed = wait_for(lambda: (r := get_run(channel, "r9"))["status"] == "failed" and r)
        assert "the automations API is away" in failed["failure"]
        assert not (tmp_path / "bundles" / "job_ddl-0009").exists()
        assert [p.name for p in (tmp_path / "bundles").iterdir()] == []  # no staged folder either
        assert not [k for k in prefect.deployments if k.startswith("mn-bundle-run/")]  # no deployment left
        with pytest.raises(grpc.RpcError) as refused:
            start(channel, "job_ddl-0009", "r10")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "could not be deployed" in refused.value.details() and "automations" in refused.value.details()
        again, _ = create(channel, "job_ddl-0009")  # the id is free again
        assert again["status"] == "deploying"
    finally:
        channel.close()
        server.stop(0)
        store.close()


def test_a_run_waiting_for_its_deployment_can_be_cancelled_and_never_starts(slow):
    prefect, channel, _ = slow
    create(channel, "job_ddl-0004")
    start(channel, "job_ddl-0004", "r4")
    cancelled, took = call(channel, "CancelRun", job_v2_pb2.RunRequest(run_id="r4"))
    assert cancelled["status"] == "cancelled" and took < FAST_S
    start(channel, "job_ddl-0004", "r5")
    wait_for(lambda: runs_of(prefect, "r5"))
    assert runs_of(prefect, "r4") == [] and get_run(channel, "r4")["status"] == "cancelled"


def test_a_v1_submit_job_answers_at_once_with_its_run_id(slow):
    prefect, channel, _ = slow
    rpc = channel.unary_unary("/mirrorneuron.job.v1.JobService/SubmitJob",
                              request_serializer=job_pb2.SubmitJobRequest.SerializeToString,
                              response_deserializer=job_pb2.SubmitJobResponse.FromString)
    started = time.perf_counter()
    answer = rpc(job_pb2.SubmitJobRequest(manifest_json=manifest(), payloads=payloads()), timeout=30)
    assert time.perf_counter() - started < FAST_S and answer.status == "pending"
    wait_for(lambda: runs_of(prefect, answer.job_id))


@pytest.mark.parametrize("run_ids", [
    [f"demo_dag_fork_join-20260101T0000{i:02d}Z-{i:010x}" for i in range(3)],  # the `mn` command's: one prefix
    ["nightly-2026.12.02_a", "nightly-2026.12.02_b"],
])
def test_each_run_id_gives_its_own_job_id(run_ids):
    job_ids = [job_id_for("demo-dag-fork-join", r) for r in run_ids]
    assert len(set(job_ids)) == len(run_ids)
    assert all(j.startswith("demo-dag-fork-join-") and len(j) == len("demo-dag-fork-join-") + 8 for j in job_ids)
    assert job_ids == [job_id_for("demo-dag-fork-join", r) for r in run_ids]  # the same run, the same job


def test_a_flow_run_id_names_its_job_by_its_first_eight_hex_digits_as_before():
    assert job_id_for("x", "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0") == "x-0f1e2d3c"
