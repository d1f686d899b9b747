"""Prefect Block holding the cluster store's location, so workers and flows load it by block name.

    MNClusterStore(url="postgresql://mn@db.lab:5432/mn", password="...").save("lab")
    store = MNClusterStore.load("lab").open()

The password lives in a SecretStr field (encrypted by Prefect, shown as stars in the UI), never in the URL.
"""

from __future__ import annotations

from importlib import metadata
from urllib.parse import quote

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator

from mn_prefect.store import ClusterStore, open_store, parse_store_url
from mn_prefect.store.urls import default_url


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
