"""The one-certificate TLS bundle for a plain-http Prefect API (mn_prefect/api_tls.py): who gets it, who never
does, and that it trusts nothing."""

from __future__ import annotations

import ssl
import uuid

import pytest
from test_containers import _placement, _spec

from mn_prefect.api_tls import API_CA_VAR, PLAIN_HTTP_CA, plain_http_env
from mn_prefect.model.placement import Allocation, PlacedResources, Placement
from mn_prefect.worker.launching import run_environment
from mn_prefect.worker.variables import MNJobConfiguration

HTTP = "http://127.0.0.1:4200/api"


@pytest.mark.parametrize(("api_url", "env", "expected"), [
    (HTTP, {}, {API_CA_VAR: str(PLAIN_HTTP_CA)}),
    ("HTTP://box:4200/api", {}, {API_CA_VAR: str(PLAIN_HTTP_CA)}),
    ("https://api.example/api", {}, {}),  # verified as Prefect verifies it
    (None, {}, {}),
    ("", {}, {}),
    (HTTP, {API_CA_VAR: "/etc/ssl/mine.pem"}, {}),  # the user's bundle stands
    (HTTP, {"PREFECT_API_TLS_INSECURE_SKIP_VERIFY": "true"}, {}),
    (HTTP, {API_CA_VAR: ""}, {API_CA_VAR: str(PLAIN_HTTP_CA)}),  # set empty: not set
])
def test_only_a_plain_http_api_with_no_tls_setting_gets_the_bundle(api_url, env, expected):
    assert plain_http_env(api_url, env) == expected


def test_the_bundle_is_one_certificate_that_verifies_no_server():
    context = ssl.create_default_context(cafile=str(PLAIN_HTTP_CA))
    [certificate] = context.get_ca_certs()
    assert ("organizationName", "mn-prefect") in [pair for rdn in certificate["subject"] for pair in rdn]
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname  # verifies, against nothing usable


def _configuration(user_env: dict) -> MNJobConfiguration:
    configuration = MNJobConfiguration(env={"PATH": "/usr/bin"})
    configuration._user_env = dict(user_env)
    return configuration


PLACEMENT = Placement(agent_id="a", node="n1", resources=PlacedResources(cpu_cores=1), allocation=Allocation())


@pytest.mark.parametrize(("user_env", "expected"), [
    ({}, str(PLAIN_HTTP_CA)),
    ({"PREFECT_API_URL": "https://api.example/api"}, None),  # the run's API is not plain http
    ({API_CA_VAR: "/etc/ssl/mine.pem"}, "/etc/ssl/mine.pem"),  # the user's variable wins
    ({"PREFECT_API_TLS_INSECURE_SKIP_VERIFY": "1"}, None),
])
def test_a_host_run_gets_the_bundle_unless_its_api_or_its_user_says_otherwise(monkeypatch, user_env, expected):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv(API_CA_VAR, raising=False)
    with temporary_settings({PREFECT_API_URL: HTTP}):
        env = run_environment(_configuration(user_env), PLACEMENT, {"MN_STORE_URL": "sqlite:///s.db"})
    assert env.get(API_CA_VAR) == expected
    assert env["MN_STORE_URL"] is None and env["PATH"] == "/usr/bin"  # a user run: the worker's store stays with it
    assert env["MN_ALLOCATION_JSON"]  # the placement's hints are there too


def test_a_container_never_gets_the_hosts_bundle_path_but_keeps_a_users_own():
    ours = _spec(_placement(), run_env={"MY": "1", API_CA_VAR: str(PLAIN_HTTP_CA)})
    assert API_CA_VAR not in ours.environment and ours.environment["MY"] == "1"
    mine = f"/certs/{uuid.uuid4().hex}.pem"
    assert _spec(_placement(), run_env={API_CA_VAR: mine}).environment[API_CA_VAR] == mine
