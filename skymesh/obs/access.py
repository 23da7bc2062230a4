"""One access-log line per request through skymesh-lb, and the request's trace span.

:func:`install` adds an aiohttp middleware that times each request and, when it ends,
logs one INFO line on the ``skymesh.access`` logger (fields below; text or JSON by
:mod:`skymesh.obs.logs`) and ends the request's SERVER span (:mod:`skymesh.obs.tracing`).
What only the balancer knows it tells the record with :func:`note` (the model, the replica
or peer that served it); each attempt upstream runs inside :func:`upstream_span` and
stamps its ``traceparent`` with :func:`inject_trace`. All three do nothing when the
middleware is not installed (access log off and tracing off). Without tracing, the
daemons' server takes the middleware out of the app's chain and calls it around the
whole app instead (:func:`outside_chain`): the same lines, without aiohttp's middleware
chain per request.

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

The request's end hands its record to an :class:`AccessWriter`: no dict and no
formatting per request. The loop makes a batch's lines at once (``BATCH`` lines or what
gathered in ``_LINGER_S``) straight from the records, and the writer's thread writes what
gathered, at most every ``WRITE_EVERY_S``, with one system call
(:meth:`skymesh.obs.logs._Handler.write_lines`), so a slow log sink blocks the thread,
not the loop. On a request's path, as few Python calls as it takes: the server's handler
makes the record without an ``__init__`` call (:mod:`skymesh.net.front`), the notes read
the record from the request's own dict, the balancer's two on every request take
positional arguments (:func:`note_model` with the request's id, :func:`note_target`), the
prepare hook is a plain function that watches streams only, which the lean server does
not call for a whole reply (:func:`skymesh.net.prepare_hooks.streams_only`), a whole reply's
usage counts are read at its end in one test (the body is not kept for the batch), and a
line's time is its request's end from the log's clock and the wall clock's offset the
batch took as it opened (no ``time.time()`` per request).
With handlers other than the daemons' own (a test's, an operator's), each line goes
through ``logging`` in the thread instead. Past
``max_backlog`` waiting lines (``logging.access_log_backlog``, default ``MAX_BACKLOG``)
a request's line is dropped and counted
(``skymesh_access_log_dropped_total``; the thread logs a warning with the count when it
writes again): a stuck log sink neither grows memory nor stops the loop, which would
otherwise wait on the handler's lock the thread holds in its blocked write. Before the
app starts and after it stops, lines are made on the loop one by one.
docs/operations-logs.md#cost says why the lines are made on the loop.
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
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, Metric

from skymesh.net.jsonbody import NOT_DECODED, fast_usage
from skymesh.net.prepare_hooks import streams_only
from skymesh.obs.config import ACCESS_LOG_BACKLOG
from skymesh.obs.logs import (
    ACCESS_LOGGER,
    MILLIS,
    JsonFormatter,
    TextFormatter,
    _Handler,
    batched_writes,
    direct_handler,
)
from skymesh.obs.logsink import LineSink, open_sink

if TYPE_CHECKING:
    from skymesh.obs.tracing import Tracing

Clock = Callable[[], float]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request": never sent
_TAIL_CHUNKS = 4  # the usage event is the last one before [DONE]; it may straddle chunks
_USAGE_SPAN = 4096  # bytes after "usage": to decode (the object is ~200 bytes)
_COLON = re.compile(rb"\s*:\s*")
_DECODER = json.JSONDecoder()
# The usage objects engines send (OpenAI's and the stub's key order, and vLLM's), in
# whole: both counts appear once, so this reads what the decoder would.
_PLAIN_USAGE = re.compile(
    rb'\{"prompt_tokens":(0|[1-9]\d*),(?:"total_tokens":\d+,)?"completion_tokens":'
    rb'(0|[1-9]\d*)(?:,"total_tokens":\d+)?(?:,"prompt_tokens_details":null)?\}')
_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()
MAX_BACKLOG = ACCESS_LOG_BACKLOG  # the default; why: skymesh.obs.config
# Lines gather this long (or to BATCH of them) before they are made and written: one
# write per batch rather than per line, and a thread wake-up per batch, not per request.
_LINGER_S = 0.02
BATCH = 64
# The writer thread writes what has gathered at most this often: each of its wake-ups
# costs a hand-over of the interpreter lock with the loop and a system call (in process,
# the thread's CPU per line halved from a write every 20 ms to one every 100 ms). At
# 15,000 lines/s (past one worker's rate) 750 lines wait: far from the backlog.
WRITE_EVERY_S = 0.05
SETTLE_S = 2.0  # at a stop, how long lines held back by a full pipe may wait to be written


class AccessRecord:
    """What is known about one request so far; the middleware owns it. At the request's
    end the loop adds what the line needs (``code`` ... ``completion_tokens``) and hands
    the record to the writer thread, which makes the fields (:func:`record_fields`): the
    loop makes no dict and formats nothing.

    Made once per request, so it holds only what a plain request sets or reads, and its
    making stores only what may be read before the request's end (:data:`BEGUN`): the
    request's end sets the rest (unset until then), a streamed body's state is one
    member (:class:`_Stream`), and the span and tracer are a traced request's
    (:class:`_TracedRecord`; None on the class for the others). Each member is a store
    per request and a word the batch keeps alive. The server's handler
    (:mod:`skymesh.net.front`) makes it without this ``__init__`` (a Python call): the
    same stores, in its own frame."""

    __slots__ = ("client", "code", "completion_tokens", "disconnected", "end",
                 "first_byte_at", "method", "model", "path", "priority", "prompt_tokens",
                 "request_id", "served_by", "start", "stream", "tenant", "usage", "via")

    span: Any = None  # the request's SERVER span: with tracing only
    tracing: Tracing | None = None
    # Set at the request's end (finish), read only after it: the status sent (or 499),
    # the request's method, path and client, the end's time, when its first byte left
    # (None: none did), its usage counts (when read from the decoded usage; else the
    # line reads them from the body it is handed).
    code: int
    method: str
    path: str
    client: str | None
    end: float
    first_byte_at: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    priority: str | None  # with tenants: set with ``tenant``, read only when it is set

    def __init__(self, start: float, request_id: str | None = None) -> None:
        self.start = start
        self.request_id = request_id
        self.model: str | None = None
        self.served_by: str | None = None
        self.via: str | None = None
        self.tenant: str | None = None  # with tenants (note(tenant=...)), and its class
        self.disconnected = False  # the balancer saw the client leave (note(left=True))
        self.stream: _Stream | None = None  # a streamed body, once its headers are prepared
        # The reply's top-level usage as the balancer decoded it (note_usage), so the line
        # does not decode it again; NOT_DECODED: the line reads it from the body.
        self.usage: Any = NOT_DECODED


# What AccessRecord.__init__ stores besides ``start`` (the server's handler makes the
# record with these stores inline; tests/unit/test_obs_access.py checks they agree).
BEGUN = ("request_id", "model", "served_by", "via", "tenant", "disconnected", "stream",
         "usage")


class _TracedRecord(AccessRecord):
    """A traced request's record: its span and the tracer of its upstream spans."""

    __slots__ = ("span", "tracing")

    def __init__(self, start: float, tracing: Tracing) -> None:
        super().__init__(start)
        self.tracing = tracing
        self.span = None


