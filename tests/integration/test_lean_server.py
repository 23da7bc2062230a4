"""The lean HTTP server (``listen.http_server: lean``, skymesh.net.lean) over loopback: the
app's plain routes are served by it, the rest handed to aiohttp's server at a request
boundary, and what aiohttp's server gave the daemons still holds (keep-alive, HTTP/1.0,
pipelining, chunked bodies, smuggling refused, header limits, 500s, cancellation on
disconnect, graceful shutdown, TLS, the access log)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support import chat_replica, eventually, serving, until

from skymesh.balancer.config import parse_config
from skymesh.balancer.server import build_app
from skymesh.net.front import direct_routes
from skymesh.net.lean_request import LeanRequest
from skymesh.net.limits import ConnectionGuard, ConnLimits
from skymesh.net.serving import start_app
from skymesh.obs.access import ACCESS_LOGGER, install

MODEL = "m"
CHAT = "/v1/chat/completions"
BIG = 32 * 1024 * 1024  # a response the socket buffers cannot hold


class Probe:
    """What the test app's handlers saw: the request classes, the slow handler's state."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.slow_started = asyncio.Event()
        self.slow_release = asyncio.Event()
        self.slow_ended: list[str] = []


def probe_app(probe: Probe) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        probe.kinds.append(type(request).__name__)
        body = await request.read()
        return web.json_response({"kind": type(request).__name__, "len": len(body),
                                  "x": request.headers.get("X-Test", "")})

    async def hello(request: web.Request) -> web.Response:
        probe.kinds.append(type(request).__name__)
        return web.Response(text="hello")

    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("handler bug")

    async def chunked(request: web.Request) -> web.Response:
        resp = web.Response(text="x")
        resp.enable_chunked_encoding()  # which prepare() refuses for HTTP/1.0
        return resp

    async def slow(request: web.Request) -> web.Response:
        probe.slow_started.set()
        try:
            await probe.slow_release.wait()
        except asyncio.CancelledError:
            probe.slow_ended.append("cancelled")
            raise
        probe.slow_ended.append("done")
        return web.Response(text="slow done")

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * BIG)

    async def dynamic(request: web.Request) -> web.Response:
        probe.kinds.append(type(request).__name__)
        return web.Response(text=request.match_info["name"])

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_get("/hello", hello)
    app.router.add_get("/boom", boom)
    app.router.add_get("/chunked", chunked)
    app.router.add_get("/slow", slow)
    app.router.add_get("/big", big)
    app.router.add_get("/items/{name}", dynamic)
    install(app, access_log=True)
    return app


@contextlib.asynccontextmanager
async def lean_server(limits: ConnLimits | None = None,
                      ssl_ctx: ssl.SSLContext | None = None
                      ) -> AsyncIterator[tuple[int, Probe, ConnectionGuard]]:
    """The probe app served lean on a free port: the port, the probe, the guard."""
    probe = Probe()
    runner, guard = await start_app(probe_app(probe), "127.0.0.1", 0, "t",
                                    limits or ConnLimits(), ssl_ctx, http_server="lean")
    try:
        yield runner.addresses[0][1], probe, guard
    finally:
        probe.slow_release.set()
        await runner.cleanup()


@pytest.fixture
async def lean(caplog: pytest.LogCaptureFixture) -> AsyncIterator[tuple[int, Probe]]:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with lean_server() as (port, probe, _):
        yield port, probe


Answer = tuple[int, dict[str, str], bytes]


