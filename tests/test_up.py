"""The README's main job: `mn-prefect up` on a machine with no Prefect server configured."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_up_runs_the_examples_and_shows_where_each_run_went(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MN_"))}
    env.update({"MN_PREFECT_HOME": str(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect-client"),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    result = subprocess.run([str(Path(sys.executable).parent / "mn-prefect"), "up", "--exit-when-done", "--port", "0",
                             "--runs", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
    assert "3 of 3 runs completed" in out  # the lifecycle deployments run on their own and "Prefect UI: http://127.0.0.1:" in out
    assert re.search(r"cuda-inference.*COMPLETED.*gpu-[12].*GPU-", out)
    assert re.search(r"http-service.*COMPLETED.*http=\d+", out)
    assert re.search(r"scratch-writer.*COMPLETED.*scratch=/tmp", out)
    # Everything it started is stopped: no worker or server of this lab is left behind.
    leftover = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(tmp_path) in cmdline.read_bytes().decode(errors="replace"):
                leftover.append(cmdline.parent.name)
        except OSError:
            continue
    assert leftover == []
