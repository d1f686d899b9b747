"""Where mn-prefect finds its store and its Prefect server, and where each answer came from.

One resolution order for every command: an explicit flag, then the environment (``MN_STORE_URL``,
``PREFECT_API_URL``), then the profile ``~/.mn-prefect/config`` that ``mn-prefect up`` writes, then the
embedded default (a SQLite store under ``~/.mn-prefect``; no Prefect server). ``MN_PREFECT_HOME`` moves
``~/.mn-prefect``.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOME_VAR = "MN_PREFECT_HOME"
STORE_URL_VAR = "MN_STORE_URL"
API_URL_VAR = "PREFECT_API_URL"
NOTIFY_BLOCKS_VAR = "MN_NOTIFY_BLOCKS"
WAKEUPS_VAR = "MN_WAKEUPS"
LAB = "lab"


def home() -> Path:
    """mn-prefect's own folder (default ``~/.mn-prefect``)."""
    return Path(os.environ.get(HOME_VAR) or Path.home() / ".mn-prefect")


def profile_path() -> Path:
    return home() / "config"


class ProfileError(ValueError):
    """The profile file exists but cannot be read; the message names the file."""


@dataclass(frozen=True)
class Setting:
    """One resolved setting: its value (None when nothing names one) and where it came from."""

    value: str | None
    source: str  # "--store-url", "env MN_STORE_URL", "profile /root/.mn-prefect/config (lab pid 12)", "default"


def read_profile() -> dict[str, Any]:
    """The profile as a dict ({} when there is none)."""
    path = profile_path()
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ProfileError(f"{path}: {error}") from None


def _toml(data: dict[str, Any]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(str(v))  # a JSON string is a valid TOML basic string

    head = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    tables = [f"\n[{k}]\n" + "".join(f"{kk} = {value(vv)}\n" for kk, vv in v.items())
              for k, v in data.items() if isinstance(v, dict)]
    return ("# mn-prefect profile: `mn-prefect up` writes [lab], `mn-prefect down` marks it stopped.\n"
            "# Flags and the environment (MN_STORE_URL, PREFECT_API_URL) override what is here.\n"
            + "".join(line + "\n" for line in head) + "".join(tables))


def _write_profile(data: dict[str, Any]) -> None:
    path = profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(_toml(data))
    os.replace(partial, path)  # readers never see half a file


def record_lab(*, pid: int, store_url: str, prefect_api_url: str, ui_url: str, lab_home: Path) -> None:
    """Write the running lab into the profile (other sections are kept)."""
    data = read_profile()
    data[LAB] = {"status": "running", "pid": pid, "store_url": store_url, "prefect_api_url": prefect_api_url,
                 "ui_url": ui_url, "home": str(lab_home)}
    _write_profile(data)


def record_lab_fields(**fields: str) -> None:
    """Add ``fields`` to the profile's lab (its other fields are kept)."""
    data = read_profile()
    data[LAB] = {**data.get(LAB, {}), **fields}
    _write_profile(data)


def record_mn_api(target: str) -> None:
    """The running lab's MirrorNeuron API address (``MN_GRPC_TARGET`` for the ``mn`` command and mn_sdk)."""
    record_lab_fields(mn_grpc_target=target)


def mark_lab_stopped(pid: int | None = None) -> bool:
    """Mark the profile's lab stopped (only the lab of ``pid`` when given): later commands keep reading its
    store file but no longer talk to its server. True when something changed."""
    try:
        data = read_profile()
    except ProfileError:
        return False
    lab = data.get(LAB)
    if not isinstance(lab, dict) or lab.get("status") != "running" or (pid is not None and lab.get("pid") != pid):
        return False
    data[LAB] = {**lab, "status": "stopped"}
    _write_profile(data)
    return True


def process_alive(pid: Any) -> bool:
    """Is ``pid`` a live process (an exited one that its parent has not reaped yet is not)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (not Linux): kill(0) said it exists
        return True


def running_lab(profile: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The profile's lab when it says running and its ``mn-prefect up`` process is alive."""
    lab = (read_profile() if profile is None else profile).get(LAB)
    if isinstance(lab, dict) and lab.get("status") == "running" and process_alive(lab.get("pid")):
        return lab
    return None


def store_url(flag: str | None = None, flag_name: str = "--store-url") -> Setting:
    """The store URL: ``flag``, else MN_STORE_URL, else the profile's lab (running or stopped: the store
    outlives its lab), else a SQLite file under ``home()``."""
    if flag:
        return Setting(flag, flag_name)
    if os.environ.get(STORE_URL_VAR):
        return Setting(os.environ[STORE_URL_VAR], f"env {STORE_URL_VAR}")
    lab = read_profile().get(LAB)
    if isinstance(lab, dict) and lab.get("store_url"):
        state = f"lab pid {lab.get('pid')}" if running_lab({LAB: lab}) else "lab stopped"
        return Setting(str(lab["store_url"]), f"profile {profile_path()} ({state})")
    return Setting(f"sqlite:///{home() / 'state.db'}", "default")


def prefect_api_url() -> Setting:
    """The Prefect API URL: PREFECT_API_URL, else the profile's running lab; value None when neither (then
    only Prefect's own profile, if any, names a server)."""
    if os.environ.get(API_URL_VAR):
        return Setting(os.environ[API_URL_VAR], f"env {API_URL_VAR}")
    lab = running_lab()
    if lab is not None and lab.get("prefect_api_url"):
        return Setting(str(lab["prefect_api_url"]), f"profile {profile_path()} (lab pid {lab['pid']})")
    return Setting(None, "none")


def notify_blocks() -> Setting:
    """The names of the ``MNNotificationWebhook`` blocks that notifications go to, comma-separated:
    MN_NOTIFY_BLOCKS, else the profile's top-level ``notify_blocks``; value None when neither names any (then
    nothing is sent)."""
    if os.environ.get(NOTIFY_BLOCKS_VAR, "").strip():
        return Setting(os.environ[NOTIFY_BLOCKS_VAR], f"env {NOTIFY_BLOCKS_VAR}")
    named = read_profile().get("notify_blocks")
    if isinstance(named, str) and named.strip():
        return Setting(named, f"profile {profile_path()}")
    return Setting(None, "none")


def wakeups_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether an mn worker polls at once when the store says capacity freed or a run was placed on its node
    (MN_WAKEUPS: on, the default, or off: polls on PREFECT_WORKER_QUERY_SECONDS only). ValueError, naming the
    variable, for any other value."""
    value = (os.environ if env is None else env).get(WAKEUPS_VAR, "on").strip().lower()
    if value in ("on", "1", "true", "yes", ""):
        return True
    if value in ("off", "0", "false", "no"):
        return False
    raise ValueError(f"{WAKEUPS_VAR}={value!r}: expected on or off")
