"""A retry and an open breaker (issue #35), on the live balancer in front of two stub
replicas: a retry must not wait in the queue for a replica whose breaker is open."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support import chat_reply, idle_vllm_metrics, start_lb_with, until

from skymesh.balancer.overload import BREAKER_SPREAD_S
from skymesh.util.procs import Daemon

MODEL = "m"
QUEUE_TIMEOUT_S = 5.0  # what the retry sat out before the fix, then a 503
_METRICS = idle_vllm_metrics(MODEL)
_REPLY = chat_reply(MODEL)


def _stub(fails_all: bool) -> web.Application:
    """A healthy replica (probes and model list answer) whose chat completions fail with a
    500: all of them, or only a prompt that says "replica-error"."""
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=_METRICS)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL,
                                                             "object": "model"}]})

    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        if fails_all or b"replica-error" in body:
            return web.json_response({"error": "boom"}, status=500)
        return web.json_response(_REPLY)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def balancer(tmp_path: Path) -> AsyncIterator[tuple[Daemon, str, str]]:
    """The balancer (one worker, breakers that open on one failure and stay open past the
    queue timeout), a replica that fails every request and one that fails only bad ones."""
    bad, bad_url = await _serve(_stub(fails_all=True))
    good, good_url = await _serve(_stub(fails_all=False))
    cfg: dict[str, Any] = {
        "region": "test", "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
        "policy": {"name": "round-robin"},
        "probe": {"interval_s": 0.05},
        "queue": {"timeout_s": QUEUE_TIMEOUT_S},
        "breaker": {"failure_threshold": 1, "open_s": 300},
        "replicas": [{"url": bad_url}, {"url": good_url}],
    }
    lb = start_lb_with(tmp_path, cfg, {})
    try:
        yield lb, bad_url, good_url
    finally:
        lb.stop()
        await bad.cleanup()
        await good.cleanup()


async def _status(s: aiohttp.ClientSession, lb: Daemon) -> dict[str, Any]:
    async with s.get(lb.url + "/status") as r:
        out: dict[str, Any] = await r.json()
        return out


async def _both_healthy(s: aiohttp.ClientSession, lb: Daemon) -> None:
    async def ready() -> bool:
        async with s.get(lb.url + "/ready") as r:
            return bool((await r.json())["healthy_replicas"] == 2)
    await until(ready, "both replicas healthy")


async def _post(s: aiohttp.ClientSession, lb: Daemon, content: str) -> tuple[int, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    async with s.post(lb.url + "/v1/chat/completions", json=body) as r:
        return r.status, json.loads(await r.read())


async def test_a_retry_fails_at_once_when_the_other_breakers_are_open(
        balancer: tuple[Daemon, str, str]) -> None:
    lb, bad_url, good_url = balancer
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        await _both_healthy(s, lb)

        # Good requests until one lands on the failing replica: its breaker opens and
        # the request is retried on the other, which answers.
        for i in range(4):
            status, _ = await _post(s, lb, f"hello {i}")
            assert status == 200
            if (await _status(s, lb))["replicas"][bad_url]["breaker"] == "open":
                break
        assert (await _status(s, lb))["replicas"][bad_url]["breaker"] == "open"

        # A prompt that fails everywhere: it fails on the good replica, and the only one
        # left is behind its open breaker. Before the fix the retry queued for it and,
        # the breaker staying open past the queue timeout, ended in a 503 NoCapacity
        # (with a default breaker it took the trial, failed it, and so on for good).
        status, body = await _post(s, lb, "replica-error")
        assert status == 502, body
        assert body["error"]["code"] == "upstream_failed"
        assert (await _status(s, lb))["queued"] == 0
        assert (await _status(s, lb))["replicas"][good_url]["breaker"] == "open"


async def test_a_new_request_fails_at_once_when_every_breaker_is_open(
        balancer: tuple[Daemon, str, str]) -> None:
    """Every replica of the model behind an open breaker (open 300 s, past the 5 s queue
    timeout): a new request gets a 503 no_healthy_replica at once, told to come back when
    the first breaker lets a trial through. Before, it queued, sat out the queue timeout
    and ended in a 503 no_capacity that said nothing of when to come back."""
    lb, bad_url, good_url = balancer
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        await _both_healthy(s, lb)

        # Fails on one replica, then on the other as a retry: both breakers open
        # (failure_threshold 1), and the client gets the upstream's failure.
        status, body = await _post(s, lb, "replica-error")
        assert status == 502, body
        replicas = (await _status(s, lb))["replicas"]
        assert [replicas[u]["breaker"] for u in (bad_url, good_url)] == ["open", "open"]

        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
        async with s.post(lb.url + "/v1/chat/completions", json=body) as r:
            status, reply, retry_after = r.status, await r.json(), r.headers["Retry-After"]
        assert status == 503, reply
        assert reply["error"]["code"] == "no_healthy_replica"
        # the breakers' open_s (spread upward), not 1 s
        assert QUEUE_TIMEOUT_S < int(retry_after) <= 300 + BREAKER_SPREAD_S
        assert (await _status(s, lb))["queued"] == 0
