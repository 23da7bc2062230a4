"""The transparent proxy: engine routes the balancer does not own go to a replica as they
are.

What is forwarded: the OpenAI API family (``/v1/...``, ``/v2/...``: ``/v1/responses``,
``/v1/embeddings``, ``/v1/audio/*``, ``/v1/completions/render``, ``/v2/rerank``, ...) and
the engines' request-scoped helpers (``FORWARDED_PATHS``: ``/tokenize``, ``/detokenize``,
``/version``, ``/get_model_info``, SGLang's ``/generate``, ...). The balancer's own routes
come first (``build_app`` registers them before the catch-all), and routes that change
one engine's state (``/v1/load_lora_adapter``, ``/flush_cache``, ``/sleep``, ...) are not
forwarded: through a balancer they would reach one replica picked at random. Anything
else is the balancer's own 404 (or 405 on its own paths), in the OpenAI error shape.

Which path: the one the client sent, normalised (:func:`normalise_path`) before any check,
and the normalised form is what goes upstream: dot segments resolved, empty segments
(``//``) and a trailing slash dropped. A path that climbs above the root, or that encodes a
dot, a slash or a backslash (``%2e``, ``%2f``, ``%5c``: a dot needs no encoding, RFC 3986
2.3, so an encoded one is only there to slip past a check), is a 400. Otherwise
``/v1/./load_lora_adapter`` or ``/v1/x/../../sleep`` would pass the deny check as written
and reach an engine that resolves them.

How: method, normalised path, query string and body go upstream, with the client's
headers less the hop-by-hop ones (and less its ``Authorization`` when the balancer checks
keys or has its own key for the replicas, as on the generation path); the response comes
back unchanged, status, headers (less hop-by-hop) and body, streamed chunk by chunk as it
arrives. The body is read whole first, under ``limits.max_body_bytes`` (413).

Where: a JSON body's ``model`` picks among the healthy replicas serving that model (404
``model_not_found`` when none serves it, 503 ``no_healthy_replica`` when none of them is
up); without one, any healthy replica. Replicas behind an open circuit breaker (the
generation path's, ``skymesh.balancer.breaker``) are passed over while another is up; when
every one up is behind one, the answer is the generation path's 503 ``no_healthy_replica``
with ``Retry-After`` the first breaker's trial, spread upward (``overload.breakers_wait``),
not the failing replica's own errors. Among those, the least outstanding (the dispatcher's count
plus the passthrough requests in flight), ties at random: routing policies are for
generation. A connect error is retried once on another replica (the
request never left, whatever its method), and so is a connection lost before the answer
for idempotent methods.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web
from yarl import URL

from skymesh.balancer.dispatch import Dispatcher
from skymesh.balancer.edge import (
    REQUEST_ID_HEADER,
    OwnedRoutes,
    error_response,
    no_route,
    request_id,
)
from skymesh.balancer.errors import (
    BadRequest,
    ModelNotFound,
    NoHealthyReplica,
    NotFound,
    PayloadTooLarge,
    SkyMeshError,
    UpstreamFailed,
)
from skymesh.balancer.overload import breakers_wait, outage_retry_s, unlisted_replicas

log = logging.getLogger("skymesh.lb")

FORWARDED_PREFIXES = ("/v1/", "/v2/")
FORWARDED_PATHS = frozenset({
    "/tokenize", "/detokenize", "/version", "/get_model_info", "/model_info",
    "/get_server_info", "/server_info", "/pooling", "/classify", "/score", "/rerank",
    "/invocations", "/generate", "/encode",
})
REFUSED_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
ATTEMPTS = 2  # the first and one retry
# RFC 9110 7.6.1's hop-by-hop headers, plus what aiohttp sets itself on each leg.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                  "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
                  "host", "content-length", "date", "server"})
# Sent only if the client sent them: aiohttp would add its own otherwise.
_NOT_AUTO = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


# Percent-encodings refused anywhere in a path (lower case): dot, slash, backslash.
_ENCODED_SEPARATORS = ("%2e", "%2f", "%5c")


def normalise_path(raw_path: str) -> str:
    """The path-only, still percent-encoded ``raw_path`` normalised: ``.`` and empty
    segments dropped, ``..`` removing the segment before it, no trailing slash ("/" stays
    "/"). Raises BadRequest for a path that climbs above the root, has a backslash, or
    percent-encodes a dot, slash or backslash (see the module docstring)."""
    lowered = raw_path.lower()
    if not raw_path.startswith("/") or "\\" in raw_path or any(
            e in lowered for e in _ENCODED_SEPARATORS):
        raise BadRequest("the request path may not contain a backslash or an encoded dot, "
                         "slash or backslash (%2e, %2f, %5c)")
    out: list[str] = []
    for seg in raw_path.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if not out:
                raise BadRequest("the request path climbs above the root ('..')")
            out.pop()
        else:
            out.append(seg)
    return "/" + "/".join(out)


def forwarded(path: str) -> bool:
    return path not in REFUSED_PATHS and (path in FORWARDED_PATHS
                                          or path.startswith(FORWARDED_PREFIXES))


def body_model(raw: bytes, content_type: str) -> str | None:
    """A JSON body's ``model``, or None (no body, not JSON, no such string field)."""
    if not raw or "json" not in content_type:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


