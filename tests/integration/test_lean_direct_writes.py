"""The lean server's direct writes (skymesh.net.lean, ``LeanProtocol._send_plain``):
skymesh-lb's plain answers (the generation routes' non-streaming JSON and their error
answers, ``/health``) reach the client with the status line, headers (in order) and body
that aiohttp's server sends for the same request, on HTTP/1.1 and 1.0, keeping the
connection or closing it alike, and without ``web.StreamResponse.prepare()``."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support import chat_replica, serving, until

from skymesh.balancer.config import parse_config
from skymesh.balancer.server import build_app
from skymesh.net.lean_request import LeanRequest
from skymesh.net.limits import ConnLimits
from skymesh.net.serving import start_app

MODEL = "m"
CHAT = "/v1/chat/completions"
DATE = re.compile(r"[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT")


def replica() -> web.Application:
    app = chat_replica(MODEL)

    async def tag(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Replica-Tag"] = "r1"  # a header of its own: the relay copies it

    app.on_response_prepare.append(tag)
    return app


@contextlib.asynccontextmanager
async def balancer(server: str, rport: int) -> AsyncIterator[int]:
    cfg = parse_config({"listen": {"host": "127.0.0.1", "port": 0, "http_server": server},
                        "policy": {"name": "round-robin"},
                        "replicas": [{"url": f"http://127.0.0.1:{rport}",
                                      "models": [MODEL]}]})
    runner, _ = await start_app(build_app(cfg), "127.0.0.1", 0, "lb", ConnLimits(),
                                http_server=cfg.listen.http_server)
    try:
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as s:
            async def ready() -> bool:
                async with s.post(f"http://127.0.0.1:{port}{CHAT}", json=chat()) as r:
                    return r.status == 200
            await until(ready, "the replica in service")
        yield port
    finally:
        await runner.cleanup()


def chat(model: str = MODEL) -> dict[str, Any]:
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def post(body: bytes, version: str = "1.1", extra: str = "") -> bytes:
    return (f"POST {CHAT} HTTP/{version}\r\nHost: x\r\nX-Request-Id: same-1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


CHAT_BODY = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}'
REQUESTS = {
    "chat": post(CHAT_BODY),
    "chat, Connection: close": post(CHAT_BODY, extra="Connection: close\r\n"),
    "chat, HTTP/1.0": post(CHAT_BODY, "1.0"),
    "chat, HTTP/1.0 keep-alive": post(CHAT_BODY, "1.0", "Connection: keep-alive\r\n"),
    "not JSON (400)": post(b"{not json"),
    "unknown model (404)": post(CHAT_BODY.replace(b'"m"', b'"nope"')),
    "health": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: same-1\r\n\r\n",
}
Seen = tuple[str, list[tuple[str, str]], bytes, bool]


async def answer(port: int, raw: bytes) -> Seen:
    """The status line, the header lines in order (Date's value checked, then masked),
    the body, and whether the server closed the connection after it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode("latin-1")
        status, *lines = head[:-4].split("\r\n")
        headers = [(k, v.strip()) for k, _, v in (line.partition(":") for line in lines)]
        length = int(dict((k.lower(), v) for k, v in headers)["content-length"])
        body = await asyncio.wait_for(reader.readexactly(length), 10)
        for i, (k, v) in enumerate(headers):
            if k == "Date":
                assert DATE.fullmatch(v), v
                headers[i] = (k, "<date>")
        try:  # a closed connection reads EOF at once; a kept one reads nothing
            closed = await asyncio.wait_for(reader.read(1), 0.3) == b""
        except TimeoutError:
            closed = False
        return status, headers, body, closed
    finally:
        writer.close()


async def test_plain_answers_match_aiohttps_byte_for_byte_but_the_date(
        monkeypatch: pytest.MonkeyPatch) -> None:
    prepared: list[str] = []  # the lean requests whose answer went through prepare()
    real = web.StreamResponse.prepare

    async def counted(self: web.StreamResponse, request: Any) -> Any:
        if isinstance(request, LeanRequest):
            prepared.append(request.path)
        return await real(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", counted)
    seen: dict[str, dict[str, Seen]] = {}
    async with serving(replica()) as rport:
        for server in ("aiohttp", "lean"):
            async with balancer(server, rport) as port:
                seen[server] = {name: await answer(port, raw)
                                for name, raw in REQUESTS.items()}
    assert prepared == []  # every lean answer here was written directly
    for name in REQUESTS:
        assert seen["lean"][name] == seen["aiohttp"][name], name
    chat_seen = seen["lean"]["chat"]
    names = [k for k, _ in chat_seen[1]]
    assert {"X-Request-Id", "X-Replica-Tag", "Content-Type", "Content-Length", "Date",
            "Server"} <= set(names)
    assert ("X-Request-Id", "same-1") in chat_seen[1] and not chat_seen[3]
    assert [s[3] for s in seen["lean"].values()] == [False, True, True, False, False, False,
                                                      False]
    assert seen["lean"]["not JSON (400)"][0] == "HTTP/1.1 400 Bad Request"
    assert seen["lean"]["chat, HTTP/1.0"][0].startswith("HTTP/1.0 200")


def bad_header_app() -> web.Application:
    async def bad(request: web.Request) -> web.Response:
        return web.Response(text="x", headers={"X-Bad": "a\nb"})  # header injection

    async def head_ok(request: web.Request) -> web.Response:
        return web.Response(text="fine")

    app = web.Application()
    app.router.add_get("/bad", bad)
    app.router.add_get("/ok", head_ok)
    return app


@pytest.mark.parametrize("server", ["aiohttp", "lean"])
async def test_a_header_with_a_line_break_never_leaves(server: str) -> None:
    # aiohttp's header writer refuses it on both paths: aiohttp's server then closes the
    # connection with no answer, the lean server answers its 500 and closes.
    runner, _ = await start_app(bad_header_app(), "127.0.0.1", 0, "t", ConnLimits(),
                                http_server=server)
    try:
        port = runner.addresses[0][1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /bad HTTP/1.1\r\nHost: x\r\n\r\n")
        sent = await asyncio.wait_for(reader.read(), 10)  # to EOF: closed
        writer.close()
        assert b"X-Bad" not in sent and b"a\nb" not in sent
        assert sent == b"" if server == "aiohttp" else sent.startswith(b"HTTP/1.1 500 ")
        status, _, body, _ = await answer(port, b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (status, body) == ("HTTP/1.1 200 OK", b"fine")
    finally:
        await runner.cleanup()
