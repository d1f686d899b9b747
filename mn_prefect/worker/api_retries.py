"""Retries for the ``mn`` worker's own Prefect API calls.

Prefect's HTTP client already retries some failures itself (``prefect.client.base``: 408, 429, 502, 503 and
``PREFECT_CLIENT_RETRY_EXTRA_CODES``; read/write/connect timeouts and connection resets), up to
``PREFECT_CLIENT_MAX_RETRIES`` times. It does not retry 504, and once its retries are spent (a Prefect server
on SQLite can answer 503 for longer than that under load) the error reaches the caller. In the base worker
such an error during the submission (reading the deployment and flow, labelling the run) marks a user's run
Crashed. Here every such call is tried again with a bounded exponential backoff; only errors that say
"try again later" are retried, never a 404 or a 422.

Which calls: reads (``read_*``), the run's state proposals (``set_flow_run_state``) and its updates
(``update_flow_run``, ``update_flow_run_labels``). A create sent again could make two, so the one thing the
worker creates, a run's artifact, is sent with Prefect's own retries off and, after a transient error, sent
again only when a read shows the server did not write it (``create_artifact``).
"""

from __future__ import annotations

import inspect
import logging
import os
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from uuid import UUID

import anyio
import httpx

T = TypeVar("T")

TRANSIENT_STATUS = frozenset({408, 429, 502, 503, 504})
ATTEMPTS_VAR = "MN_API_ATTEMPTS"
DEFAULT_ATTEMPTS = 6
BASE_DELAY_S = 0.5
MAX_DELAY_S = 8.0
# Client methods whose call may be sent again: reads, and updates that set the same value twice.
UPDATES = frozenset({"set_flow_run_state", "update_flow_run", "update_flow_run_labels"})


def attempts() -> int:
    """How many times a call is tried in all (``MN_API_ATTEMPTS``; 1 turns the retries off)."""
    try:
        return max(1, int(os.environ.get(ATTEMPTS_VAR, DEFAULT_ATTEMPTS)))
    except ValueError:
        return DEFAULT_ATTEMPTS


def is_transient(error: BaseException) -> bool:
    """An error that a later try may not meet: 408/429/502/503/504, a timeout, a reset or refused connection."""
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code in TRANSIENT_STATUS
    return isinstance(error, (httpx.TransportError, ConnectionError, TimeoutError))


def delay(attempt: int) -> float:
    """The wait after failed attempt ``attempt`` (1-based): 0.5, 1, 2, 4, 8, 8... s, each within +-20 %."""
    return min(MAX_DELAY_S, BASE_DELAY_S * 2 ** (attempt - 1)) * random.uniform(0.8, 1.2)


async def call_with_retries(call: Callable[[], Awaitable[T]], *, what: str,
                            logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None,
                            tries: int | None = None,
                            on_error: Callable[[BaseException], None] | None = None) -> T:
    """``await call()``, again after a transient error, up to ``tries`` times in all; the last error is raised."""
    tries = tries or attempts()
    for attempt in range(1, tries + 1):
        try:
            return await call()
        except Exception as error:
            if not is_transient(error) or attempt == tries:
                raise
            if on_error is not None:
                on_error(error)
            wait = delay(attempt)
            (logger or logging.getLogger(__name__)).warning(
                "Prefect API call %s failed (%s: %s); attempt %d of %d, trying again in %.1f s", what,
                type(error).__name__, error, attempt, tries, wait)
            await anyio.sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover


class RetryingClient:
    """The worker's ``PrefectClient`` with retried reads, state proposals and updates; all else as is."""

    def __init__(self, inner: Any, logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None):
        self.inner = inner
        self._logger = logger

    def __getattr__(self, name: str) -> Any:
        if name == "set_flow_run_state":
            return self._set_flow_run_state
        if name == "create_artifact":
            return self._create_artifact
        attribute = getattr(self.inner, name)
        if not inspect.iscoroutinefunction(attribute) or not (name.startswith("read_") or name in UPDATES):
            return attribute

        async def retried(*args: Any, **kwargs: Any) -> Any:
            return await call_with_retries(lambda: attribute(*args, **kwargs), what=name, logger=self._logger)

        return retried

    async def _set_flow_run_state(self, flow_run_id: UUID | str, state: Any, force: bool = False) -> Any:
        """A proposal sent again after an error the server may have answered without us hearing: each try
        carries a new ``transition_id`` (Prefect's client makes one per call), so a try that the server did
        apply makes the next one rejected or aborted (Pending -> Pending is refused). When the run's
        state is one of our own earlier tries, that try was accepted: say so."""
        from prefect.client.schemas.responses import OrchestrationResult, SetStateStatus, StateAcceptDetails

        sent: list[UUID] = []

        def remember(_error: BaseException) -> None:
            details = getattr(state, "state_details", None)
            if details is not None and details.transition_id is not None:
                sent.append(details.transition_id)

        result = await call_with_retries(
            lambda: self.inner.set_flow_run_state(flow_run_id, state, force=force), what="set_flow_run_state",
            logger=self._logger, on_error=remember)
        if sent and result.status in (SetStateStatus.ABORT, SetStateStatus.REJECT):
            run = await call_with_retries(lambda: self.inner.read_flow_run(flow_run_id), what="read_flow_run",
                                          logger=self._logger)
            current = run.state
            if current is not None and current.state_details.transition_id in sent:
                return OrchestrationResult(state=current, status=SetStateStatus.ACCEPT, details=StateAcceptDetails())
        return result

    async def _create_artifact(self, artifact: Any) -> None:
        """One artifact, at most once. Prefect's client would resend the POST after a read timeout, and a
        server that wrote the artifact but answered late then holds two; here each try goes out with those
        retries off, and after a transient error the run's artifacts of that key are read before trying again."""
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
        from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

        artifact_filter = ArtifactFilter(key=ArtifactFilterKey(any_=[artifact.key]),
                                         flow_run_id=ArtifactFilterFlowRunId(any_=[artifact.flow_run_id]))
        tries = attempts()
        with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}):
            for attempt in range(1, tries + 1):
                try:
                    await self.inner.create_artifact(artifact)
                    return
                except Exception as error:
                    if not is_transient(error) or attempt == tries:
                        raise
                    (self._logger or logging.getLogger(__name__)).warning(
                        "Prefect API call create_artifact failed (%s: %s); attempt %d of %d",
                        type(error).__name__, error, attempt, tries)
                await anyio.sleep(delay(attempt))
                found = await call_with_retries(lambda: self.inner.read_artifacts(artifact_filter=artifact_filter),
                                                what="read_artifacts", logger=self._logger)
                if found:
                    return
