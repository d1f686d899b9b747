"""The gRPC server that MirrorNeuron's own clients (the ``mn`` command, ``mn_sdk.Client``) talk to.

It speaks MirrorNeuron's five services from the message types in ``mn_sdk.proto`` (the ``mirrorneuron`` extra)
and answers from the same store and Prefect server as everything else in mn-prefect. Each RPC in the catalog
marked supported has a handler below; every other one answers UNIMPLEMENTED naming the mn-prefect or Prefect way
to do it. With a token, every call must carry ``authorization: Bearer <token>`` (what the clients send when
``MN_GRPC_AUTH_TOKEN`` is set); the server refuses to listen beyond loopback without one."""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

from mn_prefect.mn_api import catalog, cluster
from mn_prefect.mn_api.deployments import Deployments
from mn_prefect.mn_api.errors import ApiError, invalid, not_found
from mn_prefect.mn_api.jobs import Jobs
from mn_prefect.mn_api.operations import Operations
from mn_prefect.mn_api.schedules import Schedules
from mn_prefect.model.issues import InvalidInput, Issue
from mn_prefect.store.base import ClusterStore, StoreUnavailable

log = logging.getLogger("mn_prefect.mn_api")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # bundles arrive inline (the clients inline each file up to 1 MiB)
MAX_RECEIVE_MB_ENV = "MN_GRPC_MAX_RECEIVE_MB"
MAX_STREAMS_ENV = "MN_GRPC_MAX_STREAMS"
DEFAULT_MAX_RECEIVE_MB = 16
DEFAULT_MAX_STREAMS = 200
UNARY_WORKERS = 16  # threads kept for unary calls beside the stream budget
SWEEP_TURNS = 30  # the rollout watcher removes orphaned trigger automations every 30 turns (30 s)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return max(int(raw), 1) if raw else default
    except ValueError:
        raise InvalidInput([Issue(name, f"must be a whole number, not {raw!r}")]) from None


class StreamBudget:
    """How many server streams may be open at once, so that open streams never take the threads unary calls
    need; a stream past the budget is refused with RESOURCE_EXHAUSTED."""

    def __init__(self, limit: int):
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)

    def acquire(self) -> bool:
        return self._slots.acquire(blocking=False)

    def release(self) -> None:
        self._slots.release()

    def refusal(self) -> str:
        return (f"this MirrorNeuron API already has {self.limit} streams open (its limit): close one, or raise "
                f"the limit with {MAX_STREAMS_ENV} on the server")


def _proto_modules():
    try:
        from mn_sdk.proto import cluster_pb2, job_pb2, job_v2_pb2, observability_pb2, operations_pb2
    except ImportError as error:  # the extra is not installed
        raise RuntimeError("the MirrorNeuron API needs the `mirrorneuron` extra: pip install 'mn-prefect[mirrorneuron]'"
                           f" ({error})") from None
    return {catalog.CLUSTER: cluster_pb2, catalog.JOB_V1: job_pb2, catalog.JOB_V2: job_v2_pb2,
            catalog.OPERATIONS: operations_pb2, catalog.OBSERVABILITY: observability_pb2}


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _dumps(doc: Any) -> str:
    return json.dumps(doc, default=str)


