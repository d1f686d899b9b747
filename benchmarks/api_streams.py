"""The MirrorNeuron gRPC API beside open follow streams: opens N StreamEvents(follow=True) calls on a real server
(127.0.0.1, an in-process SQLite store), then times GetResource calls beside them.

    .venv/bin/python benchmarks/api_streams.py [--streams 200] [--calls 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from mn_sdk.proto import cluster_pb2, observability_pb2

from mn_prefect.mn_api import server as mn_server
from mn_prefect.store import open_store

STREAM = "/mirrorneuron.observability.v1.ObservabilityService/StreamEvents"
GET_RESOURCE = "/mirrorneuron.cluster.v1.ClusterService/GetResource"


class HeldStreams(mn_server.Api):
    """The real server and handlers, with StreamEvents held open as a follow stream with no events is."""

    release = threading.Event()

    def StreamEvents(self, request, context):
        self.release.wait(600)
        yield from ()


def measure(streams: int, calls: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(f"sqlite:///{Path(tmp) / 'state.db'}")
        api = HeldStreams(store, lambda: None, pool="gpu", bundles_root=Path(tmp) / "bundles", ui_url=None)
        api.release = threading.Event()
        server, port = mn_server.build_server(api, "127.0.0.1", 0, token=None, max_streams=max(streams, 1))
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        open_stream = channel.unary_stream(
            STREAM, request_serializer=observability_pb2.StreamEventsRequest.SerializeToString,
            response_deserializer=observability_pb2.EventResponse.FromString)
        get = channel.unary_unary(GET_RESOURCE, request_serializer=cluster_pb2.GetResourceRequest.SerializeToString,
                                  response_deserializer=cluster_pb2.GetResourceResponse.FromString)
        held = [open_stream(observability_pb2.StreamEventsRequest(job_id="j", follow=True), timeout=600)
                for _ in range(streams)]
        latencies, failed = [], 0
        for _ in range(calls):
            start = time.perf_counter()
            try:
                get(cluster_pb2.GetResourceRequest(), timeout=30)
            except grpc.RpcError:
                failed += 1
            latencies.append(time.perf_counter() - start)
        api.release.set()
        for stream in held:
            list(stream)
        channel.close()
        server.stop(0)
        store.close()
    latencies.sort()
    return {"streams": streams, "calls": calls, "failed": failed,
            "p50_s": round(statistics.median(latencies), 4),
            "p99_s": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.streams, args.calls)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'open streams':>12} {'calls':>6} {'failed':>6} {'p50 s':>8} {'p99 s':>8}")
        print(f"{result['streams']:>12} {result['calls']:>6} {result['failed']:>6} "
              f"{result['p50_s']:>8} {result['p99_s']:>8}")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
