"""What every answer of ``skymesh-lb`` shares, whichever handler gives it.

* **Request ids.** A request's id is the client's ``X-Request-Id`` when it sent a usable
  one, else a new one: 32 hex digits, a random per-process half and a counter (unique
  like a uuid4, at a tenth of its cost on the request path). The same id goes upstream,
  into the dispatcher's route, and back on every response (stamped just before the
  headers leave, streams included), so a client can quote it and an operator can find it
  in every log along the way.
* **Errors.** Whatever the balancer answers by itself is an OpenAI error body
  (``{"error": {"message", "type", "param", "code"}}``), unknown routes (404) and wrong
  methods (405, with ``Allow``) included, so an SDK always sees a ``code``.
"""

from __future__ import annotations

import itertools
import os

from aiohttp import web

from skymesh.balancer.errors import MethodNotAllowed, NotFound, SkyMeshError

REQUEST_ID_HEADER = "X-Request-Id"
_ID_KEY = web.RequestKey("skymesh.request_id", str)
# A client's id is echoed and logged: bounded, and printable ASCII only (aiohttp already
# refuses line breaks in a header).
MAX_ID_LEN = 128
_PREFIX = os.urandom(8).hex()
_COUNTER = itertools.count(1)


def request_id(request: web.Request) -> str:
    """The request's id (see the module docstring); the same on every call."""
    # The request's own dict, not request.get() and request[...]: a Python call fewer
    # each on the lean server's request, of the three a request makes here (aiohttp's
    # Request and the lean server's both keep their items in ``_state``).
    state = request._state
    rid: str | None = state.get(_ID_KEY)
    if rid is None:
        given = request.headers.get(REQUEST_ID_HEADER)
        rid = given if given and len(given) <= MAX_ID_LEN and given.isprintable() \
            and given.isascii() else f"{_PREFIX}{next(_COUNTER):016x}"
        state[_ID_KEY] = rid
    return rid


async def stamp_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: runs before any response's headers leave."""
    response.headers[REQUEST_ID_HEADER] = request_id(request)


def error_response(exc: SkyMeshError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers())


class OwnedRoutes:
    """The balancer's own routes, path -> methods: a request to one of these paths is
    never forwarded (a wrong method there is a 405)."""

    def __init__(self, app: web.Application) -> None:
        exact: dict[str, set[str]] = {}
        prefix: dict[str, set[str]] = {}
        for route in app.router.routes():
            path = route.resource.canonical if route.resource is not None else None
            if path is None:
                continue
            if "{" in path:  # "/v1/models/{model}": the static part
                prefix.setdefault(path.split("{", 1)[0], set()).add(route.method)
            else:
                exact.setdefault(path, set()).add(route.method)
        self._exact = {p: frozenset(m) for p, m in exact.items()}
        self._prefix = {p: frozenset(m) for p, m in prefix.items()}

    def allowed(self, path: str) -> frozenset[str] | None:
        """The methods ``path`` takes here, or None when the balancer does not own it."""
        got = self._exact.get(path)
        if got is None:
            got = next((m for p, m in self._prefix.items() if path.startswith(p)), None)
        return got


def no_route(request: web.Request, owned: OwnedRoutes) -> web.Response:
    """The 405 for a path the balancer serves with other methods, else the 404."""
    allowed = owned.allowed(request.path)
    if allowed is not None:
        return error_response(MethodNotAllowed(
            f"{request.method} is not allowed on {request.path}; allowed: "
            f"{', '.join(sorted(allowed))}", allow=sorted(allowed)))
    return error_response(NotFound(f"no route for {request.method} {request.path}"))