async def exchange(port: int, raw: bytes, *, responses: int = 1,
                   ssl_ctx: ssl.SSLContext | None = None) -> list[Answer]:
    """Send ``raw`` on one connection; read ``responses`` responses (Content-Length
    framed), or to EOF."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ssl_ctx)
    try:
        writer.write(raw)
        await writer.drain()
        out = []
        for _ in range(responses):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.lower(): v.strip() for k, _, v in
                       (line.partition(":") for line in lines[1:] if line)}
            n = int(headers.get("content-length", "0"))
            out.append((status, headers, await reader.readexactly(n)))
        return out
    finally:
        writer.close()


async def closed_by_server(port: int, raw: bytes) -> bytes:
    """Everything the server sends on a connection before it closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def echo_req(body: bytes = b"{}", extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST /echo HTTP/{version}\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


async def test_plain_routes_are_served_lean_the_rest_by_aiohttp(
        lean: tuple[int, Probe]) -> None:
    port, probe = lean
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{port}/echo", data=b"abc") as r:
            assert (r.status, (await r.json())["kind"]) == (200, "LeanRequest")
        async with s.get(f"http://127.0.0.1:{port}/items/a1") as r:  # dynamic: aiohttp
            assert (r.status, await r.text()) == (200, "a1")
        async with s.get(f"http://127.0.0.1:{port}/hello?x=1") as r:  # a query: aiohttp
            assert r.status == 200
        async with s.get(f"http://127.0.0.1:{port}/nowhere") as r:
            assert r.status == 404
        async with s.post(f"http://127.0.0.1:{port}/hello") as r:
            assert r.status == 405
        async with s.post(f"http://127.0.0.1:{port}/echo", data=b"abc",
                          expect100=True) as r:
            assert (r.status, (await r.json())["kind"]) == (200, "Request")
    assert probe.kinds == ["LeanRequest", "Request", "Request", "Request"]


async def test_keep_alive_connection_close_and_http_1_0(lean: tuple[int, Probe]) -> None:
    port, _ = lean
    two = await exchange(port, echo_req(b"12") + echo_req(b"345"), responses=2)
    assert [json.loads(b)["len"] for _, _, b in two] == [2, 3]
    assert all(h.get("connection") != "close" for _, h, _ in two)
    closing = await closed_by_server(port, echo_req(b"1", "Connection: close\r\n"))
    assert closing.startswith(b"HTTP/1.1 200") and b"Connection: close" in closing
    old = await closed_by_server(port, echo_req(b"1", version="1.0"))
    assert old.startswith(b"HTTP/1.0 200")
    kept = await exchange(port, echo_req(b"1", "Connection: keep-alive\r\n", "1.0") * 2,
                          responses=2)
    assert [s for s, _, _ in kept] == [200, 200]
    assert kept[0][1]["connection"] == "keep-alive"


async def test_pipelined_requests_are_answered_in_order_across_a_hand_off(
        lean: tuple[int, Probe]) -> None:
    port, probe = lean
    raw = (echo_req(b"1", "X-Test: a\r\n") + echo_req(b"22", "X-Test: b\r\n")
           + b"GET /items/c HTTP/1.1\r\nHost: x\r\n\r\n" + echo_req(b"4444", "X-Test: d\r\n"))
    got = await exchange(port, raw, responses=4)
    assert [s for s, _, _ in got] == [200] * 4
    assert json.loads(got[0][2])["x"] == "a" and json.loads(got[1][2])["x"] == "b"
    assert got[2][2] == b"c"
    assert json.loads(got[3][2]) == {"kind": "Request", "len": 4, "x": "d"}  # aiohttp's now
    assert probe.kinds[:2] == ["LeanRequest", "LeanRequest"]


async def test_a_long_pipeline_is_answered_in_order(lean: tuple[int, Probe]) -> None:
    port, probe = lean
    n = 50  # past MAX_QUEUED: reading pauses while the queue drains, and resumes
    raw = b"".join(echo_req(b"x" * i, f"X-Test: {i}\r\n") for i in range(n))
    got = await exchange(port, raw, responses=n)
    assert [json.loads(b)["x"] for _, _, b in got] == [str(i) for i in range(n)]
    assert probe.kinds == ["LeanRequest"] * n


async def test_an_upgrade_goes_to_aiohttp(lean: tuple[int, Probe]) -> None:
    port, probe = lean
    raw = (b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
           b"Upgrade: websocket\r\n\r\n")
    (status, _, body), = await exchange(port, raw)
    assert (status, body, probe.kinds) == (200, b"hello", ["Request"])


async def test_empty_lines_before_a_request_do_not_move_the_hand_off_point(
        lean: tuple[int, Probe]) -> None:
    port, _ = lean
    # The parser skips empty lines before a request line: the next request's first byte
    # is found past them, so aiohttp gets the right bytes (not the echo's body).
    body = b"GET /items/smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    raw = b"\r\n\r\n" + echo_req(body) + b"GET /items/real HTTP/1.1\r\nHost: x\r\n\r\n"
    got = await exchange(port, raw, responses=2)
    assert [s for s, _, _ in got] == [200, 200]
    assert json.loads(got[0][2])["len"] == len(body) and got[1][2] == b"real"


async def test_a_request_split_across_reads_and_a_body_in_pieces(
        lean: tuple[int, Probe]) -> None:
    port, _ = lean
    body = b"x" * 300_000  # past the lean body's high-water mark: reading pauses
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        raw = echo_req(body)
        for i in range(0, len(raw), 65_536):
            writer.write(raw[i:i + 65_536])
            await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        assert json.loads(await reader.readexactly(n))["len"] == len(body)
    finally:
        writer.close()


async def test_chunked_bodies_go_to_aiohttp_and_smuggling_is_refused(
        lean: tuple[int, Probe]) -> None:
    port, _ = lean
    chunked = (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    (status, _, body), = await exchange(port, chunked)
    assert (status, json.loads(body)) == (200, {"kind": "Request", "len": 5, "x": ""})
    both = (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /hello HTTP/1.1\r\n\r\n")
    answer = await closed_by_server(port, both)
    assert answer.startswith(b"HTTP/1.0 400") and answer.count(b"HTTP/1.") == 1


async def test_header_limits_and_garbage_are_aiohttps_400(lean: tuple[int, Probe]) -> None:
    port, _ = lean
    long_value = echo_req(b"1", "X-Test: " + "v" * 9000 + "\r\n")
    # aiohttp answers a request it cannot parse as HTTP/1.0
    assert (await closed_by_server(port, long_value)).startswith(b"HTTP/1.0 400")
    many = echo_req(b"1", "".join(f"X-{i}: v\r\n" for i in range(130)))
    assert (await closed_by_server(port, many)).startswith(b"HTTP/1.0 400")
    # A long head within aiohttp's limits is served (lean, or by aiohttp past MAX_HEAD).
    big_head = echo_req(b"1", "".join(f"X-{i}: {'v' * 900}\r\n" for i in range(100)))
    (status, _, body), = await exchange(port, big_head)
    assert (status, json.loads(body)["len"]) == (200, 1)
    # After a served request, garbage on the same connection: aiohttp's 400 for it.
    answer = await closed_by_server(port, echo_req(b"1") + b"\x16\x03\x01garbage\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and b"HTTP/1.0 400" in answer


async def test_a_handler_exception_is_a_500_logged_and_closed(
        lean: tuple[int, Probe], caplog: pytest.LogCaptureFixture) -> None:
    port, _ = lean
    answer = await closed_by_server(port, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 500") and b"Connection: close" in answer
    assert any("handler bug" in str(r.exc_info) for r in caplog.records if r.exc_info)
    await eventually(lambda: any(r.name == ACCESS_LOGGER and getattr(r, "status", 0) == 500
                                 for r in caplog.records), "the 500's access line")


async def test_a_response_that_cannot_be_sent_is_a_500_and_the_server_lives(
        lean: tuple[int, Probe]) -> None:
    port, _ = lean
    answer = await closed_by_server(port, b"GET /chunked HTTP/1.0\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.0 500")
    (status, _, _), = await exchange(port, b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200


async def test_a_client_that_disconnects_cancels_its_handler(
        lean: tuple[int, Probe], caplog: pytest.LogCaptureFixture) -> None:
    port, probe = lean
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(probe.slow_started.wait(), 10)
    writer.close()
    await eventually(lambda: probe.slow_ended == ["cancelled"], "the handler cancelled")
    await eventually(lambda: any(r.name == ACCESS_LOGGER and getattr(r, "path", "") == "/slow"
                                 for r in caplog.records), "the access line of /slow")


async def test_shutdown_lets_the_request_in_flight_finish() -> None:
    probe = Probe()
    runner, _ = await start_app(probe_app(probe), "127.0.0.1", 0, "t", ConnLimits(),
                                http_server="lean")
    port = runner.addresses[0][1]
    idle = await asyncio.open_connection("127.0.0.1", port)  # an idle keep-alive client
    pending = asyncio.ensure_future(closed_by_server(
        port, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"))
    await asyncio.wait_for(probe.slow_started.wait(), 10)
    cleanup = asyncio.ensure_future(runner.cleanup())
    assert await asyncio.wait_for(idle[0].read(), 10) == b""  # closed at once
    assert not cleanup.done()  # waits for the request in flight
    probe.slow_release.set()
    answer = await asyncio.wait_for(pending, 10)
    await asyncio.wait_for(cleanup, 10)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"slow done")
    assert probe.slow_ended == ["done"]
    idle[1].close()


async def test_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    client_ctx.check_hostname = False
    async with lean_server(ssl_ctx=server_ctx) as (port, _, _):
        got = await exchange(port, echo_req(b"abc") * 2, responses=2, ssl_ctx=client_ctx)
        assert [json.loads(b)["kind"] for _, _, b in got] == ["LeanRequest"] * 2


async def test_the_header_timeout_still_cuts_a_slow_client() -> None:
    async with lean_server(ConnLimits(header_timeout_s=0.2)) as (port, _, guard):
        # A served request first (the guard's marks from the lean path), then half a head.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(echo_req(b"1"))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        writer.write(b"POST /echo HTTP/1.1\r\nHost:")
        await writer.drain()
        await asyncio.wait_for(reader.read(), 10)  # to EOF: the guard cut it
        assert guard.closed["header_timeout"] == 1
        writer.close()


async def test_the_body_timeout_cuts_a_body_that_stops() -> None:
    async with lean_server(ConnLimits(body_timeout_s=0.2)) as (port, _, guard):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(echo_req(b"0123456789")[:-8])  # the head and 2 of the 10 body bytes
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # cut, no answer
        assert guard.closed["body_timeout"] == 1
        writer.close()


async def test_the_write_stall_timeout_cuts_a_client_that_stops_reading() -> None:
    async with lean_server(ConnLimits(idle_timeout_s=0.3)) as (port, _, guard):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read
        await writer.drain()
        await eventually(lambda: guard.closed["write_stall"] == 1, "the stall cut", 10)
        writer.close()


async def test_the_balancer_through_skymesh_lb_config(caplog: pytest.LogCaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    # The requests' storage keys, set through request[...] or (on the request path) its
    # ``_state`` directly: typed, as on web.Request.
    served: list[LeanRequest] = []
    real = LeanRequest.__init__

    def recorded(self: LeanRequest, *args: Any) -> None:
        served.append(self)
        real(self, *args)

    monkeypatch.setattr(LeanRequest, "__init__", recorded)
    async with serving(chat_replica(MODEL)) as rport:
        cfg = parse_config({"listen": {"host": "127.0.0.1", "port": 0, "http_server": "lean"},
                            "policy": {"name": "round-robin"},
                            "replicas": [{"url": f"http://127.0.0.1:{rport}",
                                          "models": [MODEL]}],
                            "logging": {"access_log": True}})
        assert cfg.listen.http_server == "lean"
        runner, _ = await start_app(build_app(cfg), "127.0.0.1", 0, "lb", ConnLimits(),
                                    http_server=cfg.listen.http_server)
        try:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            body: dict[str, Any] = {"model": MODEL, "max_tokens": 4,
                                    "messages": [{"role": "user", "content": "hi"}]}
            async with aiohttp.ClientSession() as s:
                async def ready() -> bool:
                    async with s.post(url + CHAT, json=body) as r:
                        return r.status == 200
                await until(ready, "the replica in service")
                async with s.post(url + CHAT, json=body,
                                  headers={"X-Request-Id": "lean-1"}) as r:
                    assert r.status == 200 and r.headers["X-Request-Id"] == "lean-1"
                    assert (await r.json())["usage"]["completion_tokens"] == 1
                async with s.post(url + CHAT, data=b"{not json") as r:
                    assert r.status == 400
                    assert "error" in await r.json()  # the OpenAI shape
            await eventually(lambda: any(getattr(r, "request_id", "") == "lean-1"
                                         for r in caplog.records), "its access line")
            stored = [k for r in served for k in r._state]
            assert stored and all(isinstance(k, web.RequestKey) for k in stored)
        finally:
            await runner.cleanup()


async def test_an_app_with_a_middleware_is_served_by_aiohttp_alone() -> None:
    probe = Probe()
    app = probe_app(probe)

    @web.middleware
    async def passthrough(request: web.Request, handler: Any) -> web.StreamResponse:
        return await handler(request)

    app.middlewares.append(passthrough)
    runner, _ = await start_app(app, "127.0.0.1", 0, "t", ConnLimits(), http_server="lean")
    try:
        (status, _, body), = await exchange(runner.addresses[0][1], echo_req(b"ab"))
        assert (status, json.loads(body)["kind"]) == (200, "Request")
        server = runner.server
        assert server is not None
        assert all(type(c).__name__ == "RequestHandler" for c in server.connections)
    finally:
        await runner.cleanup()


async def test_skymesh_replica_keeps_aiohttps_server_under_the_lean_default() -> None:
    # start_app's default is lean; the replica's app has an error middleware, so no route
    # is taken leanly and every connection is aiohttp's (the emulated engine the
    # benchmarks run against does not change server with skymesh-lb's default).
    from skymesh_replica.server import ReplicaConfig, create_app
    app = create_app(ReplicaConfig())
    runner, _ = await start_app(app, "127.0.0.1", 0, "r", ConnLimits())
    try:
        assert await direct_routes(app) == {}
        (status, _, body), = await exchange(
            runner.addresses[0][1], b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and json.loads(body)["data"]
        server = runner.server
        assert server is not None
        assert all(type(c).__name__ == "RequestHandler" for c in server.connections)
    finally:
        await runner.cleanup()


def test_the_config_key_is_checked() -> None:
    assert parse_config({}).listen.http_server == "lean"  # the default since session 25
    assert parse_config({"listen": {"http_server": "aiohttp"}}).listen.http_server == "aiohttp"
    with pytest.raises(Exception, match="http_server"):
        parse_config({"listen": {"http_server": "fast"}})
