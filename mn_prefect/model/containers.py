"""What a container run must say before anything is booked (docs/drivers.md): an image, written as an image
reference, and a memory figure Docker can enforce. Pure: used by the pool's job configuration and by blueprints."""

from __future__ import annotations

import re

from mn_prefect.model.issues import Issues, child
from mn_prefect.model.resources import ResourceRequest

DOCKER = "docker"
# Docker refuses a memory limit below 6 MB (its own minimum), so a smaller request could never start.
DOCKER_MIN_MEMORY_MB = 6.0
# An image reference: [registry[:port]/]path[:tag][@sha256:digest], lower-case path components. No spaces or
# shell characters can pass, so the reference cannot be read as anything but an image name.
IMAGE_REFERENCE = (r"^(?:[a-zA-Z0-9](?:[a-zA-Z0-9.-]*[a-zA-Z0-9])?(?::[0-9]+)?/)?"
                   r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
                   r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")
_IMAGE = re.compile(IMAGE_REFERENCE)


def image_problem(image: str) -> str | None:
    """Why ``image`` is not an image reference, or None."""
    if _IMAGE.match(image):
        return None
    return (f"{image!r} is not an image reference (name[:tag][@sha256:digest], lower-case, no spaces or shell "
            "characters)")


def container_issues(request: ResourceRequest, image: str | None, *, resources_path: str, image_path: str,
                     issues: Issues) -> None:
    """Add what stops ``request`` from running in a container: under ``runtime_driver: docker``, a missing or
    malformed image and memory below Docker's minimum; under any driver, a malformed image."""
    if image is not None and (problem := image_problem(image)):
        issues.add(image_path, problem)
    if request.runtime_driver != DOCKER:
        return
    if image is None:
        issues.add(image_path, "is required with runtime_driver docker (the container image to run in)")
    if 0 < request.memory_mb < DOCKER_MIN_MEMORY_MB:
        issues.add(child(resources_path, "memory_mb"),
                   f"must be at least {DOCKER_MIN_MEMORY_MB:g} MB under runtime_driver docker (Docker's minimum), "
                   f"got {request.memory_mb:g}")
