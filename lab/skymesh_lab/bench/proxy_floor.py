"""Floor proxies for ``skymesh bench router-overhead``: the least a Python proxy on
skymesh-lb's stack costs per request on this machine.

Lab code, never product. Each kind is a reverse proxy with nothing but the proxying:
round-robin over the upstreams, the request body passed through, the reply returned; no
parsing of JSON, no metrics, no log. Served as skymesh-lb serves (``--workers`` processes,
default skymesh-lb's own ``auto`` count, each listening on the same port with
``SO_REUSEPORT``: :func:`skymesh.balancer.workers.bind_shared`; each on a core of its own
where skymesh-lb's default ``listen.pin_workers: auto`` would pin its workers, by its rule,
:func:`skymesh.balancer.workers.worker_cpus`), on uvloop, so the figure bounds what
skymesh-lb could reach with its logic taken away:

* ``aiohttp``: aiohttp's low-level server and one pooled ``aiohttp.ClientSession`` per
  worker (the textbook aiohttp proxy);
* ``stack``: aiohttp's server and skymesh-lb's own request-path client
  (:class:`skymesh.balancer.upstream.Upstream`, httptools on a bare connection): the
  HTTP stack skymesh-lb ran before its lean server became the default (session 25);
* ``lean``: the HTTP stack skymesh-lb runs by default, without skymesh-lb: its serving
  path (:func:`skymesh.net.serving.start_app`: the connection guard and the lean server,
  ``listen.http_server: lean``) with one plain POST route, and the same client;
* ``asyncio``: no aiohttp at all: asyncio protocols on uvloop, httptools only to find where
  each request and reply ends, the bytes passed through verbatim (no pipelined requests:
  wrk sends one at a time per connection). Where aiohttp's own cost lies.

    python -m skymesh_lab.bench.proxy_floor --kind aiohttp --upstreams URL,URL [--workers N]
        [--pin-workers auto|true|false]

It prints ``listening on http://HOST:PORT`` (as skymesh-lb does) once its sockets are bound.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import itertools
import os
import signal
import socket
import sys
import traceback
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

import aiohttp
import httptools
import uvloop
from aiohttp import web
from yarl import URL

from skymesh.balancer.upstream import Upstream
from skymesh.balancer.workers import (
    bind_shared,
    listen_url,
    resolve_workers,
    usable_core_ids,
    usable_cores,
    worker_cpus,
)
from skymesh.net.limits import ConnLimits
from skymesh.net.serving import start_app

KINDS = ("aiohttp", "stack", "lean", "asyncio")
# --pin-workers, as listen.pin_workers takes it
# The one path the lean floor serves (the benchmark's wrk posts there).
GENERATION_PATH = "/v1/chat/completions"
PIN_SETTINGS: dict[str, bool | str] = {"auto": "auto", "true": True, "false": False}


def default_workers() -> int:
    """skymesh-lb's worker count with no configuration (``listen.workers: auto``)."""
    return resolve_workers("auto", usable_cores(), mesh_or_controller=False)


def floor_cpus(workers: int, pin: bool | str = "auto") -> list[int] | None:
    """The core of each worker by index, or ``None`` (the kernel places them): skymesh-lb's
    ``listen.pin_workers`` rule over the cores this process may use."""
    return worker_cpus(pin, usable_core_ids(), workers)


def _content_type(headers: Mapping[str, str]) -> dict[str, str]:
    return {"Content-Type": headers.get("Content-Type", "application/json")}


