"""A closed lean connection is freed by reference counting (issue #35 item 5): its
protocol, parser, task and requests left for the cyclic GC pile up between full
collections, which skymesh.net.serving.tune_gc makes rare (the rss-soak page's probe
counted up to 109 closed connections per worker)."""

from __future__ import annotations

import asyncio
import gc

import pytest
from support import eventually
from test_lean_server import echo_req, exchange, lean_server

from skymesh.net.lean import LeanProtocol
from skymesh.net.lean_request import LeanRequest


def _alive() -> tuple[int, int]:
    """Lean protocols and requests the collector tracks, unreachable ones included."""
    objects = gc.get_objects()
    return (sum(type(o) is LeanProtocol for o in objects),
            sum(type(o) is LeanRequest for o in objects))


@pytest.mark.usefixtures("no_cyclic_gc")
async def test_connections_closed_after_their_answers_are_freed_without_the_cyclic_gc(
        ) -> None:
    async with lean_server() as (port, _, _):
        for _ in range(10):
            await exchange(port, echo_req())
        # two requests on one connection, then close
        await exchange(port, echo_req() + echo_req(), responses=2)
        await eventually(lambda: _alive() == (0, 0), "every closed connection freed")


@pytest.mark.usefixtures("no_cyclic_gc")
async def test_a_connection_whose_client_left_mid_request_is_freed_too() -> None:
    async with lean_server() as (port, probe, _):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + echo_req())  # one queued
        await writer.drain()
        await asyncio.wait_for(probe.slow_started.wait(), 10)
        writer.close()
        await eventually(lambda: probe.slow_ended == ["cancelled"], "the handler cancelled")
        await eventually(lambda: _alive() == (0, 0), "the connection freed")