class _Stream:
    """A streamed body as the access log watches it (:meth:`_Access.watch_body`): the
    response whose ``write`` is wrapped, the status its headers went with (logged if the
    client leaves mid-stream), when its first byte left and its last chunks (the usage
    event)."""

    __slots__ = ("first_byte_at", "response", "status", "tail")

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self.status = response.status
        self.first_byte_at: float | None = None
        self.tail: deque[bytes | bytearray | memoryview] = deque(maxlen=_TAIL_CHUNKS)


# A queued line: the record or its fields, the body holding the usage, the time it ended.
_Item = tuple[AccessRecord | dict[str, Any], bytes | None, float]
_NONE: dict[str, Any] = {}
RECORD_KEY = web.RequestKey("skymesh.obs.access", AccessRecord)
# Whether install() has put the access log or tracing on any app of this process: until
# then no request has a record, and the balancer's calls return without looking (a
# lookup of a missing key raises and catches a KeyError inside aiohttp, about 0.2 us,
# several times per request with the access log off).
_installed = False


def _record_of(request: web.Request) -> AccessRecord | None:
    if not _installed:  # no request has one: not even a lookup
        return None
    try:  # not request.get(): one call fewer (collections.abc's get calls __getitem__)
        return request[RECORD_KEY]
    except KeyError:  # an app without the access log, in a process with one that has it
        return None


def note(request: web.Request, *, model: str | None = None, served_by: str | None = None,
         peer: bool = False, left: bool = False, tenant: str | None = None,
         priority: str | None = None, request_id: str | None = None) -> None:
    """Tell the access record the request's model, or who serves it (a replica URL, or a
    peer balancer's id with ``peer``); the last attempt's wins. ``left``: the client went
    away and the handler ends normally (a write to it failed), logged as disconnected.
    ``request_id``: the request's id as the balancer gave it (``install``'s
    ``request_id`` function is then not called again at the request's end)."""
    if not _installed:  # no request has a record: not even a lookup
        return
    # The request's own dict, not request.get(): two Python calls fewer per note (aiohttp's
    # Request and the lean server's both keep their items in ``_state``).
    rec = request._state.get(RECORD_KEY)
    if rec is None:
        return
    if left:
        rec.disconnected = True
    if model is not None:
        rec.model = model
    if request_id is not None:
        rec.request_id = request_id
    if served_by is not None:
        rec.served_by, rec.via = served_by, "peer" if peer else "replica"
    if tenant is not None:
        rec.tenant, rec.priority = tenant, priority


def note_model(request: web.Request, model: str, request_id: str | None) -> None:
    """:func:`note` of ``model`` and ``request_id``, what the balancer knows once it has
    read the request: positional, so the call parses no keywords (it runs on every
    request; about 60 ns fewer than ``note``'s)."""
    if _installed and (rec := request._state.get(RECORD_KEY)) is not None:
        rec.model = model
        rec.request_id = request_id


def note_target(request: web.Request, served_by: str, peer: bool) -> None:
    """:func:`note` of who serves the request (the last attempt's wins), positional."""
    if _installed and (rec := request._state.get(RECORD_KEY)) is not None:
        rec.served_by = served_by
        rec.via = "peer" if peer else "replica"


