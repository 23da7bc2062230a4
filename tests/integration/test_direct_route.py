"""skymesh-lb's app served by start_app over loopback: the generation routes go straight to
their handler (skymesh.net.front), past ``Application._handle``, and answer as through it:
the X-Request-Id stamp, ``Expect: 100-continue``, the body limit's 413, the access line;
other paths and methods still go through the app (404, 405), and an app with a middleware
of its own keeps it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support import chat_replica, eventually, serving, until

from skymesh.balancer.config import parse_config
from skymesh.balancer.server import build_app
from skymesh.net.lean_request import LeanRequest
from skymesh.net.limits import ConnLimits
from skymesh.net.serving import start_app
from skymesh.obs.access import ACCESS_LOGGER

MODEL = "m"
MAX_BODY = 4096
CHAT = "/v1/chat/completions"


def replica() -> web.Application:
    return chat_replica(MODEL)


class Handled(list[str]):
    """The paths of the requests that went through ``Application._handle`` of the apps
    in ``watched`` (not the stand-in replica's)."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: list[web.Application] = []


@pytest.fixture
def handled(monkeypatch: pytest.MonkeyPatch) -> Handled:
    seen = Handled()
    real = web.Application._handle

    async def counted(self: web.Application, request: web.Request) -> web.StreamResponse:
        if any(self is app for app in seen.watched):
            seen.append(request.path)
        return await real(self, request)

    monkeypatch.setattr(web.Application, "_handle", counted)
    return seen


@pytest.fixture
async def lb(request: pytest.FixtureRequest, handled: Handled,
             caplog: pytest.LogCaptureFixture) -> AsyncIterator[str]:
    """skymesh-lb's app on a free port, on its default server (or the ``listen.http_server``
    a test asks for by indirect parametrization)."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    listen: dict[str, Any] = {"host": "127.0.0.1", "port": 0}
    if hasattr(request, "param"):
        listen["http_server"] = request.param
    async with serving(replica()) as port:
        cfg = parse_config({"listen": listen,
                            "policy": {"name": "round-robin"},
                            "replicas": [{"url": f"http://127.0.0.1:{port}",
                                          "models": [MODEL]}],
                            "limits": {"max_body_bytes": MAX_BODY},
                            "logging": {"access_log": True}})
        app = build_app(cfg)
        handled.watched.append(app)
        runner, _ = await start_app(app, "127.0.0.1", 0, "lb", ConnLimits(),
                                    http_server=cfg.listen.http_server)
        try:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            async with aiohttp.ClientSession() as s:
                async def ready() -> bool:
                    async with s.post(url + CHAT, json=body()) as r:
                        return r.status == 200
                await until(ready, "the replica in service")
            handled.clear()
            yield url
        finally:
            await runner.cleanup()


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello"}], **extra}


def access_records(caplog: pytest.LogCaptureFixture, rid: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == ACCESS_LOGGER and getattr(r, "request_id", None) == rid]


async def test_a_generation_request_goes_direct_stamped_and_logged(
        lb: str, handled: Handled, caplog: pytest.LogCaptureFixture) -> None:
    async with aiohttp.ClientSession() as s, s.post(
            lb + CHAT, json=body(), headers={"X-Request-Id": "direct-1"}) as r:
        assert r.status == 200
        assert r.headers["X-Request-Id"] == "direct-1"
        assert (await r.json())["usage"]["completion_tokens"] == 1
    assert handled == []  # straight to the handler, not through _handle
    await eventually(lambda: bool(access_records(caplog, "direct-1")), "its access line")
    line = access_records(caplog, "direct-1")[0]
    assert (line.method, line.path, line.status, line.model, line.via) == (  # type: ignore[attr-defined]
        "POST", CHAT, 200, MODEL, "replica")
    assert (line.prompt_tokens, line.completion_tokens) == (3, 1)  # type: ignore[attr-defined]
    assert line.client == "127.0.0.1" and line.ttft_ms is not None  # type: ignore[attr-defined]


async def test_expect_100_continue_is_answered_as_by_the_app(
        lb: str, handled: Handled) -> None:
    async with aiohttp.ClientSession() as s, s.post(
            lb + CHAT, json=body(), expect100=True) as r:
        assert r.status == 200
        assert r.headers["X-Request-Id"]
    assert handled == [CHAT]  # a request with Expect goes through _handle


async def test_a_body_over_the_limit_is_a_413_in_the_openai_shape(
        lb: str, handled: Handled, caplog: pytest.LogCaptureFixture) -> None:
    big = body(messages=[{"role": "user", "content": "x" * (2 * MAX_BODY)}])
    async with aiohttp.ClientSession() as s, s.post(
            lb + CHAT, json=big, headers={"X-Request-Id": "big-1"}) as r:
        assert r.status == 413
        assert r.headers["X-Request-Id"] == "big-1"
        err = (await r.json())["error"]
        assert err["type"] and err["message"]
    assert handled == []
    await eventually(lambda: bool(access_records(caplog, "big-1")), "its access line")
    assert access_records(caplog, "big-1")[0].status == 413  # type: ignore[attr-defined]


async def test_other_methods_and_paths_go_through_the_app(
        lb: str, handled: Handled) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(lb + CHAT) as r:  # an owned path: 405 in the OpenAI shape
            assert r.status == 405
            assert "error" in await r.json()
            assert r.headers["X-Request-Id"]
        async with s.post(lb + "/v1/nowhere", json=body()) as r:  # forwarded: 404 there
            assert r.status == 404
        async with s.get(lb + "/health") as r:  # a plain route: direct
            assert r.status == 200
    assert handled == [CHAT, "/v1/nowhere"]


async def test_an_app_with_a_middleware_of_its_own_keeps_it(handled: Handled) -> None:
    @web.middleware
    async def tag(request: web.Request, handler: Any) -> web.StreamResponse:
        resp = await handler(request)
        resp.headers["X-Tag"] = "mw"
        return resp

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application(middlewares=[tag])
    app.router.add_post(CHAT, hello)
    handled.watched.append(app)
    runner, _ = await start_app(app, "127.0.0.1", 0, "test", ConnLimits())
    try:
        async with aiohttp.ClientSession() as s, \
                s.post(f"http://127.0.0.1:{runner.addresses[0][1]}{CHAT}") as r:
            assert (r.status, r.headers.get("X-Tag"), await r.text()) == (200, "mw", "hi")
    finally:
        await runner.cleanup()
    assert handled == [CHAT]


@pytest.mark.parametrize("lb", ["aiohttp", "lean"], indirect=True)
async def test_request_storage_uses_typed_keys_only(
        lb: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    # aiohttp warns (NotAppKeyWarning, once per key and process) for each plain-string
    # key stored on a request: the daemon's stderr stays free of it with typed keys. The
    # lean server's request (a plain dict inside) would not warn: its keys are recorded too.
    stored: list[object] = []
    kinds: set[str] = set()  # the request classes that stored them
    for cls in (web.BaseRequest, LeanRequest):
        real = cls.__setitem__

        def recorded(self: Any, key: Any, value: Any, real: Any = real) -> None:
            stored.append(key)
            kinds.add(type(self).__name__)
            real(self, key, value)

        monkeypatch.setattr(cls, "__setitem__", recorded)
    async with aiohttp.ClientSession() as s:
        async with s.post(lb + CHAT, json=body(), headers={"X-Request-Id": "keys-1"}) as r:
            assert r.status == 200
        async with s.post(lb + CHAT, json=body(stream=True)) as r:
            assert r.status == 200
            await r.read()
    assert stored  # the ticket, the access record, the output tokens
    assert [k for k in stored if not isinstance(k, web.RequestKey)] == []
    server = request.node.callspec.params["lb"]
    assert kinds == {{"aiohttp": "Request", "lean": "LeanRequest"}[server]}