class Api:
    """One method per supported RPC, named as the RPC: (request, context) -> response message (or an iterator
    of them for a stream)."""

    def __init__(self, store: ClusterStore, prefect_client: Callable[[], Any], *, pool: str, bundles_root: Path,
                 ui_url: str | None):
        self.store = store
        self.pb = _proto_modules()
        self.jobs = Jobs(store, prefect_client, pool=pool, bundles_root=bundles_root, ui_url=ui_url)
        self.schedules = Schedules(self.jobs)
        self.deployments = Deployments(self.jobs)
        self.operations = Operations(store, prefect_client)
        self.prefect_client = prefect_client

    def _msg(self, service: str, name: str, **fields: Any):
        return getattr(self.pb[service], name)(**fields)

    # -- cluster -------------------------------------------------------------------------------------------------

    def GetSystemSummary(self, request, context):
        doc = cluster.system_summary(self.store, self.jobs.list(0, True)["data"])
        return self._msg(catalog.CLUSTER, "GetSystemSummaryResponse", summary_json=_dumps(doc), version=1)

    def GetResource(self, request, context):
        return self._msg(catalog.CLUSTER, "GetResourceResponse", resource_json=_dumps(cluster.resources(self.store)),
                         version=1)

    def SetResource(self, request, context):
        doc = cluster.set_resources(self.store, request.resource_json)
        return self._msg(catalog.CLUSTER, "SetResourceResponse", resource_json=_dumps(doc), version=1)

    def SetNodeMaintenance(self, request, context):
        doc = cluster.maintenance(self.store, request.node_name, request.enabled, request.reason)
        return self._msg(catalog.CLUSTER, "SetNodeMaintenanceResponse", result_json=_dumps(doc), version=1)

    def CancelNodeDrain(self, request, context):
        doc = cluster.cancel_drain(self.store, request.node_name, request.reason, request.mark_eligible)
        return self._msg(catalog.CLUSTER, "CancelNodeDrainResponse", result_json=_dumps(doc), version=1)

    def GetNodeDrainStatus(self, request, context):
        doc = cluster.drain_status(self.store, request.node_name)
        return self._msg(catalog.CLUSTER, "GetNodeDrainStatusResponse", result_json=_dumps(doc), version=1)

    def DrainNode(self, request, context):
        options = {"node_name": request.node_name, "reason": request.reason, "dry_run": request.dry_run,
                   "deadline_ms": request.deadline_ms or 1_800_000, "ignore_system_jobs": request.ignore_system_jobs}
        node, reason, deadline_s, dry_run = cluster.check_drain_options(self.store, options)
        if dry_run:
            doc = cluster.drain_preview(self.store, node, deadline_s)
        elif request.wait:  # followed to its end as an operation, within the call's deadline
            operation = self.operations.start("drain_node", options)
            for _ in operation.follow(0, follow=True, heartbeat_s=1.0, active=context.is_active):
                pass
            doc = {**operation.as_json(), "node": node, "status": "complete" if operation.status == "completed"
                   else operation.status}
        else:
            doc = {**cluster.begin_drain(self.store, node, reason, deadline_s), "version": 1}
        return self._msg(catalog.CLUSTER, "DrainNodeResponse", result_json=_dumps(doc), version=1)

    def ReconcileNode(self, request, context):
        from mn_prefect.ops.flows import reconcile_once

        node = cluster.node_name(self.store, request.node_name)
        with self.prefect_client() as client:
            doc = reconcile_once(self.store, client, node=node, dry_run=request.dry_run)
        return self._msg(catalog.CLUSTER, "ReconcileNodeResponse", result_json=_dumps({**doc, "version": 1}),
                         version=1)

    def ListServices(self, request, context):
        from mn_prefect.ops import services

        query = cluster.json_object(request.query_json or "{}", "query_json")
        status = query.get("status")
        if problem := services.status_problem(status):
            raise invalid("query_json.status", problem)
        found = services.instances(self.store, name=query.get("name"), node=query.get("node"), status=status,
                                   passing_only=bool(query.get("passing_only")))
        return self._msg(catalog.CLUSTER, "ListServicesResponse",
                         result_json=_dumps({"services": found, "count": len(found), "version": 1}), version=1)

    def ResolveService(self, request, context):
        from mn_prefect.ops import services

        if not request.name:
            raise invalid("name", "the service's name is required")
        query = cluster.json_object(request.query_json or "{}", "query_json")
        passing_only = bool(query.get("passing_only", True))
        found = services.instances(self.store, name=request.name, node=query.get("node"), tags=query.get("tags") or [],
                                   passing_only=passing_only)
        if not found:  # as `mn-prefect service resolve` (exit 1): nothing to reach is an answer of its own
            raise not_found(f"no {'passing ' if passing_only else ''}instance of {request.name}")
        return self._msg(catalog.CLUSTER, "ResolveServiceResponse", result_json=_dumps(
            {"name": request.name, "services": found, "count": len(found), "version": 1}), version=1)

    def CheckServices(self, request, context):
        from mn_prefect.ops import services

        try:
            raw = json.loads(request.services_json or "[]")
        except ValueError as error:
            raise invalid("services_json", f"not JSON: {error}") from None
        raw = raw.get("services", []) if isinstance(raw, dict) else raw
        if not isinstance(raw, list) or not all(isinstance(r, dict) and r.get("name") for r in raw):
            raise invalid("services_json", "a list of required services, each {\"name\", \"tags\"}")
        return self._msg(catalog.CLUSTER, "CheckServicesResponse",
                         result_json=_dumps({**services.check(self.store, raw), "version": 1}), version=1)

    # -- operations ----------------------------------------------------------------------------------------------

    def StartOperation(self, request, context):
        options = cluster.json_object(request.options_json or "{}", "options_json")
        operation = self.operations.start(request.kind, options)
        return self._msg(catalog.OPERATIONS, "StartOperationResponse", operation_json=_dumps(operation.as_json()),
                         version=1)

    def GetOperation(self, request, context):
        operation = self.operations.get(request.operation_id)
        return self._msg(catalog.OPERATIONS, "GetOperationResponse", operation_json=_dumps(operation.as_json()),
                         version=1)

    def StreamOperationEvents(self, request, context) -> Iterator[Any]:
        operation = self.operations.get(request.operation_id)
        heartbeat_s = max(request.heartbeat_interval_ms, 200) / 1000 if request.heartbeat_interval_ms else 5.0
        for event in operation.follow(request.after_sequence, follow=request.follow, heartbeat_s=heartbeat_s,
                                      active=context.is_active):
            yield self._msg(catalog.OPERATIONS, "OperationEventResponse", event_json=_dumps(event), version=1)

    # -- jobs v1 -------------------------------------------------------------------------------------------------

    def SubmitJob(self, request, context):
        run_id = self.jobs.submit(request.manifest_json, dict(request.payloads))
        return self._msg(catalog.JOB_V1, "SubmitJobResponse", job_id=run_id, status="pending", version=1)

    def GetJob(self, request, context):
        if request.DESCRIPTOR.full_name.startswith("mirrorneuron.job.v2"):  # v2 GetJob: a job, not a run
            doc = self.jobs.get_job(request.job_id)
            return self._msg(catalog.JOB_V2, "JsonResponse", result_json=_dumps(doc), version=1)
        return self._msg(catalog.JOB_V1, "GetJobResponse", job_json=_dumps(self.jobs.get(request.job_id)), version=1)

    def ListJobs(self, request, context):
        if request.DESCRIPTOR.full_name.startswith("mirrorneuron.job.v2"):
            return self._msg(catalog.JOB_V2, "JsonResponse", result_json=_dumps(self.jobs.list_jobs()), version=1)
        doc = self.jobs.list(request.limit, request.include_terminal)
        return self._msg(catalog.JOB_V1, "ListJobsResponse", jobs_json=_dumps(doc), version=1)

    def CancelJob(self, request, context):
        status = self.jobs.cancel(request.job_id)
        return self._msg(catalog.JOB_V1, "CancelJobResponse", job_id=request.job_id, status=status, version=1)

    def PauseJob(self, request, context):
        status = self.jobs.pause(request.job_id)
        return self._msg(catalog.JOB_V1, "PauseJobResponse", job_id=request.job_id, status=status, version=1)

    def ResumeJob(self, request, context):
        status = self.jobs.resume(request.job_id)
        return self._msg(catalog.JOB_V1, "ResumeJobResponse", job_id=request.job_id, status=status, version=1)

    # -- deployments (v1) -------------------------------------------------------------------------------------------

    def _deployment(self, doc: dict[str, Any]):
        return self._msg(catalog.JOB_V1, "DeploymentResponse", result_json=_dumps(doc), version=1)

    def DeployJob(self, request, context):
        return self._deployment(self.deployments.deploy(request.manifest_json, dict(request.payloads),
                                                        request.deployment_key, request.update_policy_json,
                                                        wait=request.wait))

    def UpdateDeployment(self, request, context):
        return self._deployment(self.deployments.deploy(request.manifest_json, dict(request.payloads),
                                                        request.deployment_key, request.update_policy_json,
                                                        wait=request.wait, update=True))

    def GetDeployment(self, request, context):
        return self._deployment(self.deployments.get(request.id_or_key))

    def ListDeployments(self, request, context):
        return self._deployment(self.deployments.list(request.query_json))

    def PromoteDeployment(self, request, context):
        return self._deployment(self.deployments.promote(request.id_or_key))

    def RollbackDeployment(self, request, context):
        return self._deployment(self.deployments.rollback(request.id_or_key, request.version, request.tag,
                                                          request.reason))

    def PauseDeployment(self, request, context):
        return self._deployment(self.deployments.pause(request.id_or_key, request.reason))

    def ResumeDeployment(self, request, context):
        return self._deployment(self.deployments.resume(request.id_or_key, request.reason))

    def FailDeployment(self, request, context):
        return self._deployment(self.deployments.fail(request.id_or_key, request.reason))

    def watch_rollouts(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """Advance every rollout under way each ``interval_s`` until ``stop`` (a thread of ``serve``)."""
        turns = 0
        while not stop.wait(interval_s):
            try:
                self.deployments.advance_all()
            except Exception as error:  # a Prefect server away for a moment: the next turn tries again
                log.warning("advancing deployments failed: %s", error)
            turns += 1
            if turns % SWEEP_TURNS == 1:
                self.sweep_automations()

    def sweep_automations(self) -> list[str]:
        """Remove the trigger automations of bundle deployments deleted in Prefect (they would fire into a 404)."""
        from mn_prefect.bundles.triggers import remove_orphaned_automations

        try:
            with self.jobs.prefect_client() as client:
                removed = remove_orphaned_automations(client)
        except Exception as error:
            log.warning("removing the automations of deleted deployments failed: %s", error)
            return []
        for name in removed:
            log.info("removed automation %r: its deployment was deleted", name)
        return removed

    # -- schedules and trigger events (v1) -------------------------------------------------------------------------

    def _schedule(self, doc: dict[str, Any]):
        return self._msg(catalog.JOB_V1, "ScheduleResponse", result_json=_dumps(doc), version=1)

    def CreateSchedule(self, request, context):
        return self._schedule(self.schedules.create(request.manifest_json, dict(request.payloads),
                                                    request.schedule_json, request.source_json))

    def UpdateSchedule(self, request, context):
        return self._schedule(self.schedules.update(request.schedule_id, request.attrs_json, request.reason))

    def GetSchedule(self, request, context):
        return self._schedule(self.schedules.get(request.schedule_id))

    def ListSchedules(self, request, context):
        return self._schedule(self.schedules.list(request.query_json))

    def PauseSchedule(self, request, context):
        return self._schedule(self.schedules.pause(request.schedule_id, request.reason))

    def ResumeSchedule(self, request, context):
        return self._schedule(self.schedules.resume(request.schedule_id, request.reason))

    def DeleteSchedule(self, request, context):
        return self._schedule(self.schedules.delete(request.schedule_id, request.reason))

    def DispatchSchedule(self, request, context):
        return self._schedule(self.schedules.dispatch(request.schedule_id, request.payload_json, request.reason))

    def EmitTriggerEvent(self, request, context):
        return self._schedule(self.schedules.emit(request.event_type, request.payload_json, request.source))

    def ListTriggerEvents(self, request, context):
        return self._schedule(self.schedules.events(request.limit))

    # -- jobs v2 -------------------------------------------------------------------------------------------------

    def _v2(self, doc: dict[str, Any]):
        return self._msg(catalog.JOB_V2, "JsonResponse", result_json=_dumps(doc), version=1)

    def CreateJob(self, request, context):
        return self._v2(self.jobs.create(request.job_id, request.manifest_json, dict(request.payloads),
                                         request.resolved_configuration_json))

    def UpdateJob(self, request, context):
        return self._v2(self.jobs.update(request.job_id, request.manifest_json, dict(request.payloads),
                                         request.attrs_json))

    def StartRun(self, request, context):
        return self._v2(self.jobs.start_run(request.job_id, request.run_id, request.inputs_json))

    def ListRuns(self, request, context):
        return self._v2(self.jobs.list_runs(request.job_id))

    def GetRun(self, request, context):
        return self._v2({**self.jobs.get(request.run_id)["job"], "version": 1})

    def PauseRun(self, request, context):
        return self._v2({"run_id": request.run_id, "status": self.jobs.pause(request.run_id), "version": 1})

    def ResumeRun(self, request, context):
        return self._v2({"run_id": request.run_id, "status": self.jobs.resume(request.run_id), "version": 1})

    def CancelRun(self, request, context):
        return self._v2({"run_id": request.run_id, "status": self.jobs.cancel(request.run_id), "version": 1})

    # -- observability -------------------------------------------------------------------------------------------

    def StreamEvents(self, request, context) -> Iterator[Any]:
        heartbeat_s = request.heartbeat_interval_ms / 1000 if request.heartbeat_interval_ms > 0 else 30.0
        for event in self.jobs.events(request.job_id, follow=request.follow, heartbeat_s=heartbeat_s,
                                      limit=max(request.limit, 0), active=context.is_active):
            yield self._msg(catalog.OBSERVABILITY, "EventResponse", event_json=_dumps(event), version=1)


def _abort(context, error: BaseException):
    import grpc

    if isinstance(error, ApiError):
        context.abort(getattr(grpc.StatusCode, error.code), error.message)
    if isinstance(error, StoreUnavailable):
        context.abort(grpc.StatusCode.UNAVAILABLE, f"the cluster store is not reachable: {error}")
    if isinstance(error, RecursionError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      "a JSON field of the request nests too deep (lists or objects inside one another)")
    log.exception("MirrorNeuron API call failed")
    # the details go to any client: the log has the message, which may name server paths
    context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: the call failed; the server log has why")


def _handlers(api: Api, token: str | None, budget: StreamBudget | None = None):
    """A generic handler per service: each method of the service's descriptor, supported or UNIMPLEMENTED."""
    import grpc

    budget = budget or StreamBudget(DEFAULT_MAX_STREAMS)

    def authorized(context) -> None:
        if token is None:
            return
        sent = dict(context.invocation_metadata()).get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "this mn-prefect MirrorNeuron API needs a token: set MN_GRPC_AUTH_TOKEN")

    def unary(fn):
        def handle(request, context):
            authorized(context)
            try:
                return fn(request, context)
            except Exception as error:
                _abort(context, error)
        return handle

    def stream(fn):
        def handle(request, context):
            authorized(context)
            if not budget.acquire():
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, budget.refusal())
            try:
                yield from fn(request, context)
            except Exception as error:
                _abort(context, error)
            finally:
                budget.release()
        return handle

    def unimplemented(rpc: catalog.Rpc):
        def handle(request, context):
            authorized(context)
            context.abort(grpc.StatusCode.UNIMPLEMENTED, rpc.unimplemented_message())
        return handle

    out = []
    for service_name, module in api.pb.items():
        service = module.DESCRIPTOR.services_by_name[service_name.rsplit(".", 1)[1]]
        methods = {}
        for method in service.methods:
            rpc = catalog.BY_PATH[f"/{service.full_name}/{method.name}"]
            request_type = getattr(module, method.input_type.name)
            response_type = getattr(module, method.output_type.name)
            make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
            if rpc.supported:
                behaviour = (stream if method.server_streaming else unary)(getattr(api, method.name))
            else:
                behaviour = unimplemented(rpc)
            methods[method.name] = make(behaviour, request_deserializer=request_type.FromString,
                                        response_serializer=response_type.SerializeToString)
        out.append(grpc.method_handlers_generic_handler(service.full_name, methods))
    return out