def note_usage(request: web.Request, usage: Any) -> None:
    """Hand the record the ``usage`` member the balancer decoded from the whole reply it
    answers with (``fast_usage`` of that body): the line takes its counts from it rather
    than decoding the body a second time. A separate function from :func:`note`, whose
    every call would otherwise pay for one more keyword."""
    if _installed and (rec := request._state.get(RECORD_KEY)) is not None:
        rec.usage = usage


def upstream_span(request: web.Request, target: str, *, attempt: int = 1,
                  peer: bool = False) -> contextlib.AbstractContextManager[Any]:
    """A CLIENT span for one attempt at ``target`` (child of the request's span), current
    inside the block, so :func:`inject_trace` stamps its id; a no-op without tracing."""
    rec = _record_of(request)
    if rec is None or rec.tracing is None:
        return _NO_SPAN
    return rec.tracing.client_span(f"{request.method} {request.path}", {
        "server.address": target, "skymesh.attempt": attempt, "skymesh.peer": peer})


def inject_trace(request: web.Request, headers: dict[str, str]) -> None:
    """Add the current span's ``traceparent`` to an upstream request's ``headers``."""
    rec = _record_of(request)
    if rec is not None and rec.tracing is not None:
        rec.tracing.inject(headers)


def _count_or_none(value: Any) -> bool:
    return value is None or (type(value) is int)  # not a bool, not a float: read as below


