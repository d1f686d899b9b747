"""The static feasibility chain: one small checker per concern, in the order of docs/scheduling.md.

Each checker looks only at what does not change with bookings (status, profiles, constraints, services,
drivers, host paths, the device inventory), so its answer can be cached per node class. Capacity, ports
and free devices are checked by the cluster view, which owns the bookings.
"""

from __future__ import annotations

from typing import Protocol

from mn_prefect.model.node import ExecutionProfile, NodeRecord
from mn_prefect.model.node_status import SCHEDULABLE_STATES
from mn_prefect.model.resources import DeviceRequest
from mn_prefect.scheduler import reasons
from mn_prefect.scheduler.ask import Ask
from mn_prefect.scheduler.constraints import satisfied
from mn_prefect.scheduler.devices import describe, pick_devices
from mn_prefect.scheduler.volumes import check_volumes

IMPLIED_GPU = DeviceRequest(kind="gpu", count=1)


class Checker(Protocol):
    stage: int

    def check(self, node: NodeRecord, ask: Ask) -> str | None:
        """A reason when ``node`` can never take ``ask``; None when it may."""


class StatusChecker:
    stage = reasons.STAGE_STATUS

    def check(self, node: NodeRecord, ask: Ask) -> str | None:
        if node.status not in SCHEDULABLE_STATES:
            return reasons.reason(reasons.NODE_NOT_READY, f"status {node.status}")
        if node.scheduling_eligible is False:
            return reasons.reason(reasons.NODE_INELIGIBLE, "scheduling_eligible is false")
        return None


def profile_of(node: NodeRecord, name: str | None) -> ExecutionProfile | None:
    if name is None:
        return None
    return next((p for p in node.profiles if p.name == name), None)


class ProfileChecker:
    stage = reasons.STAGE_PROFILE

    def check(self, node: NodeRecord, ask: Ask) -> str | None:
        if ask.profile is not None and profile_of(node, ask.profile) is None:
            return reasons.reason(reasons.MISSING_PROFILE, ask.profile)
        return None


class ConstraintChecker:
    """Constraints on class attributes; ``escaped`` ones (node name, dotted paths) are checked per node."""

    stage = reasons.STAGE_CONSTRAINTS

    def __init__(self, escaped: bool = False):
        self.escaped = escaped

    def check(self, node: NodeRecord, ask: Ask) -> str | None:
        for constraint in ask.escaped_constraints if self.escaped else ask.class_constraints:
            if not satisfied(constraint, node):
                return reasons.reason(reasons.CONSTRAINT_NOT_MET, constraint.describe())
        return None


class ServiceChecker:
    stage = reasons.STAGE_SERVICES

    def check(self, node: NodeRecord, ask: Ask) -> str | None:
        for need in ask.services:
            if not any(s.name == need.name and s.status == "passing" and set(need.tags).issubset(s.tags)
                       for s in node.services):
                return reasons.reason(reasons.MISSING_SERVICE, need.name)
        return None


class DriverChecker:
    stage = reasons.STAGE_DRIVER

    def check(self, node: NodeRecord, ask: Ask) -> str | None:
        driver = ask.request.runtime_driver
        if driver is not None and driver not in node.runtime_drivers:
            return reasons.reason(reasons.MISSING_DRIVER, driver)
        return None


class VolumeChecker:
    stage = reasons.STAGE_VOLUMES

    def check(self, node: NodeRecord, ask: Ask) -> str | None:
        _, missing = check_volumes(ask.request.volumes, node.host_paths)
        if missing is not None:
            return reasons.reason(reasons.MISSING_HOST_PATH,
                                  f"volume {missing.name}: {missing.source} is not under an advertised host path")
        return None


def device_requests(node: NodeRecord, ask: Ask) -> tuple[DeviceRequest, ...]:
    """The ask's device requests on this node, plus one GPU when its execution profile implies it."""
    if implies_gpu(node, ask):
        return ask.request.devices + (IMPLIED_GPU,)
    return ask.request.devices


def implies_gpu(node: NodeRecord, ask: Ask) -> bool:
    profile = profile_of(node, ask.profile)
    return bool(profile is not None and profile.gpu and ask.request.gpu_count == 0)


class DeviceInventoryChecker:
    """Could the node's devices ever satisfy the requests (ignoring bookings and exact ids)?"""

    stage = reasons.STAGE_DEVICES

    def check(self, node: NodeRecord, ask: Ask) -> str | None:
        requests = device_requests(node, ask)
        if not requests:
            return None
        _, failing, found = pick_devices(requests, node.devices, check_ids=False)
        if failing is not None:
            why = f"{describe(failing)}: {found} of {failing.count} match"
            in_mig = [d.id for d in node.devices if d.mig_mode and failing.mig_profile is None and d.kind == failing.kind]
            if in_mig:  # the surprise worth naming: a GPU that is there but can only be booked by its slices
                why += f" ({', '.join(in_mig)} in MIG mode: ask for its slices by mig_profile)"
            return reasons.reason(reasons.MISSING_DEVICES, why)
        return None


# The order of docs/scheduling.md; capacity (stage 5) and ports (stage 7) sit between these and are checked by the view.
STATIC_CHAIN: tuple[Checker, ...] = (
    StatusChecker(),
    ProfileChecker(),
    ConstraintChecker(),
    ServiceChecker(),
    DriverChecker(),
    VolumeChecker(),
    DeviceInventoryChecker(),
)
ESCAPED_CONSTRAINTS = ConstraintChecker(escaped=True)


def first_static_failure(node: NodeRecord, ask: Ask) -> tuple[int, str] | None:
    """(stage, reason) of the first static check ``node`` fails for ``ask``, over class attributes only."""
    for checker in STATIC_CHAIN:
        why = checker.check(node, ask)
        if why is not None:
            return checker.stage, why
    return None
