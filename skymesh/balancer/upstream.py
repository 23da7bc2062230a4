"""The balancer's HTTP/1.1 client for the request path: POST to a replica, relay the reply.

Why not aiohttp's ``ClientSession`` here: it does general work per request (URL objects,
timeouts, tracing hooks, cookie and redirect handling, a ``ClientResponse`` with its
stream reader) that costs 75-100 us of CPU on this machine, against 14 us for the same
exchange on a bare connection (docs/notes/lab-diary.md, "Overhead, measured"). A
balancer pays it on every request, and at low request rates that Python runs cold and
shows in TTFT. This client does only what the proxy needs: keep-alive connections per
replica, one request written in one call, the reply parsed by ``httptools`` (llhttp, the
parser aiohttp and uvicorn use, in C; chunked bodies are decoded there), and
backpressure while the client is slower than the replica.

What it keeps of aiohttp's surface, so the proxy code reads the same: ``status``,
``headers``, ``read()``, ``content.iter_any()``, ``release()`` and ``close()``. Its
errors subclass aiohttp's connection and payload errors, which the proxy already treats
as replica faults. Probes, models and the rest of the control path stay on aiohttp.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import ssl
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any, Protocol, cast

import aiohttp
import httptools
from multidict import CIMultiDict
from yarl import URL

# Past this many unread bytes from a replica, stop reading its socket until the client
# has taken them: a slow client must not make the balancer buffer a whole reply.
HIGH_WATER = 256 * 1024
# Idle connections kept per replica, and how long one may idle before it is dropped
# (aiohttp's client default). A replica that closes idle connections sooner (vLLM's and
# SGLang's uvicorn do after 5 s) is seen closing them and they are skipped; one closed
# just as a request goes out is retried on a fresh connection (``Upstream.post``).
MAX_IDLE_PER_TARGET = 128
IDLE_S = 15.0
# The most bytes of status line and headers taken from a replica per reply (config:
# upstream.max_response_header_bytes); llhttp keeps a header it is still reading, so
# an endless one would otherwise grow without bound.
MAX_HEADER_BYTES = 64 * 1024
# A deadline timer may run this much before its time (the loop's clock resolution):
# it then counts as due rather than re-arming for a fraction of a millisecond.
_TIMER_SLACK_S = 0.001


class ReplyBody(Protocol):
    def iter_any(self) -> AsyncIterator[bytes]: ...


class Reply(Protocol):
    """What the proxy reads of a replica's reply: :class:`UpstreamReply`, or aiohttp's
    ``ClientResponse`` where the control path (migration) still uses aiohttp."""

    @property
    def status(self) -> int: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def content(self) -> ReplyBody: ...
    async def read(self) -> bytes: ...
    def release(self) -> Any: ...
    def close(self) -> None: ...


class UpstreamConnectionError(aiohttp.ClientConnectionError):
    """Could not connect to the replica, or it closed the connection mid-reply."""


class UpstreamPayloadError(aiohttp.ClientPayloadError):
    """The replica's reply is not valid HTTP/1.1."""


