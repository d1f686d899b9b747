"""What a person sees of mn-prefect in the Prefect UI, in headless Chromium against a real lab: the ``mn`` pool's
form, a placed run's ``placement`` artifact, the ``mn.*`` events in the feed and the ``mn-cluster`` overview."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import prefect_env
import pytest
import servers
from lab import TERMINAL

from mn_prefect import events
from mn_prefect.ops.overview import CLUSTER_KEY
from mn_prefect.worker import MNWorker, ui_listing
from mn_prefect.worker.decisions import NEVER_FITS

pytestmark = pytest.mark.lab  # every test here starts a server or a whole lab


def _rendered(description: str) -> str:
    """A description as the UI shows it: its markdown takes ``<WORD>`` for an HTML tag and drops it."""
    return re.sub(r"<[^>\s]+>", "", description)


def _shown_after_reloads(page, url: str, text: str, *, timeout_s: float = 90) -> None:
    """Open ``url`` until ``text`` shows: events reach the server a moment after what caused them, and the feed
    does not refresh by itself."""
    deadline = time.monotonic() + timeout_s
    while True:
        page.goto(url)
        try:
            page.get_by_text(text, exact=True).first.wait_for(timeout=10_000)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise


def _cli(lab, *args: str) -> subprocess.CompletedProcess:
    env = {**lab.server.env, "MN_STORE_URL": lab.store_url}
    return subprocess.run([str(prefect_env.BIN / "mn-prefect"), *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def placed_run(lab):
    """A run holding a GPU and a port on its node until the module ends: (run id, its placement in the store)."""
    variables = {"resources": {"cpu_cores": 2, "memory_mb": 2048, "gpu_count": 1, "ports": [{"label": "http"}]}}
    # Beside Playwright's event loop, Prefect's sync calls would return coroutines: deploy from a thread of its own.
    with ThreadPoolExecutor(1) as thread:
        deployment = thread.submit(lab.deploy, variables).result()
    barrier = lab.out / "ui.barrier"
    run_id = lab.run(deployment, hold_until=str(barrier))
    lab.wait(run_id, states={"RUNNING"}, timeout=180)
    [placement] = lab.booked(run_id)
    yield run_id, placement
    barrier.write_text("go")
    lab.wait(run_id, states=TERMINAL, timeout=120)


def test_the_pool_form_shows_the_resources_fields_with_their_descriptions(lab, page, screenshots):
    resources = MNWorker.get_default_base_job_template()["variables"]["definitions"]["Resources"]
    page.goto(f"{lab.server.ui_url}/work-pools/work-pool/{lab.pool}/edit")
    heading = page.get_by_text(f"{resources['title']} (Optional)", exact=True)
    heading.wait_for()
    page.get_by_text(resources["description"], exact=True).wait_for()
    for name, field in resources["properties"].items():
        assert page.get_by_text(f"{field['title']} (Optional)", exact=True).count() >= 1, f"no field for {name}"
        assert page.get_by_text(_rendered(field["description"]), exact=True).count() == 1, f"no help for {name}"
    # Only what a user sets: the markers mn-prefect sets on its own runs are not in the form; and its type is named.
    body = page.inner_text("body")
    assert "Blueprint booking" not in body and "System copy" not in body and "Leave it empty" not in body, body
    assert page.locator(".block-type-select").inner_text().strip() == "Mn"
    heading.evaluate("e => { e.style.scrollMarginTop = '24px'; e.scrollIntoView({block: 'start'}) }")
    screenshots.take(page, "pool-form")


def test_the_create_pool_wizard_offers_the_mn_type(lab, page):
    page.goto(f"{lab.server.ui_url}/work-pools/create")
    offered = page.get_by_text(ui_listing.entry()["display_name"], exact=True)
    offered.wait_for()
    assert page.get_by_text(ui_listing.DESCRIPTION, exact=True).count() == 1


def test_a_placed_runs_page_shows_its_node_devices_and_ports(lab, placed_run, page, screenshots):
    run_id, placement = placed_run
    [device] = placement.allocation.devices
    [port] = placement.allocation.ports
    page.goto(f"{lab.server.ui_url}/runs/flow-run/{run_id}")
    # Where it runs, at a glance: the node and the GPU as tags in the header, and a first log line in words.
    for tag in (f"mn-node:{placement.node}", f"mn-gpu:{device.id}"):
        page.get_by_text(tag, exact=True).first.wait_for()
    placed_line = page.get_by_text(f"mn placed this run on {placement.node}:", exact=False).first
    placed_line.wait_for()
    line = placed_line.inner_text()
    assert f"device {device.id}" in line and f"port {port.label}={port.port}" in line, line
    assert not re.search(r"[\[\]{}']", line), line  # no Python list or dict text
    screenshots.take(page, "placed-run-header")
    page.locator("li.p-tab#artifacts").click()
    card = page.get_by_text("placement", exact=True)
    card.wait_for()
    # The card's key and its description render apart: wait for the description (is_visible() does not wait).
    page.get_by_text(f"mn-prefect placement on {placement.node}", exact=True).wait_for(state="visible")
    screenshots.take(page, "placed-run-artifacts")
    card.click()
    table = page.locator("table")
    table.wait_for()
    rows = {cells[0]: cells[1] for cells in (row.locator("td").all_inner_texts() for row in table.locator("tbody tr").all())}
    assert rows["node"].strip() == placement.node
    assert rows[f"device {device.index}"].strip().startswith(f"{device.id} (nvidia/cuda")
    assert rows[f"port {port.label}"].strip() == f"{port.protocol}:{port.port}"
    screenshots.take(page, "placed-run")


def test_the_runs_list_shows_where_each_run_went_and_filters_by_node(lab, placed_run, page, screenshots):
    run_id, placement = placed_run
    run_name = lab.flow_run(run_id)["name"]
    node_tag = f"mn-node:{placement.node}"
    page.goto(f"{lab.server.ui_url}/runs")
    card = page.locator(".flow-run-list-item", has_text=run_name)
    card.wait_for()
    assert node_tag in card.inner_text()
    # The runs list's tag filter is Prefect's flow-run tag filter: the node's tag finds exactly the runs it holds.
    found = lab.http.post("/flow_runs/filter", json={"flow_runs": {"tags": {"all_": [node_tag]}}}).json()
    assert [r["id"] for r in found] == [run_id]
    assert lab.http.get(f"/flow_runs/{run_id}").json()["labels"]["mn.node"] == placement.node
    screenshots.take(page, "runs-list")


def test_the_event_feed_lists_node_and_placement_events(lab, placed_run, page, screenshots):
    for switch in ("--enable", "--disable"):
        done = _cli(lab, "node", "maintenance", "cpu-1", switch, "--reason", "checked in the UI")
        assert done.returncode == 0, done.stdout + done.stderr
    # The feed filtered by resource mn.node: the events about nodes, placements included.
    feed = f"{lab.server.ui_url}/events?resource=mn.node"
    for event in (f"{events.NODE}maintenance", f"{events.NODE}healthy", events.PLACEMENT_CREATED):
        _shown_after_reloads(page, feed, event)
    assert page.get_by_text("mn.node.cpu-1", exact=True).count() >= 2  # maintenance, then healthy again
    assert page.get_by_text(f"mn.node.{placed_run[1].node}", exact=True).count() == 1  # one event per placement
    screenshots.take(page, "event-feed")


def test_the_cluster_overview_renders_its_table(lab, placed_run, page, screenshots):
    run_id, placement = placed_run
    [device] = placement.allocation.devices
    [port] = placement.allocation.ports
    reconcile = subprocess.run([sys.executable, "-c", "from mn_prefect.ops.flows import reconcile_cluster as f; f()"],
                               env={**lab.server.env, "MN_STORE_URL": lab.store_url}, capture_output=True,
                               text=True, timeout=180)
    assert reconcile.returncode == 0, reconcile.stdout + reconcile.stderr
    page.set_viewport_size({"width": 1680, "height": 900})  # the table's eight columns side by side
    page.goto(f"{lab.server.ui_url}/artifacts/key/{CLUSTER_KEY}")
    page.locator("a[href*='/artifacts/artifact/']").first.click()  # its latest version
    page.get_by_text("gpu devices", exact=True).wait_for()
    rows = {r.locator("td").first.inner_text().strip(): r for r in page.locator("table tbody tr").all()}
    assert sorted(rows) == ["cpu-1", "gpu-1"]
    held = rows[placement.node]
    assert f"{device.id}: held whole" in held.inner_text()
    assert f"{port.protocol}:{port.port}" in held.inner_text()
    link = held.get_by_role("link", name=placement.node)
    assert link.get_attribute("href").endswith(f"/events?resource=mn.node.{placement.node}")
    screenshots.take(page, "cluster-overview")


def test_the_runs_list_shows_a_waiting_run_as_never_fits_and_a_never_fitting_run_failed_with_why(lab, page,
                                                                                                  screenshots):
    with ThreadPoolExecutor(1) as thread:  # beside Playwright's event loop: deploy from a thread of its own
        failing = lab.run(thread.submit(lab.deploy, {"resources": {"gpu": 99}}).result())
        waiting = lab.run(thread.submit(lab.deploy, {"resources": {"gpu": 99}, "wait_for_new_nodes": True}).result())
    assert lab.wait(failing, timeout=120)["state"]["type"] == "FAILED"
    servers.wait_for(lambda: lab.flow_run(waiting)["state"]["name"] == NEVER_FITS, timeout=120, interval=0.5,
                     what="the waiting run shown as Never fits")
    page.goto(f"{lab.server.ui_url}/runs")
    waiting_row = page.locator(".flow-run-list-item", has_text=lab.flow_run(waiting)["name"])
    waiting_row.wait_for()
    assert NEVER_FITS in waiting_row.inner_text(), waiting_row.inner_text()
    failed_row = page.locator(".flow-run-list-item", has_text=lab.flow_run(failing)["name"])
    assert "Failed" in failed_row.inner_text(), failed_row.inner_text()
    screenshots.take(page, "runs-list-never-fits")
    page.goto(f"{lab.server.ui_url}/runs/flow-run/{failing}")
    page.get_by_text("mn: no node can ever take this run (", exact=False).first.wait_for()
    screenshots.take(page, "never-fitting-run-failed")
    lab.http.post(f"/flow_runs/{waiting}/set_state", json={"state": {"type": "CANCELLED"}, "force": True})
