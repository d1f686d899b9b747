"""The Prefect profile `up` writes, and the way back: on a fresh machine `prefect profile use default` works after
`up` (it creates `default` when the user has none), the user's own active profile is kept and named as the one to
switch back to, and stopping the lab makes the profile active before `up` active again when the lab's is active.
Fast: Prefect's profiles file and mn-prefect's home in the test's folder, no server."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import servers
from prefect.settings import PREFECT_PROFILES_PATH, temporary_settings

from mn_prefect import settings
from mn_prefect.cli import up

API = "http://127.0.0.1:4999/api"
PREFECT = str(Path(sys.executable).parent / "prefect")


@pytest.fixture
def homes(tmp_path, monkeypatch):
    """Prefect's profiles file and mn-prefect's home, both fresh; the lab's section as `up` writes it first."""
    monkeypatch.setenv(settings.HOME_VAR, str(tmp_path / "mn"))
    profiles = tmp_path / "prefect" / "profiles.toml"
    settings.record_lab(pid=4242, store_url="sqlite:///x.db", prefect_api_url=API, ui_url=API[:-4],
                        lab_home=tmp_path / "mn" / "lab")
    with temporary_settings({PREFECT_PROFILES_PATH: profiles}):
        yield profiles


def read(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def prefect_cli(profiles: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(profiles.parent), "PREFECT_PROFILES_PATH": str(profiles),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return subprocess.run([PREFECT, *args], env=env, capture_output=True, text=True, timeout=120)


def test_on_a_fresh_machine_up_leaves_a_default_profile_to_switch_back_to(homes):
    path, before = up.record_prefect_profile(API)

    assert path == homes and before == "default"
    written = read(homes)
    assert written["profiles"]["mn-lab"] == {"PREFECT_API_URL": API}
    assert written["profiles"]["default"] == {"PREFECT_SERVER_EPHEMERAL_ENABLED": "true"}  # Prefect's fresh one
    assert "active" not in written  # the active profile is left as it was: Prefect's own default
    assert settings.read_profile()["lab"][up.BEFORE_FIELD] == "default"
    # The README's advice works as written (it failed with "Profile 'default' not found").
    used = prefect_cli(homes, "profile", "use", "default")
    assert used.returncode == 0, used.stdout + used.stderr
    assert read(homes)["active"] == "default"


def test_the_users_own_active_profile_is_kept_and_named_as_the_way_back(homes):
    homes.parent.mkdir(parents=True)
    homes.write_text('active = "mine"\n\n[profiles.mine]\nPREFECT_API_URL = "http://10.0.0.1:4200/api"\n\n'
                     '[profiles.default]\nPREFECT_API_URL = "http://10.0.0.2:4200/api"\n')

    path, before = up.record_prefect_profile(API)

    written = read(homes)
    assert before == "mine" and written["active"] == "mine"
    assert written["profiles"]["default"] == {"PREFECT_API_URL": "http://10.0.0.2:4200/api"}  # the user's, kept
    assert written["profiles"]["mine"] == {"PREFECT_API_URL": "http://10.0.0.1:4200/api"}


def test_stopping_the_lab_switches_back_when_the_labs_profile_is_active(homes):
    up.record_prefect_profile(API)
    assert prefect_cli(homes, "profile", "use", "mn-lab").returncode in (0, 1)  # 1: no server answers there
    assert read(homes)["active"] == "mn-lab"

    assert up.restore_prefect_profile() == "default"

    assert read(homes)["active"] == "default"
    assert settings.read_profile()["lab"][up.RESTORED_FIELD] == "default"
    assert up.restore_prefect_profile() is None  # once: the lab's profile is no longer active


def test_the_switch_back_goes_to_the_profile_active_before_up(homes):
    homes.parent.mkdir(parents=True)
    homes.write_text('active = "mine"\n\n[profiles.mine]\nPREFECT_API_URL = "http://10.0.0.1:4200/api"\n')
    up.record_prefect_profile(API)
    text = read(homes)
    assert "default" in text["profiles"]  # created: the user had none
    homes.write_text(homes.read_text().replace('active = "mine"', 'active = "mn-lab"'))

    assert up.restore_prefect_profile() == "mine"
    assert read(homes)["active"] == "mine"


def test_a_profile_the_user_did_not_switch_to_the_lab_is_left_alone(homes):
    homes.parent.mkdir(parents=True)
    homes.write_text('active = "mine"\n\n[profiles.mine]\nPREFECT_API_URL = "http://10.0.0.1:4200/api"\n')
    up.record_prefect_profile(API)

    assert up.restore_prefect_profile() is None
    assert read(homes)["active"] == "mine"


def test_a_lab_profile_active_before_up_switches_back_to_default(homes):
    """`up` again while the lab's profile is still active (an older lab never switched back): the way back is
    `default`, never the lab's own profile."""
    homes.parent.mkdir(parents=True)
    homes.write_text('active = "mn-lab"\n\n[profiles.mn-lab]\nPREFECT_API_URL = "http://127.0.0.1:1/api"\n')

    _, before = up.record_prefect_profile(API)

    assert before == "default" and "default" in read(homes)["profiles"]
    assert up.restore_prefect_profile() == "default"
    assert read(homes)["active"] == "default"


@pytest.mark.lab
def test_up_on_a_machine_whose_active_profile_is_a_stopped_labs_switches_back_to_default_as_it_stops(tmp_path):
    """An older lab's profile left active (the README's `prefect profile use mn-lab`, never switched back): `up`
    names `default` as the way back, creates it, and makes it active again as the lab stops."""
    from test_up import MN_PREFECT, ROOT, lab_env

    servers.lab_only("`mn-prefect up`")
    profiles = tmp_path / "prefect-client" / "profiles.toml"
    profiles.parent.mkdir()
    profiles.write_text('active = "mn-lab"\n\n[profiles.mn-lab]\nPREFECT_API_URL = "http://127.0.0.1:1/api"\n')

    result = subprocess.run([MN_PREFECT, "up", "--exit-when-done", "--port", "0", "--runs", "0"], cwd=ROOT,
                            env=lab_env(tmp_path), capture_output=True, text=True, timeout=580)

    out = " ".join(result.stdout.split())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "(switch back: prefect profile use default;" in out, out[-3000:]
    assert "the active Prefect profile was mn-lab (the stopped lab's server): switched back to default" in out
    written = read(profiles)
    assert written["active"] == "default" and "default" in written["profiles"]
    assert written["profiles"]["mn-lab"]["PREFECT_API_URL"] != "http://127.0.0.1:1/api"  # the lab's, rewritten
