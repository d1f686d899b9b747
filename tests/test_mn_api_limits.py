"""The MirrorNeuron gRPC API cannot be starved: open streams leave threads for unary calls, a stream past the
budget is refused, an unauthenticated oversize request is refused unread, deep JSON is INVALID_ARGUMENT and
INTERNAL details name no server path."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from builders import gpu
from mn_sdk.proto import cluster_pb2, job_v2_pb2, observability_pb2

from mn_prefect.mn_api import server as mn_server
from mn_prefect.model.node import NodeRecord
from mn_prefect.store import open_store

STREAM = "/mirrorneuron.observability.v1.ObservabilityService/StreamEvents"
GET_RESOURCE = "/mirrorneuron.cluster.v1.ClusterService/GetResource"
SET_RESOURCE = "/mirrorneuron.cluster.v1.ClusterService/SetResource"
CREATE_JOB = "/mirrorneuron.job.v2.JobService/CreateJob"
HANG_BOUND_S = 30  # only so a broken server fails the test instead of hanging it


class HeldStreams(mn_server.Api):
    """The real handlers, with StreamEvents held open until the test lets go (a follow stream with no events)."""

    release = threading.Event()
    reached: list[str] = []  # the job ids of the streams the handler was called for

    def StreamEvents(self, request, context):
        self.reached.append(request.job_id)
        self.release.wait(HANG_BOUND_S)
        yield from ()


@pytest.fixture
def served(tmp_path: Path, request):
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    store.register_node(NodeRecord.model_validate({"name": "gpu-1", "cpu_cores": 16, "memory_mb": 65536,
                                                   "devices": [gpu("GPU-1a", 0, 24576)]}))
    api = HeldStreams(store, lambda: None, pool="gpu", bundles_root=tmp_path / "bundles", ui_url=None)
    api.release, api.reached = threading.Event(), []
    options = getattr(request, "param", {})
    server, port = mn_server.build_server(api, "127.0.0.1", 0, **{"token": None, **options})
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield api, channel, tmp_path
    api.release.set()
    channel.close()
    server.stop(0)
    store.close()


def _open_streams(channel, count: int):
    call = channel.unary_stream(STREAM, request_serializer=observability_pb2.StreamEventsRequest.SerializeToString,
                                response_deserializer=observability_pb2.EventResponse.FromString)
    return [call(observability_pb2.StreamEventsRequest(job_id="j", follow=True), timeout=HANG_BOUND_S)
            for _ in range(count)]


def _get_resource(channel):
    return channel.unary_unary(GET_RESOURCE, request_serializer=cluster_pb2.GetResourceRequest.SerializeToString,
                               response_deserializer=cluster_pb2.GetResourceResponse.FromString)(
        cluster_pb2.GetResourceRequest(), timeout=HANG_BOUND_S)


def test_a_unary_call_answers_beside_forty_open_streams(served):
    api, channel, _ = served
    streams = _open_streams(channel, 40)
    assert "gpu-1" in _get_resource(channel).resource_json
    api.release.set()
    for stream in streams:
        list(stream)


@pytest.mark.parametrize("served", [{"max_streams": 3}], indirect=True)
def test_a_stream_past_the_budget_is_refused_naming_the_limit(served):
    api, channel, _ = served
    held = _open_streams(channel, 3)
    _get_resource(channel)  # the three are open by the time a later call is answered
    with pytest.raises(grpc.RpcError) as refused:
        list(_open_streams(channel, 1)[0])
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "3 streams" in refused.value.details() and mn_server.MAX_STREAMS_ENV in refused.value.details()
    api.release.set()
    for stream in held:
        list(stream)


@pytest.mark.parametrize("served", [{"token": "s3cret"}], indirect=True)
def test_an_oversize_unauthenticated_create_job_is_refused_and_creates_nothing(served):
    _, channel, tmp_path = served
    create = channel.unary_unary(CREATE_JOB, request_serializer=job_v2_pb2.CreateJobRequest.SerializeToString,
                                 response_deserializer=job_v2_pb2.JsonResponse.FromString)
    with pytest.raises(grpc.RpcError) as refused:
        create(job_v2_pb2.CreateJobRequest(job_id="big", manifest_json="{}", payloads={"x": b"x" * (60 << 20)}),
               timeout=HANG_BOUND_S)
    assert refused.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED)
    with pytest.raises(grpc.RpcError) as oversize:  # the receive limit refuses it even with the token
        create(job_v2_pb2.CreateJobRequest(job_id="big", manifest_json="{}", payloads={"x": b"x" * (60 << 20)}),
               metadata=[("authorization", "Bearer s3cret")], timeout=HANG_BOUND_S)
    assert oversize.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not (tmp_path / "bundles").exists() or not any((tmp_path / "bundles").iterdir())


def test_deep_json_is_invalid_argument_not_internal(served):
    _, channel, _ = served
    set_resource = channel.unary_unary(SET_RESOURCE,
                                       request_serializer=cluster_pb2.SetResourceRequest.SerializeToString,
                                       response_deserializer=cluster_pb2.SetResourceResponse.FromString)
    with pytest.raises(grpc.RpcError) as refused:
        set_resource(cluster_pb2.SetResourceRequest(resource_json="[" * 200_000 + "]" * 200_000),
                     timeout=HANG_BOUND_S)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "resource_json: nested too deeply to read"  # the request's field, named


def test_internal_details_name_no_server_path(served, monkeypatch):
    api, channel, tmp_path = served
    monkeypatch.setattr(mn_server.cluster, "resources",
                        lambda store: (_ for _ in ()).throw(OSError(f"cannot read {tmp_path}/bundles/x")))
    with pytest.raises(grpc.RpcError) as failed:
        _get_resource(channel)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert str(tmp_path) not in failed.value.details()


@pytest.mark.parametrize("served", [{"token": "s3cret"}], indirect=True)
def test_a_stream_without_the_token_is_refused_before_it_takes_a_stream_slot(served):
    """StreamEvents, like every unary call, answers UNAUTHENTICATED without the token (or with a wrong one); the
    refused calls never reach the handler, and one with the token streams."""
    api, channel, _ = served
    call = channel.unary_stream(STREAM, request_serializer=observability_pb2.StreamEventsRequest.SerializeToString,
                                response_deserializer=observability_pb2.EventResponse.FromString)
    for metadata in ([], [("authorization", "Bearer wrong")]):
        with pytest.raises(grpc.RpcError) as refused:
            list(call(observability_pb2.StreamEventsRequest(job_id="j", follow=True), metadata=metadata,
                      timeout=HANG_BOUND_S))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value.details()
    assert api.reached == []
    with pytest.raises(grpc.RpcError) as unary:
        _get_resource(channel)
    assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED
    api.release.set()  # the handler's stream ends at once
    assert list(call(observability_pb2.StreamEventsRequest(job_id="ok", follow=False),
                     metadata=[("authorization", "Bearer s3cret")], timeout=HANG_BOUND_S)) == []
    assert api.reached == ["ok"]
