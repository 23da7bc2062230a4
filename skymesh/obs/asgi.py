"""The controller's access log and request spans: a pure ASGI middleware (no Starlette
import, so this module loads without the ``controller`` extra).

One INFO line per HTTP request on ``skymesh.access``: ``method``, ``path``, ``status``,
``duration_ms``, ``principal`` (the token's name, never the token) and ``client``, plus
``trace_id`` when traced. The principal is whatever the app put in the request's state
under :data:`PRINCIPAL` (Starlette's ``request.state.principal``): the middleware makes
sure the state dict exists before the app runs, so the app's write is visible here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from skymesh.obs.logs import ACCESS_LOGGER

if TYPE_CHECKING:
    from skymesh.obs.tracing import Tracing

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
PRINCIPAL = "principal"
CLIENT_CLOSED = 499


class AccessLogMiddleware:
    """Wraps an ASGI app; with ``tracing``, also a SERVER span per request, ended (and the
    provider flushed) when the app's lifespan ends."""

    def __init__(self, app: App, *, access_log: bool = True, tracing: Tracing | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.app = app
        self.log = logging.getLogger(ACCESS_LOGGER) if access_log else None
        self.tracing = tracing
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            try:
                await self.app(scope, receive, send)
            finally:
                if self.tracing is not None:
                    await asyncio.to_thread(self.tracing.shutdown)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        start = self.clock()
        status: int | None = None

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        span_cm: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.tracing is not None:
            headers = {k.decode("latin-1"): v.decode("latin-1")
                       for k, v in scope.get("headers", ())}
            span_cm = self.tracing.server_span(f"{scope['method']} {scope['path']}", headers, {
                "http.request.method": scope["method"], "url.path": scope["path"]})
        failed = False
        with span_cm as span:
            try:
                await self.app(scope, receive, watch)
            except Exception as exc:
                failed = True
                if span is not None:
                    span.record_exception(exc)
                raise
            finally:
                if status is None:
                    status = 500 if failed else CLIENT_CLOSED
                self._finish(scope, state, start, status, span)

    def _finish(self, scope: Scope, state: dict[str, Any], start: float, status: int,
                span: Any) -> None:
        client = scope.get("client")
        fields: dict[str, Any] = {
            "method": scope["method"], "path": scope["path"], "status": status,
            "duration_ms": round((self.clock() - start) * 1e3, 3),
            "principal": state.get(PRINCIPAL), "client": client[0] if client else None,
        }
        if span is not None:
            from skymesh.obs.tracing import set_error, trace_id

            fields["trace_id"] = trace_id(span)
            span.set_attribute("http.response.status_code", status)
            if fields["principal"] is not None:
                span.set_attribute("skymesh.principal", fields["principal"])
            if status >= 500:
                set_error(span, f"HTTP {status}")
        if self.log is not None and self.log.isEnabledFor(logging.INFO):
            rest = " ".join(f"{k}={v}" for k, v in fields.items()
                            if v is not None and k not in ("method", "path", "status"))
            self.log.info("%s %s %s %s", fields["method"], fields["path"], status, rest,
                          extra=fields)
