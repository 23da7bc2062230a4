"""The balancer's upstream HTTP/1.1 client (skymesh.balancer.upstream) against scripted
servers on loopback: framing, keep-alive reuse, stale connections, errors, timeouts,
backpressure and cancellation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from support import eventually

from skymesh.balancer.upstream import (
    HIGH_WATER,
    Upstream,
    UpstreamConnectionError,
    UpstreamPayloadError,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server running ``handler`` per connection; yields its URL and a list
    that grows by one per accepted connection."""
    conns: list[int] = []

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(1)
        try:
            await handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", conns
    finally:
        srv.close()


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await r.readexactly(length)


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")


async def test_chunked_and_sized_replies_on_one_kept_alive_connection() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(r)
            seen.append((head, body))
            if len(seen) % 2:
                w.write(SSE_HEAD + chunked(b"data: 1\n\n", b"data: 2\n\n"))
            else:
                w.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n"
                        b"X-Extra: yes\r\n\r\nnope!")
            await w.drain()

    async with server(handler) as (url, conns):
        up = Upstream(connect_timeout_s=2, read_timeout_s=5)
        for i in range(4):
            reply = await up.post(url + "/base/", "/v1/chat/completions", b'{"x": %d}' % i,
                                  {"Content-Type": "application/json",
                                   "Authorization": "Bearer k"})
            if i % 2 == 0:
                assert reply.status == 200
                assert reply.headers["content-type"] == "text/event-stream"
                assert b"".join([c async for c in reply.content.iter_any()]) == \
                    b"data: 1\n\ndata: 2\n\n"
            else:
                assert (reply.status, reply.headers["X-Extra"]) == (404, "yes")
                assert await reply.read() == b"nope!"
            reply.release()
            reply.release()  # twice is harmless: the connection is pooled once
        await up.close()
    assert len(conns) == 1, "every request reused the first connection"
    head, body = seen[0]
    assert head.startswith(b"POST /base/v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:" in head and b"\r\nAuthorization: Bearer k\r\n" in head
    assert body == b'{"x": 0}'


async def test_a_get_has_no_body_and_shares_the_kept_alive_connection() -> None:
    heads: list[bytes] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(r)
            heads.append(head + body)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\nvllm:x 1.0\n\n")
            await w.drain()

    async with server(handler) as (url, conns):
        up = Upstream(connect_timeout_s=2, read_timeout_s=5)
        for _ in range(3):  # probes, then a generate request on the same connection
            reply = await up.get(url, "/metrics", {"Authorization": "Bearer k"})
            assert (reply.status, await reply.read()) == (200, b"vllm:x 1.0\n\n")
            reply.release()
        reply = await up.post(url, "/v1/completions", b"{}", {})
        assert await reply.read() == b"vllm:x 1.0\n\n"
        reply.release()
        await up.close()
    assert len(conns) == 1
    assert heads[0].startswith(b"GET /metrics HTTP/1.1\r\n")
    assert heads[0].endswith(b"\r\n\r\n") and b"content-length" not in heads[0].lower()
    assert b"\r\nAuthorization: Bearer k\r\n" in heads[0]
    assert heads[3].startswith(b"POST /v1/completions HTTP/1.1\r\n") and \
        heads[3].endswith(b"\r\n\r\n{}")


def answer_once(reply: bytes, hold: bool = False) -> Handler:
    """A connection handler that answers one request with ``reply`` (may be partial or
    empty), then closes the connection, or with ``hold`` waits for the client to."""
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(reply)
        await w.drain()
        if hold:
            await r.read()  # EOF: the client closed it

    return handler


async def test_a_connection_the_replica_closed_is_replaced_not_reported() -> None:
    """A replica closing idle keep-alive connections (uvicorn does after 5 s) must not
    fail the next request: nothing of it reached the engine."""
    # Each connection closes after one answer, as a server whose keep-alive timer fired.
    handler = answer_once(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    async with server(handler) as (url, conns):
        up = Upstream(connect_timeout_s=2, read_timeout_s=5)
        for _ in range(3):
            reply = await up.post(url, "/v1/completions", b"{}", {})
            assert await reply.read() == b"ok"
            reply.release()
        await up.close()
    assert len(conns) == 3


async def test_errors_are_the_aiohttp_kinds_the_proxy_treats_as_replica_faults() -> None:
    up = Upstream(connect_timeout_s=2, read_timeout_s=0.3)
    async with server(answer_once(b"")) as (url, _):
        pass  # closed: nobody listens on that port any more
    with pytest.raises(UpstreamConnectionError, match="cannot connect"):
        await up.post(url, "/v1/completions", b"{}", {})

    async with server(answer_once(b"SPDY/9 nonsense\r\n\r\n", hold=True)) as (url, _):
        with pytest.raises(UpstreamPayloadError):
            await up.post(url, "/v1/completions", b"{}", {})

    async with server(answer_once(b"", hold=True)) as (url, _):  # says nothing
        with pytest.raises(TimeoutError):
            await up.post(url, "/v1/completions", b"{}", {})

    # One event of a stream, then the connection ends.
    async with server(answer_once(SSE_HEAD + b"9\r\ndata: 1\n\n\r\n")) as (url, _):
        reply = await up.post(url, "/v1/completions", b"{}", {})
        it = reply.content.iter_any()
        assert await it.__anext__() == b"data: 1\n\n"
        with pytest.raises(UpstreamConnectionError):
            await it.__anext__()
        reply.release()
    with pytest.raises(ValueError, match="line break"):
        await up.post(url, "/x", b"", {"X-Evil": "a\r\nInjected: 1"})
    await up.close()


async def test_a_body_delimited_by_the_connection_end_is_complete() -> None:
    handler = answer_once(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
    async with server(handler) as (url, _):
        up = Upstream(connect_timeout_s=2, read_timeout_s=5)
        reply = await up.post(url, "/v1/completions", b"{}", {})
        assert await reply.read() == b"all of it"
        reply.release()
        await up.close()


async def test_a_slow_reader_pauses_the_replica_and_an_abandoned_reply_closes() -> None:
    """Backpressure: with nobody reading the reply, the balancer stops reading the socket
    past HIGH_WATER, so the replica's writes block (it waits in drain with bytes queued)
    instead of the balancer buffering without bound. Releasing a reply midway closes its
    connection, so the replica sees the client leave and stops generating."""
    sent = 0
    blocked = False
    closed = asyncio.Event()
    writer: list[asyncio.StreamWriter] = []

    async def flood(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal sent, blocked
        writer.append(w)
        await read_request(r)
        w.write(SSE_HEAD)
        piece = b"x" * 16384
        try:
            while True:
                w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
                blocked = True
                await w.drain()
                blocked = False
        except ConnectionError:
            closed.set()
            raise

    def stalled() -> bool:
        return blocked and writer[0].transport.get_write_buffer_size() > 0

    async with server(flood) as (url, _):
        up = Upstream(connect_timeout_s=2, read_timeout_s=5)
        reply = await up.post(url, "/v1/completions", b"{}", {})
        await eventually(lambda: reply.reading_paused and stalled(),
                         "the balancer paused reading and the replica blocked")
        # Kernel socket buffers hold a few MB on loopback; the balancer holds HIGH_WATER.
        assert sent < HIGH_WATER + 32 * 2**20
        got = await reply.content.iter_any().__anext__()
        # Paused at HIGH_WATER, give or take one socket read (the loop reads 256 KB).
        assert HIGH_WATER <= len(got) <= HIGH_WATER + 256 * 1024
        reply.release()
        await asyncio.wait_for(closed.wait(), 5)
        await up.close()


async def test_cancelling_a_request_in_flight_closes_its_connection() -> None:
    received = asyncio.Event()
    closed = asyncio.Event()

    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        received.set()
        await r.read()  # returns at EOF: the balancer hung up
        closed.set()

    async with server(slow) as (url, _):
        up = Upstream(connect_timeout_s=2, read_timeout_s=30)
        task = asyncio.ensure_future(up.post(url, "/v1/completions", b"{}", {}))
        await asyncio.wait_for(received.wait(), 5)  # the replica has the request
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 5)
        await up.close()
