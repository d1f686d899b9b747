"""A per-allocation health check (docs/prefect.md, "Health checks"), as a deployment's ``job_variables.health`` or a
blueprint agent's ``health`` declares it. The node's worker runs it (``mn_prefect.lifecycle.health``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from mn_prefect.model.issues import Issues, child
from mn_prefect.model.node import issues_from_validation_error
from mn_prefect.model.scalars import type_name


class HealthCheck(BaseModel):
    """A check the node's worker runs against the run while it runs: an HTTP GET of a path, or a TCP connect, on
    one of the run's booked ports."""

    model_config = ConfigDict(extra="forbid", title="Health check")

    http: str | None = Field(None, pattern=r"^/", title="HTTP path",
                             description="GET this path on the port; a 2xx or 3xx answer passes.", examples=["/healthz"])
    tcp: bool = Field(False, title="TCP", description="Instead of HTTP: passes when the port accepts a connection.")
    port_label: str = Field(min_length=1, title="Port label",
                            description="Which of the run's ports (resources.ports) to probe.", examples=["api"])
    interval_s: float = Field(180, gt=0, title="Interval (seconds)", description="Time between probes.")
    timeout_s: float = Field(10, gt=0, title="Timeout (seconds)", description="A probe slower than this fails.")
    failures_to_deallocate: int = Field(
        20, ge=1, title="Failures before deallocation",
        description="After this many failed probes in a row the run is cancelled and its booking released; a "
                    "passing probe starts the count again.")

    @model_validator(mode="after")
    def _one_kind(self) -> HealthCheck:
        if (self.http is None) == (not self.tcp):
            raise PydanticCustomError("health", "set exactly one of http (a path) or tcp: true")
        return self


def parse_health(raw: Any, path: str, port_labels: Sequence[str], issues: Issues) -> HealthCheck | None:
    """A blueprint agent's ``health`` (None when absent or invalid: each problem is an issue naming its field).
    The check probes one of the agent's own ports: ``port_label`` must be one of ``port_labels``."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        issues.add(path, f"must be an object (http or tcp, port_label, interval_s, ...), got {type_name(raw)}")
        return None
    try:
        check = HealthCheck.model_validate(raw)
    except ValidationError as error:
        issues_from_validation_error(error, path, issues)
        return None
    if check.port_label not in port_labels:
        booked = ", ".join(repr(label) for label in port_labels) or "none"
        issues.add(child(path, "port_label"), f"{check.port_label!r} is not one of the agent's resources.ports "
                                              f"labels ({booked})")
        return None
    return check
