"""Where a command's store and Prefect server come from: flag > environment > profile > default, said by
--verbose and by the errors. Real `mn-prefect` processes; the profile is written as `up` writes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cli_runner
import pytest
import servers

from mn_prefect import settings

MN_PREFECT = str(Path(sys.executable).parent / "mn-prefect")


def env_for(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MN_"))}
    env.update({"MN_PREFECT_HOME": str(home), "PREFECT_HOME": str(home / "prefect-client"), **extra})
    return env


def mn(home: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    """A command that talks to Prefect (``ops``) runs in a subprocess: Prefect reads its settings once a process."""
    return cli_runner.run(args, env=env_for(home, **extra), whole_env=True, process=args[0] == "ops")


@pytest.fixture
def lab_profile(tmp_path, monkeypatch):
    """A profile naming a running lab (this test process stands in for its `up`) with a server nobody answers."""
    monkeypatch.setenv(settings.HOME_VAR, str(tmp_path))
    port = servers.free_port()
    settings.record_lab(pid=os.getpid(), store_url=f"sqlite:///{tmp_path / 'lab' / 'state.db'}",
                        prefect_api_url=f"http://127.0.0.1:{port}/api", ui_url=f"http://127.0.0.1:{port}",
                        lab_home=tmp_path / "lab")
    return tmp_path, port


def test_store_resolution_is_flag_then_env_then_profile_then_default(lab_profile):
    home, _ = lab_profile
    flag, env_url = f"sqlite:///{home / 'flag.db'}", f"sqlite:///{home / 'env.db'}"

    by_flag = mn(home, "--verbose", "node", "list", "--store-url", flag, MN_STORE_URL=env_url)
    by_env = mn(home, "--verbose", "node", "list", MN_STORE_URL=env_url)
    by_profile = mn(home, "--verbose", "node", "list")
    (home / "config").unlink()
    by_default = mn(home, "--verbose", "node", "list")

    assert f"store: {flag} (from --store-url)" in by_flag.stderr
    assert f"store: {env_url} (from env MN_STORE_URL)" in by_env.stderr
    assert f"store: sqlite:///{home / 'lab' / 'state.db'} (from profile {home / 'config'} (lab pid {os.getpid()}))" \
        in by_profile.stderr
    assert f"store: sqlite:///{home / 'state.db'} (from default)" in by_default.stderr


def test_an_unreachable_server_from_the_profile_is_named_with_its_source(lab_profile):
    home, port = lab_profile

    result = mn(home, "ops", "deploy")

    assert result.returncode == 1
    assert (f"cannot reach the Prefect server http://127.0.0.1:{port}/api (from profile {home / 'config'} "
            f"(lab pid {os.getpid()}))") in result.stderr


def test_a_stopped_lab_keeps_its_store_but_not_its_server(lab_profile):
    home, _ = lab_profile
    settings.mark_lab_stopped()

    result = mn(home, "--verbose", "node", "list")

    assert "Prefect server: none" in result.stderr
    assert f"store: sqlite:///{home / 'lab' / 'state.db'} (from profile {home / 'config'} (lab stopped))" \
        in result.stderr


def test_a_command_that_needs_a_server_says_none_is_configured(tmp_path):
    result = mn(tmp_path, "ops", "deploy")

    assert result.returncode == 1
    assert "no Prefect server configured: set PREFECT_API_URL, or start a lab with `mn-prefect up`" in result.stderr


def test_a_store_error_says_where_the_store_url_came_from(tmp_path):
    url = f"redis://127.0.0.1:{servers.free_port()}/0?retry_seconds=0.5"  # no server: fail soon, not after 15 s

    result = mn(tmp_path, "job", "list", MN_STORE_URL=url)

    assert result.returncode == 1
    assert "(store URL from env MN_STORE_URL)" in result.stderr and url in result.stderr


def test_the_tests_have_a_home_of_their_own_and_no_prefect_profile_of_the_users():
    """tests/conftest.py: a user's active Prefect profile (``prefect profile use mn-lab`` pointing at a lab that
    has since stopped) or exported PREFECT_API_URL never reaches a test: HOME is a fresh folder of this test
    process, and the only Prefect and mn-prefect settings in the environment are the ones the suite sets."""
    home = Path(os.environ["HOME"])
    assert home.name.startswith("mn-prefect-test-home-") and Path.home() == home
    from prefect.settings import get_current_settings

    assert get_current_settings().api.url is None  # no server but the ones the tests start and name
