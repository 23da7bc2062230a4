"""The server's one-frame request handler (skymesh.net.front): which routes go direct, and
that a direct hit behaves as Application._handle would."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from skymesh.net.front import direct_routes, request_handler

CONFIG = web.AppKey("config", str)
SELF = web.AppKey("self", web.Application)


async def hot(request: web.Request) -> web.Response:
    # What a handler may read: all set up by the match info as _handle makes it.
    return web.json_response({"app": request.app is request.config_dict[SELF],
                              "config": request.config_dict[CONFIG],
                              "route": request.match_info.route.resource.canonical,  # type: ignore[union-attr]
                              "frozen": request.match_info._frozen,
                              "apps": len(request.match_info.apps)})


async def other(request: web.Request) -> web.Response:
    return web.Response(text="other")



def app_like_the_balancer() -> web.Application:
    app = web.Application()
    app[CONFIG] = "c"
    app[SELF] = app
    app.router.add_post("/v1/chat/completions", hot)
    app.router.add_post("/v1/completions", hot)
    app.router.add_get("/health", other)
    app.router.add_get("/v1/models/{model:.+}", other)
    app.router.add_route("*", "/{tail:.*}", other)
    return app


async def frozen_routes(app: web.Application) -> dict[tuple[str, str], Any]:
    app.freeze()
    return await direct_routes(app)


async def test_the_plain_routes_with_a_method_go_direct() -> None:
    table = await frozen_routes(app_like_the_balancer())
    assert set(table) == {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                          ("GET", "/health"), ("HEAD", "/health")}
    assert table[("POST", "/v1/chat/completions")].handler is hot


async def test_an_app_with_a_middleware_has_no_direct_route() -> None:
    app = app_like_the_balancer()

    @web.middleware
    async def mw(request: web.Request, handler: Any) -> web.StreamResponse:
        return await handler(request)

    app.middlewares.append(mw)
    assert await frozen_routes(app) == {}


async def test_a_sub_app_with_a_middleware_has_no_direct_route() -> None:
    app = app_like_the_balancer()
    sub = web.Application()

    @web.middleware
    async def mw(request: web.Request, handler: Any) -> web.StreamResponse:
        return await handler(request)

    sub.middlewares.append(mw)
    sub.router.add_get("/x", other)
    app.add_subapp("/sub", sub)
    assert await frozen_routes(app) == {}


async def test_the_first_registered_resource_of_a_path_wins_as_in_the_router() -> None:
    app = web.Application()
    first = app.router.add_resource("/q", name="first").add_route("GET", hot)
    second = app.router.add_resource("/q", name="second")
    second.add_route("GET", other)  # never reached by the router
    post = second.add_route("POST", other)
    table = await frozen_routes(app)
    assert table == {("GET", "/q"): first, ("POST", "/q"): post}


async def test_a_direct_hit_skips_handle_and_sets_up_the_request_as_it_would() -> None:
    app = app_like_the_balancer()
    routes = await frozen_routes(app)
    handled: list[str] = []

    async def handle(request: Any) -> web.StreamResponse:
        handled.append(request.path)
        return await app._handle(request)

    front = request_handler(app, handle, routes, None)
    resp = await front(make_mocked_request("POST", "/v1/chat/completions", app=app))
    assert isinstance(resp, web.Response) and resp.body is not None
    assert handled == []
    assert resp.body == b'{"app": true, "config": "c", "route": "/v1/chat/completions", ' \
                        b'"frozen": true, "apps": 1}'


@pytest.mark.parametrize(("method", "path", "headers"), [
    ("GET", "/v1/chat/completions", {}),  # another method: the catch-all route
    ("POST", "/v1/chat/completions?x=1", {}),  # a raw target that is not the path
    ("POST", "/v1/chat/completions", {"Expect": "100-continue"}),
    ("GET", "/v1/models/m", {}),  # a dynamic route
])
async def test_anything_else_goes_through_handle(method: str, path: str,
                                                 headers: dict[str, str]) -> None:
    app = app_like_the_balancer()
    routes = await frozen_routes(app)
    handled: list[str] = []

    async def handle(request: Any) -> web.StreamResponse:
        handled.append(request.method)
        return web.Response(text="handled")

    front = request_handler(app, handle, routes, None)
    resp = await front(make_mocked_request(method, path, headers=headers, app=app))
    assert handled == [method]
    assert isinstance(resp, web.Response) and resp.text == "handled"


def test_hooks_marked_streams_only_are_left_out_of_a_plain_replys() -> None:
    from skymesh.net.prepare_hooks import plain_prepare_hooks, streams_only

    async def stamp(request: Any, response: web.StreamResponse) -> None:
        pass

    @streams_only
    async def watch(request: Any, response: web.StreamResponse) -> None:
        pass

    class Watcher:
        @streams_only
        async def hook(self, request: Any, response: web.StreamResponse) -> None:
            pass

    app = web.Application()
    for hook in (watch, stamp, Watcher().hook, stamp):
        app.on_response_prepare.append(hook)
    assert plain_prepare_hooks(app) == (stamp, stamp)
