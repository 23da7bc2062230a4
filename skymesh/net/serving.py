"""Running an aiohttp application until SIGINT/SIGTERM (shared by the daemons)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import ssl
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from skymesh.net.accept import BatchAcceptServer, listen_sockets
from skymesh.net.front import direct_routes, request_handler
from skymesh.net.lean import lean_factory
from skymesh.net.limits import ConnectionGuard, ConnLimits, fit_file_limit
from skymesh.obs.access import metrics as access_metrics
from skymesh.obs.access import outside_chain

# Where an app keeps its Prometheus registry, if it has one: the connection metrics
# (skymesh_open_connections, ..._refused_total, ..._closed_total) are added to it.
METRICS_REGISTRY = web.AppKey("metrics_registry", CollectorRegistry)
# The HTTP/1.1 server protocols start_app can serve with (listen.http_server).
HTTP_SERVERS = ("aiohttp", "lean")
# Every in-process server's default, not only skymesh-lb's: the tests that start
# skymesh-lb's app through start_app then serve it as the daemon does. An app with a
# middleware in its chain (skymesh-replica's error middleware, skymesh-lb with tracing)
# has no route the lean server takes, and is served by aiohttp's server alone whatever
# this says (docs/notes/lean-server.md).
DEFAULT_HTTP_SERVER = "lean"


def run(main: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run`` on uvloop when it is installed (the ``fast`` extra).

    uvloop's event loop takes about 0.15 ms off the balancer's added latency per request
    at moderate rates (measured by the lab's overhead benchmark); asyncio's loop works the same,
    only slower.
    """
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def tune_gc() -> None:
    """Fewer, cheaper garbage collections for a daemon on a request path.

    Everything built at start-up (config, policy, tries, the app) moves to a permanent
    generation that collections no longer scan (``gc.freeze``), and the young generation
    is collected every 20,000 net allocations instead of 700. With CPython's defaults a
    collection runs every few proxied requests, inside one of them. Tuned, skymesh-lb's
    added TTFT p50 was 0.06-0.08 ms lower in four of seven same-run A/B runs at 20-100
    req/s (the lab's overhead A/B benchmark), and within 0.03 ms in the other
    three (mean -0.04 ms). Cycles are still collected, only later: a few MB of garbage
    at most wait for it.
    """
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


class GuardedSite(web.TCPSite):
    """A TCP site whose connections go through a :class:`ConnectionGuard` first.

    ``sock``: serve an already listening socket (a worker's share of the port,
    skymesh.balancer.workers) instead of binding ``host:port``.
    """

    __slots__ = ("_guard", "_protocol", "_sock")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard,
                 *, ssl_context: ssl.SSLContext | None = None,
                 sock: socket.socket | None = None,
                 protocol: Callable[..., asyncio.Protocol] | None = None) -> None:
        # A deep backlog: a burst of new clients waits in the kernel rather than failing.
        super().__init__(runner, host, port, ssl_context=ssl_context, backlog=2048)
        self._guard = guard
        self._sock = sock
        self._protocol = protocol  # the server's protocol factory: the runner's by default

    async def start(self) -> None:
        # BaseSite.start registers the site; TCPSite.start would bind the bare server.
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        handshake = self._guard.limits.header_timeout_s if self._ssl_context else None
        if self._sock is not None:
            self._sock.setblocking(False)
            socks = [self._sock]
        else:
            socks = listen_sockets(self._host, self._port, self._backlog)
        # Not loop.create_server: uvloop's accepts one connection per loop iteration, and
        # a burst of new clients waited seconds unaccepted (skymesh.net.accept).
        inner = self._protocol or server
        acceptor = BatchAcceptServer(socks, self._guard.protocol_factory(inner),
                                     ssl_context=self._ssl_context,
                                     ssl_handshake_timeout=handshake)
        await acceptor.start_serving()
        self._server = acceptor
        self._bound_port = socks[0].getsockname()[1] if socks else self._port


