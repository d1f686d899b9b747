"""TLS settings for a Prefect API reached over plain http.

Prefect's client builds a TLS context for every client it makes, whatever the API's scheme, loading the whole
certifi bundle each time (about 20 ms of CPU). A flow run's process makes a few dozen clients and a worker one per
poll, so on a plain-http API (the local lab, a fleet on a private network) that work is a tenth of what a short run
costs. On such an API nothing is verified, and the bundle can be a single certificate whose key was discarded
(``data/plain-http-ca.pem``): loading it costs a third of a millisecond, and it trusts nothing, so a Prefect client
pointed at an https URL by mistake fails verification instead of trusting it. A bundle, or TLS settings, that the
user set are never replaced. A container is not given the bundle: its path is the host's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

PLAIN_HTTP_CA = Path(__file__).parent / "data" / "plain-http-ca.pem"
API_CA_VAR = "PREFECT_API_SSL_CERT_FILE"
_TLS_SETTINGS = (API_CA_VAR, "PREFECT_API_TLS_INSECURE_SKIP_VERIFY")


def plain_http_env(api_url: str | None, env: Mapping[str, str]) -> dict[str, str]:
    """The environment to add for processes that talk to ``api_url``: the one-certificate bundle when the URL is
    plain http and ``env`` sets no TLS setting of Prefect's; else nothing."""
    if not api_url or not api_url.lower().startswith("http://") or any(env.get(name) for name in _TLS_SETTINGS):
        return {}
    if not PLAIN_HTTP_CA.is_file():  # an install without the package's data: Prefect's default, slower
        return {}
    return {API_CA_VAR: str(PLAIN_HTTP_CA)}