class ReplyTooLarge(UpstreamPayloadError):
    """A replica's reply went over one of the balancer's caps; it is not read further.
    ``what`` names the cap (``headers``, ``body``, ``metrics``) for counters and logs."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(message)
        self.what = what


class _Conn(asyncio.Protocol):
    """One keep-alive connection to a replica and the reply in progress on it."""

    def __init__(self, key: tuple[str, int, bool], max_header_bytes: int) -> None:
        self.key = key
        self.max_header_bytes = max_header_bytes
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reply: UpstreamReply | None = None
        self.lost = False
        self.idle_since = 0.0
        # The loop it was made on (_connect), so that a reply waiting for bytes does not
        # ask asyncio: on Python 3.11 each get_running_loop() is a getpid() system call.
        self.loop: asyncio.AbstractEventLoop | None = None
        # The read timeout is a deadline (loop time; 0: nobody waits) checked by one
        # timer per connection that re-arms when the deadline moved, so a wait for bytes
        # costs no timer of its own (a call_later and its cancel per wait, per chunk of
        # a stream).
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        reply = self.reply
        if reply is None:  # bytes nobody asked for (an idle connection): not parsed
            self.abort()
            return
        if not reply.status:
            reply.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamPayloadError("the replica switched protocols"))
            return
        except httptools.HttpParserError as exc:
            self._fail(UpstreamPayloadError(f"bad HTTP from the replica: {exc}"))
            return
        # Checked after the feed: the chunk that ends the headers may carry body bytes.
        if not reply.status and reply.head_bytes > self.max_header_bytes:
            self._fail(ReplyTooLarge("headers", "the replica's response headers exceed "
                                     f"{self.max_header_bytes} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._stop_timer()
        reply = self.reply
        if reply is None or reply.complete or reply.failed:
            return
        if exc is None and reply.status and not reply.delimited():
            reply.complete = True  # a body that runs to the end of the connection
            reply.wake()
            return
        reply.fail(UpstreamConnectionError(
            f"the replica closed the connection{f': {exc}' if exc else ''}"))

    def pause_writing(self) -> None:  # a request body is small: nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        reply = self.reply
        if reply is None or reply.complete:
            # A second reply to one request: stop parsing here (llhttp raises it out of
            # feed_data), so nothing of it lands in the reply the proxy is reading.
            raise UpstreamPayloadError("the replica sent a reply nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.reply is not None:
            self.reply.raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        reply = self.reply
        if reply is not None:
            reply.status = self.parser.get_status_code()
            reply.keep_alive = self.parser.should_keep_alive()
            reply.wake()

    def on_body(self, body: bytes) -> None:
        reply = self.reply
        if reply is not None:
            reply.feed(body)

    def on_message_complete(self) -> None:
        reply = self.reply
        if reply is not None:
            reply.complete = True
            reply.wake()

    # -- the read timeout ---------------------------------------------------------------
    def arm(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        """A reply waits for bytes from now on, for at most ``timeout`` seconds."""
        deadline = self.deadline = loop.time() + timeout
        timer = self.timer
        if timer is not None:
            if timer.when() <= deadline:
                return  # it fires first and re-arms for this deadline
            timer.cancel()
        self.timer = loop.call_at(deadline, self._check_deadline, loop)

    def _check_deadline(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        deadline = self.deadline
        reply = self.reply
        if not deadline or reply is None:
            return  # nobody waits: the next wait arms the timer again
        if loop.time() < deadline - _TIMER_SLACK_S:
            self.timer = loop.call_at(deadline, self._check_deadline, loop)
            return
        reply.timed_out()

    def _stop_timer(self) -> None:
        self.deadline = 0.0
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # -- helpers ------------------------------------------------------------------------
    def _fail(self, exc: Exception) -> None:
        if self.reply is not None and not self.reply.complete:  # a whole one stands
            self.reply.fail(exc)
        self.abort()

    def abort(self) -> None:
        self.lost = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()


class UpstreamReply:
    """A replica's reply as it arrives: aiohttp ``ClientResponse``'s surface, minus what
    the proxy does not use. ``content`` is the reply itself (``content.iter_any()``)."""

    __slots__ = ("_buf", "_buffered", "_conn", "_error", "_headers", "_paused", "_pool",
                 "_read_timeout", "_waiter", "complete", "head_bytes", "keep_alive",
                 "last_data_at", "raw_headers", "status")

    def __init__(self, conn: _Conn, pool: Upstream, read_timeout: float) -> None:
        self._conn = conn
        self._pool = pool
        self._read_timeout = read_timeout
        # A list, not a deque: it is mostly one chunk, taken whole; a deque is 760 bytes
        # (and a block of 64 slots) per request, an empty list 56.
        self._buf: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: Exception | None = None
        self._headers: CIMultiDict[str] | None = None
        self.raw_headers: list[tuple[str, str]] = []
        self.status = 0
        self.keep_alive = False
        self.complete = False
        self.head_bytes = 0  # bytes received before the headers were complete
        self.last_data_at = time.monotonic()  # when the replica last sent body bytes

    # -- fed by the connection ----------------------------------------------------------
    def wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def feed(self, data: bytes) -> None:
        self.last_data_at = time.monotonic()
        self._buf.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused and \
                self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        self.wake()

    def delimited(self) -> bool:
        """Whether the body's end is marked (a length or chunked), not the connection's."""
        return any(n.lower() in ("content-length", "transfer-encoding")
                   for n, _ in self.raw_headers)

    @property
    def reading_paused(self) -> bool:
        """Whether the unread part reached HIGH_WATER and the socket is not being read."""
        return self._paused

    @property
    def failed(self) -> bool:
        return self._error is not None

    def fail(self, exc: Exception) -> None:
        if self._error is None:
            self._error = exc
        self.wake()

    # -- read by the proxy --------------------------------------------------------------
    @property
    def headers(self) -> Mapping[str, str]:
        if self._headers is None:
            self._headers = CIMultiDict(self.raw_headers)
        return self._headers

    @property
    def content(self) -> UpstreamReply:
        return self

    # A wait for bytes is ``await reply._expect()`` then ``reply._expected()`` in a
    # ``finally``, in the reading coroutine itself: a helper coroutine would be one more
    # frame to create per wait (per chunk of a stream) and to pass through at each resume.
    def _expect(self) -> asyncio.Future[None]:
        """A future resolved when something arrives (bytes, the end, an error), or failed
        at the read timeout (the connection's deadline timer, :meth:`_Conn.arm`)."""
        conn = self._conn
        loop = conn.loop or asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        conn.arm(loop, self._read_timeout)
        return waiter

    def _expected(self) -> None:
        self._conn.deadline = 0.0
        self._waiter = None

    def timed_out(self) -> None:
        """The read timeout passed with nothing from the replica: the waiting read fails."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(TimeoutError(
                f"no bytes from the replica for {self._read_timeout:g} s"))

    def _take(self) -> bytes:
        data = self._buf[0] if len(self._buf) == 1 else b"".join(self._buf)
        self._buf.clear()
        self._buffered = 0
        if self._paused and self._conn.transport is not None:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    def iter_any(self) -> UpstreamReply:
        return self

    def __aiter__(self) -> UpstreamReply:
        return self

    async def __anext__(self) -> bytes:
        """The bytes that have arrived since the last call, as soon as there are any."""
        while not self._buf:
            if self.complete:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            try:
                await self._expect()
            finally:
                self._expected()
        return self._take()

    def whole(self) -> bytes | None:
        """The whole body when all of it is here already (a small reply usually comes
        with its headers), else None: then read it as it comes."""
        if not self.complete or self._error is not None:
            return None
        return self._take() if self._buf else b""

    async def read(self) -> bytes:
        parts = []
        async for chunk in self:
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the reply: the connection goes back to the pool if the reply was
        read to its end and the replica keeps connections alive, else it is closed (a
        reply abandoned midway, e.g. the client left, must stop on the replica)."""
        conn = self._conn
        if conn.reply is not self:  # released already (the connection may serve another)
            return
        conn.reply = None
        if self.complete and self.keep_alive and self._error is None and not conn.lost \
                and not self._buf:
            self._pool.put(conn)
        else:
            conn.abort()

    def close(self, reason: str = "the balancer closed the upstream connection") -> None:
        """Abort the reply now (shutdown, a migration, a replica marked down): whoever
        reads it gets an error saying ``reason``."""
        self.fail(UpstreamConnectionError(reason))
        self._conn.abort()


def whole_capped(reply: Reply, limit: int, what: str = "body") -> bytes | None:
    """:func:`read_capped` without a coroutine for a reply whose whole body is here
    already (a small reply usually comes with its headers), else None (nothing taken):
    then await :func:`read_capped`. The same refusals as it, in the same words."""
    if type(reply) is not UpstreamReply or not reply.complete or reply._error is not None:
        return None
    body = reply.whole()
    assert body is not None  # complete, no error
    if len(body) > limit:
        # A complete reply with a Content-Length has exactly that many bytes: the cap's
        # message names the declared size, as read_capped's check before reading does.
        _check_declared(reply, limit, what)
        raise _over(what, limit)
    return body


def _check_declared(reply: Reply, limit: int, what: str) -> None:
    declared = reply.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ReplyTooLarge(what, f"the replica's response {what} is {declared} bytes, "
                            f"over the {limit}-byte cap")


async def read_capped(reply: Reply, limit: int, what: str = "body") -> bytes:
    """A reply's whole body, refused (:class:`ReplyTooLarge`) once it is over ``limit``
    bytes: at once when its Content-Length says so, else as soon as that many arrived.
    The caller then drops the connection (``release`` of an unfinished reply does)."""
    body = whole_capped(reply, limit, what)
    if body is not None:
        return body  # no async iteration for what is in hand
    _check_declared(reply, limit, what)
    parts: list[bytes] = []
    size = 0
    async for chunk in reply.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise _over(what, limit)
        parts.append(chunk)
    return b"".join(parts)


def _over(what: str, limit: int) -> ReplyTooLarge:
    return ReplyTooLarge(what, f"the replica's response {what} exceeds the {limit}-byte cap")


async def read_head(reply: Reply, limit: int) -> bytes:
    """At most the first ``limit`` bytes of a reply (an error's detail): the rest is not
    read, and the caller's ``release`` drops the connection with it."""
    got = b""
    async for chunk in reply.content.iter_any():
        got += chunk
        if len(got) >= limit:
            break
    return got[:limit]


def header_lines(headers: Mapping[str, str]) -> bytes:
    """``headers`` as a request's header lines (``Name: value\\r\\n`` each, in order),
    refused (ValueError) when a name or value has a line break: it would end the header
    early and smuggle what follows into another header or request."""
    lines: list[bytes] = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} has a line break")
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    return b"".join(lines)