def _die_with_parent() -> None:
    """SIGTERM this worker when the forking process dies, even by SIGKILL (Linux's
    ``PR_SET_PDEATHSIG``): a benchmark that kills the floor leaves no worker behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


# -- aiohttp's server, with aiohttp's client or skymesh-lb's ----------------------------
async def _serve_aiohttp(sock: socket.socket, upstreams: Sequence[str], kind: str) -> None:
    targets = itertools.cycle(upstreams)
    handle: Callable[[web.BaseRequest], Awaitable[web.Response]]
    if kind == "aiohttp":
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))

        async def pooled(request: web.BaseRequest) -> web.Response:
            body = await request.read()
            async with session.request(request.method, next(targets) + request.path_qs,
                                       data=body, headers=_content_type(request.headers)
                                       ) as r:
                return web.Response(body=await r.read(), status=r.status,
                                    headers=_content_type(r.headers))
        handle = pooled
    else:
        handle = _upstream_handler(targets)
    runner = web.ServerRunner(web.Server(handle, access_log=None))
    await runner.setup()
    await web.SockSite(runner, sock).start()
    await asyncio.Event().wait()  # until SIGTERM ends the process


def _upstream_handler(targets: Iterator[str]
                      ) -> Callable[[web.BaseRequest], Awaitable[web.Response]]:
    """The handler of the floors on skymesh-lb's client: the body to the next upstream,
    its reply back."""
    up = Upstream(connect_timeout_s=5.0, read_timeout_s=60.0)

    async def handle(request: web.BaseRequest) -> web.Response:
        body = await request.read()
        r = await up.post(next(targets), request.raw_path, body,
                          _content_type(request.headers))
        try:
            data = await r.read()
        finally:
            r.release()
        return web.Response(body=data, status=r.status, headers=_content_type(r.headers))

    return handle


async def _serve_lean(sock: socket.socket, upstreams: Sequence[str]) -> None:
    """skymesh-lb's serving path with no app behind it but the proxying: the one POST
    route the benchmark sends to is a plain route, so the lean server serves it."""
    app = web.Application()
    app.router.add_post(GENERATION_PATH, _upstream_handler(itertools.cycle(upstreams)))
    await start_app(app, "127.0.0.1", 0, "lean-floor", ConnLimits(), sock=sock,
                    http_server="lean")
    await asyncio.Event().wait()  # until SIGTERM ends the process


# -- asyncio protocols and httptools -----------------------------------------------------
class _Side(asyncio.Protocol):
    """A connection's transport, until it is lost."""

    transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def feed(self, parser: httptools.HttpRequestParser | httptools.HttpResponseParser,
             data: bytes) -> None:
        """Parse ``data`` (the parser calls back ``on_message_complete``); bad HTTP closes."""
        try:
            parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()


class _Client(_Side):
    """One client connection: each whole request goes to an upstream connection as is."""

    def __init__(self, proxy: _Proxy) -> None:
        self.proxy = proxy
        self.parser = httptools.HttpRequestParser(self)
        self.parts: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self.parts.append(data)
        self.feed(self.parser, data)

    def on_message_complete(self) -> None:
        message = b"".join(self.parts)
        self.parts.clear()
        self.proxy.forward(message, self)


class _Conn(_Side):
    """One keep-alive connection to an upstream: the reply's bytes go to the client as
    they arrive; the parser only says where the reply ends."""

    def __init__(self, idle: collections.deque[_Conn]) -> None:
        self.idle = idle
        self.parser = httptools.HttpResponseParser(self)
        self.client: _Client | None = None

    def send(self, message: bytes, client: _Client) -> None:
        assert self.transport is not None
        self.client = client
        self.transport.write(message)

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is not None and client.transport is not None:
            client.transport.write(data)
        self.feed(self.parser, data)

    def on_message_complete(self) -> None:
        self.client = None
        if self.parser.should_keep_alive() and self.transport is not None:
            self.idle.append(self)
        else:
            self.close()

    def close(self) -> None:
        """Close this connection and the client whose reply it was carrying (cut short)."""
        if self.client is not None:
            self.client.close()
            self.client = None
        super().close()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        with contextlib.suppress(ValueError):
            self.idle.remove(self)
        self.close()


