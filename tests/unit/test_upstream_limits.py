"""Caps on what a replica sends the balancer (skymesh.balancer.upstream): response headers,
a body read whole, an error's detail; scripted servers on loopback that count what they
managed to send before the balancer hung up. And the pure pieces beside them: which
streams a replica marked down loses (skymesh.balancer.streaming.stalled) and the /metrics
parse gate (skymesh.balancer.probing.ParseGate)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from skymesh.balancer.probing import QUIET_FACTOR, ParseGate
from skymesh.balancer.streaming import stalled
from skymesh.balancer.upstream import (
    ReplyTooLarge,
    Upstream,
    UpstreamConnectionError,
    read_capped,
    read_head,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, list[int]], Awaitable[None]]
MB = 1 << 20


@contextlib.asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server running ``handler`` per connection; yields its URL and a list
    holding the bytes the handler got through before the peer hung up."""
    sent = [0]

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await r.readuntil(b"\r\n\r\n")
            await handler(r, w, sent)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", sent
    finally:
        srv.close()


async def send(w: asyncio.StreamWriter, sent: list[int], data: bytes) -> None:
    w.write(data)
    await w.drain()
    sent[0] += len(data)


async def test_endless_headers_are_refused_before_they_are_read_whole() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, sent: list[int]
                      ) -> None:
        await send(w, sent, b"HTTP/1.1 200 OK\r\nX-Big: ")
        for _ in range(64):  # 64 MB of one header value
            await send(w, sent, b"a" * MB)
        await send(w, sent, b"\r\nContent-Length: 2\r\n\r\n{}")

    async with server(handler) as (url, sent):
        up = Upstream(connect_timeout_s=2, read_timeout_s=5, max_header_bytes=64 << 10)
        with pytest.raises(ReplyTooLarge) as info:
            await up.post(url, "/v1/completions", b"{}", {})
        assert info.value.what == "headers"
        # The balancer hung up: the server could not push the 64 MB through (what it got
        # out is the socket buffers' worth).
        await asyncio.sleep(0)
        assert sent[0] < 16 * MB
        await up.close()


async def test_headers_under_the_cap_pass() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, sent: list[int]
                      ) -> None:
        await send(w, sent, b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 30_000 +
                   b"\r\nContent-Length: 2\r\n\r\n{}")

    async with server(handler) as (url, _):
        up = Upstream(connect_timeout_s=2, read_timeout_s=5, max_header_bytes=64 << 10)
        reply = await up.post(url, "/v1/completions", b"{}", {})
        assert await read_capped(reply, 1024) == b"{}"
        reply.release()
        await up.close()


@pytest.mark.parametrize("framing", ["content-length", "chunked", "connection-close"])
async def test_a_body_over_the_cap_is_refused_and_its_connection_dropped(framing: str
                                                                         ) -> None:
    total = 256 * MB

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, sent: list[int]
                      ) -> None:
        head = {"content-length": b"Content-Length: %d\r\n" % total,
                "chunked": b"Transfer-Encoding: chunked\r\n",
                "connection-close": b"Connection: close\r\n"}[framing]
        await send(w, sent, b"HTTP/1.1 200 OK\r\n" + head + b"\r\n")
        part = b"x" * MB
        for _ in range(total // MB):
            await send(w, sent, b"%x\r\n%s\r\n" % (MB, part) if framing == "chunked"
                       else part)

    async with server(handler) as (url, sent):
        up = Upstream(connect_timeout_s=2, read_timeout_s=5)
        reply = await up.post(url, "/v1/completions", b"{}", {})
        with pytest.raises(ReplyTooLarge) as info:
            await read_capped(reply, 4 * MB)
        assert info.value.what == "body"
        reply.release()  # unfinished: the connection goes, not back to the pool
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(_until_stopped(sent), 5)
        assert sent[0] < 32 * MB
        await up.close()


async def _until_stopped(sent: list[int]) -> None:
    """Until the server's count stops moving (it hit the closed connection)."""
    last = -1
    while sent[0] != last:
        last = sent[0]
        await asyncio.sleep(0.05)


async def test_an_error_detail_is_its_first_bytes_only() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, sent: list[int]
                      ) -> None:
        await send(w, sent, b"HTTP/1.1 500 Oops\r\nContent-Length: %d\r\n\r\n" % (300 * MB))
        for _ in range(300):
            await send(w, sent, b"e" * MB)

    async with server(handler) as (url, sent):
        up = Upstream(connect_timeout_s=2, read_timeout_s=5)
        reply = await up.post(url, "/v1/completions", b"{}", {})
        assert await read_head(reply, 200) == b"e" * 200
        reply.release()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(_until_stopped(sent), 5)
        assert sent[0] < 32 * MB
        await up.close()


