"""Every breaker of a model open, on the live balancer in front of a stub replica: the
requests already queued when the last breaker opens, and the passthrough routes, get the
503 ``no_healthy_replica`` a new generation request gets (told to come back when the
first breaker lets a trial through, spread), not a wait up to ``queue.timeout_s`` or a replica
that is failing."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support import (
    chat_reply,
    eventually,
    get_metrics,
    idle_vllm_metrics,
    lb_status,
    ready_replicas,
    serving,
    start_lb_with,
    until,
)

from skymesh.balancer.overload import BREAKER_SPREAD_S
from skymesh.util.procs import Daemon

MODEL = "m"
QUEUE_TIMEOUT_S = 8.0  # what the queued requests sat out before the fix
OPEN_S = 300  # the breaker stays open past the queue timeout
_METRICS = idle_vllm_metrics(MODEL)
_REPLY = chat_reply(MODEL)


class Stub:
    """A replica whose probes answer; a chat prompt with "hold" waits for ``release`` and
    then fails with a 500, as does everything once ``broken``."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.held = asyncio.Event()
        self.broken = False
        self.app = web.Application()
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_post("/tokenize", self._tokenize)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=_METRICS)

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL,
                                                             "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        if b"hold" in await request.read():
            self.held.set()
            await self.release.wait()
            self.broken = True
        if self.broken:
            return web.json_response({"error": "boom"}, status=500)
        return web.json_response(_REPLY)

    async def _tokenize(self, _: web.Request) -> web.Response:
        if self.broken:
            return web.json_response({"error": "boom"}, status=500)
        return web.json_response({"tokens": [1, 2], "count": 2})


# One request per model let into the dispatcher's queue: the rest wait in the fair queue.
TENANTS: dict[str, Any] = {"dispatch_queue": 1, "reserve": {}}


@pytest.fixture
async def balancer(tmp_path: Path, request: pytest.FixtureRequest
                   ) -> AsyncIterator[tuple[Daemon, Stub, Path, bool]]:
    """One worker, one replica taking one request at a time (sp-o, max_outstanding 1),
    a breaker that opens on one failure and stays open past the queue timeout; with
    ``tenants`` when parametrized with that section."""
    stub = Stub()
    async with serving(stub.app) as port:
        cfg: dict[str, Any] = {
            "region": "test", "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
            "policy": {"name": "round-robin"},
            "pushing": {"mode": "sp-o", "max_outstanding": 1},
            "probe": {"interval_s": 0.05},
            "queue": {"timeout_s": QUEUE_TIMEOUT_S},
            "breaker": {"failure_threshold": 1, "open_s": OPEN_S},
            "logging": {"format": "text", "access_log": True},
            "replicas": [{"url": f"http://127.0.0.1:{port}"}],
        }
        tenants = getattr(request, "param", None)
        if tenants is not None:
            cfg["tenants"] = tenants
        lb = start_lb_with(tmp_path, cfg, {})
        try:
            yield lb, stub, tmp_path / "lb.log", tenants is not None
        finally:
            stub.release.set()
            lb.stop()


async def _post(s: aiohttp.ClientSession, lb: Daemon, content: str, rid: str = ""
                ) -> tuple[int, Any, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    headers = {"X-Request-Id": rid} if rid else {}
    async with s.post(lb.url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.json(), r.headers


def _retry_after(headers: Any) -> float:
    ms = int(headers["retry-after-ms"])
    assert int(headers["Retry-After"]) == -(-ms // 1000)
    return ms / 1000


@pytest.mark.parametrize("balancer", [None, TENANTS], ids=["fcfs", "tenants"],
                         indirect=True)
async def test_queued_requests_fail_at_once_when_the_last_breaker_opens(
        balancer: tuple[Daemon, Stub, Path, bool]) -> None:
    """A request holds the only slot; three queue behind it (with tenants, two of them in
    the fair queue); it then fails, opening the only breaker. Before the fix the three
    sat out ``queue.timeout_s`` and ended in a 503 ``no_capacity`` whose Retry-After
    (1 s) said nothing of the breaker."""
    lb, stub, log_path, _ = balancer
    # Under the queue timeout: a request that waits it out fails the test here.
    guard = aiohttp.ClientTimeout(total=QUEUE_TIMEOUT_S - 2)
    async with aiohttp.ClientSession(timeout=guard) as s:
        await ready_replicas(s, lb.url, 1)
        holder = asyncio.create_task(_post(s, lb, "hold"))
        await asyncio.wait_for(stub.held.wait(), 5)
        waiting = [asyncio.create_task(_post(s, lb, f"q{i}", rid=f"queued-{i}"))
                   for i in range(3)]

        async def queued() -> bool:
            m = await get_metrics(s, lb.url)
            return m["skymesh_queue_length"] + m.get("skymesh_tenant_queue_length", 0) == 3
        await until(queued, "three requests queued behind the held one")
        stub.release.set()

        status, body, _ = await holder
        assert status == 502, body  # its retry has nowhere to go (issue #35)
        waits = []
        for status, body, headers in await asyncio.gather(*waiting):
            assert status == 503, body
            assert body["error"]["code"] == "no_healthy_replica"
            assert "circuit breaker" in body["error"]["message"]
            waits.append(_retry_after(headers))
            # the trial's time, spread upward
            assert QUEUE_TIMEOUT_S < waits[-1] <= OPEN_S + BREAKER_SPREAD_S
        assert len(set(waits)) > 1  # not all told to come back in the same instant

        assert (await lb_status(s, lb.url))["queued"] == 0
        m = await get_metrics(s, lb.url)
        assert m["skymesh_queue_length"] == m.get("skymesh_tenant_queue_length", 0) == 0

    # The balancer's log says why those requests ended, naming them (with tenants, the
    # fair queue's waiters in the tenant gate's line, the dispatcher's in skymesh.lb's).
    def named() -> set[str]:
        return {rid for line in log_path.read_text().splitlines()
                if ("skymesh.lb" in line or "skymesh.balancer.tenant_gate" in line)
                and "ended at once" in line and "circuit breaker open" in line
                for rid in re.findall(r"queued-\d", line)}
    ids = {f"queued-{i}" for i in range(3)}
    await eventually(lambda: named() == ids, "the log lines naming the failed requests")


async def test_passthrough_answers_503_while_every_breaker_is_open(
        balancer: tuple[Daemon, Stub, Path, bool]) -> None:
    """Before the fix the passthrough route went to the replica behind the open breaker
    and relayed its 500."""
    lb, stub, _, _ = balancer
    stub.release.set()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        await ready_replicas(s, lb.url, 1)
        async with s.post(lb.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}) as r:
            assert r.status == 200  # the breaker closed: forwarded
        status, body, _ = await _post(s, lb, "hold")  # fails: the breaker opens
        assert status == 502, body
        replicas = (await lb_status(s, lb.url))["replicas"]
        assert [r["breaker"] for r in replicas.values()] == ["open"]
        for payload in ({"model": MODEL, "prompt": "hi"}, {"prompt": "no model"}):
            async with s.post(lb.url + "/tokenize", json=payload) as r:
                assert r.status == 503, await r.text()
                assert (await r.json())["error"]["code"] == "no_healthy_replica"
                assert QUEUE_TIMEOUT_S < _retry_after(r.headers) <= OPEN_S + BREAKER_SPREAD_S