class _Proxy:
    def __init__(self, upstreams: Sequence[str]) -> None:
        self.loop = asyncio.get_running_loop()
        self.addrs = [(u.host or "127.0.0.1", u.port or 80) for u in map(URL, upstreams)]
        self.idle: list[collections.deque[_Conn]] = [collections.deque() for _ in upstreams]
        self.turn: Iterator[int] = itertools.cycle(range(len(upstreams)))

    def forward(self, message: bytes, client: _Client) -> None:
        i = next(self.turn)
        if self.idle[i]:
            self.idle[i].pop().send(message, client)
        else:
            self.loop.create_task(self._connect_and_send(i, message, client))

    async def _connect_and_send(self, i: int, message: bytes, client: _Client) -> None:
        try:
            _, conn = await self.loop.create_connection(
                lambda: _Conn(self.idle[i]), *self.addrs[i])
        except OSError:
            client.close()
            return
        conn.send(message, client)


async def _serve_asyncio(sock: socket.socket, upstreams: Sequence[str]) -> None:
    proxy = _Proxy(upstreams)
    server = await proxy.loop.create_server(lambda: _Client(proxy), sock=sock)
    async with server:
        await server.serve_forever()


# -- processes ---------------------------------------------------------------------------
def serve(kind: str, sock: socket.socket, upstreams: Sequence[str]) -> None:
    """One worker: serve ``sock`` until killed."""
    main = (_serve_asyncio(sock, upstreams) if kind == "asyncio"
            else _serve_lean(sock, upstreams) if kind == "lean"
            else _serve_aiohttp(sock, upstreams, kind))
    uvloop.run(main)


def run_workers(kind: str, upstreams: Sequence[str], workers: int, host: str, port: int,
                pin: bool | str = "auto") -> int:
    """Fork one worker per shared socket (on its core of :func:`floor_cpus`); forward
    SIGTERM/SIGINT to them; end when any ends (a floor that lost a worker would measure
    less than the floor)."""
    socks = bind_shared(host, port, workers)
    cpus = floor_cpus(workers, pin)
    pids: list[int] = []
    sys.stdout.flush()
    for i, sock in enumerate(socks):
        pid = os.fork()
        if pid == 0:  # the worker: its own socket, a fresh loop (none exists before fork)
            _die_with_parent()
            if cpus is not None:
                # Before the loop exists: every thread it starts inherits the core, as a
                # skymesh-lb worker's do (pinned before its imports).
                try:
                    os.sched_setaffinity(0, {cpus[i]})
                except OSError as exc:  # refused: served unpinned, as skymesh-lb would
                    print(f"worker {i} not pinned to core {cpus[i]}: {exc}", file=sys.stderr)
            for other in socks[:i] + socks[i + 1:]:
                other.close()
            code = 0
            try:
                serve(kind, sock, [*upstreams[i % len(upstreams):],
                                   *upstreams[:i % len(upstreams)]])
            except BaseException:  # a worker reports and exits: it never returns to main
                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)

    def stop(signum: int, frame: object) -> None:
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    placed = (f" pinned to cores {', '.join(map(str, cpus))}" if cpus is not None
              else " unpinned")
    print(f"{kind} floor, {workers} workers{placed}: listening on "
          f"{listen_url(socks[0], False)}", flush=True)
    code = 0
    while pids:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid in pids:
            pids.remove(pid)
            code = code or (0 if os.waitstatus_to_exitcode(status) in (0, -signal.SIGTERM)
                            else 1)
            stop(signal.SIGTERM, None)
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.proxy_floor",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=KINDS, required=True)
    ap.add_argument("--upstreams", required=True, metavar="URL,URL")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes (default: skymesh-lb's auto count)")
    ap.add_argument("--pin-workers", choices=PIN_SETTINGS, default="auto",
                    help="each worker on a core of its own, by skymesh-lb's "
                         "listen.pin_workers rule (default: auto, as skymesh-lb)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    workers = args.workers if args.workers is not None else default_workers()
    return run_workers(args.kind, args.upstreams.split(","), workers, args.host, args.port,
                       PIN_SETTINGS[args.pin_workers])


if __name__ == "__main__":
    sys.exit(main())
