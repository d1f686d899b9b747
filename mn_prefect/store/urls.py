"""Store URLs: which backend, where, and how to print them without their secrets."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from mn_prefect.settings import HOME_VAR, STORE_URL_VAR, home, store_url

__all__ = ["HOME_VAR", "STORE_URL_VAR", "StoreURL", "default_url", "home", "parse_store_url", "redact"]

_USERINFO = re.compile(r"(?P<scheme>[a-z0-9+.-]+://)(?P<user>[^:@/]*)(?::(?P<password>[^@/]*))?@", re.I)


def default_url() -> str:
    """MN_STORE_URL, else the profile's lab store, else the SQLite file under ``home()`` (see settings)."""
    url = store_url().value
    assert url is not None  # the store URL always resolves (its default is a SQLite file)
    return url


def redact(url: str) -> str:
    """The URL with any password replaced by ``***``: safe for logs and errors."""
    def hide(match: re.Match) -> str:
        user = match.group("user") or ""
        if match.group("password") is None:
            return match.group(0)
        return f"{match.group('scheme')}{user}:***@"

    redacted = _USERINFO.sub(hide, url)
    return re.sub(r"(?i)(password=)[^&]*", r"\1***", redacted)


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL. ``password`` is kept out of repr()."""

    backend: str  # sqlite | postgresql | redis | sentinel
    raw: str = field(repr=False)
    password: str | None = field(default=None, repr=False)
    username: str | None = None
    hosts: tuple[tuple[str, int], ...] = ()
    database: str | None = None
    path: str | None = None
    tls: bool = False
    master: str | None = None
    options: dict[str, str] = field(default_factory=dict)

    @property
    def safe(self) -> str:
        return redact(self.raw)


def parse_store_url(url: str) -> StoreURL:
    """sqlite:///path, postgresql://user:pass@host:port/db, redis[s]://[:pass@]host:port/db,
    redis+sentinel://[:pass@]host:port,host:port/master[/db]."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "sqlite":
        path = url.split("://", 1)[1]
        path = path[1:] if path.startswith("/") else path  # sqlite:///abs -> /abs after this strip keeps one "/"
        path = os.path.expanduser(path) if path.startswith("~") else path
        if path != ":memory:" and not path.startswith("/"):
            path = str(Path(path).resolve())
        return StoreURL(backend="sqlite", raw=url, path=path)
    if scheme in ("postgresql", "postgres", "postgresql+psycopg"):
        parts = urlsplit(url)
        return StoreURL(backend="postgresql", raw=url, username=unquote(parts.username or "") or None,
                        password=unquote(parts.password) if parts.password else None,
                        hosts=((parts.hostname or "localhost", parts.port or 5432),),
                        database=parts.path.lstrip("/") or None,
                        options={k: v[-1] for k, v in parse_qs(parts.query).items()})
    if scheme in ("redis", "rediss", "redis+sentinel", "rediss+sentinel"):
        rest = url.split("://", 1)[1]
        userinfo, _, rest = rest.rpartition("@")
        username = password = None
        if userinfo:
            username, _, password = userinfo.partition(":")
            username, password = unquote(username) or None, unquote(password) or None
        location, _, query = rest.partition("?")
        hostpart, _, path = location.partition("/")
        hosts = []
        for item in hostpart.split(","):
            host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
            hosts.append((host or "localhost", int(port) if port else (26379 if "sentinel" in scheme else 6379)))
        segments = [s for s in path.split("/") if s]
        options = {k: v[-1] for k, v in parse_qs(query).items()}
        if "sentinel" in scheme:
            if not segments:
                raise ValueError(f"{redact(url)}: a sentinel URL names the master: redis+sentinel://host:port,.../MASTER[/DB]")
            return StoreURL(backend="sentinel", raw=url, username=username, password=password, hosts=tuple(hosts),
                            master=segments[0], database=segments[1] if len(segments) > 1 else "0",
                            tls=scheme.startswith("rediss"), options=options)
        return StoreURL(backend="redis", raw=url, username=username, password=password, hosts=tuple(hosts),
                        database=segments[0] if segments else "0", tls=scheme == "rediss", options=options)
    raise ValueError(f"unsupported store URL {redact(url)!r}: use sqlite:///path, postgresql://..., redis://..., "
                     "rediss://... or redis+sentinel://...")
