"""Every RPC of MirrorNeuron's five gRPC services, and what mn-prefect answers for it.

One table serves three readers: the server (an RPC marked supported must have a handler; every other one
answers UNIMPLEMENTED with ``instead``), ``docs/mirrorneuron-api.md`` (the table there is this one, checked by a
test), and the people who move from MirrorNeuron (``instead`` names the mn-prefect or Prefect way to do it).
"""

from __future__ import annotations

from dataclasses import dataclass

CLUSTER = "mirrorneuron.cluster.v1.ClusterService"
JOB_V1 = "mirrorneuron.job.v1.JobService"
JOB_V2 = "mirrorneuron.job.v2.JobService"
OPERATIONS = "mirrorneuron.operations.v1.OperationsService"
OBSERVABILITY = "mirrorneuron.observability.v1.ObservabilityService"
SERVICES = (CLUSTER, JOB_V1, JOB_V2, OPERATIONS, OBSERVABILITY)


@dataclass(frozen=True)
class Rpc:
    service: str
    name: str
    supported: bool
    maps_to: str  # supported: what it does in mn-prefect / Prefect; otherwise: the mn-prefect or Prefect way

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"

    def unimplemented_message(self) -> str:
        return f"{self.service.rsplit('.', 1)[-1]}/{self.name} is not part of mn-prefect's MirrorNeuron API: {self.maps_to}"


def _yes(service: str, name: str, maps_to: str) -> Rpc:
    return Rpc(service, name, True, maps_to)


def _no(service: str, name: str, instead: str) -> Rpc:
    return Rpc(service, name, False, instead)


_SCHEDULE = ("a bundle's manifest `schedule` becomes its deployment's schedules; or `prefect deployment schedule "
             "create`, `prefect deploy` with `schedules:`, the Prefect UI")
_WORKER = "a node joins by running `prefect worker start --type mn --pool POOL` on it (docs/several-machines.md)"

