"""A burst of new clients is accepted in a few loop iterations (issue #35, item 4).

uvloop's own server (libuv >= 1.45) accepts one connection per loop iteration; at c=256 a
busy balancer took seconds to accept a burst of new clients while their first requests
waited unread (docs/notes/c256-tail.md). skymesh.net.accept takes them in batches.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
from aiohttp import web

from skymesh.net import accept
from skymesh.net.accept import accept_waiting
from skymesh.net.limits import ConnLimits
from skymesh.net.serving import start_app

BURST = 64
ITERATIONS = 8  # loop iterations allowed for the whole burst (one accept each: 8 only)

RUNNERS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {
    "uvloop": uvloop.run, "asyncio": asyncio.run}


async def _hello(_: web.Request) -> web.Response:
    return web.Response(text="hi")


@pytest.mark.parametrize("loop_name", sorted(RUNNERS))
def test_a_burst_of_new_connections_is_accepted_within_a_few_loop_iterations(
        loop_name: str) -> None:
    seen: dict[str, int] = {}

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/", _hello)
        runner, guard = await start_app(app, "127.0.0.1", 0, "test", ConnLimits())
        port = runner.addresses[0][1]
        clients: list[socket.socket] = []
        try:
            # Blocking connects complete in the kernel (the backlog is deep): the burst
            # waits in the accept queue before the loop runs again.
            for _ in range(BURST):
                clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            for _ in range(ITERATIONS):
                await asyncio.sleep(0)  # one loop iteration, which polls the sockets
            seen["open"] = guard.open
        finally:
            for c in clients:
                c.close()
            await runner.cleanup()

    RUNNERS[loop_name](scenario())
    assert seen["open"] == BURST


def test_accept_waiting_takes_at_most_its_limit_and_stops_on_an_empty_queue() -> None:
    with socket.create_server(("127.0.0.1", 0), backlog=16) as lsock:
        lsock.setblocking(False)
        port = lsock.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(5)]
        try:
            first, err1 = accept_waiting(lsock, 3)
            rest, err2 = accept_waiting(lsock, 3)
            none, err3 = accept_waiting(lsock, 3)
            assert (len(first), len(rest), len(none)) == (3, 2, 0)
            assert (err1, err2, err3) == (None, None, None)
            assert all(not s.getblocking() for s in first + rest)
            for s in first + rest:
                s.close()
        finally:
            for c in clients:
                c.close()


async def test_out_of_descriptors_pauses_accepting_logs_it_and_then_resumes(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    made: list[asyncio.BaseTransport] = []

    class Count(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            made.append(transport)

    real = accept.accept_waiting
    failures = [OSError(errno.EMFILE, "Too many open files")]

    def flaky(sock: socket.socket, limit: int) -> tuple[list[socket.socket], OSError | None]:
        if failures:
            return [], failures.pop()
        return real(sock, limit)

    monkeypatch.setattr(accept, "accept_waiting", flaky)
    monkeypatch.setattr(accept, "RETRY_DELAY_S", 0.05)
    server = accept.BatchAcceptServer(accept.listen_sockets("127.0.0.1", 0, 16), Count)
    await server.start_serving()
    loop = asyncio.get_running_loop()
    port = server.sockets[0].getsockname()[1]
    client = socket.socket()
    client.setblocking(False)
    try:
        with caplog.at_level(logging.WARNING, logger="skymesh.net.accept"):
            await loop.sock_connect(client, ("127.0.0.1", port))
            end = loop.time() + 10
            while not made and loop.time() < end:
                await asyncio.sleep(0.01)
        assert not failures and len(made) == 1  # refused once, then accepted
        assert "accepting again" in caplog.text
    finally:
        client.close()
        for t in made:
            t.close()
        server.close()
        await server.wait_closed()