class Passthrough:
    def __init__(self, dispatcher: Dispatcher, session: Callable[[], aiohttp.ClientSession],
                 *, max_body_bytes: int, forward_client_auth: bool,
                 refused: Callable[[web.Request], web.Response | None],
                 owned: OwnedRoutes, hidden_headers: frozenset[str] = frozenset(),
                 rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dispatcher = dispatcher
        self._clock = clock  # the breakers' clock: the balancer's ``now``
        self._session = session
        self.max_body_bytes = max_body_bytes
        self._refused = refused
        self.owned = owned  # the balancer's own routes (build_app fills it)
        # The request id goes up as request_id() says (the client's or a new one).
        drop = set(_HOP) | {h.lower() for h in hidden_headers} | {REQUEST_ID_HEADER.lower()}
        if not forward_client_auth:
            drop.add("authorization")
        self._drop = frozenset(drop)
        self._rng = rng or random.Random()
        self.in_flight: dict[str, int] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            raw_path = normalise_path(request.rel_url.raw_path)
        except BadRequest as exc:
            return error_response(exc)
        # The checks read the decoded path (as the engine will: %6c is an "l"); no
        # separator or dot can appear by decoding, normalise_path refused those.
        path = URL.build(path=raw_path, encoded=True).path
        if path != request.path and self.owned.allowed(path) is not None:
            return error_response(NotFound(f"no route for {request.method} {request.path}; "
                                           f"the balancer serves {path}"))
        if self.owned.allowed(path) is not None or not forwarded(path):
            return no_route(request, self.owned)
        if (refused := self._refused(request)) is not None:
            return refused
        try:
            raw = await self._read_body(request)
            model = body_model(raw, request.headers.get("Content-Type", ""))
            query = request.rel_url.raw_query_string
            upstream_path = f"{raw_path}?{query}" if query else raw_path
            return await self._forward(request, upstream_path, raw, model)
        except SkyMeshError as exc:
            return error_response(exc)

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        buf = bytearray()
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        return bytes(buf)

    def pick(self, model: str | None, excluded: set[str]) -> str:
        d = self.dispatcher
        serving = [tid for tid, t in d.targets.items()
                   if model is None or model in t.models]
        cands = [tid for tid in serving if d.targets[tid].healthy and tid not in excluded]
        if cands and d.health_summary()[1]:  # some breaker open: pass over the shut ones
            now = self._clock()
            shut = [d.targets[tid].breaker for tid in cands
                    if d.targets[tid].breaker.shut(now)]
            if len(shut) == len(cands):
                raise breakers_wait(self._what(model), shut, now, self._rng.random())
            if shut:
                cands = [tid for tid in cands if not d.targets[tid].breaker.shut(now)]
        if cands:
            return min(cands, key=lambda tid: (
                d.targets[tid].load.outstanding + self.in_flight.get(tid, 0),
                self._rng.random()))
        if model is not None and not serving and not unlisted_replicas(d):
            raise ModelNotFound(f"model {model!r} is not served here; see /v1/models",
                                param="model")
        raise NoHealthyReplica(f"no healthy replica can serve {self._what(model)} now "
                               f"({len(serving)} replica(s) known for it, none up)",
                               retry_after_s=outage_retry_s(self._rng.random()))

    @staticmethod
    def _what(model: str | None) -> str:
        return f"model {model!r}" if model is not None else "this route"

    def _headers(self, request: web.Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in self._drop}
        headers[REQUEST_ID_HEADER] = request_id(request)
        return headers

    async def _forward(self, request: web.Request, upstream_path: str, raw: bytes,
                       model: str | None) -> web.StreamResponse:
        method = request.method
        headers = self._headers(request)
        excluded: set[str] = set()
        for attempt in range(1, ATTEMPTS + 1):
            target = self.pick(model, excluded)
            self.in_flight[target] = self.in_flight.get(target, 0) + 1
            try:
                try:
                    up = await self._session().request(
                        method, URL(target + upstream_path, encoded=True),
                        data=raw or None, headers=headers, allow_redirects=False,
                        skip_auto_headers=_NOT_AUTO)
                except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
                        aiohttp.ClientOSError, TimeoutError) as exc:
                    never_sent = isinstance(exc, aiohttp.ClientConnectorError)
                    log.warning("passthrough %s %s to %s failed: %s", method, request.path,
                                target, exc or type(exc).__name__)
                    if attempt < ATTEMPTS and (never_sent or method in IDEMPOTENT):
                        excluded.add(target)
                        continue
                    raise UpstreamFailed(f"the replica did not answer {method} "
                                         f"{request.path}: {exc or type(exc).__name__}"
                                         ) from None
                try:
                    return await self._relay(request, up)
                finally:
                    up.release()
            finally:
                left = self.in_flight[target] - 1
                if left:
                    self.in_flight[target] = left
                else:
                    del self.in_flight[target]
        raise AssertionError("unreachable")  # the loop returns or raises

    async def _relay(self, request: web.Request, up: aiohttp.ClientResponse
                     ) -> web.StreamResponse:
        resp = web.StreamResponse(status=up.status, reason=up.reason, headers={
            k: v for k, v in up.headers.items() if k.lower() not in _HOP})
        if up.content_length is not None:
            resp.content_length = up.content_length
        await resp.prepare(request)
        if request.method == "HEAD":
            return resp
        try:
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError,
                TimeoutError) as exc:
            # The client has the status line already: cut its connection so it sees a
            # truncated response, never a clean end to half a body.
            log.warning("passthrough %s broke mid-response: %s", request.path, exc)
            if request.transport is not None:
                request.transport.abort()
            return resp
        await resp.write_eof()
        return resp
