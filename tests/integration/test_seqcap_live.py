"""A live ``skymesh-lb`` learns a vLLM replica's ``--max-num-seqs`` from its probes (issue
#34): a stand-in replica serves vLLM's gauges as the test sets them; ``/status`` shows
the limit and where it came from (``unknown`` while learning, then ``learned``; ``told``
when the config gives it). Waits are on the balancer's own ``/status``."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from support import serving, until

from skymesh.util.procs import Daemon, start_daemon

MODEL = "tiny"


class FakeVllm:
    """vLLM's /metrics with the running and waiting counts the test sets."""

    def __init__(self) -> None:
        self.running, self.waiting = 0, 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.Response:
        """Answered at once and not streamed, whatever the gauges say (the
        router-overhead stubs')."""
        await request.read()
        return web.json_response({
            "id": "c", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def metrics(self, request: web.Request) -> web.Response:
        labels = f'{{engine="0",model_name="{MODEL}"}}'
        text = ("# HELP vllm:num_requests_running Number of requests in model execution "
                "batches.\n# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{labels} {float(self.running)}\n"
                "# HELP vllm:num_requests_waiting Number of requests waiting to be "
                "processed.\n# TYPE vllm:num_requests_waiting gauge\n"
                f"vllm:num_requests_waiting{labels} {float(self.waiting)}\n")
        return web.Response(text=text, content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeVllm, str]]:
    replica = FakeVllm()
    async with serving(replica.app()) as port:
        yield replica, f"http://127.0.0.1:{port}"


def start_lb(tmp: Path, url: str, *extra: str, **pushing: Any) -> Daemon:
    cfg = {"region": "us", "listen": {"host": "127.0.0.1", "port": 0},
           "probe": {"interval_s": 0.05}, "pushing": {"mode": "sp-p", **pushing},
           "replicas": [{"url": url, "kind": "vllm"}]}
    (tmp / "lb.yaml").write_text(yaml.safe_dump(cfg))
    return start_daemon("skymesh-lb", ["--config", str(tmp / "lb.yaml"), *extra],
                        log_path=tmp / "lb.log")


async def replica_status(s: aiohttp.ClientSession, lb: Daemon, url: str) -> dict[str, Any]:
    async with s.get(lb.url + "/status") as r:
        return (await r.json())["replicas"][url]


async def admission_gauge(s: aiohttp.ClientSession, lb: Daemon, url: str) -> list[str]:
    """The ``skymesh_replica_admission_limit`` series of ``url``, one per worker, each
    as ``source value``."""
    async with s.get(lb.url + "/metrics") as r:
        text = await r.text()
    return [" ".join(re.findall(r'source="(\w+)".* (\S+)$', line)[0])
            for line in text.splitlines()
            if line.startswith(f'skymesh_replica_admission_limit{{replica="{url}"')]


async def test_the_limit_is_learned_from_the_probes(
        tmp_path: Path, fake: tuple[FakeVllm, str]) -> None:
    """``/status``, the gauge and the INFO lines follow it."""
    replica, url = fake
    lb = start_lb(tmp_path, url, "--log-level", "info")
    try:
        async with aiohttp.ClientSession() as s:
            replica.running, replica.waiting = 3, 0

            async def shows(cap: int, source: str) -> bool:
                st = await replica_status(s, lb, url)
                return st["max_num_seqs"] == cap and st["max_num_seqs_source"] == source

            # Conservative while learning: no more than it has seen running.
            await until(lambda: shows(3, "unknown"), "the running count as the limit")
            replica.running, replica.waiting = 4, 5  # running stops at 4; more wait
            await until(lambda: shows(4, "learned"), "the limit learned at 4")

            async def gauge(*want: str) -> bool:  # every worker's series shows ``want``
                series = await admission_gauge(s, lb, url)
                return bool(series) and set(series) <= set(want)

            await until(lambda: gauge("learned 4.0"), "the gauge: learned, 4")
            workers = len(await admission_gauge(s, lb, url))
            replica.running, replica.waiting = 6, 0  # restarted with a larger limit
            await until(lambda: shows(6, "unknown"), "learning again from 6")
            # engine_queue 1: while learning, the limit is what it has seen running
            await until(lambda: gauge("unknown 6.0"), "the gauge: unknown, 6")
    finally:
        lb.stop()
    log = (tmp_path / "lb.log").read_text()  # a line per worker and change, not per probe
    assert log.count(f"replica {url}: admission limit learned: 4 ") == workers, log
    assert log.count(f"replica {url}: learned admission limit 4 dropped") == workers, log


async def test_a_configured_limit_is_told_not_learned(
        tmp_path: Path, fake: tuple[FakeVllm, str]) -> None:
    replica, url = fake
    replica.running, replica.waiting = 4, 5
    lb = start_lb(tmp_path, url, max_num_seqs=8)
    try:
        async with aiohttp.ClientSession() as s:
            async def told() -> bool:
                st = await replica_status(s, lb, url)
                return st["max_num_seqs"] == 8 and st["max_num_seqs_source"] == "told"

            await until(told, "the configured limit, told")
    finally:
        lb.stop()


async def test_gauges_at_zero_and_replies_at_once_let_the_limit_rise(
        tmp_path: Path, fake: tuple[FakeVllm, str]) -> None:
    """Issue #35: an engine whose gauges read 0 while it answers non-streamed requests at
    once is never seen running more than one; sp-p used to hold it at a request or two
    and keep a queue at the balancer for good. It takes all it is sent with no queue:
    the limit rises to the clients' concurrency."""
    _, url = fake  # running 0, waiting 0 throughout
    lb = start_lb(tmp_path, url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession() as s:
            async def client() -> None:
                while True:
                    async with s.post(lb.url + "/v1/chat/completions", json=body) as r:
                        text = await r.text()
                    # A worker that has not probed the replica yet says so (503): back off.
                    if r.status == 503 and "no_healthy_replica" in text:
                        await asyncio.sleep(0.05)
                        continue
                    assert r.status == 200, text

            async def probed() -> bool:
                return (await replica_status(s, lb, url))["max_num_seqs"] == 1

            async def routable() -> bool:  # the model listed: requests are not refused
                async with s.post(lb.url + "/v1/chat/completions", json=body) as r:
                    return r.status == 200

            await until(probed, "a first probe: the limit at 1")
            await until(routable, "the replica taking requests")
            clients = [asyncio.create_task(client()) for _ in range(24)]
            try:
                async def risen() -> bool:
                    for c in clients:
                        if c.done():
                            c.result()  # a client that stopped: its failed request
                    st = await replica_status(s, lb, url)
                    return ((st["max_num_seqs"] or 0) >= 16
                            and st["max_num_seqs_source"] == "unknown")

                await until(risen, "the limit risen with what the engine took", timeout=30)
            finally:
                for c in clients:
                    c.cancel()
                for c in clients:
                    with contextlib.suppress(asyncio.CancelledError):
                        await c
    finally:
        lb.stop()
