"""Named refusal reasons. A node's reason is ``"<constant>: <detail>"`` so programs can match the prefix."""

NODE_NOT_READY = "node not ready"
NODE_INELIGIBLE = "scheduling ineligible"
MISSING_PROFILE = "missing execution profile"
CONSTRAINT_NOT_MET = "constraint not met"
MISSING_SERVICE = "required service not passing"
INSUFFICIENT = "insufficient"  # followed by the resource: "insufficient cpu: ..."
MISSING_DRIVER = "missing runtime driver"
PORT_IN_USE = "port in use"
NO_DYNAMIC_PORT = "no free dynamic port"
MISSING_HOST_PATH = "missing host path"
MISSING_DEVICES = "missing devices"
UNKNOWN_NODE = "unknown node"
OTHER_GROUP = "other resource group"
RESERVATION_ENDED = "reservation ended"
HOLD_ENDED = "hold ended"
QUOTA = "quota"  # the run's queue is at its quota (scheduler/quotas.py): "quota: queue a is at ..."

# Feasibility stages in the order of docs/scheduling.md: the first failing stage gives the node's reason.
STAGE_STATUS = 1
STAGE_PROFILE = 2
STAGE_CONSTRAINTS = 3
STAGE_SERVICES = 4
STAGE_CAPACITY = 5
STAGE_DRIVER = 6
STAGE_PORTS = 7
STAGE_VOLUMES = 8
STAGE_DEVICES = 9


def reason(constant: str, detail: str) -> str:
    return f"{constant}: {detail}"
