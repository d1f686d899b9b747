"""The Prefect UI in a real browser: Debian's ``chromium`` driven by Playwright (no browser download here), against
a lab whose Prefect server serves its UI. Screenshots go to this session's test artifacts, and also to the folder
``MN_UI_SCREENSHOTS`` names (docs/ui.md's come from ``MN_UI_SCREENSHOTS=docs/screenshots``)."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import prefect_env
import pytest
from builders import gpu
from lab import Lab

CHROMIUM = os.environ.get("MN_CHROMIUM", "/usr/bin/chromium")
VIEWPORT = {"width": 1280, "height": 900}
TIMEOUT_MS = 60_000  # a loaded 2-core machine renders the UI slowly; a missing element still fails in time


def fleet() -> list[dict]:
    return [
        {"name": "gpu-1", "cpu_cores": 16, "memory_mb": 65536, "dynamic_port_range": [21000, 21999],
         "devices": [gpu("GPU-1a", 0, 24576, caps=("fp16", "bf16")), gpu("GPU-1b", 1, 16384)]},
        {"name": "cpu-1", "cpu_cores": 8, "memory_mb": 32768, "dynamic_port_range": [23000, 23999]},
    ]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    home = tmp_path_factory.mktemp("ui")
    # A private server, not the test process's shared one: it must serve the UI (the shared one does not), and the
    # pages shown (the events feed, the cluster overview of every mn pool) must show this lab's nodes and runs only.
    with pytest.MonkeyPatch.context() as patch:  # Lab starts its Prefect server without the UI
        patch.setattr(prefect_env, "PrefectServer", functools.partial(prefect_env.PrefectServer, ui=True))
        lab = Lab(home, fleet=fleet(), private_server=True)
    yield lab
    lab.stop()


@pytest.fixture(scope="module")  # Playwright's event loop runs while it is open: Prefect's sync calls would see it
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: install Debian's chromium (`apt-get install chromium`; .ci/run does) "
                    "or name the binary in MN_CHROMIUM", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright is missing: pip install -e '.[dev]'", pytrace=False)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


class Screenshots:
    """PNGs of what the tests saw: in ``folder`` (test artifacts), and a copy in ``publish`` when set."""

    def __init__(self, folder: Path, publish: Path | None):
        self.folder, self.publish = folder, publish

    def take(self, page, name: str) -> Path:
        path = self.folder / f"{name}.png"
        page.screenshot(path=str(path))
        if self.publish is not None:
            self.publish.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, self.publish / path.name)
        return path


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory) -> Screenshots:
    publish = os.environ.get("MN_UI_SCREENSHOTS")
    return Screenshots(tmp_path_factory.mktemp("ui-screenshots"), Path(publish) if publish else None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.ui_failed = report.failed  # read by ``page``: a failed test leaves a screenshot of what it saw
    return report


@pytest.fixture
def page(browser, request, screenshots):
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    if getattr(request.node, "ui_failed", False):
        screenshots.take(page, f"{request.node.name}-failed")
    context.close()
