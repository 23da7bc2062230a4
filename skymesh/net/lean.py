"""A lean HTTP/1.1 server protocol for an aiohttp app's plain routes (``listen.http_server:
lean``).

aiohttp's server costs about 30 ms of CPU per 1,000 requests on top of asyncio protocols
and httptools (docs/results/router-overhead.md): its request parser and message objects,
a new task per request, the request's and the payload's objects. This protocol serves the
requests the balancer's hot routes get (a plain route of the app, from
:func:`skymesh.net.front.direct_routes`, with no query string, no ``Expect``, no
``Transfer-Encoding``, no upgrade) with httptools' parser, a light request object
(:mod:`skymesh.net.lean_request`) and the handler run inline in one task per connection.
Responses are aiohttp's own ``web.Response`` objects, so the handlers, the access log and
the connection guard's marks (all in :func:`skymesh.net.front.request_handler`) are the
same code as under aiohttp and do not know which server runs them. A plain answer (a
``web.Response`` with a bytes body: the generation routes' non-streaming JSON and error
answers, the probes) is written directly, the bytes ``prepare()`` and ``write_eof()``
would write (:meth:`LeanProtocol._send_plain`); anything else (streams among them) goes
through aiohttp's ``StreamWriter``.

Anything else hands the connection, at that request's first byte, to aiohttp's own
``RequestHandler`` (the runner's ``web.Server``): it gets the bytes of that request
onwards and every later protocol call, and answers exactly as aiohttp does (404, 405, 400,
413, chunked bodies, ``Expect: 100-continue``, oversized header lines). The hand-off
needs that request's first byte: the parser reports no offsets, so the protocol keeps the
bytes of a request until its headers are complete, and counts body bytes to find where
the next pipelined request starts (exact for the ``Content-Length`` bodies it takes;
chunked bodies go to aiohttp). docs/notes/lean-server.md has the design and the figures.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
from collections.abc import Callable
from typing import Any, cast

import httptools
from aiohttp import hdrs, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.helpers import EMPTY_BODY_STATUS_CODES, rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_writer import (
    MIN_PAYLOAD_FOR_WRITELINES,
    SKIP_WRITELINES,
    HttpVersion10,
    HttpVersion11,
    _serialize_headers,
)
from multidict import CIMultiDict, CIMultiDictProxy

from skymesh.net.front import DirectRoutes, Handler
from skymesh.net.lean_request import LeanBody, LeanRequest
from skymesh.net.limits import connection_client
from skymesh.net.prepare_hooks import PrepareHook, plain_prepare_hooks

server_log = logging.getLogger("aiohttp.server")  # where aiohttp logs a handler's error

# aiohttp's parser limits (RequestHandler's defaults): a request past one goes to aiohttp,
# which refuses it as it does today.
MAX_LINE = 8190
MAX_HEADERS = 128
# Header bytes kept before the headers end; past this, aiohttp takes the connection (and
# applies its own limits to what it has).
MAX_HEAD = 64 * 1024
# Requests parsed ahead of the one being served (pipelining) before reading pauses.
MAX_QUEUED = 8
_VERSIONS = {"1.1": HttpVersion11, "1.0": HttpVersion10}
_IDLE, _HEAD, _BODY = range(3)


def _header_end(buf: bytes, start: int) -> int:
    """Where in ``buf`` the body of the request starting at ``start`` begins: after the
    first CRLFCRLF past the empty lines the parser skips before a request line."""
    while start < len(buf) and buf[start] in b"\r\n":
        start += 1
    return buf.find(b"\r\n\r\n", start) + 4


def _plain(resp: web.StreamResponse, method: str) -> bool:
    """Whether ``resp`` is an answer :meth:`LeanProtocol._send_plain` writes exactly as
    aiohttp would: a ``web.Response`` (not a subclass: it may write otherwise) not yet
    sent, its body bytes, no chunking, compression or cookies, no framing header of the
    handler's own, and a body the status and method let it send. Anything else goes
    through ``prepare()`` and ``write_eof()``."""
    return (type(resp) is web.Response and resp._payload_writer is None
            and not resp._eof_sent and isinstance(resp._body, bytes | bytearray | None)
            and not resp._chunked and not resp._compression and not resp._cookies
            and method != hdrs.METH_HEAD and resp._status not in EMPTY_BODY_STATUS_CODES
            and hdrs.CONTENT_LENGTH not in resp._headers
            and hdrs.TRANSFER_ENCODING not in resp._headers)


class _HandOff(Exception):
    """Raised in a parser callback: stop parsing here, aiohttp takes the rest."""


def lean_factory(server: web.Server, app: web.Application, routes: DirectRoutes,
                 keepalive_s: float, direct_writes: bool = True
                 ) -> Callable[..., asyncio.Protocol]:
    """A protocol factory serving ``routes`` of ``app`` leanly, the rest through
    ``server`` (whose ``request_handler`` is :func:`skymesh.net.front.request_handler`);
    ``keepalive_s``: aiohttp's keep-alive timeout, an idle connection's life;
    ``direct_writes``: plain answers written by :meth:`LeanProtocol._send_plain` (off:
    every answer through aiohttp's ``prepare()``, the benches' comparison)."""
    keys = frozenset(routes)
    hooks = plain_prepare_hooks(app)  # the app is frozen: decided once, not per reply

    def factory(**_: Any) -> asyncio.Protocol:
        return LeanProtocol(server, app, keys, keepalive_s, direct_writes, hooks)

    return factory


def _drop_cancellation(task: asyncio.Task[None]) -> None:
    """Let a cancelled connection task's exception go: the task keeps it for
    ``result()``, and its traceback's frames hold the connection's protocol and requests
    (which hold the task: a cycle left to the cyclic GC, rare under
    skymesh.net.serving.tune_gc). Nothing reads the result of this task."""
    if task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            task.result()


class LeanProtocol(BaseProtocol):
    """One client connection: lean requests, until aiohttp's protocol takes it over."""

    __slots__ = (
        "_aio",
        "_app",
        "_chunk",
        "_context",
        "_cursor",
        "_direct",
        "_eof",
        "_hand",
        "_handler",
        "_headers",
        "_http",
        "_idle_at",
        "_idle_timer",
        "_keepalive",
        "_keys",
        "_mark",
        "_oversized",
        "_plain_hooks",
        "_prefix",
        "_queue",
        "_reading_held",
        "_remote",
        "_request",
        "_seen",
        "_server",
        "_serving",
        "_shutting",
        "_start",
        "_state",
        "_task",
        "_task_handler",
        "_url",
        "_waiter",
    )

    def __init__(self, server: web.Server, app: web.Application,
                 keys: frozenset[tuple[str, str]], keepalive_s: float,
                 direct_writes: bool = True,
                 plain_hooks: tuple[PrepareHook, ...] | None = None) -> None:
        super().__init__(asyncio.get_running_loop())
        self._server = server
        self._direct = direct_writes
        self._app = app
        # The app's prepare hooks a whole reply needs (skymesh.net.prepare_hooks).
        self._plain_hooks = (plain_prepare_hooks(app) if plain_hooks is None
                             else plain_hooks)
        self._keys = keys
        self._handler: Handler = server.request_handler
        self._keepalive = keepalive_s
        self._http = httptools.HttpRequestParser(self)
        self._aio: asyncio.Protocol | None = None  # aiohttp's, once it has the connection
        self._hand: bytes | None = None  # bytes waiting for aiohttp's protocol
        self._queue: collections.deque[LeanRequest] = collections.deque()
        self._request: LeanRequest | None = None  # the one being parsed
        self._serving = False  # a handler runs (or its response is written)
        self._shutting = False
        self._eof = False
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._task_handler = None  # what web.Server.connection_lost reads
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_at = 0.0  # when the connection last went idle
        self._reading_held = False
        self._remote: str | None = None
        self._context = contextvars.copy_context()
        # Offsets (see the module docstring): the parser's state, the chunk being fed.
        self._state = _IDLE
        self._prefix = b""  # the current request's bytes from earlier chunks (_HEAD)
        self._chunk = b""  # the chunk being fed
        self._cursor = 0  # where in it the next request starts
        self._start = 0  # where in it the current request starts (_HEAD)
        self._mark = 0  # where in it the current request's body starts (_BODY)
        self._seen = 0  # body bytes of the current request in this chunk
        self._url = b""
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._oversized = False  # a header line past aiohttp's limit

    # -- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # request.remote: the guard parsed the peer already (start_app always guards);
        # parsed here, as aiohttp's request.remote does, only off a guard.
        self._remote = connection_client()
        if self._remote is None:
            peer = transport.get_extra_info("peername")
            self._remote = str(peer[0]) if isinstance(peer, list | tuple) else (
                str(peer) if peer is not None else None)
        # The guard's connection is in this context: the task and a later hand-off see it.
        self._context = contextvars.copy_context()
        self._server.connection_made(cast(Any, self), cast(asyncio.Transport, transport))
        self._task = self._loop.create_task(self._serve())
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self._aio is not None:
            self._aio.data_received(data)
            return
        if self._hand is not None:
            self._hand += data  # held for aiohttp: reading is paused, a last read may land
            return
        if self._shutting:
            return
        self._feed(data)

    def eof_received(self) -> bool | None:
        if self._aio is not None:
            return self._aio.eof_received()
        self._eof = True
        return None  # close the transport once our side is done

    def pause_writing(self) -> None:
        if self._aio is not None:
            self._aio.pause_writing()
        else:
            super().pause_writing()

    def resume_writing(self) -> None:
        if self._aio is not None:
            self._aio.resume_writing()
        else:
            super().resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        # Nothing is parsed after this; the parser holds our callbacks, a cycle that would
        # leave a closed connection to the cyclic GC (rare: skymesh.net.serving.tune_gc).
        del self._http
        if self._aio is not None:
            self._aio.connection_lost(cast(Exception | None, exc))
            return
        super().connection_lost(exc)
        self._server.connection_lost(cast(Any, self), exc)
        if self._request is not None:
            self._request.content.set_exception(ConnectionResetError("Connection lost"))
        self._queue.clear()  # requests parsed ahead, never served now (each refers to us)
        # handler_cancellation: a client gone cancels its handler (its finally releases it).
        if self._task is not None and not self._task.done():
            self._task.cancel()
            self._task.add_done_callback(_drop_cancellation)

    # -- web.Server's shutdown ------------------------------------------------------------
    def close(self) -> None:
        """Serve no further request; close now if none is being served."""
        self._shutting = True
        if not self._serving and self._aio is None and self.transport is not None:
            self.transport.close()
        self._wake()

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """Let the request being served finish within ``timeout``, then close."""
        self._shutting = True
        self._wake()
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
        if self.transport is not None and self._aio is None:
            self.transport.close()

    # -- parsing ---------------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._chunk, self._cursor, self._seen, self._mark = data, 0, 0, 0
        if self._state == _HEAD:
            self._start = 0
        try:
            self._http.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._hand is not None:
                pass  # _HandOff
            elif self._state == _BODY:  # the body of a request being served: no boundary
                assert self._request is not None
                self._request.content.set_exception(ConnectionResetError(str(exc)))
                self._shutting = True
            else:  # a parse error: aiohttp's 400, from this request's first byte
                self._hand = self._from_start()
                self._hold_reading(True)
        else:
            if self._state == _HEAD:
                self._prefix = self._from_start()
                if len(self._prefix) > MAX_HEAD:
                    self._hand = self._prefix
                    self._hold_reading(True)
        self._chunk = b""
        if self._hand is not None and not self._serving and not self._queue:
            self._hand_off()

    def _from_start(self) -> bytes:
        """This chunk from the current request's first byte (with its earlier bytes)."""
        if self._state == _HEAD:
            return self._prefix + self._chunk[self._start:]
        return self._chunk[self._cursor:]

    def on_message_begin(self) -> None:
        self._state = _HEAD
        self._start = self._cursor
        self._prefix = b""
        self._url = b""
        self._headers = CIMultiDict()
        self._oversized = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) > MAX_LINE or len(value) > MAX_LINE:
            self._oversized = True
        self._headers.add(name.decode("utf-8", "surrogateescape"),
                          value.decode("utf-8", "surrogateescape"))

    def on_headers_complete(self) -> None:
        parser = self._http
        method = parser.get_method().decode("ascii", "replace")
        path = self._url.decode("utf-8", "surrogateescape")
        headers = self._headers
        version = _VERSIONS.get(parser.get_http_version())
        if ((method, path) not in self._keys or version is None or self._oversized
                or hdrs.EXPECT in headers or hdrs.TRANSFER_ENCODING in headers
                or len(path) > MAX_LINE or len(headers) > MAX_HEADERS
                or parser.should_upgrade()):
            self._hand = self._from_start()
            self._hold_reading(True)
            raise _HandOff
        if self._prefix:
            joined = self._prefix + self._chunk
            self._mark = _header_end(joined, 0) - len(self._prefix)
        else:
            self._mark = _header_end(self._chunk, self._start)
        self._state = _BODY
        self._seen = 0
        self._prefix = b""
        body = LeanBody(self._hold_reading)
        assert self.transport is not None
        request = LeanRequest(self._app, method, path, CIMultiDictProxy(headers), version,
                              parser.should_keep_alive(), body,
                              self, self.transport,
                              self._remote, self._task)
        self._request = request
        self._queue.append(request)
        if len(self._queue) > MAX_QUEUED:
            self._hold_reading(True)
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._seen += len(body)
        assert self._request is not None
        self._request.content.feed(body)

    def on_message_complete(self) -> None:
        self._cursor = self._mark + self._seen
        self._state = _IDLE
        request, self._request = self._request, None
        if request is not None:
            request.content.feed_eof()
            if not request.keep_alive:
                self._shutting = True  # nothing after a request that closes is read

    # -- serving ---------------------------------------------------------------------------
    async def _serve(self) -> None:
        """The connection's one task: its requests in order, each handler inline."""
        while True:
            if not self._queue:
                if self._hand is not None or self._shutting or self._aio is not None:
                    break
                self._waiter = self._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
                continue
            request = self._queue.popleft()
            if self._reading_held and len(self._queue) <= MAX_QUEUED:
                self._hold_reading(False)
            self._serving = True
            try:
                keep = await self._respond(request)
            finally:
                self._serving = False
            if not keep or self.transport is None:
                self._shutting = True
                break
            self._arm_idle()
        if self._hand is not None and self._aio is None and not self._shutting:
            self._hand_off()
        elif self._aio is None and self.transport is not None and not self._serving:
            self.transport.close()

    async def _respond(self, request: LeanRequest) -> bool:
        """Serve ``request`` as aiohttp's RequestHandler would; whether to keep the
        connection for another."""
        resp: web.StreamResponse | None
        try:
            resp = await self._handler(request)
        except web.HTTPException as exc:
            resp = exc
        except Exception:
            server_log.exception("Error handling request from %s", request.remote)
            resp = None
        try:
            if resp is not None:
                try:
                    if self._direct and _plain(resp, request.method):
                        await self._send_plain(request, cast(web.Response, resp))
                    else:
                        await resp.prepare(cast(web.Request, request))
                        await resp.write_eof()
                except ConnectionError:
                    raise
                except Exception:  # not a response, or one that cannot be sent
                    server_log.exception("Error sending the response to %s",
                                         request.remote)
                    resp = None
            if resp is None:
                if request.output_size > 0:
                    return False  # half sent: only closing tells the client
                resp = web.Response(status=500, content_type="text/plain",
                                    text="500 Internal Server Error\n\n"
                                         "Server got itself in trouble")
                resp.force_close()
                await resp.prepare(cast(web.Request, request))
                await resp.write_eof()
        except ConnectionError:
            return False
        # A body the handler left unread: closing is simpler than reading it away.
        return bool(resp.keep_alive) and request.content.is_eof() and not self._eof

    async def _send_plain(self, request: LeanRequest, resp: web.Response) -> None:
        """Write ``resp`` (a :func:`_plain` answer) as ``resp.prepare(request)`` and
        ``resp.write_eof()`` would, in one go: the same headers set in the same order
        (Content-Length, the default Content-Type, Date, Server, Connection, then the
        app's ``on_response_prepare`` hooks: the request-id stamp), the same status line,
        serialized by aiohttp's own header writer (which refuses a control character in
        a name or value); without the ``StreamWriter`` and the awaits of its path. A
        client that stops reading holds the connection here as aiohttp's drain does (the
        guard's write-stall timer runs meanwhile)."""
        body = cast(bytes | bytearray, resp._body or b"")  # _plain checked its type
        headers = resp._headers
        headers[hdrs.CONTENT_LENGTH] = str(len(body))
        keep_alive = resp._keep_alive
        if keep_alive is None:
            keep_alive = resp._keep_alive = request.keep_alive
        version = request.version
        if body:
            headers.setdefault(hdrs.CONTENT_TYPE, "application/octet-stream")
        if hdrs.DATE not in headers:
            headers[hdrs.DATE] = rfc822_formatted_time()
        headers.setdefault(hdrs.SERVER, SERVER_SOFTWARE)
        if hdrs.CONNECTION not in headers:
            if keep_alive:
                if version == HttpVersion10:
                    headers[hdrs.CONNECTION] = "keep-alive"
            elif version == HttpVersion11:
                headers[hdrs.CONNECTION] = "close"
        resp._req = cast(web.Request, request)  # what a hook may read (resp.task)
        # What request._prepare_hook does (the on_response_prepare signals of the route's
        # apps, frozen since start-up), without its and the signals' coroutine frames;
        # for this protocol's app, without the hooks that only watch streams.
        match_info = request._match_info
        for app in match_info._apps if match_info is not None else ():
            hooks = self._plain_hooks if app is self._app else app.on_response_prepare
            for hook in hooks:
                await hook(cast(web.Request, request), resp)
        head = _serialize_headers(
            f"HTTP/{version[0]}.{version[1]} {resp._status} {resp._reason}", headers)
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        # One write, joined or not as aiohttp's writer decides (joined always before
        # Python 3.12.9, whose asyncio writelines aiohttp avoids).
        if SKIP_WRITELINES or len(head) + len(body) < MIN_PAYLOAD_FOR_WRITELINES:
            transport.write(head + body)
        else:
            transport.writelines((head, body))
        resp._eof_sent = True
        resp._req = None
        resp._body_length = len(head) + len(body)
        if self._paused:
            await self._drain_helper()

    def _hand_off(self) -> None:
        """aiohttp's protocol takes the connection from the request in ``_hand``."""
        data, self._hand = self._hand or b"", None
        transport = self.transport
        if transport is None:
            return
        self._server.connection_lost(cast(Any, self), None)  # aiohttp's registers itself
        aio = self._aio = self._server()
        self._context.run(aio.connection_made, transport)
        if self._paused:
            aio.pause_writing()
        if self._reading_held:
            self._reading_held = False
            transport.resume_reading()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._wake()
        if data:
            aio.data_received(data)
        if self._eof:
            aio.eof_received()

    def _hold_reading(self, hold: bool) -> None:
        """Pause (or resume) the transport's reading: a full body or queue, a hand-off."""
        transport = self.transport
        if transport is None or hold == self._reading_held:
            return
        if not hold and (self._hand is not None or len(self._queue) > MAX_QUEUED):
            return
        self._reading_held = hold
        if hold:
            transport.pause_reading()
        else:
            transport.resume_reading()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _arm_idle(self) -> None:
        # aiohttp's keep-alive timer: an idle connection is closed after keepalive_timeout.
        # The time is a value; one timer per connection re-arms when it has moved, so a
        # keep-alive request costs no timer.
        self._idle_at = self._loop.time()
        if self._keepalive > 0 and self._idle_timer is None:
            self._idle_timer = self._loop.call_at(self._idle_at + self._keepalive,
                                                  self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        if self._aio is not None or self.transport is None:
            return
        loop = self._loop
        busy = self._serving or self._queue or self._state != _IDLE
        due = (loop.time() if busy else self._idle_at) + self._keepalive
        if busy or loop.time() < due:
            self._idle_timer = loop.call_at(due, self._idle_check)
            return
        self.transport.close()


__all__ = ["LeanProtocol", "lean_factory"]