CATALOG: tuple[Rpc, ...] = (
    # -- cluster ------------------------------------------------------------------------------------------------
    _no(CLUSTER, "NetworkHandshake", _WORKER),
    _yes(CLUSTER, "GetSystemSummary", "the nodes in the store (as `mn-prefect node list`) and the jobs (as "
                                      "`mn-prefect job list`), with counts"),
    _yes(CLUSTER, "GetResource", "per-node and cluster totals, usable and free capacity under the limits (as "
                                 "`mn-prefect resource list --store`)"),
    _yes(CLUSTER, "SetResource", "the cluster-wide scheduling limits cpu, memory, gpu, disk in percent (as "
                                 "`mn-prefect resource set`); they bind the scheduler at once"),
    _no(CLUSTER, "GetRuntimeStatuses", "node and placement status changes are Prefect events (`mn.node.*`, "
                                       "`mn.placement.*`): see the Prefect UI's event feed"),
    _no(CLUSTER, "PublishRuntimeStatus", "emit a Prefect event (`prefect.events.emit_event`)"),
    _no(CLUSTER, "AckRuntimeStatusEvents", "Prefect events need no acknowledgement"),
    _no(CLUSTER, "AddNode", _WORKER),
    _no(CLUSTER, "RemoveNode", "stop the node's worker, or drain it first (`mn node drain`, `mn-prefect node drain`)"),
    _yes(CLUSTER, "ReconcileNode", "one reconcile pass for the node's bookings (as `mn-prefect node reconcile NODE`)"),
    _yes(CLUSTER, "DrainNode", "starts a drain (as `mn-prefect node drain`); `wait` follows it to the end, "
                               "`dry_run` shows what it would do"),
    _yes(CLUSTER, "CancelNodeDrain", "ends a drain (as `mn-prefect node undrain`)"),
    _yes(CLUSTER, "SetNodeMaintenance", "puts a node in maintenance or takes it out (as `mn-prefect node maintenance`)"),
    _yes(CLUSTER, "GetNodeDrainStatus", "the node's status, its drain and its maintenance"),
    _yes(CLUSTER, "ListServices", "the services the nodes declare and running bundles offer, with the status "
                                  "their checks give them (as `mn-prefect service list`); a node offline or "
                                  "disconnected makes its services critical"),
    _yes(CLUSTER, "ResolveService", "the passing instances of one service, by tags and node (as `mn-prefect service "
                                    "resolve`)"),
    _yes(CLUSTER, "CheckServices", "whether each required service has a passing instance"),
    _no(CLUSTER, "SyncLiteLLMGateway", "mn-prefect runs no model gateway; run one as a service and ask for it"),
    _no(CLUSTER, "RemoveLiteLLMGatewayRoute", "mn-prefect runs no model gateway"),
    _no(CLUSTER, "PrepareRuntimeModel", "mn-prefect prepares no models; a step's own code or image does"),
    _no(CLUSTER, "PrepareDockerWorker", "the docker driver prepares each step's container when it is placed "
                                        "(docs/drivers.md)"),
    _no(CLUSTER, "CleanupDockerWorker", "the docker driver removes each container when its run ends"),
    # -- jobs, v1 -----------------------------------------------------------------------------------------------
    _yes(JOB_V1, "SubmitJob", "as job.v2 CreateJob then StartRun (the run started once the bundle's deployment "
                              "is ready); the job id is the run id"),
    _yes(JOB_V1, "GetJob", "a job by its run id, mn-prefect job id or Prefect flow-run id: status, steps, "
                           "result, recent events, the flow run and its UI address"),
    _yes(JOB_V1, "ListJobs", "the bundle runs and blueprint jobs in the store (as `mn-prefect job list`), "
                             "newest first"),
    _yes(JOB_V1, "CancelJob", "cancels the flow run (Prefect's Cancelling: the worker stops its process and "
                              "releases what it booked)"),
    _no(JOB_V1, "CancelAllJobs", "cancel flow runs in bulk from the Prefect UI or `prefect flow-run cancel`"),
    _yes(JOB_V1, "PauseJob", "a bundle run starts no new steps (running steps finish); a run not started yet "
                             "is Paused in Prefect"),
    _yes(JOB_V1, "ResumeJob", "undoes PauseJob"),
    _no(JOB_V1, "ExportJobBackup", "a run's record is its run store folder (`MN_RUNS_ROOT/<run id>`) and its "
                                   "flow run in Prefect"),
    _no(JOB_V1, "RestoreJobBackup", "run the bundle again (`mn-prefect blueprint run`)"),
    _no(JOB_V1, "ClearJobs", "Prefect keeps flow-run history; delete runs in the Prefect UI"),
    _yes(JOB_V1, "DeployJob", "a new version of the bundle under the deployment key (`mn-bundle-run/<key>` in "
                              "Prefect), rolled out by its update policy: rolling, or canary runs beside the "
                              "stable version until promoted (docs/bundles.md, \"Deployments and canaries\")"),
    _yes(JOB_V1, "UpdateDeployment", "DeployJob for a key that exists"),
    _yes(JOB_V1, "GetDeployment", "the deployment's status, policy and versions with each run's state and health"),
    _yes(JOB_V1, "ListDeployments", "the deployments this server keeps, by status"),
    _yes(JOB_V1, "PromoteDeployment", "makes the healthy canary version stable and cancels the old version's runs"),
    _yes(JOB_V1, "RollbackDeployment", "a new version running an older version's bundle (by number or tag; the "
                                       "last good one by default)"),
    _yes(JOB_V1, "PauseDeployment", "holds the rollout's automatic steps (promotion, failure)"),
    _yes(JOB_V1, "ResumeDeployment", "undoes PauseDeployment"),
    _yes(JOB_V1, "FailDeployment", "fails the rollout under way (with auto_revert, its runs are cancelled and the "
                                   "stable version stays)"),
    _yes(JOB_V1, "CreateSchedule", "the bundle is kept as a job and deployed as `mn-bundle-run/<schedule id>`: "
                                   "periodic as the deployment's cron schedules, delayed as one Scheduled flow run, "
                                   "event as a Prefect automation on the event (docs/bundles.md, \"Schedules and "
                                   "triggers\")"),
    _yes(JOB_V1, "UpdateSchedule", "renames it; other changes are a new schedule (delete, then create)"),
    _yes(JOB_V1, "GetSchedule", "the schedule, its deployment, next and recent runs, and its automations"),
    _yes(JOB_V1, "ListSchedules", "the schedules this server made and the bundle deployments' other cron schedules "
                                  "and trigger automations (`managed_by: prefect`), by kind and status"),
    _yes(JOB_V1, "PauseSchedule", "pauses the deployment (Prefect makes no runs of it) and its automations; a "
                                  "delayed schedule's waiting run is held Paused"),
    _yes(JOB_V1, "ResumeSchedule", "undoes PauseSchedule"),
    _yes(JOB_V1, "DeleteSchedule", "deletes the deployment, its automations, its runs not started and the bundle"),
    _yes(JOB_V1, "DispatchSchedule", "one run now, the payload as its trigger event (`MN_TRIGGER_EVENT_JSON`)"),
    _yes(JOB_V1, "EmitTriggerEvent", "a Prefect event of that name (as `mn-prefect event emit`): every matching "
                                     "bundle trigger runs its bundle"),
    _yes(JOB_V1, "ListTriggerEvents", "the latest such events (as `mn-prefect event list`)"),
    # -- jobs, v2 -----------------------------------------------------------------------------------------------
    _yes(JOB_V2, "CreateJob", "the bundle (manifest and payloads) is written under the server's bundle folder "
                              "and checked; it answers then: the bundle's one deployment on the server's pool, "
                              "`mn-bundle-run/api-<pool>-<bundle>`, is reused as it is when its version is this "
                              "bundle's, else made in the background (status `deploying`)"),
    _yes(JOB_V2, "GetJob", "the job's deployment: its bundle, pool and runs"),
    _yes(JOB_V2, "ListJobs", "the deployments CreateJob made"),
    _yes(JOB_V2, "UpdateJob", "a new manifest and payloads replace the job's bundle; its deployment is reused or "
                              "made again as CreateJob does"),
    _no(JOB_V2, "ArchiveJob", "delete the deployment (`prefect deployment delete`); its runs stay in Prefect"),
    _no(JOB_V2, "ResetJobData", "a run's data is its run store folder; remove it there"),
    _no(JOB_V2, "DeleteJob", "remove the job's folder under the bundles root; its bundle's deployment serves "
                             "the bundle's other jobs (`prefect deployment delete` removes it)"),
    _yes(JOB_V2, "StartRun", "one flow run of the job's deployment on the job's own bundle folder, with the "
                             "client's run id and inputs (`--set` values); while the deployment is being made "
                             "(up to 0.5 s waited) the run is `pending` with no flow run yet, and starts once it "
                             "is ready, or fails naming why"),
    _yes(JOB_V2, "ListRuns", "the flow runs of the job's deployment"),
    _yes(JOB_V2, "GetRun", "as job.v1 GetJob, by run id"),
    _yes(JOB_V2, "PauseRun", "as job.v1 PauseJob"),
    _yes(JOB_V2, "ResumeRun", "as job.v1 ResumeJob"),
    _yes(JOB_V2, "CancelRun", "as job.v1 CancelJob"),
    _no(JOB_V2, "DeleteRun", "delete the flow run in the Prefect UI (`prefect flow-run delete`)"),
    _no(JOB_V2, "SendRunInput", "Prefect's flow-run input (`pause_flow_run(wait_for_input=...)`) in your own flows"),
    _no(JOB_V2, "CreateJobSchedule", _SCHEDULE),
    # -- operations ---------------------------------------------------------------------------------------------
    _yes(OPERATIONS, "StartOperation", "kinds `drain_node` and `reconcile_node` (what `mn node drain` and "
                                       "`mn node reconcile` start); other kinds answer UNIMPLEMENTED"),
    _yes(OPERATIONS, "GetOperation", "an operation this server started: status, counters, items"),
    _yes(OPERATIONS, "StreamOperationEvents", "its events from a sequence number on; follows it to the end"),
    # -- observability ------------------------------------------------------------------------------------------
    _yes(OBSERVABILITY, "StreamEvents", "a job's events (job and step changes, from the flow run and the run "
                                        "store) from the start; follows it to its end"),
)

BY_PATH = {rpc.path: rpc for rpc in CATALOG}


def markdown_table() -> str:
    """The RPC table of docs/mirrorneuron-api.md, one section per service."""
    lines = []
    for service in SERVICES:
        lines += [f"### `{service}`", "", "| RPC | mn-prefect | what it does, or the mn-prefect / Prefect way |",
                  "| --- | --- | --- |"]
        lines += [f"| {rpc.name} | {'supported' if rpc.supported else 'UNIMPLEMENTED'} | {rpc.maps_to} |"
                  for rpc in CATALOG if rpc.service == service]
        lines.append("")
    return "\n".join(lines)
