"""Per-allocation health checks (docs/prefect.md, "Health checks"): the node's worker probes each of its running runs
that declares ``health`` on one of its booked ports, every ``interval_s``; ``failures_to_deallocate`` failures in a row
end the watch with a verdict, and the worker deallocates the run. A passing probe starts the count again. Until the
service has answered once, a failure counts only when the run has started (its flow is Running): before, nothing is
expected to listen yet (the flow's process is still starting).

Node services declared with a check (``ServiceInstance.check``) are probed the same way by their node's worker;
``service_status`` is their rule: a pass makes a service passing, ``failures_to_critical`` failures in a row make it
critical.

The rule (``Tally``) is a value with no I/O; ``probe`` is one check; ``watch`` ties them to a clock.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import httpx

from mn_prefect.model.health import HealthCheck as HealthVariable
from mn_prefect.model.node import ServiceInstance

HOST = "127.0.0.1"  # a run's ports are booked on its own node, where its worker runs


@dataclass
class Tally:
    """Consecutive failures of one allocation's check, and the last reason."""

    limit: int
    failures: int = 0
    last: str = ""
    answered: bool = False  # the check has passed once: the service is up, every failure counts

    def observe(self, failure: str | None) -> bool:
        """Count one probe (``failure`` None: it passed); whether the allocation is now to be deallocated."""
        if failure is None:
            self.failures, self.last, self.answered = 0, "", True
            return False
        self.failures += 1
        self.last = failure
        return self.failures >= self.limit

    def verdict(self, check: HealthVariable, port: int) -> str:
        """Why the allocation goes, for the run's state message and the events."""
        target = f"GET {check.http}" if check.http is not None else "TCP connect"
        return f"health check failed {self.failures} times ({target} on port {port}: {self.last})"


def service_status(status: str, tally: Tally, failure: str | None) -> str:
    """A checked service's status after one probe (``failure`` None: it passed): passing on a pass, critical once
    ``tally.limit`` probes in a row failed, else unchanged (one failure is no verdict)."""
    if tally.observe(failure):
        return "critical"
    return "passing" if failure is None else status


def unproven(services: list[ServiceInstance]) -> list[ServiceInstance]:
    """The services as a starting worker registers them: one declared with a check is critical until it passes
    (Consul's default), whatever the inventory says."""
    return [s.model_copy(update={"status": "critical"}) if s.check is not None else s for s in services]


async def probe_service(service: ServiceInstance, host: str = HOST) -> str | None:
    """One probe of a node service declared with a check: None when it passes, else why it failed."""
    if service.check is None or service.port is None:
        raise ValueError(f"service {service.name!r} has no check to probe")
    return await probe_port(service.port, service.check.http, service.timeout_s, host)


async def probe(check: HealthVariable, port: int, host: str = HOST) -> str | None:
    """One probe of ``host:port`` for a run's health check: see ``probe_port``."""
    return await probe_port(port, check.http, check.timeout_s, host)


async def probe_port(port: int, http: str | None, timeout_s: float, host: str = HOST) -> str | None:
    """One probe of ``host:port`` within ``timeout_s`` seconds, a GET of path ``http`` or (None) a TCP connect: None
    when it passes (an HTTP answer 2xx or 3xx, or a TCP connection accepted), else why it failed."""
    try:
        with anyio.fail_after(timeout_s):
            if http is None:
                stream = await anyio.connect_tcp(host, port)
                await stream.aclose()
                return None
            async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client:
                response = await client.get(f"http://{host}:{port}{http}")
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except (OSError, httpx.HTTPError) as error:
        return _said(error)
    if 200 <= response.status_code < 400:
        return None
    return f"HTTP {response.status_code}"


def _said(error: BaseException) -> str:
    """The innermost reason (anyio's "All connection attempts failed" wraps the refusal)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


async def watch(check: HealthVariable, port: int, on_failure: Callable[[Tally], Awaitable[None]] | None = None,
                started: Callable[[], Awaitable[bool]] | None = None) -> str:
    """Probe every ``interval_s`` until ``failures_to_deallocate`` counted failures in a row; returns the verdict.
    ``started`` says whether the run has started (asked only after a failure while the service never answered;
    None: it has); ``on_failure`` hears each counted failure. Runs until cancelled while the allocation is healthy."""
    tally = Tally(limit=check.failures_to_deallocate)
    while True:
        await anyio.sleep(check.interval_s)
        failure = await probe(check, port)
        if failure is not None and not tally.answered and started is not None and not await started():
            continue  # still starting: nothing listens yet
        done = tally.observe(failure)
        if failure is not None and on_failure is not None:
            await on_failure(tally)
        if done:
            return tally.verdict(check, port)