class Upstream:
    """Keep-alive connections to the replicas, and ``post`` and ``get`` over them."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float,
                 resolver: aiohttp.abc.AbstractResolver | None = None,
                 max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_header_bytes = max_header_bytes
        # With a URL policy (skymesh.net.resolver.PolicyResolver), a replica's host name is
        # resolved and checked at every new connection: DNS can change after the name was
        # accepted. IP literals were checked when the URL was accepted.
        self.resolver = resolver
        self._idle: dict[tuple[str, int, bool], collections.deque[_Conn]] = {}
        self._targets: dict[str, tuple[tuple[str, int, bool], bytes, str]] = {}
        self._ssl: ssl.SSLContext | None = None
        self.closed = False

    def _target(self, target: str) -> tuple[tuple[str, int, bool], bytes, str]:
        """(connection key, Host header line, path prefix) of a replica URL, cached."""
        got = self._targets.get(target)
        if got is None:
            url = URL(target)
            if url.scheme not in ("http", "https") or not url.host:
                raise UpstreamConnectionError(f"not an http(s) URL: {target!r}")
            tls = url.scheme == "https"
            port = url.port or (443 if tls else 80)
            host = f"[{url.host}]" if ":" in url.host else url.host
            host_line = f"Host: {host}:{port}\r\n".encode("latin-1")
            got = ((url.host, port, tls), host_line, url.path.rstrip("/"))
            if len(self._targets) > 4096:  # replica URLs come from config: a bound anyway
                self._targets.clear()
            self._targets[target] = got
        return got

    def put(self, conn: _Conn) -> None:
        idle = self._idle.get(conn.key)
        if idle is None:  # not setdefault: its default would be a new deque per call
            idle = self._idle[conn.key] = collections.deque()
        if self.closed or len(idle) >= MAX_IDLE_PER_TARGET:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def _get(self, key: tuple[str, int, bool]) -> _Conn | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the likeliest to be warm
            if conn.lost or now - conn.idle_since > IDLE_S:
                conn.abort()
                continue
            # Anything older than this one idled longer: drop those too.
            while idle and now - idle[0].idle_since > IDLE_S:
                idle.popleft().abort()
            return conn
        return None

    async def _connect(self, key: tuple[str, int, bool]) -> _Conn:
        host, port, tls = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                addr = await self._address(host, port)
                _, conn = await loop.create_connection(
                    lambda: _Conn(key, self.max_header_bytes), addr, port,
                    ssl=self._ssl if tls else None, server_hostname=host if tls else None)
        except TimeoutError:
            raise UpstreamConnectionError(
                f"connecting to {host}:{port} timed out after {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise UpstreamConnectionError(f"cannot connect to {host}:{port}: {exc}") from exc
        conn.loop = loop
        return conn

    async def _address(self, host: str, port: int) -> str:
        """Where to connect for ``host``: itself, or the address the policy resolver allows."""
        if self.resolver is None:
            return host
        try:
            ipaddress.ip_address(host)
            return host
        except ValueError:
            pass
        found = await self.resolver.resolve(host, port)
        return str(found[0]["host"])

    # post and get hand back _request's coroutine rather than awaiting it: one frame
    # fewer for the loop to pass through each time the request resumes.
    def post(self, target: str, path: str, body: bytes, headers: Mapping[str, str] | bytes
             ) -> Coroutine[Any, Any, UpstreamReply]:
        """POST ``body`` to ``target`` + ``path``; returns once the reply's status and
        headers are in. A kept-alive connection the replica closed before answering is
        retried once on a fresh one (nothing reached the engine). ``headers``: a mapping,
        or its lines already made and checked (:func:`header_lines`)."""
        return self._request("POST", target, path, body, headers)

    def get(self, target: str, path: str, headers: Mapping[str, str]
            ) -> Coroutine[Any, Any, UpstreamReply]:
        """GET ``target`` + ``path`` (the load probes: ten a second per replica, where
        aiohttp's client costs several times this one's CPU)."""
        return self._request("GET", target, path, None, headers)

    async def _request(self, method: str, target: str, path: str, body: bytes | None,
                       headers: Mapping[str, str] | bytes) -> UpstreamReply:
        if self.closed:
            raise UpstreamConnectionError("the balancer is shutting down")
        key, host_line, prefix = self._target(target)
        head = [f"{method} {prefix}{path} HTTP/1.1\r\n".encode("latin-1"), host_line,
                headers if isinstance(headers, bytes) else header_lines(headers)]
        if body is None:
            head.append(b"\r\n")
        else:  # joined with the head: one copy of the body, not two
            head += (b"Content-Length: %d\r\n\r\n" % len(body), body)
        message = b"".join(head)
        conn = self._get(key)
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect(key)
            reply = UpstreamReply(conn, self, self.read_timeout_s)
            # The connection's parser carries on: a pooled connection's last reply ended
            # cleanly, and llhttp starts the next message from there.
            conn.reply = reply
            assert conn.transport is not None
            conn.transport.write(message)
            # Waited for here, not in a helper coroutine (see UpstreamReply._expect).
            try:
                while not reply.status and reply._error is None:  # the headers
                    try:
                        await reply._expect()
                    finally:
                        reply._expected()
                if reply._error is not None:
                    raise reply._error
            except UpstreamConnectionError:
                reply.release()
                if reply.status or not reused or not conn.lost:
                    raise
                # Lost before any reply on a kept-alive connection: the replica closed
                # it as we sent. Once more on a fresh one (nothing reached the engine).
                reused, conn = False, None
                continue
            except BaseException:
                reply.release()
                raise
            return reply

    async def close(self) -> None:
        self.closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().abort()
        self._idle.clear()

