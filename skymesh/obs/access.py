"""One access-log line per request through skymesh-lb, and the request's trace span.

:func:`install` adds an aiohttp middleware that times each request and, when it ends,
logs one INFO line on the ``skymesh.access`` logger (fields below; text or JSON by
:mod:`skymesh.obs.logs`) and ends the request's SERVER span (:mod:`skymesh.obs.tracing`).
What only the balancer knows it tells the record with :func:`note` (the model, the replica
or peer that served it); each attempt upstream runs inside :func:`upstream_span` and
stamps its ``traceparent`` with :func:`inject_trace`. All three do nothing when the
middleware is not installed (access log off and tracing off).

Fields: ``request_id`` (the ``X-Request-Id`` the balancer echoes), ``method``, ``path``,
``model``, ``served_by`` (replica URL or peer id) and ``via`` (``replica`` | ``peer``),
``status`` (499: the client left before any response; ``disconnected``: it left during
one), ``ttft_ms`` (to the first byte of a streamed body; for a whole body, to when it
was ready), ``duration_ms``, ``prompt_tokens``/``completion_tokens`` (when the response
carries OpenAI ``usage``: a whole body, or a stream with ``include_usage``), ``client``
(peer address of the connection), and ``trace_id`` when the request is traced;
``tenant`` and ``priority`` (its class) when the balancer has tenants (docs/tenancy.md).

Times come from an injected clock (``time.perf_counter``). A streamed body is observed by
wrapping its ``write`` when its headers are prepared: aiohttp has no server-side hook for
body bytes, and this keeps the balancer's stream code untouched.

The line is made and written off the event loop: the request's end hands its fields to an
:class:`AccessWriter` (one queue put), whose thread decodes the usage, builds the record,
runs the logger's handlers and writes a batch of lines with one system call
(:func:`skymesh.obs.logs.batched_writes`). Past ``MAX_BACKLOG`` waiting lines, or before
the app starts and after it stops, lines are made on the loop as before: a slow log sink
slows requests down rather than growing memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from skymesh.obs.logs import (
    ACCESS_LOGGER,
    JsonFormatter,
    TextFormatter,
    batched_writes,
    direct_handler,
)

if TYPE_CHECKING:
    from skymesh.obs.tracing import Tracing

Clock = Callable[[], float]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request": never sent
_TAIL_CHUNKS = 4  # the usage event is the last one before [DONE]; it may straddle chunks
_USAGE_SPAN = 4096  # bytes after "usage": to decode (the object is ~200 bytes)
_COLON = re.compile(rb"\s*:\s*")
_DECODER = json.JSONDecoder()
_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()
# Lines waiting for the writer thread before they are made on the loop instead (about
# 1 KB each with a stream's tail: a few MB at most).
MAX_BACKLOG = 4096
# The writer waits this long after a batch, so lines gather into the next one: one write
# per batch rather than per line, and a thread wake-up per batch rather than per request.
_LINGER_S = 0.02


@dataclass(slots=True, eq=False)
class AccessRecord:
    """What is known about one request so far; the middleware owns it."""

    start: float
    clock: Clock
    tracing: Tracing | None
    request_id: str | None = None
    model: str | None = None
    served_by: str | None = None
    via: str | None = None
    tenant: str | None = None  # with tenants (note(tenant=...)), and its priority class
    priority: str | None = None
    status: int | None = None  # once headers are prepared
    first_byte_at: float | None = None
    disconnected: bool = False  # the balancer saw the client leave (note(left=True))
    watched: web.StreamResponse | None = None  # a stream whose write is wrapped
    tail: deque[bytes | bytearray | memoryview] = field(
        default_factory=lambda: deque(maxlen=_TAIL_CHUNKS))
    span: Any = None


RECORD_KEY = web.RequestKey("skymesh.obs.access", AccessRecord)


def note(request: web.Request, *, model: str | None = None, served_by: str | None = None,
         peer: bool = False, left: bool = False, tenant: str | None = None,
         priority: str | None = None) -> None:
    """Tell the access record the request's model, or who serves it (a replica URL, or a
    peer balancer's id with ``peer``); the last attempt's wins. ``left``: the client went
    away and the handler ends normally (a write to it failed), logged as disconnected."""
    rec = request.get(RECORD_KEY)
    if rec is None:
        return
    if left:
        rec.disconnected = True
    if model is not None:
        rec.model = model
    if served_by is not None:
        rec.served_by, rec.via = served_by, "peer" if peer else "replica"
    if tenant is not None:
        rec.tenant, rec.priority = tenant, priority


def upstream_span(request: web.Request, target: str, *, attempt: int = 1,
                  peer: bool = False) -> contextlib.AbstractContextManager[Any]:
    """A CLIENT span for one attempt at ``target`` (child of the request's span), current
    inside the block, so :func:`inject_trace` stamps its id; a no-op without tracing."""
    rec = request.get(RECORD_KEY)
    if rec is None or rec.tracing is None:
        return _NO_SPAN
    return rec.tracing.client_span(f"{request.method} {request.path}", {
        "server.address": target, "skymesh.attempt": attempt, "skymesh.peer": peer})


def inject_trace(request: web.Request, headers: dict[str, str]) -> None:
    """Add the current span's ``traceparent`` to an upstream request's ``headers``."""
    rec = request.get(RECORD_KEY)
    if rec is not None and rec.tracing is not None:
        rec.tracing.inject(headers)


def usage_tokens(body: bytes) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` of the last non-null OpenAI ``usage`` object
    in ``body`` (a JSON reply, or the tail of an SSE stream), else ``(None, None)``.

    Only the usage object is decoded, not the body: this runs once per request."""
    end = len(body)
    while (i := body.rfind(b'"usage"', 0, end)) >= 0:
        end = i
        if i and body[i - 1] == 0x5C:  # \"usage\": inside a string (generated text)
            continue
        colon = _COLON.match(body, i + 7)
        if colon is None:
            continue
        text = body[colon.end():colon.end() + _USAGE_SPAN].decode("utf-8", "replace")
        try:
            usage, _ = _DECODER.raw_decode(text)
        except ValueError:
            continue
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            return (prompt if isinstance(prompt, int) else None,
                    completion if isinstance(completion, int) else None)
    return None, None


def _default_request_id(request: web.Request) -> str | None:
    return request.headers.get("X-Request-Id")


def _route_name(request: web.Request) -> str:
    """The route's template (``/{tail:.*}`` for the pass-through): span names stay few."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


class _Access:
    def __init__(self, log: logging.Logger | None, tracing: Tracing | None,
                 request_id: Callable[[web.Request], str | None], clock: Clock) -> None:
        self.log = log
        self.tracing = tracing
        self.request_id = request_id
        self.clock = clock
        self.writer = AccessWriter(log) if log is not None else None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        rec = AccessRecord(self.clock(), self.clock, self.tracing,
                           request_id=self.request_id(request))
        request[RECORD_KEY] = rec
        status: int | None = None
        resp: web.StreamResponse | None = None
        with self._span(request, rec):
            try:
                resp = await handler(request)
                status = resp.status
                return resp
            except web.HTTPException as exc:
                status = exc.status
                raise
            except asyncio.CancelledError:  # the client went away (handler_cancellation)
                raise
            except Exception as exc:
                status = 500  # aiohttp answers an unhandled exception with a 500
                if rec.span is not None:
                    rec.span.record_exception(exc)
                raise
            finally:
                self._finish(request, rec, resp, status)

    def _span(self, request: web.Request, rec: AccessRecord
              ) -> contextlib.AbstractContextManager[Any]:
        if self.tracing is None:
            return _NO_SPAN
        return _server_span(self.tracing, request, rec)

    def _finish(self, request: web.Request, rec: AccessRecord,
                resp: web.StreamResponse | None, status: int | None) -> None:
        end = self.clock()
        if rec.watched is not None:
            # The wrapped write refers to its response: a reference cycle, left to the
            # cyclic GC (rare in a tuned daemon) it kept every stream's response, request
            # and buffers alive for tens of thousands of requests (docs/notes/memory-1m.md).
            with contextlib.suppress(AttributeError):
                del rec.watched.write
            rec.watched = None
        disconnected = status is None or rec.disconnected
        if status is None or rec.disconnected:  # what the client got, if anything
            status = rec.status if rec.status is not None else CLIENT_CLOSED
        body: bytes | None = None  # where the usage is, if anywhere
        if resp is not None and status < 400:
            if isinstance(resp, web.Response):
                if isinstance(resp.body, bytes | bytearray):
                    body = bytes(resp.body)
            elif rec.tail:
                body = b"".join(bytes(c) for c in rec.tail)
        first = rec.first_byte_at
        if first is None and not disconnected:
            first = end  # a whole body: it leaves now, in one write with the headers
        fields: dict[str, Any] = {
            "request_id": rec.request_id, "method": request.method, "path": request.path,
            "model": rec.model, "served_by": rec.served_by, "via": rec.via, "status": status,
            "ttft_ms": None if first is None else round((first - rec.start) * 1e3, 3),
            "duration_ms": round((end - rec.start) * 1e3, 3),
            "prompt_tokens": None, "completion_tokens": None, "client": request.remote,
        }
        if disconnected:
            fields["disconnected"] = True
        if rec.tenant is not None:
            fields["tenant"], fields["priority"] = rec.tenant, rec.priority
        if rec.span is not None:  # the span ends with the middleware: fill it in now
            from skymesh.obs.tracing import trace_id

            _fill_usage(fields, body)
            body = None
            fields["trace_id"] = trace_id(rec.span)
            _end_span(rec.span, fields)
        if self.writer is not None and not self.writer.put(fields, body):
            # A whole body is written after the middleware returns: the line (and the
            # usage parse) waits for the next loop turn rather than delay the answer.
            asyncio.get_running_loop().call_soon(self.writer.emit, fields, body, time.time())


class AccessWriter:
    """Makes and writes access lines in a thread of its own, in batches.

    :meth:`put` is all a request pays on the loop; the thread does the rest with the
    ``skymesh.access`` logger's own handlers and formatters, so the lines are the same as
    a plain ``log.info`` would give (the record's time is the request's end)."""

    def __init__(self, log: logging.Logger, linger_s: float = _LINGER_S,
                 max_backlog: int = MAX_BACKLOG) -> None:
        self.log = log
        self.linger_s = linger_s
        self.max_backlog = max_backlog
        self._queue: queue.SimpleQueue[tuple[dict[str, Any], bytes | None, float] | None] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="skymesh-access-log",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Write what is queued and end the thread (blocking: at most one batch)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def put(self, fields: dict[str, Any], body: bytes | None) -> bool:
        """Queue a request's line; False when the caller should make it itself (the
        thread is not running, or is that far behind)."""
        if self._thread is None or self._queue.qsize() >= self.max_backlog:
            return False
        self._queue.put((fields, body, time.time()))
        return True

    def emit(self, fields: dict[str, Any], body: bytes | None, created: float) -> None:
        log = self.log
        if not log.isEnabledFor(logging.INFO):
            return
        _fill_usage(fields, body)
        record = log.makeRecord(log.name, logging.INFO, __file__, 0, "%s", (_text(fields),),
                                None, extra=fields)
        record.created = created
        record.msecs = (created - int(created)) * 1000
        log.handle(record)

    def _run(self) -> None:
        q = self._queue
        while True:
            items = [q.get()]
            with contextlib.suppress(queue.Empty):
                while len(items) < self.max_backlog:
                    items.append(q.get_nowait())
            stop = items[-1] is None
            if stop:
                items.pop()
            self.write_batch(items)  # type: ignore[arg-type]
            if stop:
                return
            time.sleep(self.linger_s)

    def write_batch(self, items: list[tuple[dict[str, Any], bytes | None, float]]) -> None:
        log = self.log
        handler = direct_handler(log)
        if handler is None:  # someone else's handlers too: through logging, batched
            with batched_writes():
                for item in items:
                    self.emit(*item)
            return
        # The daemons' set-up: the lines straight from the fields, no LogRecords.
        fmt = handler.formatter
        assert isinstance(fmt, TextFormatter | JsonFormatter)
        lines = []
        for fields, body, created in items:
            _fill_usage(fields, body)
            lines.append(fmt.line(created, log.name, _text(fields), fields)
                         + handler.terminator)
        handler.write_lines(lines)


def _fill_usage(fields: dict[str, Any], body: bytes | None) -> None:
    if body is not None:
        fields["prompt_tokens"], fields["completion_tokens"] = usage_tokens(body)


@contextlib.contextmanager
def _server_span(tracing: Tracing, request: web.Request, rec: AccessRecord) -> Iterator[None]:
    with tracing.server_span(f"{request.method} {_route_name(request)}", request.headers, {
            "http.request.method": request.method, "url.path": request.path,
            "client.address": request.remote or ""}) as span:
        rec.span = span
        yield


def _end_span(span: Any, fields: dict[str, Any]) -> None:
    """The request's outcome on its span (before the span ends, after the handler)."""
    from skymesh.obs.tracing import set_error

    span.set_attribute("http.response.status_code", fields["status"])
    for key, attr in (("request_id", "skymesh.request_id"), ("model", "gen_ai.request.model"),
                      ("served_by", "skymesh.served_by"),
                      ("prompt_tokens", "gen_ai.usage.input_tokens"),
                      ("completion_tokens", "gen_ai.usage.output_tokens")):
        if fields[key] is not None:
            span.set_attribute(attr, fields[key])
    if fields["status"] >= 500:
        set_error(span, f"HTTP {fields['status']}")


