"""A CreateJob (or v1 SubmitJob) that carries nothing to run is INVALID_ARGUMENT naming what is missing, answered
by a real in-process gRPC server before any bundle is kept or any deployment is made."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from mn_sdk.proto import job_pb2, job_v2_pb2

from mn_prefect.mn_api import server as mn_server
from mn_prefect.store import open_store

CREATE_JOB = "/mirrorneuron.job.v2.JobService/CreateJob"
SUBMIT_JOB = "/mirrorneuron.job.v1.JobService/SubmitJob"
ANSWER_BOUND_S = 30  # only so a broken server fails the test instead of hanging it
NO_AGENTS = [
    {},
    {"job_name": "x"},
    {"nodes": []},
    {"apiVersion": "mn.workflow/v2", "kind": "Workflow", "id": "x"},
    {"apiVersion": "mn.workflow/v2", "kind": "Workflow", "id": "x", "agents": {"nodes": []}},
]


def _no_prefect():
    raise AssertionError("a refused job must not reach Prefect")


@pytest.fixture
def served(tmp_path: Path):
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    api = mn_server.Api(store, _no_prefect, pool="gpu", bundles_root=tmp_path / "bundles", ui_url=None)
    server, port = mn_server.build_server(api, "127.0.0.1", 0, token=None)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, tmp_path / "bundles"
    channel.close()
    server.stop(0)
    store.close()


def _create(channel, **fields):
    call = channel.unary_unary(CREATE_JOB, request_serializer=job_v2_pb2.CreateJobRequest.SerializeToString,
                               response_deserializer=job_v2_pb2.JsonResponse.FromString)
    with pytest.raises(grpc.RpcError) as refused:
        call(job_v2_pb2.CreateJobRequest(**fields), timeout=ANSWER_BOUND_S)
    return refused.value


def _kept(bundles: Path) -> list[str]:
    return sorted(p.name for p in bundles.iterdir()) if bundles.exists() else []


def test_an_empty_create_job_is_invalid_argument_naming_the_manifest(served):
    channel, bundles = served
    refused = _create(channel)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("manifest_json: is required")
    assert _kept(bundles) == []


@pytest.mark.parametrize("manifest", NO_AGENTS, ids=lambda m: json.dumps(m))
def test_a_create_job_without_agents_is_invalid_argument_naming_the_nodes(served, manifest):
    channel, bundles = served
    refused = _create(channel, job_id="empty", manifest_json=json.dumps(manifest))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nodes" in refused.details() or "agents" in refused.details()
    assert _kept(bundles) == []


def test_a_v1_submit_job_with_an_empty_manifest_is_invalid_argument(served):
    channel, bundles = served
    call = channel.unary_unary(SUBMIT_JOB, request_serializer=job_pb2.SubmitJobRequest.SerializeToString,
                               response_deserializer=job_pb2.SubmitJobResponse.FromString)
    with pytest.raises(grpc.RpcError) as refused:
        call(job_pb2.SubmitJobRequest(manifest_json="{}"), timeout=ANSWER_BOUND_S)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nodes" in refused.value.details()
    assert _kept(bundles) == []


def test_a_create_job_with_a_number_past_the_digit_limit_names_the_field_and_keeps_nothing(served):
    """A 5,000-digit number where a step's timeout belongs: refused by that field (too large), INVALID_ARGUMENT,
    not a bare conversion error, and no bundle kept."""
    channel, bundles = served
    manifest = ('{"manifest_version": "1.0", "graph_id": "g", "job_name": "huge", "entrypoints": ["a"], '
                '"nodes": [{"node_id": "a", "agent_type": "executor", "config": {"command": ["true"], '
                '"timeout_seconds": 1' + "0" * 5000 + '}}], "edges": []}')
    refused = _create(channel, manifest_json=manifest)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
    assert "timeout_seconds" in refused.details() and "4300" not in refused.details(), refused.details()
    assert _kept(bundles) == []


def test_a_create_job_nested_past_what_can_be_read_is_invalid_argument_naming_the_manifest(served):
    channel, bundles = served
    refused = _create(channel, manifest_json='{"nodes": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "manifest_json" in refused.details()
    assert _kept(bundles) == []
