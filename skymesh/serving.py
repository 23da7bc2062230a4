"""Running an aiohttp application until SIGINT/SIGTERM (shared by the daemons)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web


def run(main: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run`` on uvloop when it is installed (the ``fast`` extra).

    uvloop's event loop takes about 0.15 ms off the balancer's added latency per request
    at moderate rates (measured by skymesh.bench.overhead); asyncio's loop works the same,
    only slower.
    """
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


async def serve_app(app: web.Application, host: str, port: int, name: str, detail: str = "",
                    on_bound: Callable[[str], Awaitable[None]] | None = None) -> None:
    """Serve ``app`` on ``host:port`` (0: any free port) until a stop signal.

    Prints ``NAME listening on http://HOST:PORT`` to stderr once bound: scripts and tests
    read the real port from it.
    """
    # handler_cancellation: a client that disconnects cancels its handler, whose finally
    # block releases what the request held (aiohttp leaves this off by default).
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0,
                           access_log=logging.getLogger(f"{name}.access"))
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        suffix = f" ({detail})" if detail else ""
        if on_bound is not None:
            await on_bound(f"http://{shown}:{bound_port}")
        print(f"{name} listening on http://{shown}:{bound_port}{suffix}",
              file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()
