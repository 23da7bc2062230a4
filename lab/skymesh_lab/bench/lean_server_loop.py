"""The HTTP server's own CPU per request, in process: aiohttp's against the lean one (#35).

What is measured
    The loop thread's CPU (``time.thread_time``) per keep-alive request through the
    server protocol that ``skymesh.net.serving.start_app`` gives a connection, behind the
    connection guard: aiohttp's ``RequestHandler`` (``listen.http_server: aiohttp``),
    ``skymesh.net.lean`` (``lean``, the default: plain answers written directly) or
    ``lean-prepare`` (the lean server with every answer through aiohttp's ``prepare()``
    and ``write_eof()``, as in session 24: what the direct writes save). The app is
    shaped like skymesh-lb's generation route (the request-id stamp, the access log off
    as with ``--no-access-log``, a JSON body read, the C stub's reply as the answer) and
    needs no network: the connection is a
    stand-in transport that takes the bytes written to it, and each request is the bytes
    of one POST handed to ``data_received``, then awaited until its response is written.
    So the figure is the server's parser, request objects, task or wake-up, response
    writing and the loop's turn for it; not the sockets' system calls (the same for both).

How
    The arms in one process, their order turned every round: ``--rounds`` rounds, each
    the best of ``--repeats`` runs of ``--requests`` requests per arm, on uvloop as the
    daemon. Prints each round's figures and the medians of lean over aiohttp and over
    lean-prepare per round.

    python -m skymesh_lab.bench.lean_server_loop [--rounds 6] [--requests 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from skymesh.net.front import direct_routes, request_handler
from skymesh.net.lean import lean_factory
from skymesh.net.limits import ConnectionGuard, ConnLimits
from skymesh.net.serving import run
from skymesh.obs.access import outside_chain
from skymesh_lab.bench.access_log_loop import BODY

PATH = "/v1/chat/completions"
PROMPT = json.dumps({"model": "stub", "messages": [{"role": "user", "content": "x" * 200}]})
REQUEST = (f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUser-Agent: wrk\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(PROMPT)}\r\n\r\n"
           f"{PROMPT}").encode()


class _Transport:
    """A connection that takes what is written and says when a response has ended."""

    def __init__(self) -> None:
        self.done: asyncio.Future[None] | None = None
        self.protocol: Any = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000),
                "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def write(self, data: bytes) -> None:
        if data.endswith(BODY) and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def writelines(self, chunks: Any) -> None:
        self.write(b"".join(chunks))

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def can_write_eof(self) -> bool:
        return True

    def close(self) -> None: ...

    def abort(self) -> None: ...

    def write_eof(self) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def get_protocol(self) -> Any:
        return self.protocol


def _app() -> web.Application:
    from skymesh.balancer.edge import stamp_request_id

    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(body=BODY, content_type="application/json")

    app = web.Application()
    app.router.add_post(PATH, generate)
    app.on_response_prepare.append(stamp_request_id)
    return app


async def _arms() -> tuple[dict[str, Callable[..., asyncio.Protocol]], web.AppRunner]:
    app = _app()
    logged = outside_chain(app)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    server = runner.server
    assert server is not None
    routes = await direct_routes(app)
    server.request_handler = request_handler(app, server.request_handler, routes, logged)
    guard = ConnectionGuard(ConnLimits(), "bench")
    return {"aiohttp": guard.protocol_factory(server),
            "lean-prepare": guard.protocol_factory(
                lean_factory(server, app, routes, 75.0, direct_writes=False)),
            "lean": guard.protocol_factory(lean_factory(server, app, routes, 75.0))}, runner


async def _one(factory: Callable[..., asyncio.Protocol], requests: int) -> float:
    loop = asyncio.get_running_loop()
    transport = _Transport()
    protocol = factory()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    try:
        t0 = time.thread_time()
        for _ in range(requests):
            transport.done = loop.create_future()
            protocol.data_received(REQUEST)
            await transport.done
        return (time.thread_time() - t0) / requests * 1e6
    finally:
        protocol.connection_lost(None)


async def measure(rounds: int, requests: int, repeats: int) -> dict[str, list[float]]:
    """Per arm, each round's best microseconds per request."""
    arms, runner = await _arms()
    out: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for factory in arms.values():  # warm every path
            await _one(factory, 1000)
        for r in range(rounds):
            names = list(arms)
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                out[name].append(min([await _one(arms[name], requests)
                                      for _ in range(repeats)]))
            print(f"round {r}: " + ", ".join(f"{n} {out[n][-1]:.1f} us" for n in arms),
                  flush=True)
    finally:
        await runner.cleanup()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    res: dict[str, list[float]] = {}

    async def go() -> None:
        res.update(await measure(args.rounds, args.requests, args.repeats))

    run(go())
    for name, xs in res.items():
        print(f"{name}: median {statistics.median(xs):.1f} us/request "
              f"[{min(xs):.1f}, {max(xs):.1f}]")
    for over in ("aiohttp", "lean-prepare"):
        ratios = [a / b for a, b in zip(res["lean"], res[over], strict=True)]
        saved = [b - a for a, b in zip(res["lean"], res[over], strict=True)]
        print(f"lean/{over} per round {[round(x, 2) for x in ratios]}, median "
              f"{statistics.median(ratios):.2f}; us saved per request per round "
              f"{[round(x, 1) for x in saved]}, median {statistics.median(saved):.1f}")
    print(f"load {load:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
