"""Prefect Blocks of mn-prefect, so workers and flows load them by block name: the cluster store's location,
and the webhooks that notifications go to.

    MNClusterStore(url="postgresql://mn@db.lab:5432/mn", password="...").save("lab")
    store = MNClusterStore.load("lab").open()
    MNNotificationWebhook(url="https://ops.example.com/hooks/mn", secret="...").save("ops")  # MN_NOTIFY_BLOCKS=ops

Passwords and secrets live in SecretStr fields (encrypted by Prefect, shown as stars in the UI), never in a URL.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any
from urllib.parse import quote, urlsplit

import anyio
from prefect.blocks.abstract import NotificationBlock, NotificationError
from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator

from mn_prefect.store import ClusterStore, open_store, parse_store_url
from mn_prefect.store.urls import default_url
from mn_prefect.webhook import (
    DEFAULT_ATTEMPTS,
    DEFAULT_RETRY_DELAY_S,
    DEFAULT_TIMEOUT_S,
    KINDS,
    Kind,
    deliver,
    from_automation,
    safe_url,
)


def readme_url(section: str) -> str | None:
    """The URL of a section of the project's README, from the ``Documentation`` (else ``Homepage``) URL that the
    installed package's metadata declares (pyproject ``[project.urls]``); None while it declares none: the
    project has no public address, and a made-up one would be a dead link in the Prefect UI."""
    try:
        declared = metadata.metadata("mn-prefect").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return None
    urls = {label.strip().lower(): url.strip() for label, _, url in (entry.partition(",") for entry in declared)}
    base = urls.get("documentation") or urls.get("homepage")
    return f"{base.split('#', 1)[0]}#{section}" if base else None


class MNClusterStore(Block):
    """Where mn-prefect keeps its cluster state: nodes, bookings, jobs, events and leases."""

    _block_type_name = "mn Cluster Store"
    _block_type_slug = "mn-cluster-store"
    _description = "Location of the mn-prefect cluster state store (SQLite, PostgreSQL, Redis or Redis Sentinel)."
    # Prefect types this as pydantic's HttpUrl; it validates the str into one when it registers the block type.
    _documentation_url = readme_url("cluster-state-store")  # type: ignore[assignment]

    url: str = Field(
        default_factory=default_url,
        description="sqlite:///path, postgresql://user@host:5432/db, redis://host:6379/0, rediss://..., or "
                    "redis+sentinel://host:26379,host2:26379/MASTER/0. Put the password in the password field.",
        examples=["postgresql://mn@db.lab:5432/mn", "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mn/0"],
    )
    password: SecretStr | None = Field(None, description="Password for PostgreSQL or Redis.")

    @field_validator("url")
    @classmethod
    def _no_password_in_url(cls, value: str) -> str:
        parsed = parse_store_url(value)  # raises on an unsupported scheme, naming it
        if parsed.password:
            raise ValueError("the URL contains a password: put it in the password field instead")
        return value

    def store_url(self) -> str:
        """The URL with the password put back in (for opening the store; never log it)."""
        if self.password is None:
            return self.url
        secret = quote(self.password.get_secret_value(), safe="")
        scheme, rest = self.url.split("://", 1)
        userinfo, at, hostpart = rest.rpartition("@")
        user = userinfo if at else ""
        return f"{scheme}://{user}:{secret}@{hostpart}"

    def open(self) -> ClusterStore:
        return open_store(self.store_url())


class MNNotificationWebhook(NotificationBlock):
    """A receiver of mn-prefect's signed notifications (ONLINE, OFFLINE, DEALLOCATION): see mn_prefect.notify.

    It is also a Prefect notification block, so an Automation's "send a notification" action can post through
    it: the action's body (an mn notification as JSON, or any text) goes out signed like the workers' own."""

    _block_type_name = "mn Notification Webhook"
    _block_type_slug = "mn-notification-webhook"
    _description = ("An http(s) address that mn-prefect posts signed JSON notifications to: node or run ONLINE, "
                    "OFFLINE, DEALLOCATION. Name it in MN_NOTIFY_BLOCKS.")
    _documentation_url = readme_url("notifications")  # type: ignore[assignment]

    url: str = Field(description="The http:// or https:// address that receives each notification as a JSON POST.",
                     examples=["https://ops.example.com/hooks/mn"])
    secret: SecretStr = Field(description="Key of the HMAC-SHA256 signature sent in X-MN-Signature; the receiver "
                                          "holds the same one.")
    events: list[Kind] = Field(default_factory=lambda: list(KINDS),
                               description="Which notifications to send: ONLINE (node healthy, run started), "
                                           "OFFLINE (node offline, run crashed), DEALLOCATION (health check or "
                                           "reservation expiry).", examples=[["OFFLINE", "DEALLOCATION"]])
    attempts: int = Field(DEFAULT_ATTEMPTS, ge=1, le=10, description="Tries per notification, the first included.")
    retry_delay_s: float = Field(DEFAULT_RETRY_DELAY_S, ge=0, le=3600, description="Seconds between two tries.")
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=300,
                             description="Seconds one try waits for the receiver (to connect, and between bytes).")

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        value = value.strip()
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http:// or https:// URL with a host, got {safe_url(value)!r}")
        return value

    @field_validator("secret")
    @classmethod
    def _some_secret(cls, value: SecretStr) -> SecretStr:
        if not value.get_secret_value().strip():
            raise ValueError("is empty: receivers check the signature made with it")
        return value

    @field_validator("events", mode="before")
    @classmethod
    def _kinds(cls, value: Any) -> Any:
        """Names in any case, as a list or one comma-separated string; each once."""
        if isinstance(value, str):
            value = value.split(",")
        if not isinstance(value, list | tuple):
            return value
        named = [v.strip().upper() if isinstance(v, str) else v for v in value]
        unknown = [v for v in named if v not in KINDS]
        if unknown:
            raise ValueError(f"unknown {unknown[0]!r}: name some of {', '.join(KINDS)}")
        if not named:
            raise ValueError(f"is empty: name some of {', '.join(KINDS)} (or leave the block out of MN_NOTIFY_BLOCKS)")
        return list(dict.fromkeys(named))

    async def notify(self, body: str, subject: str | None = None) -> None:
        """Post the Automation's message as a signed notification (see ``notify.from_automation``), with this
        block's retries. Prefect's server calls it in its actions service: it waits for the retries, which
        holds up only this action."""
        notification = from_automation(body, subject)
        result = await anyio.to_thread.run_sync(deliver, self, notification)
        if not result.delivered and self._raise_on_failure:
            raise NotificationError(f"{notification.kind} notification to {safe_url(self.url)} not delivered "
                                    f"after {result.attempts} attempt(s): {result.outcome}")
