"""Each RPC the ``mn`` command calls, timed against a real ``mn-prefect mn-api serve`` in front of a real Prefect
server on SQLite (the lab's default), with ``--burn`` processes spinning on the CPUs beside it (a busy lab).

Each round is what ``mn blueprint run --folder demo_dag_linear`` asks (GetResource, GetSystemSummary, CreateJob
with a new job id, StartRun, GetRun, StreamEvents without follow), then ``mn job list`` and ``mn job status``
(job.v1 ListJobs, GetJob) and ``mn run cancel`` (CancelRun; the pool has no worker, so runs wait until then).
Rounds alternate between the bundle changed (a new version, made in the background) and the same bundle again
(its deployment reused as it is): "deploy ready s" is how long after CreateJob the run had its flow run. The ``mn`` command's
default deadline is 10 s; the target is every RPC within 2 s.

    .venv/bin/python benchmarks/mn_api_rpcs.py [--rounds 20] [--burn 2] [--before REV] [--write BENCHMARKS.md]

``--before REV``: the same rounds once more with the API server of revision REV (a temporary worktree).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from report import (  # noqa: E402
    load_average,
    markdown_table,
    print_rows,
    provenance,
    require_positive,
    worktree,
    write_section,
)

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "examples" / "bundles" / "demo_dag_linear"
BIN = Path(sys.executable).parent
TARGET_S = 2.0
POOL = "mn-bench-api"


def burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Calls:
    """The RPCs by name on one channel: each call timed into ``self.times[name]``."""

    def __init__(self, target: str):
        import grpc
        from mn_sdk.proto import cluster_pb2, job_pb2, job_v2_pb2, observability_pb2

        self.channel = grpc.insecure_channel(target)
        self.pb = {"cluster": cluster_pb2, "job": job_pb2, "v2": job_v2_pb2, "obs": observability_pb2}
        self.times: dict[str, list[float]] = {}
        self.failed: dict[str, int] = {}

    def _rpc(self, path: str, request, response, stream: bool = False):
        make = self.channel.unary_stream if stream else self.channel.unary_unary
        return make(path, request_serializer=type(request).SerializeToString,
                    response_deserializer=response.FromString)(request, timeout=30)

    def timed(self, name: str, path: str, request, response, stream: bool = False):
        import grpc

        started = time.perf_counter()
        try:
            answer = self._rpc(path, request, response, stream)
            if stream:
                answer = list(answer)
        except grpc.RpcError as error:
            self.failed[name] = self.failed.get(name, 0) + 1
            print(f"{name}: {error.code().name} {error.details()}", file=sys.stderr)
            answer = None
        self.times.setdefault(name, []).append(time.perf_counter() - started)
        return answer

    def round(self, job_id: str, run_id: str, manifest: str, payloads: dict[str, bytes]) -> float | None:
        """One ``mn blueprint run`` and what follows it; seconds from CreateJob until the run had its flow run."""
        pb = self.pb
        self.timed("GetResource", "/mirrorneuron.cluster.v1.ClusterService/GetResource",
                   pb["cluster"].GetResourceRequest(), pb["cluster"].GetResourceResponse)
        self.timed("GetSystemSummary", "/mirrorneuron.cluster.v1.ClusterService/GetSystemSummary",
                   pb["cluster"].GetSystemSummaryRequest(), pb["cluster"].GetSystemSummaryResponse)
        created_at = time.perf_counter()
        created = self.timed("CreateJob", "/mirrorneuron.job.v2.JobService/CreateJob",
                             pb["v2"].CreateJobRequest(job_id=job_id, manifest_json=manifest, payloads=payloads),
                             pb["v2"].JsonResponse)
        if created is None:
            return None
        self.timed("StartRun", "/mirrorneuron.job.v2.JobService/StartRun",
                   pb["v2"].StartRunRequest(job_id=job_id, run_id=run_id), pb["v2"].JsonResponse)
        ready = None
        while ready is None and time.perf_counter() - created_at < 120:
            got = self.timed("GetRun", "/mirrorneuron.job.v2.JobService/GetRun", pb["v2"].RunRequest(run_id=run_id),
                             pb["v2"].JsonResponse)
            if got is not None and json.loads(got.result_json).get("flow_run_id"):
                ready = time.perf_counter() - created_at
            else:
                time.sleep(0.2)
        self.timed("StreamEvents", "/mirrorneuron.observability.v1.ObservabilityService/StreamEvents",
                   pb["obs"].StreamEventsRequest(job_id=run_id, follow=False), pb["obs"].EventResponse, stream=True)
        self.timed("ListJobs (v1)", "/mirrorneuron.job.v1.JobService/ListJobs",
                   pb["job"].ListJobsRequest(limit=50, include_terminal=True), pb["job"].ListJobsResponse)
        self.timed("GetJob (v1)", "/mirrorneuron.job.v1.JobService/GetJob", pb["job"].GetJobRequest(job_id=run_id),
                   pb["job"].GetJobResponse)
        self.timed("CancelRun", "/mirrorneuron.job.v2.JobService/CancelRun", pb["v2"].RunRequest(run_id=run_id),
                   pb["v2"].JsonResponse)
        return ready


def measure(rounds: int, burners: int, home: Path, tree: Path | None = None) -> dict:
    import httpx

    from mn_prefect.local_lab import PrefectServer
    from mn_prefect.worker import MNWorker

    server = PrefectServer(home / "prefect")
    stop = multiprocessing.Event()
    spinning = [multiprocessing.Process(target=burn, args=(stop,), daemon=True) for _ in range(burners)]
    api = None
    try:
        created = httpx.post(f"{server.api_url}/work_pools/", json={
            "name": POOL, "type": "mn", "base_job_template": MNWorker.get_default_base_job_template()}, timeout=60)
        assert created.status_code == 201, created.text
        env = {**server.env, "MN_STORE_URL": f"sqlite:///{home / 'state.db'}", "MN_PREFECT_HOME": str(home / "mn"),
               "PREFECT_LOGGING_LEVEL": "WARNING"}
        env.pop("MN_GRPC_AUTH_TOKEN", None)
        if tree is not None:  # the API server of another revision
            env["PYTHONPATH"] = str(tree)
        log = open(home / "mn-api.log", "w")
        api = subprocess.Popen([str(BIN / "mn-prefect"), "mn-api", "serve", "--port", "0", "--pool", POOL,
                                "--bundles-root", str(home / "jobs")], env=env, stdout=subprocess.PIPE, stderr=log,
                               text=True, start_new_session=True)
        line = api.stdout.readline()
        match = re.fullmatch(r"export MN_GRPC_TARGET=(\S+)\n", line)
        assert match, f"no address from the API server: {line!r}; see {home / 'mn-api.log'}"
        for proc in spinning:
            proc.start()
        time.sleep(2)  # the burners show in the load
        load_before = load_average()
        calls = Calls(match.group(1))
        manifest = json.loads((BUNDLE / "manifest.json").read_text())
        payloads = {str(p.relative_to(BUNDLE / "payloads")): p.read_bytes()
                    for p in (BUNDLE / "payloads").rglob("*") if p.is_file()}
        ready: dict[str, list[float]] = {"unchanged": [], "changed": []}
        for i in range(rounds + 1):  # round 0 makes the first deployment (and warms the server): not counted
            kind = "changed" if i % 2 else "unchanged"  # a changed bundle, then the same one again
            doc = {**manifest, "description": f"version {(i + 1) // 2}"}
            took = calls.round(f"job_ddl-{i:04d}", f"demo_dag_linear-bench-{i:04d}", json.dumps(doc), payloads)
            if i == 0:
                calls.times, calls.failed = {}, {}
                continue
            if took is not None:
                ready[kind].append(took)
        load_after = load_average()
    finally:
        stop.set()
        for proc in spinning:
            proc.join(5)
        if api is not None:
            api.terminate()
            api.wait(20)
        server.stop()
    rows = [{"rpc": name, "calls": len(values), "failed": calls.failed.get(name, 0),
             "p50 s": round(statistics.median(values), 3), "p95 s": round(percentile(values, 0.95), 3),
             "max s": round(max(values), 3)} for name, values in calls.times.items() if values]
    deploys = [{"bundle": kind, "rounds": len(values), "deploy ready p50 s": round(statistics.median(values), 2),
                "deploy ready p95 s": round(percentile(values, 0.95), 2)} for kind, values in ready.items() if values]
    return {"rows": rows, "deploys": deploys, "load_before": load_before, "load_after": load_after,
            "burners": burners, "rounds": rounds}


def table(rows: list[dict]) -> list[str]:
    return markdown_table(list(rows[0]), [list(r.values()) for r in rows])


def markdown(result: dict, before: dict | None = None) -> str:
    worst = max(r["p95 s"] for r in result["rows"])
    met = "met" if worst <= TARGET_S and not any(r["failed"] for r in result["rows"]) else "NOT met"
    return "\n".join([
        "## The MirrorNeuron API: each RPC `mn` calls", "",
        provenance("mn_api_rpcs.py", f"{os.cpu_count()} cores",
                   f"CPU burners beside it: {result['burners']}", "one local Prefect server on SQLite",
                   f"load average {result['load_before']} before, {result['load_after']} after"), "",
        f"Each of {result['rounds']} rounds: what `mn blueprint run --folder demo_dag_linear` asks (a new job id each "
        "time), then `mn job list`, `mn job status` and `mn run cancel`. Rounds alternate between the bundle "
        "changed (a new version, made in the background while StartRun has answered `pending`) and the same "
        "bundle again (its deployment reused as it is). GetRun is polled every 0.2 s until the run has its flow run.", "",
        *table(result["rows"]), "",
        *table(result["deploys"]), "",
        f"Target: every RPC within {TARGET_S:g} s at p95 (the `mn` command's default deadline is 10 s): **{met}** "
        f"(worst p95 {worst:g} s). \"deploy ready\": seconds from CreateJob until the run had its flow run.",
        *([] if before is None else [
            "", f"Before ({before['revision']}: CreateJob waited for the deployment writes, ensuring the step "
            "deployment, a new deployment per job and its automations), the same rounds, load average "
            f"{before['load_before']} before, {before['load_after']} after:", "", *table(before["rows"])]),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--burn", type=int, default=2, help="CPU burner processes beside the servers")
    parser.add_argument("--write", help="BENCHMARKS.md to update")
    parser.add_argument("--before", help="a git revision whose API server to measure too")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    require_positive(parser, args, "rounds")
    with tempfile.TemporaryDirectory(prefix="mn-bench-api-") as tmp:
        result = measure(args.rounds, max(args.burn, 0), Path(tmp) / "after")
    before = None
    if args.before:
        revision = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout.strip()
        with worktree(ROOT, revision) as tree, tempfile.TemporaryDirectory(prefix="mn-bench-api-") as tmp:
            before = {**measure(args.rounds, max(args.burn, 0), Path(tmp) / "before", tree), "revision": revision}
    if args.json:
        print(json.dumps({"after": result, "before": before}))
    else:
        for name, found in (("", result), ("before: ", before)):
            if found is not None:
                print_rows(f"{name}RPCs (load {found['load_before']} -> {found['load_after']})", found["rows"])
                print_rows(f"{name}deployments", found["deploys"])
    if args.write:
        write_section(args.write, "mn-api-rpcs", markdown(result, before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