def usage_tokens(body: bytes, decoded: Any = NOT_DECODED) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` of the last non-null OpenAI ``usage`` object
    in ``body`` (a JSON reply, or the tail of an SSE stream), else ``(None, None)``.

    Only the usage object is decoded, not the body: this runs once per request. A JSON
    reply's top-level ``usage`` is decoded alone by msgspec (when installed), at less
    than half the cost of finding it in the bytes; ``decoded``: that member when the
    caller has it already (``fast_usage(body)``, :func:`note_usage`)."""
    if body[:1] == b"{":
        # NOT_DECODED without msgspec or for no JSON: read as below
        usage = fast_usage(body) if decoded is NOT_DECODED else decoded
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if _count_or_none(prompt) and _count_or_none(completion):
                return prompt, completion
    end = len(body)
    while (i := body.rfind(b'"usage"', 0, end)) >= 0:
        end = i
        if i and body[i - 1] == 0x5C:  # \"usage\": inside a string (generated text)
            continue
        if i + 7 < len(body) and body[i + 7] == 0x3A:  # compact, as engines send it
            plain = _PLAIN_USAGE.match(body, i + 8)
            if plain is not None:
                return int(plain[1]), int(plain[2])
        colon = _COLON.match(body, i + 7)
        if colon is None:
            continue
        plain = _PLAIN_USAGE.match(body, colon.end())
        if plain is not None:  # what the engines send, read without the JSON decoder
            return int(plain[1]), int(plain[2])
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
                 request_id: Callable[[web.Request], str | None], clock: Clock,
                 max_backlog: int = MAX_BACKLOG) -> None:
        self.log = log
        self.tracing = tracing
        self.request_id = request_id
        self.clock = clock
        self.writer = (AccessWriter(log, max_backlog=max_backlog, clock=clock)
                       if log is not None else None)

    @web.middleware
    async def log_only(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """:meth:`middleware` without a span (tracing off), for an app the server could
        not take it out of (:func:`outside_chain`): no context manager, and no
        ``finally`` (an answered request, the common case, finishes on its own path)."""
        rec = self.begin(request)
        try:
            resp = await handler(request)
        except BaseException as exc:
            self.failed(request, rec, exc)
            raise
        self.finish(request, rec, resp, resp.status)
        return resp

    def begin(self, request: web.Request) -> AccessRecord:
        """A request's record, started now (without tracing; the server's handler,
        :mod:`skymesh.net.front`, makes the same record itself, without this call)."""
        rec = AccessRecord(self.clock())
        request._state[RECORD_KEY] = rec  # not request[...]: a Python call fewer (note())
        return rec

    def failed(self, request: web.Request, rec: AccessRecord, exc: BaseException
               ) -> None:
        """End ``rec`` for a handler that raised ``exc``: an HTTP error's status, 499 or
        disconnected for a cancelled one (the client went away: handler_cancellation),
        500 for any other exception (aiohttp answers it with a 500)."""
        if isinstance(exc, web.HTTPException):
            self.finish(request, rec, None, exc.status)
        elif isinstance(exc, asyncio.CancelledError):
            self.finish(request, rec, None, None)
        elif isinstance(exc, Exception):
            self.finish(request, rec, None, 500)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        rec: AccessRecord = (AccessRecord(self.clock()) if self.tracing is None
                             else _TracedRecord(self.clock(), self.tracing))
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
                self.finish(request, rec, resp, status)

    def _span(self, request: web.Request, rec: AccessRecord
              ) -> contextlib.AbstractContextManager[Any]:
        if self.tracing is None:
            return _NO_SPAN
        return _server_span(self.tracing, request, rec)

    def finish(self, request: web.Request, rec: AccessRecord,
               resp: web.StreamResponse | None, status: int | None) -> None:
        """End ``rec`` with the response and the status sent (None: none was)."""
        end = self.clock()
        # The record is the writer's from here (the prepare hook of a whole body, which
        # runs after this, leaves it alone).
        rec.end = end
        rec.method = request.method
        rec.path = request.path
        rec.client = request.remote
        if rec.request_id is None:
            rec.request_id = self.request_id(request)
        body: bytes | None = None  # where the usage is, if anywhere
        if rec.stream is None and status is not None and not rec.disconnected:
            # A whole body: it leaves now, with the headers.
            rec.code = status
            rec.first_byte_at = end
            usage = rec.usage
            got = resp._body if type(resp) is web.Response else None
            if (type(usage) is dict and type(got) is bytes and status < 400 and got
                    and got[0] == 0x7B  # b"{"
                    and type(prompt := usage.get("prompt_tokens")) is int
                    and type(completion := usage.get("completion_tokens")) is int):
                # The common case, in one test: a JSON reply whose usage the balancer
                # decoded (note_usage). Its counts now, as usage_tokens() reads them, and
                # neither the body nor the usage kept until the batch's lines are made.
                rec.prompt_tokens = prompt
                rec.completion_tokens = completion
                rec.usage = NOT_DECODED
            else:
                body = self._finish_whole(rec, resp, status)
        else:
            body = self._finish_other(rec, resp, status, end)
        if self.tracing is not None and rec.span is not None:  # it ends with the middleware:
            # fill it in now (a request's record has a span only with tracing)
            from skymesh.obs.tracing import trace_id

            fields = record_fields(rec, body)
            fields["trace_id"] = trace_id(rec.span)
            _end_span(rec.span, fields)
            self._write(fields, None)
            return
        writer = self.writer
        if writer is not None:
            pending = writer.pending
            if pending:  # a batch is open: join it (put() opens one)
                # Its time: the request's end on the wall clock, from the offset the
                # batch took as it opened (no time.time() per request).
                pending.append((rec, body, end + writer.wall))
                if len(pending) >= BATCH:
                    writer.flush()
                return
        self._write(rec, body)

    @staticmethod
    def _finish_whole(rec: AccessRecord, resp: web.StreamResponse | None, status: int
                      ) -> bytes | None:
        """:meth:`finish` of a whole body but the common case: its usage counts, or the
        body to read them from."""
        rec.prompt_tokens = rec.completion_tokens = None
        if resp is None or status >= 400 or not (
                type(resp) is web.Response or isinstance(resp, web.Response)):
            return None
        got = resp._body  # what its body property returns, without the call
        body = got if type(got) is bytes else (
            bytes(got) if isinstance(got, bytes | bytearray) else None)
        usage = rec.usage
        if type(usage) is dict and body and body[0] == 0x7B:  # b"{"
            # The balancer's decoded usage (note_usage), as usage_tokens() reads it.
            prompt = usage.get("prompt_tokens")
            completion = usage.get("completion_tokens")
            if ((prompt is None or type(prompt) is int)
                    and (completion is None or type(completion) is int)):
                rec.prompt_tokens, rec.completion_tokens = prompt, completion
                rec.usage = NOT_DECODED
                return None
        return body

    @staticmethod
    def _finish_other(rec: AccessRecord, resp: web.StreamResponse | None,
                      status: int | None, end: float) -> bytes | None:
        """:meth:`finish` of a streamed body, or of a request whose client left: its
        status and first byte, and where its usage is (the stream's last chunks)."""
        stream = rec.stream
        first = None
        if stream is not None:
            rec.stream = None
            first = stream.first_byte_at
            # The wrapped write refers to its response: a reference cycle, left to the
            # cyclic GC (rare in a tuned daemon) it kept every stream's response, request
            # and buffers alive for tens of thousands of requests (docs/notes/memory-1m.md).
            with contextlib.suppress(AttributeError):
                del stream.response.write
        if status is None or rec.disconnected:  # what the client got, if anything
            rec.disconnected = True
            status = stream.status if stream is not None else CLIENT_CLOSED
        elif first is None:
            first = end  # nothing of the stream written: its headers leave now
        rec.code = status
        rec.first_byte_at = first
        rec.prompt_tokens = rec.completion_tokens = None
        if resp is None or status >= 400:
            return None
        if stream is not None and stream.tail:
            return b"".join(bytes(c) for c in stream.tail)
        if type(resp) is web.Response or isinstance(resp, web.Response):
            got = resp._body  # a whole body whose client left: its usage, if any
            return (bytes(got) if isinstance(got, bytes | bytearray) and got else None)
        return None

    @streams_only
    def watch_body(self, request: web.Request, response: web.StreamResponse
                   ) -> Awaitable[None]:
        """``on_response_prepare``: for a streamed body, its status (logged if the client
        leaves mid-stream), the time of its first byte and its last chunks (the usage
        event). A whole body is prepared after the middleware has finished its record:
        nothing to do (the lean server does not call this for one: :func:`streams_only`).
        All of its work done when called (see :class:`_Done`)."""
        if type(response) is web.Response or isinstance(response, web.Response):
            return _DONE  # a whole body: the middleware is done with it
        rec = request.get(RECORD_KEY)
        if rec is None:
            return _DONE
        stream = rec.stream = _Stream(response)
        write = response.write
        tail = stream.tail
        clock = self.clock

        # Plain functions that hand back the original write's coroutine: no extra
        # coroutine per chunk on the stream's hot path. The first one stamps the time
        # and steps aside.
        def first_write(data: bytes | bytearray | memoryview) -> Coroutine[Any, Any, None]:
            if data:
                stream.first_byte_at = clock()
                tail.append(data)
                response.write = later_write  # type: ignore[method-assign]
            return write(data)

        def later_write(data: bytes | bytearray | memoryview) -> Coroutine[Any, Any, None]:
            tail.append(data)
            return write(data)

        response.write = first_write  # type: ignore[method-assign]
        return _DONE

    def _write(self, what: AccessRecord | dict[str, Any], body: bytes | None) -> None:
        writer = self.writer
        if writer is None or writer.put(what, body):
            return
        if writer.running:  # max_backlog behind: a stuck or slow sink
            writer.dropped += 1  # the thread reports it when it writes again
            return
        # A whole body is written after the middleware returns: the line (and the usage
        # parse) waits for the next loop turn rather than delay the answer.
        asyncio.get_running_loop().call_soon(writer.emit, what, body, time.time())


# install()'s middleware object, for outside_chain().
_ACCESS_KEY = web.AppKey("skymesh.obs.access", _Access)
OutsideLog = _Access  # what outside_chain() hands the server's request handler
_log = logging.getLogger(__name__)


def metrics(app: web.Application) -> AccessWriter | None:
    """The Prometheus collector of ``app``'s access log (its dropped lines), for the
    app's registry (:func:`skymesh.net.serving.start_app` registers it); None without
    an access log."""
    access = app.get(_ACCESS_KEY)
    return None if access is None else access.writer


def record_fields(rec: AccessRecord, body: bytes | None) -> dict[str, Any]:
    """The line's fields of a finished request (in the writer thread, or on the loop when
    the request's span needs them)."""
    start, first = rec.start, rec.first_byte_at
    fields: dict[str, Any] = {
        "request_id": rec.request_id, "method": rec.method, "path": rec.path,
        "model": rec.model, "served_by": rec.served_by, "via": rec.via, "status": rec.code,
        "ttft_ms": None if first is None else round((first - start) * 1e3, 3),
        "duration_ms": round((rec.end - start) * 1e3, 3),
        "prompt_tokens": rec.prompt_tokens, "completion_tokens": rec.completion_tokens,
        "client": rec.client,
    }
    if rec.disconnected:
        fields["disconnected"] = True
    if rec.tenant is not None:
        fields["tenant"], fields["priority"] = rec.tenant, rec.priority
    if body is not None:
        fields["prompt_tokens"], fields["completion_tokens"] = usage_tokens(body, rec.usage)
    return fields


class AccessWriter:
    """Makes access lines in batches and writes them in a thread of its own.

    With the daemons' set-up (:func:`skymesh.obs.logs.direct_handler`) the loop keeps the
    finished records of the last ``linger_s`` (at most ``BATCH`` of them), makes their
    lines in one go and hands the thread one string to write: nothing of a request
    crosses to the other thread (objects shared by two threads, each touching their
    reference counts on its own core, cost more than the formatting itself), and a slow
    log sink blocks the thread, not the loop. With any other handler on the way (a
    test's, an operator's logging config) the thread makes each line through ``logging``
    (the record's time is the request's end), so the lines are what a plain ``log.info``
    gives."""

    _THREAD = "skymesh-access"  # also the OS thread's name: top -H shows its CPU apart

    def __init__(self, log: logging.Logger, linger_s: float = _LINGER_S,
                 max_backlog: int = MAX_BACKLOG, write_every_s: float = WRITE_EVERY_S,
                 clock: Clock = time.perf_counter) -> None:
        self.log = log
        # The log's clock (of the requests' ends) and the wall clock's offset from it,
        # taken as the loop's batch opens: the batch's later lines are stamped with
        # their requests' ends from it, without a time.time() each.
        self.clock = clock
        self.wall = 0.0
        self.linger_s = linger_s
        self.write_every_s = write_every_s
        self.max_backlog = max_backlog
        # Entries: a batch's text with its handler, or one line for logging; None stops.
        self._queue: queue.SimpleQueue[tuple[_Handler, str] | _Item | None] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        # The loop's current batch; while it is not empty the middleware appends to it
        # directly (put() opens a batch: where its lines go, its linger timer).
        self.pending: list[_Item] = []
        self._timer: asyncio.TimerHandle | None = None
        self._handler: _Handler | None = None  # where the batch's lines go
        # The loop writes the batches of the handler it was started with itself, when
        # that handler's stream allows a descriptor that never blocks (a pipe, a tty);
        # the thread then idles (a handler set up later, or a stream without one).
        self._sink: LineSink | None = None
        self._sink_handler: _Handler | None = None
        self._encoding = ("utf-8", "strict")
        # Lines dropped while the thread was max_backlog behind (counted on the loop),
        # and how many of them the thread has reported in a warning.
        self.dropped = 0
        self._reported = 0

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._THREAD, daemon=True)
            self._thread.start()
        handler = direct_handler(self.log)
        if self._sink is None and handler is not None:
            stream = handler.stream
            self._sink = open_sink(stream, self.max_backlog, handler.terminator.encode(),
                                   on_drained=self._report_dropped)
            self._sink_handler = handler
            self._encoding = (getattr(stream, "encoding", None) or "utf-8",
                              getattr(stream, "errors", None) or "strict")

    async def settle(self, timeout_s: float = SETTLE_S) -> None:
        """On the loop, before :meth:`stop`: wait up to ``timeout_s`` for the lines the
        loop's sink holds back (a full pipe) and close it; what is still waiting then is
        counted dropped. Later lines go through the thread."""
        self.flush()
        sink, self._sink = self._sink, None
        if sink is not None:
            await sink.drain(timeout_s)
            self.dropped += sink.close()

    def stop(self) -> None:
        """Write what is queued and end the thread (blocking: at most one batch)."""
        thread, self._thread = self._thread, None  # from now on put() refuses
        self.flush()
        sink, self._sink = self._sink, None  # not settled (a writer run without an app)
        if sink is not None:
            self.dropped += sink.close()
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def put(self, what: AccessRecord | dict[str, Any], body: bytes | None) -> bool:
        """Take a request's line (its finished record, or its fields when already made);
        False when the caller should make it itself (the thread is not running, or is
        that far behind)."""
        if self._thread is None:
            return False
        item = (what, body, time.time())
        pending = self.pending
        if not pending:  # a new batch: where its lines go is decided once for it
            # Only here: on Python 3.11 get_running_loop() is a getpid() system call.
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not on a loop: the thread makes the line
                loop = None
            handler = None if loop is None else direct_handler(self.log)
            if handler is None:
                if self._queue.qsize() >= self.max_backlog:
                    return False
                self._queue.put(item)
                return True
            if self._queue.qsize() * BATCH >= self.max_backlog or (
                    self._sink is not None and self._sink.lines_waiting >= self.max_backlog):
                return False
            self._handler = handler
            self.wall = item[2] - self.clock()
            self._timer = loop.call_later(self.linger_s, self.flush)  # type: ignore[union-attr]
        pending.append(item)
        if len(pending) >= BATCH:
            self.flush()
        return True

    def flush(self) -> None:
        """Make the lines of the loop's batch and queue them for the thread."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        items, self.pending = self.pending, []
        handler = self._handler
        if not items or handler is None:
            return
        text = "".join(self._lines(handler, items))
        sink = self._sink
        if sink is None or handler is not self._sink_handler:
            self._queue.put((handler, text))
        elif not sink.write(text.encode(*self._encoding), len(items)):
            self.dropped += len(items)  # max_backlog lines wait already: a stuck sink

    def emit(self, what: AccessRecord | dict[str, Any], body: bytes | None,
             created: float) -> None:
        log = self.log
        if not log.isEnabledFor(logging.INFO):
            return
        fields = _fields(what, body)
        record = log.makeRecord(log.name, logging.INFO, __file__, 0, "%s", (_text(fields),),
                                None, extra=fields)
        record.created = created
        record.msecs = (created - int(created)) * 1000
        log.handle(record)

    def _run(self) -> None:
        _name_os_thread(self._THREAD)
        q = self._queue
        while True:
            entries = [q.get()]
            with contextlib.suppress(queue.Empty):
                while len(entries) < self.max_backlog:
                    entries.append(q.get_nowait())
            stop = entries[-1] is None
            if stop:
                entries.pop()
            self._write(entries)  # type: ignore[arg-type]
            self._report_dropped()
            if stop:
                return
            time.sleep(self.write_every_s)

    def _report_dropped(self) -> None:
        """One warning for the lines dropped since the last one (in this thread: a
        stuck sink blocks it here, not the loop)."""
        dropped = self.dropped
        if dropped != self._reported:
            _log.warning("access log: %d line(s) dropped, the log sink was %d lines "
                         "behind (skymesh_access_log_dropped_total)",
                         dropped - self._reported, self.max_backlog)
            self._reported = dropped

    def collect(self) -> Iterator[Metric]:
        """Prometheus: ``skymesh_access_log_dropped_total`` (see :func:`metrics`)."""
        dropped = CounterMetricFamily(
            "skymesh_access_log_dropped",
            "Access log lines dropped because the log sink was too far behind")
        dropped.add_metric([], self.dropped)
        yield dropped

    def _write(self, entries: list[tuple[_Handler, str] | _Item]) -> None:
        texts: dict[_Handler, list[str]] = {}
        items: list[_Item] = []
        for entry in entries:
            if len(entry) == 2:
                handler, text = entry
                texts.setdefault(handler, []).append(text)
            else:
                items.append(entry)
        for handler, batch in texts.items():
            handler.write_lines(batch)
        if items:
            self.write_batch(items)

    def write_batch(self, items: list[_Item]) -> None:
        """Make and write ``items``' lines (in this thread)."""
        handler = direct_handler(self.log)
        if handler is None:  # someone else's handlers too: through logging, batched
            with batched_writes():
                for item in items:
                    self.emit(*item)
            return
        handler.write_lines(self._lines(handler, items))

    def _lines(self, handler: _Handler, items: list[_Item]) -> list[str]:
        """The lines of ``items`` as ``handler``'s formatter gives them, made straight
        from the records or fields (no LogRecords)."""
        fmt = handler.formatter
        assert isinstance(fmt, TextFormatter | JsonFormatter)
        name, end = self.log.name, handler.terminator
        lines: list[str] = []
        append = lines.append
        if isinstance(fmt, JsonFormatter):
            for what, body, created in items:
                if type(what) is AccessRecord:
                    tokens = ((what.prompt_tokens, what.completion_tokens) if body is None
                              else usage_tokens(body, what.usage))
                    append(fmt.plain_line(created, name, _record_text(what, tokens),
                                          _record_json(what, tokens)) + end)
                else:
                    fields = _fields(what, body)
                    append(fmt.line(created, name, _text(fields), fields) + end)
            return lines
        # Text: what fmt.line gives, its time's whole second made once per second
        # (TextFormatter.second_text, its milliseconds looked up here as asctime does).
        head = f" INFO {name}: "
        second, stamp = -1, ""
        for what, body, created in items:
            if int(created) != second:
                second = int(created)
                stamp = fmt.second_text(created)
            millis = MILLIS[int((created - second) * 1000)]
            if type(what) is not AccessRecord:
                fields = _fields(what, body)
                append(f"{stamp}{millis}{head}{_text(fields)}{end}")
                continue
            rec = what
            if body is None:
                prompt, completion = rec.prompt_tokens, rec.completion_tokens
            else:
                prompt, completion = usage_tokens(body, rec.usage)
            done = rec.end
            if (rec.first_byte_at == done and prompt is not None and completion is not None
                    and rec.model is not None and rec.served_by is not None
                    and rec.via is not None and rec.request_id is not None
                    and rec.client is not None and not rec.disconnected
                    and rec.tenant is None):
                # The common line, a whole body served with its usage, in one piece: its
                # first byte left at its end (one decimal conversion for both times).
                duration = ms_text(done - rec.start)
                append(f"{stamp}{millis}{head}{rec.method} {rec.path} {rec.code} "
                       f"request_id={rec.request_id} model={rec.model} "
                       f"served_by={rec.served_by} via={rec.via} ttft_ms={duration} "
                       f"duration_ms={duration} prompt_tokens={prompt} "
                       f"completion_tokens={completion} client={rec.client}{end}")
            else:
                append(f"{stamp}{millis}{head}{_record_text(rec, (prompt, completion))}{end}")
        return lines


def _name_os_thread(name: str) -> None:
    """Give the calling thread's OS thread ``name`` (at most 15 bytes: /proc's comm), so
    ``top -H`` and /proc/PID/task show its CPU apart. Linux only; Python names only its
    own thread object before 3.14."""
    with contextlib.suppress(OSError), \
            open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(name[:15])


def _fields(what: AccessRecord | dict[str, Any], body: bytes | None) -> dict[str, Any]:
    if isinstance(what, AccessRecord):
        return record_fields(what, body)
    _fill_usage(what, body)
    return what


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


def ms_text(seconds: float) -> str:
    """``repr(round(seconds * 1e3, 3))``, the text a line gives a time, at a sixth of its
    cost (round() with digits and repr() each run the decimal conversion; a request's
    times, under 1e7 ms, are rounded in whole microseconds with no decimal conversion).
    Both round the exact binary value correctly to 3 decimals; under 1e12 ms a double is
    finer than 0.001, so the shortest repr of the rounded value is those decimals,
    trailing zeros dropped."""
    ms = seconds * 1e3
    if 0.0 < ms < 1e7:  # a request's times: in whole microseconds, no decimal conversion
        micros = ms * 1e3  # within 2e-6 of the exact value's: ulp(1e10) is 1.9e-6
        whole = int(micros)
        frac = micros - whole  # exact
        # Unless it lies that near a half, the nearest whole microsecond of this double is
        # that of the exact value (rounding to whole numbers jumps only at halves).
        if not 0.499 < frac < 0.501:
            if frac > 0.5:
                whole += 1
            ms_whole = whole // 1000
            return f"{ms_whole}{_DECIMALS[whole - ms_whole * 1000]}"
    if not -1e12 < ms < 1e12:  # huge, inf or nan: the slow way
        return repr(round(ms, 3))
    text = f"{ms:.3f}".rstrip("0")
    return text + "0" if text[-1] == "." else text


# ms_text's decimals of 0 ... 999 thousandths, trailing zeros dropped (".0" for none).
_DECIMALS = tuple(f".{i:03d}".rstrip("0") if i else ".0" for i in range(1000))


def _record_text(rec: AccessRecord, tokens: tuple[int | None, int | None]) -> str:
    """:func:`_text` of :func:`record_fields`, straight from the record."""
    start, first, end = rec.start, rec.first_byte_at, rec.end
    prompt, completion = tokens
    if (first is not None and prompt is not None and completion is not None
            and rec.model is not None and rec.served_by is not None and rec.via is not None
            and rec.request_id is not None and rec.client is not None
            and not rec.disconnected and rec.tenant is None):  # served, with its usage
        duration = ms_text(end - start)
        # A whole body's first byte is its end (_finish): one decimal conversion, not two.
        ttft = duration if first == end else ms_text(first - start)
        return (f"{rec.method} {rec.path} {rec.code} request_id={rec.request_id} "
                f"model={rec.model} served_by={rec.served_by} via={rec.via} "
                f"ttft_ms={ttft} duration_ms={duration} "
                f"prompt_tokens={prompt} completion_tokens={completion} client={rec.client}")
    out = f"{rec.method} {rec.path} {rec.code}"
    if rec.request_id is not None:
        out += f" request_id={rec.request_id}"
    if rec.model is not None:
        out += f" model={rec.model}"
    if rec.served_by is not None:
        out += f" served_by={rec.served_by}"
    if rec.via is not None:
        out += f" via={rec.via}"
    if first is not None:
        out += f" ttft_ms={ms_text(first - start)}"
    out += f" duration_ms={ms_text(rec.end - start)}"
    if prompt is not None:
        out += f" prompt_tokens={prompt}"
    if completion is not None:
        out += f" completion_tokens={completion}"
    if rec.client is not None:
        out += f" client={rec.client}"
    if rec.disconnected:
        out += " disconnected=True"
    if rec.tenant is not None:
        out += f" tenant={rec.tenant}"
        if rec.priority is not None:
            out += f" priority={rec.priority}"
    return out


def _record_json(rec: AccessRecord, tokens: tuple[int | None, int | None]
                 ) -> dict[str, Any]:
    """:func:`record_fields` from the usage counts already read."""
    start, first = rec.start, rec.first_byte_at
    fields: dict[str, Any] = {
        "request_id": rec.request_id, "method": rec.method, "path": rec.path,
        "model": rec.model, "served_by": rec.served_by, "via": rec.via, "status": rec.code,
        "ttft_ms": None if first is None else round((first - start) * 1e3, 3),
        "duration_ms": round((rec.end - start) * 1e3, 3),
        "prompt_tokens": tokens[0], "completion_tokens": tokens[1], "client": rec.client,
    }
    if rec.disconnected:
        fields["disconnected"] = True
    if rec.tenant is not None:
        fields["tenant"], fields["priority"] = rec.tenant, rec.priority
    return fields


class _Done(Awaitable[None]):
    """An awaitable that is done already: what :meth:`_Access.watch_body` returns (aiohttp's
    signal awaits what each receiver returns), so no coroutine is made per response.
    Once a loop runs the log (:func:`_done_future`), a done future instead: awaiting it
    runs no Python code (its ``__await__`` is asyncio's C one; 70 ns against 150)."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return iter(())  # type: ignore[return-value]  # an iterator is all await needs


_DONE: Awaitable[None] = _Done()


def _done_future() -> None:
    """Make :data:`_DONE` a done future (on the loop). Awaiting a done future reads its
    result whatever loop awaits it, so one serves every loop and app of the process."""
    global _DONE
    if type(_DONE) is _Done:
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        _DONE = done


def install(app: web.Application, *, access_log: bool = True, tracing: Tracing | None = None,
            request_id: Callable[[web.Request], str | None] | None = None,
            clock: Clock = time.perf_counter, max_backlog: int = MAX_BACKLOG) -> None:
    """Log every request of ``app`` and/or trace it; nothing is added when both are off.
    ``request_id``: the function that gives a request's id (the balancer's
    ``skymesh.balancer.edge.request_id``); by default the client's ``X-Request-Id``.
    ``max_backlog``: lines waiting for the writer thread past which lines are dropped
    (``logging.access_log_backlog``)."""
    if not access_log and tracing is None:
        return
    global _installed
    _installed = True
    access = _Access(logging.getLogger(ACCESS_LOGGER) if access_log else None, tracing,
                     request_id or _default_request_id, clock, max_backlog)
    app.middlewares.append(access.middleware if tracing is not None else access.log_only)
    app[_ACCESS_KEY] = access
    app.on_response_prepare.append(access.watch_body)
    writer = access.writer
    if writer is not None:
        async def start_writer(app: web.Application) -> None:
            _done_future()
            writer.start()

        async def stop_writer(app: web.Application) -> None:
            await writer.settle()  # the loop's batch, and what its sink holds back
            await asyncio.to_thread(writer.stop)

        app.on_startup.append(start_writer)
        app.on_cleanup.append(stop_writer)
    if tracing is not None:
        async def flush(app: web.Application) -> None:
            await asyncio.to_thread(tracing.shutdown)  # exports what is buffered: blocking

        app.on_cleanup.append(flush)


def outside_chain(app: web.Application) -> OutsideLog | None:
    """Take the access log (without tracing) out of ``app``'s middleware chain, before
    the app is frozen (``runner.setup()``); the caller must then call what this returns
    around every request of the app (its ``begin``, then ``finish`` or ``failed``:
    :mod:`skymesh.net.front`, which :func:`skymesh.net.serving.start_app` wires). The
    same lines, from around the whole app: an app with no other middleware then skips
    aiohttp's middleware chain (its cached chain lookup and frame) on every request.
    None, and the app left as it is, without an access log or with tracing (its span is
    named after the matched route, known only inside)."""
    access = app.get(_ACCESS_KEY)
    if access is None or access.tracing is not None:
        return None
    if access.log_only in app.middlewares:  # not yet taken out (a first start)
        if app.frozen:  # set up by someone else already: it stays a middleware
            return None
        app.middlewares.remove(access.log_only)
    return access
