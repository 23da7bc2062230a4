"""A TCP relay that adds one-way delay per direction and can black-hole a link.

This kernel has no ``tc netem``, so the local multi-region mesh puts one of these on every
inter-region link: bytes are forwarded in order, each chunk released ``delay_s`` after it
arrived, so a round trip through the relay costs ``2 x delay_s`` on top of loopback. With
``blackhole`` set, bytes are swallowed in both directions (connections stay open, as on a
partitioned network) until it is cleared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

log = logging.getLogger(__name__)


class DelayProxy:
    def __init__(self, target_host: str, target_port: int, delay_s: float,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.host, self.port = host, port
        self.blackhole = False
        self.connections = 0  # accepted so far: shows whether callers reuse connections
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await t

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                      ) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def release() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    break
                if not self.blackhole:
                    dst.write(data)
                    await dst.drain()

        sender = asyncio.create_task(release())
        try:
            while data := await src.read(65536):
                queue.put_nowait((loop.time() + self.delay_s, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((loop.time() + self.delay_s, b""))
            with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
                await sender
            dst.close()
