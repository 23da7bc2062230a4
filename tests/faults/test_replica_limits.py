"""A replica that sends the balancer too much: a huge non-streamed body, a huge body on a
5xx, huge response headers, a huge or costly /metrics. A real ``skymesh-lb`` process, an
in-test stand-in replica on loopback (a raw HTTP/1.1 server, so it can send what no
framework would), and the balancer's peak RSS from /proc (VmHWM): the reply must be
refused before it is read whole, the client must get a clear 502, and a replica whose
/metrics breaks the bounds must go unhealthy while the healthy one keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support import get_metrics, until

from skymesh.util.procs import Daemon, start_daemon

pytestmark = pytest.mark.timeout(180)

MODEL = "standin-model"
MB = 1 << 20
SMALL_METRICS = (b'vllm:num_requests_waiting{model_name="m"} 0\n'
                 b'vllm:num_requests_running{model_name="m"} 0\n')
OK_BODY = json.dumps({"id": "x", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hi"},
     "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                          "total_tokens": 2}}).encode()

Writer = Callable[[asyncio.StreamWriter], Awaitable[None]]


def peak_rss(pid: int) -> int:
    """Peak resident set size of ``pid`` so far (VmHWM, Linux /proc), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def costly_metrics(size: int) -> bytes:
    """Valid Prometheus text of about ``size`` bytes, the load families first and no
    ``# HELP`` lines, so a parser has to read all of it."""
    lines = [SMALL_METRICS]
    n = 0
    total = len(SMALL_METRICS)
    while total < size:
        line = b'filler_series{i="%d",pad="xxxxxxxxxxxxxxxxxxxxxxxx"} 1\n' % n
        lines.append(line)
        total += len(line)
        n += 1
    return b"".join(lines)


