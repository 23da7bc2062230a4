"""Connection limits (skymesh.net.limits) over real loopback sockets: issue #23, item 3.

In-process: an aiohttp app served the way the daemons serve theirs (skymesh.net.serving),
with small limits. Then the wiring of each daemon: skymesh-lb (limits from its config,
metrics on its /metrics), skymesh-replica (defaults, metrics) and the controller (uvicorn,
limits from its config). Timeouts are small real ones; every wait is on a condition with
a deadline, and no assertion is about how long something took.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from skymesh.net.limits import ConnectionGuard, ConnLimits
from skymesh.net.serving import METRICS_REGISTRY, start_app
from skymesh.util.procs import Daemon, start_daemon

pytestmark = pytest.mark.timeout(120)

DEADLINE_S = 10.0  # a condition not met by then is a failure (the default would be hours)
SMALL = ConnLimits(max_connections=50, max_connections_per_client=20, header_timeout_s=0.3,
                   body_timeout_s=0.3, idle_timeout_s=0.3)
OTHER_CLIENT = "127.0.0.2"  # Linux routes all of 127/8 to loopback


# -- helpers ---------------------------------------------------------------------------------
async def wait_until(cond: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}")
        await asyncio.sleep(0.01)


async def connect(port: int, local: str = "127.0.0.1", rcvbuf: int | None = None
                  ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect: the window is agreed in the handshake
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((local, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE_S)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:  # chunked: read to the end of the stream
        body = await asyncio.wait_for(reader.read(), DEADLINE_S)
    return status, headers, body


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """True once the server has closed (EOF or reset), False if the deadline passes."""
    try:
        async with asyncio.timeout(DEADLINE_S):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def request(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A value as a scraper sees it: the registry's text exposition, parsed."""
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def demo_app(registry: CollectorRegistry) -> web.Application:
    app = web.Application()
    app[METRICS_REGISTRY] = registry

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def stream(request: web.Request) -> web.StreamResponse:
        q = request.query
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(int(q["chunks"])):
            await resp.write(b"x" * int(q["size"]))
            await asyncio.sleep(float(q.get("gap", "0")))
        await resp.write_eof()
        return resp

    app.router.add_get("/ok", ok)
    app.router.add_post("/echo", echo)
    app.router.add_get("/stream", stream)
    return app


@asynccontextmanager
async def serving(limits: ConnLimits = SMALL
                  ) -> AsyncIterator[tuple[int, ConnectionGuard, CollectorRegistry]]:
    registry = CollectorRegistry()
    runner, guard = await start_app(demo_app(registry), "127.0.0.1", 0, "test", limits)
    try:
        yield runner.addresses[0][1], guard, registry
    finally:
        await runner.cleanup()


# -- timeouts --------------------------------------------------------------------------------
async def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() -> None:
    async with serving() as (port, guard, registry):
        reader, writer = await connect(port)
        writer.write(request("/ok"))
        status, headers, body = await read_response(reader)
        assert (status, body) == (200, b"ok") and headers.get("connection") != "close"
        assert metric(registry, "skymesh_open_connections") == 1
        assert await closed_by_peer(reader), "an idle keep-alive connection was kept"
        await wait_until(lambda: guard.open == 0, "the open-connection gauge back to 0")
        assert metric(registry, "skymesh_open_connections") == 0
        writer.close()


@pytest.mark.parametrize("sent", [b"", b"GET /ok HTTP/1.1\r\nHost: t\r\n"],
                         ids=["nothing", "half the headers"])
async def test_a_request_whose_headers_never_end_is_closed(sent: bytes) -> None:
    # Idle and body timeouts long: only the header timeout can end it.
    limits = replace(SMALL, idle_timeout_s=60.0, body_timeout_s=60.0)
    async with serving(limits) as (port, guard, registry):
        reader, writer = await connect(port)
        writer.write(sent)

        async def trickle() -> None:  # slowloris: a header line now and then, never the end
            for i in range(1000):
                await asyncio.sleep(0.05)
                writer.write(f"X-Slow-{i}: y\r\n".encode())

        slow = asyncio.create_task(trickle()) if sent else None
        try:
            assert await closed_by_peer(reader), "a connection without headers was kept"
        finally:
            if slow is not None:
                slow.cancel()
        await wait_until(lambda: guard.open == 0, "the gauge back to 0")
        assert metric(registry, "skymesh_connections_closed_total",
                      reason="header_timeout") == 1
        writer.close()


