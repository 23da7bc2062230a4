"""A whole reply's ``usage`` is decoded once per request, whatever the policy: the access
log takes its counts from what the request path decoded (``note_usage``)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support import eventually, until

from skymesh.balancer.config import parse_config
from skymesh.balancer.server import build_app
from skymesh.net.limits import ConnLimits
from skymesh.net.serving import start_app
from skymesh.obs.access import ACCESS_LOGGER

MODEL = "m"
USAGE = {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}
METRICS = ("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
           "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
async def replica() -> AsyncIterator[str]:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"model": MODEL, "usage": USAGE, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}}]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", models)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest.mark.parametrize("policy", ["prefix-tree", "round-robin"])
async def test_the_access_log_does_not_decode_a_reply_the_request_path_decoded(
        replica: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from skymesh.obs import access

    decodes: list[bytes] = []
    real = access.fast_usage

    def counted(raw: bytes) -> Any:
        decodes.append(raw)
        return real(raw)

    monkeypatch.setattr(access, "fast_usage", counted)
    lines = Lines()
    logger = logging.getLogger(ACCESS_LOGGER)
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    cfg = parse_config({"listen": {"host": "127.0.0.1", "port": 0},
                        "policy": {"name": policy},
                        "replicas": [{"url": replica, "models": [MODEL]}],
                        "logging": {"access_log": True}})
    runner, _ = await start_app(build_app(cfg), "127.0.0.1", 0, "lb", ConnLimits())
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as s:
            async def served() -> bool:
                async with s.post(url + "/v1/chat/completions", json={
                        "model": MODEL, "max_tokens": 4,
                        "messages": [{"role": "user", "content": "x" * 300}]}) as r:
                    await r.read()
                    return r.status == 200
            await until(served, "a request served through the balancer")
        await eventually(lambda: any(getattr(r, "status", None) == 200
                                     for r in lines.records), "its access line")
    finally:
        await runner.cleanup()
        logger.removeHandler(lines)
        logger.setLevel(level)
    ok = next(r for r in lines.records if getattr(r, "status", None) == 200)
    assert (getattr(ok, "prompt_tokens", None), getattr(ok, "completion_tokens", None)) \
        == (11, 2)
    assert decodes == []