async def start_app(app: web.Application, host: str, port: int, name: str,
                    limits: ConnLimits, ssl_context: ssl.SSLContext | None = None,
                    sock: socket.socket | None = None,
                    http_server: str = DEFAULT_HTTP_SERVER
                    ) -> tuple[web.AppRunner, ConnectionGuard]:
    """Set ``app`` up and listen on ``host:port`` (or the listening ``sock``) behind the
    connection limits; the caller ends it with ``runner.cleanup()``. ``http_server``:
    ``lean`` (the default: the app's plain routes on :mod:`skymesh.net.lean`, the rest on
    aiohttp's server), or ``aiohttp`` (everything on aiohttp's server)."""
    if http_server not in HTTP_SERVERS:
        raise ValueError(f"http_server must be one of {HTTP_SERVERS}, not {http_server!r}")
    guard = ConnectionGuard(limits, name)
    logged = outside_chain(app)  # before setup() freezes the app's middlewares
    registry = app.get(METRICS_REGISTRY)
    if registry is not None:
        registry.register(guard)
        dropped = access_metrics(app)
        if dropped is not None:
            # An app served a second time is registered already: the same collector.
            with contextlib.suppress(ValueError):
                registry.register(dropped)
    # handler_cancellation: a client that disconnects cancels its handler, whose finally
    # block releases what the request held (aiohttp leaves this off by default).
    # keepalive_timeout: aiohttp's idle timer, armed only between requests.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0,
                           access_log=logging.getLogger(f"{name}.access"),
                           keepalive_timeout=limits.idle_timeout_s)
    await runner.setup()
    try:
        # Before any connection: each takes the server's handler when it is made.
        server = runner.server
        assert server is not None
        # The guard's marks, the access log (around the app, not in its chain) and the
        # app's plain routes, in one frame per request (skymesh.net.front).
        routes = await direct_routes(app)
        server.request_handler = request_handler(app, server.request_handler, routes,
                                                 logged)
        # Lean serves only the direct routes: with none (a middleware chain, tracing),
        # every connection would be handed to aiohttp at its first request.
        protocol = (lean_factory(server, app, routes, limits.idle_timeout_s)
                    if http_server == "lean" and routes else None)
        await GuardedSite(runner, host, port, guard, ssl_context=ssl_context,
                          sock=sock, protocol=protocol).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, guard


async def serve_app(app: web.Application, host: str, port: int, name: str, detail: str = "",
                    on_bound: Callable[[str], Awaitable[None]] | None = None,
                    tuned_gc: bool = False, ssl_context: ssl.SSLContext | None = None,
                    limits: ConnLimits | None = None, sock: socket.socket | None = None,
                    announce: bool = True, http_server: str = DEFAULT_HTTP_SERVER) -> None:
    """Serve ``app`` on ``host:port`` (0: any free port) until a stop signal.

    Prints ``NAME listening on http(s)://HOST:PORT`` to stderr once bound: scripts and
    tests read the real port from it. ``tuned_gc``: :func:`tune_gc` once serving.
    ``ssl_context``: serve HTTPS. ``limits``: connection limits (default
    :class:`ConnLimits`), fitted to the open-file limit first. ``sock``: serve this
    listening socket instead of binding; ``announce=False``: no line (a worker, whose
    supervisor prints it once for all). ``http_server``: see :func:`start_app`.
    """
    limits = fit_file_limit(limits or ConnLimits(), name)
    runner, _ = await start_app(app, host, port, name, limits, ssl_context, sock,
                                http_server)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        bound_host, bound_port = runner.addresses[0][:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        suffix = f" ({detail})" if detail else ""
        scheme = "https" if ssl_context is not None else "http"
        if on_bound is not None:
            await on_bound(f"{scheme}://{shown}:{bound_port}")
        if tuned_gc:
            tune_gc()
        if announce:
            print(f"{name} listening on {scheme}://{shown}:{bound_port}{suffix}",
                  file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()
