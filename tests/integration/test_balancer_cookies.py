"""The balancer's upstream session keeps no cookies: one client's never reach a replica
with another client's request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from support import serving, until

from skymesh.util.procs import start_daemon

MODEL = "cookie-model"
METRICS = ("vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
           "vllm:gpu_cache_usage_perc 0.0\n")


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, list[str | None]]]:
    """A minimal OpenAI-compatible replica that sets a cookie on every answer and records
    the Cookie header each chat request brought."""
    seen: list[str | None] = []

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def chat(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        body = {"id": "x", "object": "chat.completion", "model": MODEL, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"},
             "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        resp = web.json_response(body)
        resp.set_cookie("session", f"client-{len(seen)}")
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    async with serving(app) as port:
        # A host name, not an address: aiohttp's cookie jar ignores cookies from bare IP
        # addresses, so only a named replica (the production case) shows the leak.
        yield f"http://localhost:{port}", seen


async def test_a_cookie_set_for_one_client_is_not_sent_upstream_for_the_next(
        upstream: tuple[str, list[str | None]]) -> None:
    url, seen = upstream
    # One process: the stand-in replica runs on this test's loop, which start_daemon
    # blocks; a worker whose start-up probes timed out learns the model only at its next
    # models probe (10 s), while /ready may be answered by another.
    lb = start_daemon("skymesh-lb", ["--port", "0", "--replicas", url, "--workers", "1"])
    try:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 1}).encode()

        async def ready() -> bool:
            async with aiohttp.ClientSession() as s, s.get(lb.url + "/ready") as r:
                return r.status == 200

        await until(ready, "the balancer sees its replica")
        for i in range(3):  # a fresh client each time, as different users would be
            async with aiohttp.ClientSession() as s, s.post(
                    lb.url + "/v1/chat/completions", data=body,
                    headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200
                # The client itself gets the replica's cookie: the proxy passes it on.
                assert r.cookies["session"].value == f"client-{i + 1}"
        assert seen == [None, None, None]
    finally:
        lb.stop()