async def test_a_body_that_never_completes_is_closed() -> None:
    limits = replace(SMALL, idle_timeout_s=60.0, header_timeout_s=60.0)
    async with serving(limits) as (port, _guard, registry):
        reader, writer = await connect(port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n0123456789")
        assert await closed_by_peer(reader), "a request with a stalled body was kept"
        assert metric(registry, "skymesh_connections_closed_total", reason="body_timeout") == 1
        # A body that does arrive is served.
        reader, writer = await connect(port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello")
        assert (await read_response(reader))[::2] == (200, b"hello")
        writer.close()


async def test_the_guard_wraps_the_servers_handler_and_adds_no_middleware() -> None:
    """An app without middleware of its own keeps none (aiohttp then skips its middleware
    chain per request); the guard still sees each request: a stalled body is cut while
    the handler has it, as above, and a finished request leaves the connection idle."""
    registry = CollectorRegistry()
    app = demo_app(registry)
    # Unmarked, the request would leave the header timer running: it is the shorter.
    limits = replace(SMALL, header_timeout_s=0.2, idle_timeout_s=1.0)
    runner, _guard = await start_app(app, "127.0.0.1", 0, "test", limits)
    try:
        assert not app.middlewares
        reader, writer = await connect(runner.addresses[0][1])
        writer.write(request("/ok"))
        assert (await read_response(reader))[::2] == (200, b"ok")
        assert await closed_by_peer(reader), "the idle connection was kept"
        assert metric(registry, "skymesh_connections_closed_total",
                      reason="header_timeout") == 0
        writer.close()
    finally:
        await runner.cleanup()


async def test_a_streaming_response_is_not_cut_while_bytes_flow() -> None:
    async with serving() as (port, _guard, registry):
        reader, writer = await connect(port)
        # Twelve chunks 50 ms apart: longer in all than every timeout (0.3 s).
        writer.write(request("/stream?chunks=12&size=10&gap=0.05", "Connection: close\r\n"))
        status, _, body = await read_response(reader)
        assert status == 200 and body.count(b"x" * 10) == 12, body[-200:]
        for reason in ("header_timeout", "body_timeout", "write_stall"):
            assert metric(registry, "skymesh_connections_closed_total", reason=reason) == 0
        writer.close()


async def test_a_client_that_stops_reading_a_response_is_cut() -> None:
    async with serving() as (port, guard, registry):
        _reader, writer = await connect(port, rcvbuf=4096)
        writer.write(request("/stream?chunks=100000&size=65536"))  # then never read
        await wait_until(lambda: guard.closed["write_stall"] == 1, "a write-stall cut")
        assert metric(registry, "skymesh_connections_closed_total", reason="write_stall") == 1
        await wait_until(lambda: guard.open == 0, "the gauge back to 0")
        writer.close()


# -- caps ------------------------------------------------------------------------------------
async def test_the_per_client_cap_refuses_the_next_connection_and_others_are_served() -> None:
    async with serving(replace(SMALL, max_connections_per_client=3, idle_timeout_s=60.0,
                               header_timeout_s=60.0)) as (port, guard, registry):
        held = [await connect(port) for _ in range(3)]
        await wait_until(lambda: guard.open == 3, "three connections admitted")
        reader, writer = await connect(port)
        writer.write(request("/ok"))
        status, headers, body = await read_response(reader)
        assert status == 429 and headers["retry-after"] == "1"
        err = json.loads(body)["error"]
        assert err["code"] == "too_many_connections" and err["message"] and err["type"]
        assert metric(registry, "skymesh_connections_refused_total", reason="client_limit") == 1
        assert metric(registry, "skymesh_open_connections") == 3
        writer.close()
        # Another address is served while the first is at its cap.
        reader, writer = await connect(port, local=OTHER_CLIENT)
        writer.write(request("/ok", "Connection: close\r\n"))
        assert (await read_response(reader))[::2] == (200, b"ok")
        writer.close()
        # After release the gauge returns to 0 and the first address is served again.
        for _, w in held:
            w.close()
        await wait_until(lambda: guard.open == 0, "the gauge back to 0")
        assert metric(registry, "skymesh_open_connections") == 0
        reader, writer = await connect(port)
        writer.write(request("/ok", "Connection: close\r\n"))
        assert (await read_response(reader))[::2] == (200, b"ok")
        writer.close()


async def test_the_process_cap_refuses_with_a_503() -> None:
    async with serving(replace(SMALL, max_connections=2, idle_timeout_s=60.0,
                               header_timeout_s=60.0)) as (port, guard, registry):
        held = [await connect(port), await connect(port, local=OTHER_CLIENT)]
        await wait_until(lambda: guard.open == 2, "two connections admitted")
        reader, writer = await connect(port, local="127.0.0.3")
        writer.write(request("/ok"))
        status, _, body = await read_response(reader)
        assert status == 503 and json.loads(body)["error"]["code"] == "too_many_connections"
        assert metric(registry, "skymesh_connections_refused_total", reason="process_limit") == 1
        for _, w in [*held, (reader, writer)]:
            w.close()
        await wait_until(lambda: guard.open == 0, "the gauge back to 0")


async def test_ten_addresses_cannot_take_the_whole_process(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue #33, item 11: connections from a few addresses filled the process cap and
    every other client got 503 for as long as they were held. Ten source addresses
    (127.0.0.2-11) each try to hold 40 idle connections under a cap of 200."""
    limits = replace(SMALL, max_connections=200, max_connections_per_client=40,
                     header_timeout_s=60.0, idle_timeout_s=60.0)
    async with serving(limits) as (port, guard, registry):
        attackers = [f"127.0.0.{i}" for i in range(2, 12)]
        with caplog.at_level(logging.WARNING, logger="skymesh.net.limits"):
            held = [await connect(port, local=a) for a in attackers for _ in range(40)]
            await wait_until(lambda: guard.open + sum(guard.refused.values()) == len(held),
                             "every attempt admitted or refused")
        assert guard.open < limits.max_connections
        assert metric(registry, "skymesh_connections_refused_total", reason="fair_share") > 0
        assert metric(registry, "skymesh_connections_refused_total",
                      reason="process_limit") == 0
        assert any("refused a connection from 127.0.0." in r.getMessage()
                   and "reserved_fraction" in r.getMessage() for r in caplog.records)
        # Other clients are still served while the ten hold what they got.
        for other in ("127.0.0.12", "127.0.0.13", "127.0.0.1"):
            reader, writer = await connect(port, local=other)
            writer.write(request("/ok", "Connection: close\r\n"))
            assert (await read_response(reader))[::2] == (200, b"ok"), other
            writer.close()
        for _, w in held:
            w.close()
        await wait_until(lambda: guard.open == 0, "the gauge back to 0")


# -- the daemons -----------------------------------------------------------------------------
def hostport(d: Daemon) -> int:
    port = urlsplit(d.url).port
    assert port is not None
    return port


async def scrape(port: int, name: str, **labels: str) -> float:
    reader, writer = await connect(port, local=OTHER_CLIENT)
    writer.write(request("/metrics", "Connection: close\r\n"))
    status, _, body = await read_response(reader)
    writer.close()
    assert status == 200
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("replica")
    d = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.01"],
                     log_path=tmp / "replica.log")
    try:
        yield d
    finally:
        d.stop()


LIMITS = {"max_connections_per_client": 2, "header_timeout_s": 0.5, "idle_timeout_s": 0.5,
          "reserved_fraction": 0.25, "reserve_share": 0.2}


async def test_skymesh_lb_applies_its_configured_limits(tmp_path: Path, replica: Daemon) -> None:
    cfg = tmp_path / "lb.yaml"
    # One process: the limits hold per worker (each has its own connections to count).
    cfg.write_text(json.dumps({"listen": {"port": 0, "workers": 1}, "limits": LIMITS,
                               "replicas": [{"url": replica.url}]}))
    lb = start_daemon("skymesh-lb", ["--config", str(cfg)], log_path=tmp_path / "lb.log")
    try:
        port = hostport(lb)
        held = [await connect(port) for _ in range(2)]
        reader, writer = await connect(port)
        writer.write(request("/health"))
        assert (await read_response(reader))[0] == 429
        assert await scrape(port, "skymesh_connections_refused_total",
                            reason="client_limit") == 1
        for r, _ in held:  # they never sent a request: the header timeout ends them
            assert await closed_by_peer(r)
        assert await scrape(port, "skymesh_connections_closed_total",
                            reason="header_timeout") == 2
        assert await scrape(port, "skymesh_open_connections") == 1  # the scrape itself
        assert "refused a connection from 127.0.0.1" in lb.log()
    finally:
        lb.stop()


async def test_skymesh_replica_serves_the_connection_metrics(replica: Daemon) -> None:
    assert await scrape(hostport(replica), "skymesh_open_connections") == 1


async def test_the_controller_applies_its_configured_limits(tmp_path: Path) -> None:
    cfg = tmp_path / "controller.yaml"
    cfg.write_text(json.dumps({"listen": {"port": 0}, "limits": LIMITS}))
    ctl = start_daemon("skymesh-controller", ["--config", str(cfg)],
                       log_path=tmp_path / "controller.log",
                       env={**os.environ, "SKYMESH_ADMIN_TOKEN": "t" * 32})
    try:
        port = hostport(ctl)
        reader, writer = await connect(port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: t\r\n")  # and never the end
        assert await closed_by_peer(reader), "uvicorn kept a half-sent request"
        reader, writer = await connect(port)
        writer.write(request("/health"))
        assert (await read_response(reader))[0] == 200
        assert await closed_by_peer(reader), "uvicorn kept an idle connection"
        held = [await connect(port) for _ in range(2)]
        reader, writer = await connect(port)
        writer.write(request("/health"))
        status, _, body = await read_response(reader)
        assert status == 429 and json.loads(body)["error"]["code"] == "too_many_connections"
        for r, _ in held:  # they never sent a request: the header timeout ends them
            assert await closed_by_peer(r)
        # The controller's /metrics (no token) serves the guard's series too.
        assert await scrape(port, "skymesh_connections_refused_total",
                            reason="client_limit") == 1
        assert "refused a connection from 127.0.0.1" in ctl.log()
    finally:
        ctl.stop()
