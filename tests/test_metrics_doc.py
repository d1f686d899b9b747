"""The metrics' names kept honest (fast, no server): docs/operating.md's table lists exactly what the cluster view
and a worker export, the cluster view reads every instrument a worker has, the dashboard and the alert rules use
only documented series, and the rules pass ``promtool check rules``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import servers
from prometheus_client import CollectorRegistry

from mn_prefect.http_serving import serve_metrics
from mn_prefect.ops.metrics import PROCESS_PATH, WORKER_LABEL, ClusterCollector, worker_families
from mn_prefect.store import open_store
from mn_prefect.worker import metrics as worker_metrics

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "operating.md"
DASHBOARD = ROOT / "deployments" / "grafana" / "mn-prefect-dashboard.json"
RULES = ROOT / "deployments" / "prometheus" / "mn-prefect-rules.yml"
SUFFIXES = ("_bucket", "_count", "_sum")  # a histogram's series, under its documented name


def documented() -> set[str]:
    """The names in the first column of the table under "Metrics for Prometheus and Grafana"."""
    text = DOC.read_text()
    table = text[text.index("| metric | labels | unit | what |"):]
    table = table[:table.index("\n\n")]
    return {name for row in table.splitlines()[2:] for name in re.findall(r"`(mn_\w+)`", row.split("|")[1])}


def exported_name(family) -> str:
    return family.name + "_total" if family.type == "counter" else family.name


def exported(tmp_path) -> set[str]:
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        families = list(ClusterCollector(store).collect())  # every family, with or without samples
    finally:
        store.close()
    return {exported_name(f) for f in families} | {exported_name(f) for f in worker_metrics.REGISTRY.collect()}


def test_the_docs_table_lists_every_exported_series_and_nothing_else(tmp_path):
    have, doc = exported(tmp_path), documented()
    assert have - doc == set(), "exported but not in docs/operating.md's table"
    assert doc - have == set(), "in docs/operating.md's table but not exported"


def test_the_cluster_view_reads_each_workers_instruments_labelled_by_its_worker():
    """What ``metrics serve`` adds to the cluster's series: each worker's /metrics/process, read at scrape time."""
    registry = CollectorRegistry()
    registry.register(worker_metrics._Process("gpu-1"))
    worker_metrics.WORKER_INFO.labels(pool="p", node="gpu-1").set(1)
    worker_metrics.COMMIT_RETRIES.labels(pool="p", stage="placer").inc(0)
    server = serve_metrics("127.0.0.1", 0, CollectorRegistry(), paths={f"/metrics{PROCESS_PATH}": registry})
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        rows = [{"node": "gpu-1", "pool": "p", "url": url},
                {"node": "gpu-2", "pool": "p", "url": url},  # a stale record: the port is gpu-1's worker's now
                {"node": "gpu-3", "pool": "p", "url": f"http://127.0.0.1:{servers.free_port()}/metrics"}]  # stopped
        families = {f.name: f for f in worker_families(rows, timeout=5, skip={"mn_queue_pending_runs"})}
    finally:
        server.shutdown()
        server.server_close()
    up = {s.labels["node"]: s.value for s in families["mn_worker_up"].samples}
    assert up == {"gpu-1": 1.0, "gpu-2": 0.0, "gpu-3": 0.0}
    assert {f.name for f in worker_metrics.REGISTRY.collect()} - {"mn_queue_pending_runs"} <= set(families)
    assert "mn_queue_pending_runs" not in families and not [n for n in families if n.endswith("_created")]
    samples = [s for name, f in families.items() if name != "mn_worker_up" for s in f.samples]
    assert samples and {s.labels[WORKER_LABEL] for s in samples} == {"gpu-1"}  # once, gpu-1's only


def series_in(expr: str) -> set[str]:
    names = set(re.findall(r"\bmn_\w+", expr))
    return {next((n.removesuffix(s) for s in SUFFIXES if n.endswith(s)), n) for n in names}


def test_the_dashboard_and_the_rules_use_only_documented_series():
    doc = documented()
    dashboard = json.loads(DASHBOARD.read_text())
    used = series_in(json.dumps(dashboard))
    assert used and used - doc == set()
    rules = series_in(RULES.read_text())
    assert rules and rules - doc == set()
    # No 0 standing in for runs nobody counted: waiting runs are 0 only where workers answer.
    waiting = [e for e in exprs(dashboard) if "mn_queue_pending_runs" in e]
    assert waiting and not [e for e in waiting if "vector(0)" in e]


def exprs(node) -> list[str]:
    """Every target's expr of every panel, rows' panels included."""
    out = [t["expr"] for t in node.get("targets", []) if t.get("expr")]
    for panel in node.get("panels", []):
        out += exprs(panel)
    return out


def test_the_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (.ci/run installs Debian's prometheus, which has it)"
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 7 rules found" in done.stdout