async def test_bytes_on_an_idle_connection_drop_it() -> None:
    done = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, sent: list[int]
                      ) -> None:
        await send(w, sent, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await send(w, sent, b"HTTP/1.1 200 OK\r\nX-Unasked: 1\r\n")  # nobody asked
        await done.wait()  # the connection stays open: only the balancer may drop it

    async with server(handler) as (url, _):
        up = Upstream(connect_timeout_s=2, read_timeout_s=5)
        reply = await up.post(url, "/x", b"{}", {})
        assert await reply.read() == b"{}"
        conn = reply._conn
        reply.release()
        for _ in range(100):
            if conn.lost:
                break
            await asyncio.sleep(0.01)
        assert conn.lost
        done.set()
        await up.close()


async def test_close_with_a_reason_is_what_the_reader_gets() -> None:
    done = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, sent: list[int]
                      ) -> None:
        await send(w, sent, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                   b"5\r\nhello\r\n")
        await done.wait()

    async with server(handler) as (url, _):
        up = Upstream(connect_timeout_s=2, read_timeout_s=5)
        reply = await up.post(url, "/x", b"{}", {})
        assert await reply.__anext__() == b"hello"
        reply.close("marked down")
        with pytest.raises(UpstreamConnectionError, match="marked down"):
            await reply.__anext__()
        reply.release()
        done.set()
        await up.close()


# -- which streams a replica marked down loses ------------------------------------------
def test_stalled_streams_are_those_on_a_down_replica_idle_long_enough() -> None:
    a, b, c, d, e = (object() for _ in range(5))
    streams: list[tuple[Any, str, float | None]] = [
        (a, "r1", 95.0),   # down, idle 5 s: cut
        (b, "r1", 99.5),   # down, had bytes 0.5 s ago: alive, goes on
        (c, "r2", 90.0),   # idle, but its replica is up
        (d, "r1", None),   # down, no timestamp (aiohttp's reply): cut
        (e, "r1", 98.0),   # exactly idle_s: cut
    ]
    assert stalled(streams, {"r1"}, now=100.0, idle_s=2.0) == [(a, "r1"), (d, "r1"),
                                                               (e, "r1")]
    assert stalled(streams, set(), now=100.0, idle_s=2.0) == []


# -- the /metrics parse gate -------------------------------------------------------------
async def test_the_parse_gate_allows_one_parse_at_a_time() -> None:
    gate = ParseGate()
    assert gate.refuses(0.0) is None
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    gate.running = fut
    assert "still running" in (gate.refuses(1.0) or "")
    fut.set_result(None)
    assert gate.refuses(1.0) is None


def test_a_parse_over_budget_quiets_the_replica_for_a_multiple_of_its_cost() -> None:
    gate = ParseGate()
    gate.finished(0.05, budget=0.1, now=10.0)  # within budget: no pause
    assert gate.refuses(10.0) is None
    gate.finished(0.5, budget=0.1, now=10.0)
    until = 10.0 + QUIET_FACTOR * 0.5
    assert gate.refuses(until - 0.01) is not None
    assert gate.refuses(until) is None
