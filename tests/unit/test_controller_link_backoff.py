"""A balancer told by its controller that its region does not exist (issue #34): one clear
warning, then exponential back-off up to ``retry_max_s``, and back to normal once the
operator creates the region. The controller is an in-test stand-in; the waits go to a
fake sleep, so no test time passes."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web
from support import eventually, serving

from skymesh.balancer.config import parse_config
from skymesh.balancer.controller_link import controller_problem
from skymesh.balancer.server import Balancer

MODEL = "m"


class FakeController:
    """Refuses registration until ``region_created``; then serves an empty membership."""

    def __init__(self) -> None:
        self.region_created = False
        self.registrations = 0
        self.polls = 0
        self.done = asyncio.Event()  # ends the long polls, so the server stops at once

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/balancers", self.balancers)
        app.router.add_post("/v1/replicas", self.replicas)
        app.router.add_get("/v1/balancers/{id}/membership", self.membership)
        return app

    async def balancers(self, request: web.Request) -> web.Response:
        self.registrations += 1
        if not self.region_created:
            return web.json_response({"detail": "no region named 'us'"}, status=422)
        return web.json_response({}, status=201)

    async def replicas(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=201)

    async def membership(self, request: web.Request) -> web.Response:
        self.polls += 1
        if "after" in request.query:
            await self.done.wait()  # a long poll with nothing new
        return web.json_response({"revision": 1, "replicas": [], "peers": []})


async def test_an_unknown_region_backs_off_and_says_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeController()
    waits: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(0)

    async with serving(fake.app()) as port:
        cfg = parse_config({
            "region": "us",
            "replicas": [{"url": "http://127.0.0.1:9", "models": [MODEL]}],
            "controller": {"url": f"http://127.0.0.1:{port}", "balancer_id": "lb-us",
                           "retry_s": 1.0, "retry_max_s": 30.0,
                           "url_policy": {"allow_loopback": True}}})
        lb = Balancer(cfg)
        link = lb.controller
        assert link is not None
        link.sleep = fake_sleep
        caplog.set_level(logging.DEBUG, logger="skymesh.lb")
        await link.start("http://127.0.0.1:1")
        try:
            await eventually(lambda: fake.registrations >= 8, "eight refused registrations")
            fake.region_created = True
            await eventually(lambda: link.registered and fake.polls >= 2,
                             "registered and following membership")
        finally:
            fake.done.set()
            await link.stop()
    refused = waits[:7]
    # Doubling from retry_s (jitter adds at most 1 s), capped at retry_max_s.
    for i, wait in enumerate(refused):
        assert min(30.0, 2.0 ** i) <= wait <= 30.0, waits
    assert refused[-1] == 30.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "Create the region first" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert link.last_error is None


@pytest.mark.parametrize(("error", "says"), [
    ("POST /v1/balancers: HTTP 422: {\"detail\": \"no region named 'us'\"}",
     "Create the region first"),
    ("GET /v1/x: HTTP 401: bad token", "refused this balancer's token"),
    ("ClientConnectorError: connection refused", "is unreachable"),
])
def test_each_failure_reads_as_what_to_do(error: str, says: str) -> None:
    assert says in controller_problem(error, "http://ctl:9000")


