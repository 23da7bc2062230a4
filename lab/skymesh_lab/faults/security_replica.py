"""A bad replica for the security page's figures: a stand-in (an aiohttp app in this
process) behind the same ``skymesh-lb`` as a healthy emulated replica, serving a model of
its own so that only the attack's requests reach it. In turn it answers:

- ``huge_body``: a non-streamed chat reply of ``body_mb`` MB (the balancer reads at most
  ``upstream.max_response_body_bytes``);
- ``huge_headers``: a reply whose headers are ``headers_mb`` MB
  (``upstream.max_response_header_bytes``);
- ``huge_metrics``: a ``/metrics`` of ``metrics_mb`` MB (``probe.max_metrics_bytes``);
- ``costly_metrics``: a 3 MB ``/metrics`` with no ``# HELP`` lines, under the size cap but
  costly to parse (``probe.max_parse_s``).

For each: the balancer's RSS before, after and at its peak, what the attack's requests got,
whether the stand-in was marked unhealthy, the limit counter, and a healthy client's p50
(the real replica's model) with no attack and while the attack runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from skymesh.util.procs import Daemon
from skymesh_lab.faults.cluster import MODEL, parse_metrics, rss_bytes, start_lb, wait_for
from skymesh_lab.faults.security_floods import (
    CHAT,
    DEADLINE_S,
    MB,
    Healthy,
    peak_rss_bytes,
    running,
)

STANDIN = "standin-model"
SMALL_METRICS = (b'vllm:num_requests_waiting{model_name="standin-model"} 0\n'
                 b'vllm:num_requests_running{model_name="standin-model"} 0\n')
OK_REPLY = {"id": "x", "object": "chat.completion", "model": STANDIN, "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
LIMITS = {"huge_body": "body", "huge_headers": "headers", "huge_metrics": "metrics",
          "costly_metrics": "metrics_parse"}


def costly_metrics(size: int) -> bytes:
    """Valid Prometheus text of about ``size`` bytes, the load families first and no
    ``# HELP`` lines, so a parser has to read all of it."""
    lines, total, n = [SMALL_METRICS], len(SMALL_METRICS), 0
    while total < size:
        line = b'filler_series{i="%d",pad="xxxxxxxxxxxxxxxxxxxxxxxx"} 1\n' % n
        lines.append(line)
        total += len(line)
        n += 1
    return b"".join(lines)


class StandIn:
    """The bad replica. ``metrics`` is what /metrics answers; a chat request's user
    message names the reply (``ok``, ``huge_body``, ``huge_headers``); ``sent`` counts the
    body bytes it got out before being cut off."""

    def __init__(self, body_mb: int, headers_mb: int) -> None:
        self.body_mb, self.headers_mb = body_mb, headers_mb
        self.metrics = SMALL_METRICS
        self.sent = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.on_metrics)
        app.router.add_get("/v1/models", self.on_models)
        app.router.add_post("/v1/chat/completions", self.on_chat)
        return app

    async def on_metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics, content_type="text/plain")

    async def on_models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": STANDIN,
                                                                "object": "model"}]})

    async def on_chat(self, request: web.Request) -> web.StreamResponse:
        mode = (await request.json())["messages"][0]["content"]
        if mode not in ("huge_body", "huge_headers"):
            return web.json_response(OK_REPLY)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        if mode == "huge_headers":
            resp.headers["X-Padding"] = "p" * (self.headers_mb * MB)
            resp.content_length = 2
        else:
            resp.content_length = self.body_mb * MB
        part = b" " * MB
        # The balancer cuts the connection once past its cap: that ends the reply.
        with contextlib.suppress(ConnectionError):
            await resp.prepare(request)
            if mode == "huge_headers":
                await resp.write(b"{}")
            for _ in range(self.body_mb if mode == "huge_body" else 0):
                await resp.write(part)
                self.sent += MB
        return resp


@contextlib.asynccontextmanager
async def serving(stand: StandIn) -> AsyncIterator[str]:
    runner = web.AppRunner(stand.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def bad_replica(work: Path, replica: Daemon, healthy: Healthy, body_mb: int,
                      headers_mb: int, metrics_mb: int) -> dict[str, Any]:
    stand = StandIn(body_mb, headers_mb)
    async with serving(stand) as url:
        lb = await start_lb(work, [replica], name="lb-bad", overrides={
            "probe": {"interval_s": 0.1}, "retry": {"max_attempts": 1},
            "replicas": [{"url": replica.url, "models": [MODEL], "gpu": "L4"},
                         {"url": url, "models": [STANDIN], "gpu": "L4"}]})
        try:
            async with aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as s:
                sizes = {"huge_body": body_mb * MB, "huge_headers": headers_mb * MB,
                         "huge_metrics": metrics_mb * MB, "costly_metrics": 3 * MB}
                out: dict[str, Any] = {}
                for mode in LIMITS:
                    out[mode] = {"offered_mb": sizes[mode] / MB,
                                 **await _one(s, lb, url, stand, healthy, mode, sizes[mode])}
                out["alive"] = lb.alive()
                return out
        finally:
            await asyncio.to_thread(lb.stop)


async def _healthy_state(s: aiohttp.ClientSession, lb: Daemon, url: str) -> bool:
    async with s.get(lb.url + "/status") as r:
        return bool((await r.json())["replicas"][url]["healthy"])


async def _one(s: aiohttp.ClientSession, lb: Daemon, url: str, stand: StandIn,
               healthy: Healthy, mode: str, size: int) -> dict[str, Any]:
    async def up() -> bool:
        return await _healthy_state(s, lb, url)

    async def down() -> bool:
        return not await _healthy_state(s, lb, url)

    await wait_for(up, "the stand-in healthy", DEADLINE_S)
    pid, chat_url = lb.proc.pid, lb.url + "/v1/chat/completions"
    statuses = Counter[str]()

    async def attacker() -> None:
        body = {"model": STANDIN, "max_tokens": 4,
                "messages": [{"role": "user", "content": mode}]}
        while True:
            async with s.post(chat_url, json=body) as r:
                await r.read()
                statuses[str(r.status)] += 1

    no_attack = await healthy.measure(chat_url, CHAT)
    before, sent_before = rss_bytes(pid), stand.sent
    marked_down = None
    if mode.endswith("metrics"):
        stand.metrics = (costly_metrics(size) if mode == "costly_metrics"
                         else SMALL_METRICS + b"# " + b"p" * size + b"\n")
        try:
            await wait_for(down, "the stand-in unhealthy", DEADLINE_S)
            marked_down = True
        except TimeoutError:
            marked_down = False
        attack = await healthy.measure(chat_url, CHAT)  # while it is still probed
        stand.metrics = SMALL_METRICS
    else:
        async with running(attacker()):
            attack = await healthy.measure(chat_url, CHAT)
    async with s.get(lb.url + "/metrics") as r:
        hits = parse_metrics(await r.text()).get(
            f'skymesh_replica_limit_hits_total{{limit="{LIMITS[mode]}",replica="{url}"}}', 0)
    return {"attack_statuses": dict(statuses), "marked_unhealthy": marked_down,
            "limit": LIMITS[mode], "limit_hits": int(hits),
            "standin_sent_mb": (stand.sent - sent_before) / MB,
            "rss_mb": {"before": before / MB, "after": rss_bytes(pid) / MB,
                       "peak": peak_rss_bytes(pid) / MB},
            "healthy": {"no_attack": no_attack, "attack": attack}}

