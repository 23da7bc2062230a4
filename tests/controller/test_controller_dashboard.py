"""The dashboard in a real headless Chromium against a real controller process.

The mesh: three regions; ``lb-us`` and ``lb-ap`` answer health probes (a small HTTP
server standing in for balancers and replicas), ``lb-eu`` does not, so its replica is
served from the nearest live balancer. The page must show all of it from the API alone.

Set ``SKYMESH_UPDATE_DOCS_IMG=1`` to also refresh docs/img/dashboard.png (the README's).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from controller_support import ADMIN, READER, auth, free_port, token_config
from playwright.sync_api import Browser, Page, expect, sync_playwright

from skymesh.util.procs import Daemon, start_daemon

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img" / "dashboard.png"
WAIT_MS = 15_000  # the page polls every 2 s; probes settle within a second


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = self.path.endswith("/health")
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass  # probes every 200 ms would flood the test output


@pytest.fixture(scope="module")
def healthy_url() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    thread = threading.Thread(target=srv.serve_forever, name="fake-health", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _telemetry(requests: int, queue: int) -> dict[str, object]:
    return {"window_s": 5, "models": {"m": {"requests": requests, "prompt_tokens": 1000,
                                            "output_tokens": 500}},
            "queue_length": queue, "in_flight": 2}


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory, healthy_url: str) -> Iterator[Daemon]:
    cfg = tmp_path_factory.mktemp("dash") / "controller.yaml"
    cfg.write_text(yaml.safe_dump({"tokens": token_config(),
                                   "url_policy": {"allow_loopback": True},
                                   "api_docs": True}))
    d = start_daemon("skymesh-controller",
                     ["--config", str(cfg), "--port", "0", "--probe-interval", "0.2"],
                     env={**os.environ, "SKYMESH_ADMIN_TOKEN": ADMIN})
    dead = f"http://127.0.0.1:{free_port()}"
    with httpx.Client(base_url=d.url, headers=auth()) as api:
        def post(path: str, body: dict[str, object]) -> None:
            r = api.post(path, json=body)
            assert r.status_code in (201, 204), r.text

        for name, lat, lon in (("us-east", 38.9, -77.0), ("eu-west", 53.3, -6.2),
                               ("ap-northeast", 35.7, 139.7)):
            post("/v1/regions", {"name": name, "latitude": lat, "longitude": lon})
        post("/v1/balancers", {"id": "lb-us", "region": "us-east", "url": healthy_url})
        post("/v1/balancers", {"id": "lb-eu", "region": "eu-west", "url": dead})
        post("/v1/balancers", {"id": "lb-ap", "region": "ap-northeast", "url": healthy_url})
        for rid, region, url in (("rep-us", "us-east", healthy_url + "/us"),
                                 ("rep-eu", "eu-west", healthy_url + "/eu"),
                                 ("rep-ap", "ap-northeast", dead + "/ap")):
            post("/v1/replicas", {"id": rid, "url": url, "model": "llama-3-8b",
                                  "region": region, "gpu": "L4"})
        for requests, queue in ((10, 3), (25, 6), (15, 1)):
            post("/v1/balancers/lb-us/telemetry", _telemetry(requests, queue))
            post("/v1/balancers/lb-ap/telemetry", _telemetry(requests // 5, queue))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make system-deps` (it installs Debian's "
                    "chromium, which the dashboard test drives headless)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 860})
    p = ctx.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    yield p
    ctx.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


def test_controller_dashboard_page_is_public_and_holds_no_data(controller: Daemon) -> None:
    r = httpx.get(controller.url + "/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert "us-east" not in r.text and "lb-us" not in r.text
    js = httpx.get(controller.url + "/dashboard/static/dashboard.js")
    assert js.status_code == 200 and "/v1/telemetry" in js.text
    # The page is not an API operation: it stays out of the OpenAPI document.
    paths = httpx.get(controller.url + "/openapi.json",
                      headers={"Authorization": f"Bearer {READER}"}).json()["paths"]
    assert not any(p.startswith("/dashboard") for p in paths)


def test_controller_dashboard_renders_live_mesh(controller: Daemon, page: Page,
                                                tmp_path: Path) -> None:
    page.goto(f"{controller.url}/dashboard#token={READER}")

    # Probing marks lb-eu down; its replica moves to the nearest live balancer (lb-us).
    page.wait_for_selector('tr[data-balancer="lb-eu"] td[data-state="down"]', timeout=WAIT_MS)
    page.wait_for_selector('tr[data-balancer="lb-us"] td[data-state="up"]', timeout=WAIT_MS)
    page.wait_for_selector('tr[data-replica="rep-eu"] td[data-assigned="lb-us"]',
                           timeout=WAIT_MS)
    page.wait_for_selector('tr[data-replica="rep-ap"] td[data-state="unhealthy"]',
                           timeout=WAIT_MS)

    # The token left the address bar for sessionStorage.
    assert page.evaluate("location.hash") == ""
    assert READER in page.evaluate("Object.values(sessionStorage)")

    for region in ("us-east", "eu-west", "ap-northeast"):
        expect(page.locator(f'#regions tr[data-region="{region}"] td').first).to_have_text(region)
    us = page.locator('#regions tr[data-region="us-east"] td')
    # Latest lb-us report: 15 requests in a 5 s window, queue 1, 2 in flight.
    expect(us.nth(5)).to_have_text("3")
    expect(us.nth(6)).to_have_text("1")
    expect(us.nth(4)).to_have_text("1/1")
    moved = page.locator('tr[data-replica="rep-eu"]')
    expect(moved.locator("td[data-home]")).to_have_text("lb-eu")
    expect(moved.locator(".moved")).to_be_visible()
    expect(page.locator('tr[data-replica="rep-us"] .moved')).to_have_count(0)

    # Charts: one line per region and metric, through every telemetry sample.
    path = page.locator('[data-chart="us-east:rps"] path.series')
    expect(path).to_have_count(1)
    d = path.get_attribute("d") or ""
    assert d.startswith("M") and d.count("L") == 2, d
    expect(page.locator('[data-chart="ap-northeast:queue"] path.series')).to_have_count(1)
    expect(page.locator('[data-chart^="eu-west:"]')).to_have_count(0)  # no telemetry there
    # Forecast vs actual from the controller's own /v1/forecast (persistence on a fresh
    # mesh): one chart per (model, region) with telemetry, both lines drawn.
    fc = page.locator("#forecast .chart")
    expect(fc.locator("h3").first).to_have_text("m · ap-northeast · prompt_tokens")
    expect(fc.first.locator('path[data-series="actual"]')).to_have_count(1)
    expect(fc.first.locator('path[data-series="forecast"]')).to_have_count(1)

    # Polling: a region added through the API shows up without a reload.
    httpx.post(controller.url + "/v1/regions", headers=auth(),
               json={"name": "sa-east", "latitude": -23.5, "longitude": -46.6}
               ).raise_for_status()
    page.wait_for_selector('#regions tr[data-region="sa-east"]', timeout=WAIT_MS)

    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("SKYMESH_UPDATE_DOCS_IMG") == "1":
        DOCS_IMG.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, DOCS_IMG)


def test_controller_dashboard_rejects_bad_token_then_accepts_login(controller: Daemon,
                                                                  page: Page) -> None:
    page.goto(f"{controller.url}/dashboard#token=not-a-token")
    expect(page.locator("#login-error")).to_contain_text("token rejected (401",
                                                         timeout=WAIT_MS)
    expect(page.locator("#mesh")).to_be_hidden()
    assert page.evaluate("Object.values(sessionStorage)") == []  # the bad token is dropped

    page.fill("#token", READER)
    page.click("#login button[type=submit]")
    page.wait_for_selector('#regions tr[data-region="us-east"]', timeout=WAIT_MS)
    expect(page.locator("#login")).to_be_hidden()


def test_controller_dashboard_draws_forecast_when_the_endpoint_exists(controller: Daemon,
                                                                      page: Page) -> None:
    # /v1/forecast is not served yet: stand in for it at the browser's network layer, in
    # the shape the page documents, to check the panel's drawing before the API lands.
    forecast = {"series": [{"model": "llama-3-8b", "region": "us-east", "metric": "requests",
                            "points": [{"ts": 1000 + 60 * i, "forecast": 10 + i,
                                        "actual": 9 + 2 * i if i < 4 else None}
                                       for i in range(6)]}]}
    page.route("**/v1/forecast", lambda route: route.fulfill(json=forecast))
    page.goto(f"{controller.url}/dashboard#token={READER}")
    panel = page.locator("#forecast .chart")
    expect(panel.locator("h3")).to_have_text("llama-3-8b · us-east · requests", timeout=WAIT_MS)
    expected_segments = {"forecast": 5, "actual": 3}  # actual stops where the data does
    for name, segments in expected_segments.items():
        d = panel.locator(f'path[data-series="{name}"]').get_attribute("d") or ""
        assert d.count("L") == segments, (name, d)
    expect(page.locator("#no-forecast")).to_have_count(0)
