"""The web page at `/` in a real browser: Debian's Chromium, headless, driven by Selenium (from PyPI) through
Debian's chromedriver, against a real mesh with API and admin keys.  The playground sends two turns of one
session and shows each streamed answer with its metadata line; the console lists every replica, and marks
an engine killed with SIGKILL down within 5 seconds.  Screenshots of both views go to
$INFERMESH_SCREENSHOTS (docs/operations.md's come from here) or the test's temp folder.

Chromium is installed with apt-get when missing (as root); where it cannot be, the tests are skipped
with the reason."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mesh.clients.http3 import H3Client
from tests.e2e.conftest import OFFSET, Mesh, running_mesh

pytestmark = pytest.mark.e2e

PORTS = OFFSET + 1400
API_KEY, ADMIN_KEY = "web-api-key", "web-admin-key"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def _chromium() -> str | None:
    """Why a browser cannot be had, or None once Chromium and its driver are installed."""
    if os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER):
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "Chromium is missing and cannot be installed here (needs root and apt-get: chromium chromium-driver)"
    done = subprocess.run(["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"], capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0 or not os.path.exists(CHROMEDRIVER):
        return f"apt-get could not install chromium and chromium-driver: {done.stderr.strip()[-300:]}"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    why = _chromium()
    if why:
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1440,1000",
                 "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def web_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("web") / "infermesh-up.log"
    env = {"INFERMESH_API_KEYS": API_KEY, "INFERMESH_ADMIN_KEYS": ADMIN_KEY}
    with running_mesh(["--engines", "2", "--kv-cache-mb", "64", "--no-restart"], PORTS, log, env=env) as m:
        yield m


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(os.environ.get("INFERMESH_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.1)


def _states(driver: Any) -> dict[str, str]:
    """Each console row's replica and state, read in one script: the page redraws the table every second, so
    rows looked up one by one can be gone (stale) halfway."""
    return dict(driver.execute_script(
        "return [...document.querySelectorAll('#replicas tbody tr')]"
        ".map(r => [r.dataset.replica, r.querySelector('td.state').textContent]);"))


def _type(driver: Any, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value, Keys.TAB)          # the change event fires on leaving the field


def test_the_page_is_static_locked_down_and_served_over_http3_too(web_mesh: Mesh) -> None:
    page = httpx.get(f"{web_mesh.http}/", timeout=10)
    assert page.status_code == 200 and "default-src 'none'" in page.headers["content-security-policy"]
    assert page.headers["alt-svc"] == f'h3=":{web_mesh.http3_port}"; ma=86400'
    assert "<script src=\"/static/app.js\"" in page.text and "<script>" not in page.text
    # With keys configured, what the page fetches asks for one.
    assert httpx.get(f"{web_mesh.http}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{web_mesh.http}/admin/console", timeout=10,
                     headers={"authorization": f"Bearer {API_KEY}"}).status_code == 401

    async def over_h3() -> tuple[int, dict[str, str], bytes]:
        async with H3Client("127.0.0.1", web_mesh.http3_port, verify=False) as client:
            r = await client.request("GET", "/static/app.js")
            return r.status, r.headers, r.body
    status, headers, body = asyncio.run(over_h3())
    assert status == 200 and headers["content-type"].startswith("text/javascript") and b"sessionStorage" in body


def test_playground_streams_an_answer_with_its_metadata_and_the_console_lists_replicas(
        web_mesh: Mesh, browser: Any, shots: Path) -> None:
    from selenium.webdriver.common.by import By
    browser.get(f"{web_mesh.http}/")
    _type(browser, "api-key", API_KEY)
    _type(browser, "admin-key", ADMIN_KEY)
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#model option"), 20, "the model list")
    assert browser.execute_script("return sessionStorage.getItem('apiKey')") == API_KEY
    assert browser.execute_script("return localStorage.length") == 0          # never kept past the tab
    _type(browser, "temperature", "0")
    _type(browser, "max-tokens", "24")
    _type(browser, "system", "You are a concise assistant.")
    metas = []
    for n, question in enumerate(["What is the capital of France?", "Name one famous building there."], 1):
        _type(browser, "message", question)
        browser.find_element(By.ID, "send").click()
        meta = _wait(lambda n=n: [m.text for m in browser.find_elements(By.CSS_SELECTOR, ".turn.assistant .meta")
                                  if m.text][n - 1:n], 120, f"answer {n}'s metadata line")[0]
        metas.append(meta)
    answers = [a.text for a in browser.find_elements(By.CSS_SELECTOR, ".turn.assistant .text")]
    assert len(answers) == 2 and all(answers), answers
    for meta in metas:
        assert re.search(r"replica engine-[01] · version \S+ · region \S+ · degraded no · confidence 1", meta), meta
        assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s", meta), meta
    prompts = [int(re.search(r"cached tokens \d+/(\d+)", m).group(1)) for m in metas]  # type: ignore[union-attr]
    assert prompts[1] > prompts[0] + 20, metas        # the session continued: the first turn is in the second's prompt
    browser.save_screenshot(str(shots / "playground.png"))

    browser.find_element(By.ID, "tab-console").click()
    rows = _wait(lambda: _states(browser), 10, "replica rows")
    assert rows == {"engine-0": "up", "engine-1": "up"}
    assert browser.find_element(By.ID, "router-state").text == "ready"
    time.sleep(4)                                     # a few seconds of chart
    browser.save_screenshot(str(shots / "console.png"))


def test_the_console_marks_a_killed_engine_down_within_5_seconds(web_mesh: Mesh, browser: Any) -> None:
    if "#console" not in browser.current_url:
        browser.get(f"{web_mesh.http}/#console")
        _type(browser, "admin-key", ADMIN_KEY)
    state = lambda: _states(browser)  # noqa: E731
    _wait(lambda: state().get("engine-1") == "up", 10, "engine-1 up")
    pattern = f"services.engine --replica-id engine-1 --port {50061 + PORTS}"
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1, pids
    os.kill(int(pids[0]), signal.SIGKILL)
    killed = time.monotonic()
    _wait(lambda: state().get("engine-1", "").startswith(("down", "isolated")), 5, "engine-1 marked down")
    print(f"engine-1 marked down {time.monotonic() - killed:.1f} s after SIGKILL")
    assert state().get("engine-0") == "up"
