"""A controller shutting down answers the long polls pending on it (Changes.close), rather
than leaving uvicorn to cancel them after its graceful timeout: that printed a
CancelledError traceback per poll in the log and answered the balancer a 500."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from controller_support import auth, token_config
from support import eventually

from skymesh.net.limits import ConnLimits
from skymesh_controller.api import build_app
from skymesh_controller.config import ControllerConfig
from skymesh_controller.serve import _bind, make_server


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


async def test_a_pending_long_poll_is_answered_when_the_controller_shuts_down() -> None:
    cfg = ControllerConfig.model_validate({
        "listen": {"host": "127.0.0.1", "port": 0}, "tokens": token_config(),
        "url_policy": {"allow_loopback": True}})
    app = build_app(cfg, probe=False)
    changes = app.state.controller.changes
    server = make_server(app, ConnLimits())
    uvicorn_log = _Records()
    logging.getLogger("uvicorn.error").addHandler(uvicorn_log)
    sock = _bind("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await eventually(lambda: server.started, "the controller serving", timeout=30)
        async with aiohttp.ClientSession(headers=auth()) as s:
            for path, body in (("/v1/regions", {"name": "us", "latitude": 0, "longitude": 0}),
                               ("/v1/balancers", {"id": "lb-us", "region": "us",
                                                  "url": "http://127.0.0.1:9"})):
                async with s.post(base + path, json=body) as r:
                    assert r.status == 201, await r.text()
            url = base + "/v1/balancers/lb-us/membership"
            async with s.get(url) as r:
                rev = (await r.json())["revision"]
            poll = asyncio.create_task(s.get(url, params={"after": rev, "wait": 300}))
            await eventually(lambda: changes.waiting == 1, "the long poll pending", timeout=30)
            server.should_exit = True
            answer = await poll
            assert answer.status == 200
            assert (await answer.json())["revision"] == rev
            answer.release()
        await serving
    finally:
        server.should_exit = True
        await serving
        logging.getLogger("uvicorn.error").removeHandler(uvicorn_log)
    assert changes.waiting == 0
    assert not [line for line in uvicorn_log.lines
                if "Traceback" in line or "Exception in ASGI" in line or "Cancel" in line]