def _text(fields: dict[str, Any]) -> str:
    """The line's message: ``METHOD PATH STATUS key=value ...`` without the empty ones."""
    head = f"{fields['method']} {fields['path']} {fields['status']}"
    rest = " ".join(f"{k}={v}" for k, v in fields.items()
                    if v is not None and k not in ("method", "path", "status"))
    return f"{head} {rest}"


async def _watch_body(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: note the status, and for a streamed body the time of its
    first byte and its last chunks (the usage event)."""
    rec = request.get(RECORD_KEY)
    if rec is None:
        return
    rec.status = response.status
    if isinstance(response, web.Response):  # a whole body: the middleware has it
        return
    write = response.write
    tail = rec.tail
    rec.watched = response

    # Plain functions that hand back the original write's coroutine: no extra coroutine
    # per chunk on the stream's hot path. The first one stamps the time and steps aside.
    def first_write(data: bytes | bytearray | memoryview) -> Coroutine[Any, Any, None]:
        if data:
            rec.first_byte_at = rec.clock()
            tail.append(data)
            response.write = later_write  # type: ignore[method-assign]
        return write(data)

    def later_write(data: bytes | bytearray | memoryview) -> Coroutine[Any, Any, None]:
        tail.append(data)
        return write(data)

    response.write = first_write  # type: ignore[method-assign]


def install(app: web.Application, *, access_log: bool = True, tracing: Tracing | None = None,
            request_id: Callable[[web.Request], str | None] | None = None,
            clock: Clock = time.perf_counter) -> None:
    """Log every request of ``app`` and/or trace it; nothing is added when both are off.
    ``request_id``: the function that gives a request's id (the balancer's
    ``skymesh.balancer.edge.request_id``); by default the client's ``X-Request-Id``."""
    if not access_log and tracing is None:
        return
    access = _Access(logging.getLogger(ACCESS_LOGGER) if access_log else None, tracing,
                     request_id or _default_request_id, clock)
    app.middlewares.append(access.middleware)
    app.on_response_prepare.append(_watch_body)
    writer = access.writer
    if writer is not None:
        async def start_writer(app: web.Application) -> None:
            writer.start()

        async def stop_writer(app: web.Application) -> None:
            await asyncio.to_thread(writer.stop)

        app.on_startup.append(start_writer)
        app.on_cleanup.append(stop_writer)
    if tracing is not None:
        async def flush(app: web.Application) -> None:
            await asyncio.to_thread(tracing.shutdown)  # exports what is buffered: blocking

        app.on_cleanup.append(flush)
