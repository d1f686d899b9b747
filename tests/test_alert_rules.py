"""The alert rules of deployments/prometheus/ fired by Prometheus' own rule evaluator: ``promtool test rules`` on
mn-prefect-rules.test.yml (a booked GPU idle, a shared GPU over its memory, a hold past its expected start, a queue
waiting past its bound, a node lost: each fires after its ``for:``, not before nor below its bound). Debian's
``prometheus`` package ships promtool (.ci/run installs it). The lab test (tests/test_prometheus_lab.py) fires
MNNodeLost and MNWorkerDown against a running lab."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[1] / "deployments" / "prometheus"


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    assert tool is not None, "promtool is needed (Debian's prometheus package; .ci/run installs it)"
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_the_rules_check_and_every_alert_fires_as_its_test_says():
    checked = promtool("check", "rules", "mn-prefect-rules.yml", cwd=RULES)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "mn-prefect-rules.test.yml", cwd=RULES)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


@pytest.mark.parametrize(("alert", "change"), [
    ("MNBookedGPUIdle", (r"max by \(node, UUID\) \(mn_device_booked_idle\) == 1", "max by (node, UUID) (mn_device_booked_idle) == 2")),
    ("MNHoldPastExpectedStart", (r"\(mn_hold_overdue_seconds\) > 900", "(mn_hold_overdue_seconds) > 9000")),
])
def test_a_rule_that_no_longer_fires_fails_its_test(tmp_path, alert, change):
    """The unit tests catch a rule that stops firing (here, its bound moved out of reach)."""
    shutil.copy(RULES / "mn-prefect-rules.test.yml", tmp_path)
    text = (RULES / "mn-prefect-rules.yml").read_text()
    broken = re.sub(change[0], change[1], text)
    assert broken != text
    (tmp_path / "mn-prefect-rules.yml").write_text(broken)
    tested = promtool("test", "rules", "mn-prefect-rules.test.yml", cwd=tmp_path)
    said = tested.stdout + tested.stderr
    assert tested.returncode != 0 and f"alertname: {alert}" in said, said