def _token_interceptor(token: str | None):
    """Checks the token from the call's metadata before the request is read, so an unauthenticated caller's
    message is never deserialized."""
    import grpc

    class TokenInterceptor(grpc.ServerInterceptor):
        def intercept_service(self, continuation, handler_call_details):
            if token is None:
                return continuation(handler_call_details)
            sent = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
            if hmac.compare_digest(str(sent).encode(), f"Bearer {token}".encode()):
                return continuation(handler_call_details)

            def refuse(request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED,
                              "this mn-prefect MirrorNeuron API needs a token: set MN_GRPC_AUTH_TOKEN")
            return grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=lambda raw: b"")

    return TokenInterceptor()


def build_server(api: Api, host: str, port: int, *, token: str | None, workers: int = UNARY_WORKERS,
                 max_streams: int | None = None, max_receive_bytes: int | None = None):
    """A started gRPC server on host:port (0: a free port); (server, bound port). InvalidInput when it would
    listen beyond loopback without a token. ``workers`` threads serve unary calls beside ``max_streams`` open
    streams (default MN_GRPC_MAX_STREAMS or 200); a request over ``max_receive_bytes`` (default
    MN_GRPC_MAX_RECEIVE_MB or 16 MiB) is refused RESOURCE_EXHAUSTED."""
    import grpc

    if not is_loopback(host) and not token:
        raise InvalidInput([Issue("--host", f"{host} is not a loopback address: set a token (MN_GRPC_AUTH_TOKEN) "
                                            f"to listen there")])
    budget = StreamBudget(max_streams or _env_int(MAX_STREAMS_ENV, DEFAULT_MAX_STREAMS))
    receive = max_receive_bytes or _env_int(MAX_RECEIVE_MB_ENV, DEFAULT_MAX_RECEIVE_MB) * 1024 * 1024
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers + budget.limit, thread_name_prefix="mn-api"),
                         interceptors=[_token_interceptor(token)],
                         options=[("grpc.max_receive_message_length", receive),
                                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    server.add_generic_rpc_handlers(_handlers(api, token, budget))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not listen on {host}:{port}")
    server.start()
    return server, bound
