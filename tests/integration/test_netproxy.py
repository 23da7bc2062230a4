"""The inter-region delay proxy: added round trip, ordering, black-holing."""

from __future__ import annotations

import asyncio
import time

from skymesh_lab.netproxy import DelayProxy


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def test_round_trip_is_delayed_in_order_and_can_be_cut() -> None:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = DelayProxy("127.0.0.1", port, delay_s=0.04)
    await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        t0 = time.monotonic()
        writer.write(b"ping")
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
        rtt = time.monotonic() - t0
        assert 0.08 <= rtt < 0.5, rtt
        payload = bytes(range(256)) * 64
        for i in range(0, len(payload), 1000):
            writer.write(payload[i:i + 1000])
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(len(payload)), 5) == payload
        proxy.blackhole = True
        writer.write(b"lost")
        await writer.drain()
        try:
            await asyncio.wait_for(reader.read(4), 0.3)
            raise AssertionError("a black-holed link delivered data")
        except TimeoutError:
            pass
        writer.close()
    finally:
        await proxy.stop()
        server.close()
        await server.wait_closed()
