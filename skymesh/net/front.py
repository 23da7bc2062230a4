"""The server's request handler for an aiohttp app: one coroutine frame per request.

aiohttp's server calls ``Application._handle`` for each request, and the daemons wrapped
it twice (the connection guard's start and end marks, the access log): three coroutine
frames before the route's handler. ``_handle`` itself calls ``asyncio.get_event_loop()``,
a ``getpid()`` system call per request on Python 3.11, then resolves the route through
the router's index. :func:`request_handler` does the guard's marks, the access log's
record and, for the app's plain routes (a fixed path and method: the balancer's two
generation routes among them), the route itself in one coroutine, and hands anything else
to ``_handle`` unchanged: dynamic paths, unknown paths and methods (their 404 and 405),
requests carrying ``Expect``, and every request of an app with middlewares in its chain
(tracing keeps the access log there). docs/notes/direct-route.md has the figures.

A direct hit does what ``_handle`` does for it: the route's match info, with the app
added and frozen (made once per route: a plain route's holds nothing of a request), so
``request.match_info``, ``request.app``, ``request.config_dict`` and the
``on_response_prepare`` signals work as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

from aiohttp import hdrs, web
from aiohttp.web_urldispatcher import (
    AbstractRoute,
    MatchedSubAppResource,
    PlainResource,
    UrlMappingMatchInfo,
)
from yarl import URL

from skymesh.net.limits import mark_started

if TYPE_CHECKING:
    from skymesh.obs.access import OutsideLog

Handler = Callable[[Any], Awaitable[web.StreamResponse]]  # the server's: a web.Request
DirectRoutes = dict[tuple[str, str], AbstractRoute]


async def direct_routes(app: web.Application) -> DirectRoutes:
    """``(method, raw path) -> route`` for the plain routes of ``app`` (set up, frozen)
    that its router resolves to them; empty when a request must go through ``_handle``
    anyway (middlewares in the chain, domain-matched sub-apps resolved first). Each
    entry is checked by the router itself, so a hit goes where ``_handle`` would send
    it (registration order, resources sharing a path)."""
    router = app.router
    if app.middlewares or getattr(app, "_run_middlewares", True) is not False:
        return {}  # the chain (the app's or a sub-app's) runs inside _handle
    resources = list(router.resources())
    if any(isinstance(r, MatchedSubAppResource) for r in resources):
        return {}  # matched on the host before any path: not a path's lookup
    table: DirectRoutes = {}
    for resource in resources:
        if type(resource) is not PlainResource:
            continue
        path = resource.canonical
        if URL(path).path_safe != path:  # a raw target never equals it: no key
            continue
        for route in resource:
            if route.method == hdrs.METH_ANY or (route.method, path) in table:
                continue
            # What the router's resolve reads of a request: its method and path.
            probe = SimpleNamespace(method=route.method, rel_url=URL(path))
            resolved = await router.resolve(cast(web.Request, probe))
            if resolved.route is route and not resolved.apps:
                table[(route.method, path)] = route
    return table


def _frozen_match_info(app: web.Application, route: AbstractRoute) -> UrlMappingMatchInfo:
    match_info = UrlMappingMatchInfo({}, route)
    match_info.add_app(app)
    match_info.freeze()
    return match_info


def request_handler(app: web.Application, handle: Handler, routes: DirectRoutes,
                    log: OutsideLog | None) -> Handler:
    """The server's request handler: the connection guard's marks (requests on a
    guarded connection), ``log``'s record (the access log taken out of the app's chain,
    :func:`skymesh.obs.access.outside_chain`) and the request through ``routes`` (from
    :func:`direct_routes`) or else ``handle`` (the app's ``_handle``), in one frame."""
    # A plain route's match info holds nothing of a request (no path parameters, the
    # app fixed, frozen): made once per route, as _handle would make it, not per request.
    infos = {key: (_frozen_match_info(app, route), route.handler)
             for key, route in routes.items()}
    lookup = infos.get
    expect = hdrs.EXPECT

    def route(request: Any) -> Awaitable[web.StreamResponse]:
        """The request's handling, not yet awaited: a plain route's handler directly
        (what _handle does for it, without the loop lookup), else the app's ``_handle``.
        A plain function, so that it adds no coroutine frame to the request."""
        direct = lookup((request.method, request.raw_path))
        if direct is None or expect in request.headers:
            return handle(request)
        request._match_info, route_handler = direct
        return route_handler(request)

    async def front(request: Any) -> web.StreamResponse:
        conn = mark_started(request)
        try:
            return await route(request)
        finally:
            if conn is not None:
                conn.request_finished()

    if log is None:
        return front
    # With the log, its own frame: the record made here (what log.begin does, without
    # its call, nor AccessRecord.__init__'s: the same stores, access.BEGUN, inline), and
    # no test per request of whether there is a log.
    from skymesh.obs.access import NOT_DECODED as not_decoded
    from skymesh.obs.access import RECORD_KEY, AccessRecord  # the log is there: loaded

    clock, key = log.clock, RECORD_KEY
    finish, failed = log.finish, log.failed
    new = object.__new__

    async def logged_front(request: Any) -> web.StreamResponse:
        conn = mark_started(request)
        rec = new(AccessRecord)
        rec.start = clock()
        rec.request_id = rec.model = rec.served_by = rec.via = rec.tenant = None
        rec.disconnected = False
        rec.stream = None
        rec.usage = not_decoded
        request._state[key] = rec
        try:
            resp = await route(request)
        except BaseException as exc:
            failed(request, rec, exc)
            raise
        else:
            finish(request, rec, resp, resp._status)  # its status property, uncalled
        finally:
            if conn is not None:
                conn.request_finished()
        return resp

    return logged_front
