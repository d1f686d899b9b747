"""The short fault campaign of tests/test_faults.py on Redis behind Sentinel (with its store and failover faults)."""

from __future__ import annotations

import pytest
from test_faults import short_campaign

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab


def test_a_short_fault_campaign_on_redis_finds_no_invariant_violated():
    short_campaign("redis")