class StandIn:
    """A replica that answers /metrics with ``metrics`` and a chat completion as the
    user message names: ``ok``, ``huge_body``, ``huge_chunked``, ``huge_500``,
    ``huge_headers``. ``sent`` counts the bytes it got out before being cut off."""

    def __init__(self) -> None:
        self.metrics = SMALL_METRICS
        self.sent = 0

    async def on_conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await r.readexactly(length)
                path = head.split(b" ", 2)[1]
                if path == b"/metrics":
                    await self.send(w, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n"
                                    % len(self.metrics) + self.metrics)
                elif path == b"/v1/chat/completions":
                    mode = json.loads(body)["messages"][0]["content"]
                    await getattr(self, mode)(w)
                else:
                    await self.send(w, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    async def send(self, w: asyncio.StreamWriter, data: bytes) -> None:
        w.write(data)
        await w.drain()
        self.sent += len(data)

    async def ok(self, w: asyncio.StreamWriter) -> None:
        await self.send(w, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(OK_BODY) + OK_BODY)

    async def _big(self, w: asyncio.StreamWriter, head: bytes, chunked: bool) -> None:
        await self.send(w, head)
        part = b" " * MB
        for _ in range(300):
            await self.send(w, b"%x\r\n%s\r\n" % (MB, part) if chunked else part)
        if chunked:
            await self.send(w, b"0\r\n\r\n")

    async def huge_body(self, w: asyncio.StreamWriter) -> None:
        await self._big(w, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % (300 * MB), chunked=False)

    async def huge_chunked(self, w: asyncio.StreamWriter) -> None:
        await self._big(w, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n", chunked=True)

    async def huge_500(self, w: asyncio.StreamWriter) -> None:
        await self._big(w, b"HTTP/1.1 500 Internal Server Error\r\n"
                        b"Content-Length: %d\r\n\r\n" % (300 * MB), chunked=False)

    async def huge_headers(self, w: asyncio.StreamWriter) -> None:
        await self.send(w, b"HTTP/1.1 200 OK\r\nX-Padding: ")
        for _ in range(100):
            await self.send(w, b"p" * MB)
        await self.send(w, b"\r\nContent-Length: 2\r\n\r\n{}")


@contextlib.asynccontextmanager
async def standing_in(stand: StandIn) -> AsyncIterator[str]:
    srv = await asyncio.start_server(stand.on_conn, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    finally:
        srv.close()


def balancer(tmp: Path, replicas: list[dict[str, Any]], **sections: Any) -> Daemon:
    cfg: dict[str, Any] = {
        # One process: the tests read its memory (/proc/PID), replica state and exact
        # counters.
        "region": "test", "listen": {"host": "127.0.0.1", "port": 0, "workers": 1},
        "policy": {"name": "round-robin"}, "probe": {"interval_s": 0.05},
        "retry": {"max_attempts": 1}, "replicas": replicas, **sections,
    }
    path = tmp / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start_daemon("skymesh-lb", ["--config", str(path)], log_path=tmp / "lb.log")


async def replica_state(s: aiohttp.ClientSession, lb: Daemon, url: str) -> dict[str, Any]:
    async with s.get(lb.url + "/status") as r:
        st: dict[str, Any] = (await r.json())["replicas"][url]
        return st


async def chat(s: aiohttp.ClientSession, lb: Daemon, content: str, model: str = MODEL
               ) -> tuple[int, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4}
    async with s.post(lb.url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.parametrize("mode", ["huge_body", "huge_chunked", "huge_500", "huge_headers"])
async def test_a_huge_reply_is_refused_not_read_whole(tmp_path: Path, mode: str) -> None:
    stand = StandIn()
    async with standing_in(stand) as url, aiohttp.ClientSession() as s:
        lb = balancer(tmp_path, [{"url": url, "models": [MODEL]}])
        try:
            async def healthy() -> bool:
                return bool((await replica_state(s, lb, url))["healthy"])
            await until(healthy, "the stand-in healthy")
            assert (await chat(s, lb, "ok"))[0] == 200
            before = peak_rss(lb.proc.pid)
            status, body = await chat(s, lb, mode)
            grew = peak_rss(lb.proc.pid) - before
            print(f"{mode}: balancer peak RSS {before / MB:.0f} MB -> +{grew / MB:.0f} MB; "
                  f"the stand-in got {stand.sent / MB:.0f} MB out")
            assert status == 502, body
            err = body["error"]
            assert err["type"] == "server_error" and err["code"] == "upstream_failed"
            if mode in ("huge_body", "huge_chunked"):
                assert "max_response_body_bytes" in err["message"]
            # 300 MB (100 MB of headers) offered; the balancer holds at most its cap.
            assert grew < 64 * MB
            if mode != "huge_500":
                limit = "headers" if mode == "huge_headers" else "body"
                m = await get_metrics(s, lb.url)
                assert m[f'skymesh_replica_limit_hits_total{{limit="{limit}",'
                         f'replica="{url}"}}'] >= 1
            assert (await chat(s, lb, "ok"))[0] == 200  # and it still serves
        finally:
            lb.stop()


async def p50_ms(s: aiohttp.ClientSession, lb: Daemon, model: str, n: int = 60,
                 rate: float = 20.0) -> float:
    """Median latency of ``n`` requests arriving at ``rate`` a second (open loop, so a
    stalled event loop shows in the median as the share of time it is stalled)."""
    async def one() -> float:
        t = time.perf_counter()
        status, body = await chat(s, lb, "hello there", model)
        assert status == 200, body
        return time.perf_counter() - t

    tasks = []
    for _ in range(n):
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(1 / rate)  # the arrival process, not a wait for a condition
    return statistics.median(await asyncio.gather(*tasks)) * 1e3


@pytest.mark.parametrize("size", [20 * MB, 3 * MB], ids=["over-size-cap", "costly-parse"])
async def test_a_replica_with_a_huge_metrics_goes_unhealthy_and_others_serve(
        tmp_path: Path, size: int) -> None:
    """A healthy real replica serves the chat; the stand-in (another model) serves a
    /metrics over the size cap (20 MB), or under it but costly to parse (3 MB, no HELP
    lines). It must go unhealthy; the healthy replica's requests all succeed."""
    real = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.01"],
                        log_path=tmp_path / "replica.log")
    stand = StandIn()
    async with standing_in(stand) as url, aiohttp.ClientSession() as s:
        lb = balancer(tmp_path, [{"url": real.url}, {"url": url, "models": [MODEL]}])
        try:
            async def both() -> bool:
                return all([(await replica_state(s, lb, u))["healthy"]
                            for u in (real.url, url)])
            await until(both, "both replicas healthy")
            async with s.get(real.url + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            quiet = await p50_ms(s, lb, model)
            stand.metrics = costly_metrics(size)

            async def down() -> bool:
                return not (await replica_state(s, lb, url))["healthy"]
            await until(down, "the stand-in unhealthy", timeout=30)
            attacked = await p50_ms(s, lb, model)
            print(f"{size // MB} MB /metrics: healthy replica's p50 through the balancer "
                  f"{quiet:.1f} ms before, {attacked:.1f} ms while it is probed")
            st = await replica_state(s, lb, url)
            assert not st["healthy"]
            err = st["probe_error"] or ""
            assert "cap" in err or "parse" in err, err
            m = await get_metrics(s, lb.url)
            limit = "metrics" if size > 4 * MB else "metrics_parse"
            assert m[f'skymesh_replica_limit_hits_total{{limit="{limit}",'
                     f'replica="{url}"}}'] >= 1
            stand.metrics = SMALL_METRICS  # and it comes back once /metrics is sane

            async def back() -> bool:
                return bool((await replica_state(s, lb, url))["healthy"])
            await until(back, "the stand-in healthy again", timeout=30)
        finally:
            lb.stop()
            real.stop()
