"""Connection limits for every server we run: skymesh-lb, skymesh-replica, the controller.

Neither aiohttp nor uvicorn bounds what a client may hold: a socket that never finishes
its headers or its body is kept until the server's keep-alive timer (aiohttp: an hour by
default; uvicorn: forever, until the first request), and the number of sockets one address
may open is bounded only by the file limit, where accept() starts failing and new clients
are dropped without a word. :class:`ConnectionGuard` closes those gaps at the protocol
level, in front of the server's own protocol, which it wraps:

- a cap on open connections per process and per client address: the connection over a
  cap gets one short HTTP error (503 for the process cap, 429 for the client's) and is
  closed; a rate-limited warning names the cap, ``skymesh_connections_refused_total
  {reason}`` counts it;
- a reserve at the top of the process cap, so that a few addresses cannot take it all
  (:func:`admission`): past ``1 - reserved_fraction`` of ``max_connections``, an address
  may open another connection only while it holds fewer than ``reserve_share`` of the
  connections still free (429, reason ``fair_share``). K addresses that keep opening
  connections leave about ``1 / (1 + K * reserve_share)`` of the reserve free (half of it
  for ten addresses at the default), and an address that holds none is let in as long as
  one place is free;
- a header timeout, from the connection's (or the next request's) first byte until the
  server hands the request to the application; a body timeout from there until the body
  has arrived; closed connections count in ``skymesh_connections_closed_total{reason}``;
- a write-stall timeout: a response whose client stops reading (the transport paused
  writing) for longer than the idle timeout is cut. A response whose bytes flow, however
  long it streams, is never cut: the server's own keep-alive timer, set to the idle
  timeout, runs only between requests;
- ``skymesh_open_connections``, the connections open now.

The application tells the guard where a request starts and ends through the server's
request handler (aiohttp: :func:`mark_started`, called by skymesh.net.front) or an ASGI
wrapper (uvicorn), which finds its connection through a context variable set while the
server's protocol creates the request's task.

Defaults (``ConnLimits``): 10,000 connections per process, 1,000 per client address,
the last 20% of the process cap held in reserve (an address may take a tenth of what is
free there), 10 s header timeout, 60 s body timeout, 75 s idle (keep-alive and write
stall).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import resource
import time
from collections import Counter
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

from skymesh.obs.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("skymesh.net.limits")

# File descriptors a process needs besides client sockets: the listener, upstream and
# peer connections (pooled and bounded), logs, Redis, the event loop's own.
FD_RESERVE = 1024
LOG_EVERY_S = 10.0

PROCESS_LIMIT = "process_limit"
CLIENT_LIMIT = "client_limit"
FAIR_SHARE = "fair_share"
HEADER_TIMEOUT = "header_timeout"
BODY_TIMEOUT = "body_timeout"
WRITE_STALL = "write_stall"


@dataclass(frozen=True, slots=True)
class ConnLimits:
    max_connections: int = 10_000
    max_connections_per_client: int = 1_000
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0
    reserved_fraction: float = 0.2
    reserve_share: float = 0.1

    def shared(self) -> int:
        """Connections any address may take (up to its own cap) before the reserve."""
        return self.max_connections - int(self.max_connections * self.reserved_fraction)


DEFAULT_LIMITS = ConnLimits()


def admission(limits: ConnLimits, open_: int, held: int) -> str | None:
    """Why a new connection from an address holding ``held`` of the ``open_`` ones is
    refused, or None (see the module docstring)."""
    if open_ >= limits.max_connections:
        return PROCESS_LIMIT
    if held >= limits.max_connections_per_client:
        return CLIENT_LIMIT
    if open_ >= limits.shared() and held >= (limits.max_connections - open_) * \
            limits.reserve_share:
        return FAIR_SHARE
    return None

# The connection whose protocol is creating tasks right now (see the module docstring).
_CURRENT: contextvars.ContextVar[_GuardedConnection | None] = contextvars.ContextVar(
    "skymesh_connection", default=None)


def mark_started(request: Any) -> _GuardedConnection | None:
    """Tell the guarded connection an aiohttp ``request`` arrived on that its headers are
    in (and whether its body is); the caller calls ``request_finished()`` on what this
    returns when the request ends. None off a guarded connection (nothing to tell)."""
    conn = _CURRENT.get()
    if conn is not None:
        content = request.content
        conn.request_started(None if content.is_eof() else content.is_eof)
    return conn


def connection_client() -> str | None:
    """The client address the guard admitted the connection being made under (its parse
    of the peer, ``str(host)`` of a TCP peer), for the server protocol it wraps; None off a
    guarded connection."""
    conn = _CURRENT.get()
    return conn._client if conn is not None else None


class _Phase:
    HEADERS, ACTIVE, IDLE = range(3)


class ConnectionGuard:  # a prometheus_client Collector (a Protocol)
    """Admission and timeouts for one server process (shared by its listeners); also
    the Prometheus collector of its metrics (``registry.register(guard)``).

    ``clock`` paces the log lines only; timers run on the event loop's clock.
    """

    def __init__(self, limits: ConnLimits, name: str, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.name = name
        self.open = 0
        self.by_client: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.closed: Counter[str] = Counter()
        self._log = RateLimitedLog(log, LOG_EVERY_S, clock)

    # -- admission -------------------------------------------------------------------
    def admit(self, client: str) -> str | None:
        """Count a new connection from ``client`` in, or return why it is refused."""
        reason = admission(self.limits, self.open, self.by_client[client])
        if reason is not None:
            return reason
        self.open += 1
        self.by_client[client] += 1
        return None

    def release(self, client: str) -> None:
        self.open -= 1
        left = self.by_client[client] - 1
        if left:
            self.by_client[client] = left
        else:
            del self.by_client[client]

    def note_refused(self, reason: str, client: str) -> None:
        self.refused[reason] += 1
        lim = self.limits
        if reason == PROCESS_LIMIT:
            why = f"{self.open} connections open (max_connections {lim.max_connections})"
        elif reason == FAIR_SHARE:
            why = (f"it holds {self.by_client[client]} of {self.open} open connections, and "
                   f"past {lim.shared()} an address may take only {lim.reserve_share:g} of "
                   f"the {lim.max_connections - self.open} still free (reserved_fraction "
                   f"{lim.reserved_fraction:g} of max_connections {lim.max_connections})")
        else:
            why = (f"{self.by_client[client]} connections open from {client} "
                   f"(max_connections_per_client {self.limits.max_connections_per_client})")
        self._log(logging.WARNING, reason, f"{self.name}: refused a connection from {client}: "
                                           f"{why}")

    def note_closed(self, reason: str, client: str) -> None:
        self.closed[reason] += 1
        self._log(logging.INFO, reason, f"{self.name}: closed a connection from {client}: "
                                        f"{reason.replace('_', ' ')}")


    # -- wiring ----------------------------------------------------------------------
    def protocol_factory(self, inner: Callable[..., asyncio.Protocol], *,
                         tasks_on_data: bool = False) -> Callable[..., asyncio.Protocol]:
        """A protocol factory for ``loop.create_server``: each connection is admitted
        here first, then handed to ``inner(**kwargs)``, the server's own protocol.
        ``tasks_on_data``: that protocol starts request tasks while it parses input
        (uvicorn), not only when the connection opens (aiohttp)."""

        def factory(**kwargs: Any) -> asyncio.Protocol:
            return _GuardedConnection(self, lambda: inner(**kwargs), tasks_on_data)

        return factory

    def asgi(self, app: Any) -> Any:
        """``app`` wrapped to mark each HTTP request's start and end on its connection."""

        async def guarded(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
            conn = _CURRENT.get()
            if conn is None or scope["type"] != "http":
                await app(scope, receive, send)
                return
            headers = dict(scope.get("headers") or ())
            has_body = (headers.get(b"content-length", b"0") not in (b"0", b"")
                        or b"transfer-encoding" in headers)
            done = [not has_body]

            async def receive_tracked() -> Any:
                message = await receive()
                if message.get("type") != "http.request" or not message.get("more_body"):
                    done[0] = True
                return message

            conn.request_started(None if done[0] else lambda: done[0])
            try:
                await app(scope, receive_tracked, send)
            finally:
                conn.request_finished()

        return guarded

    # -- metrics ---------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        # Imported here, not with the module: the configs import ConnLimits from it, and
        # skymesh-lb's supervisor, which checks its config and exports no metrics, carried
        # prometheus_client for nothing.
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        open_ = GaugeMetricFamily("skymesh_open_connections",
                                  "Client connections open on this server")
        open_.add_metric([], self.open)
        yield open_
        refused = CounterMetricFamily(
            "skymesh_connections_refused", "Connections refused at a connection cap",
            labels=["reason"])
        for reason in (PROCESS_LIMIT, CLIENT_LIMIT, FAIR_SHARE):
            refused.add_metric([reason], self.refused[reason])
        yield refused
        closed = CounterMetricFamily(
            "skymesh_connections_closed",
            "Connections closed by a header, body or write-stall timeout", labels=["reason"])
        for reason in (HEADER_TIMEOUT, BODY_TIMEOUT, WRITE_STALL):
            closed.add_metric([reason], self.closed[reason])
        yield closed


def _refusal(reason: str) -> bytes:
    mine = reason in (CLIENT_LIMIT, FAIR_SHARE)
    status = "429 Too Many Requests" if mine else "503 Service Unavailable"
    which = "from your address" if mine else "on this server"
    body = json.dumps({"error": {
        "message": f"too many open connections {which}; retry later or reuse a connection",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class _GuardedConnection(asyncio.Protocol):
    """One client connection: admission, then the server's protocol plus timers.

    Phases: HEADERS (a request is arriving: the header timer runs), ACTIVE (the
    application has it: the body timer runs until the body is in), IDLE (between
    requests: the server's keep-alive timer rules; the next byte starts HEADERS).
    """

    __slots__ = (
        "_body_done",
        "_client",
        "_deadline",
        "_guard",
        "_inner",
        "_loop",
        "_make_inner",
        "_phase",
        "_read_timer",
        "_reason",
        "_tasks_on_data",
        "_transport",
        "_write_timer",
    )

    def __init__(self, guard: ConnectionGuard, make_inner: Callable[[], asyncio.Protocol],
                 tasks_on_data: bool) -> None:
        self._guard = guard
        self._make_inner = make_inner
        self._tasks_on_data = tasks_on_data
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._client = ""
        self._phase = _Phase.HEADERS
        # The read deadline (header or body) is a value; one timer per connection checks
        # it and re-arms when it has moved, so a keep-alive request costs no timer.
        self._deadline: float | None = None
        self._reason = HEADER_TIMEOUT
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._body_done: Callable[[], bool] | None = None

    # -- asyncio.Protocol ------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if isinstance(peer, tuple) and peer else "local"
        reason = self._guard.admit(self._client)
        if reason is not None:
            self._refuse(reason)
            return
        self._inner = self._make_inner()
        self._set_deadline(self._guard.limits.header_timeout_s, HEADER_TIMEOUT)
        # The server's protocol creates its tasks here (aiohttp) or in data_received
        # (uvicorn): they inherit the context, and so find this connection.
        token = _CURRENT.set(self)
        try:
            self._inner.connection_made(transport)
        finally:
            _CURRENT.reset(token)

    def data_received(self, data: bytes) -> None:
        inner = self._inner
        if inner is None:
            return  # refused: what the client sent is dropped unread
        if self._phase == _Phase.IDLE:
            self._phase = _Phase.HEADERS
            self._set_deadline(self._guard.limits.header_timeout_s, HEADER_TIMEOUT)
        if not self._tasks_on_data:
            inner.data_received(data)
            return
        token = _CURRENT.set(self)
        try:
            inner.data_received(data)
        finally:
            _CURRENT.reset(token)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is None:
            return
        if self._write_timer is None:
            self._write_timer = self._loop.call_later(self._guard.limits.idle_timeout_s,
                                                      self._cut, WRITE_STALL)
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is None:
            return
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._read_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._read_timer = self._write_timer = None
        inner, self._inner = self._inner, None
        if inner is not None:
            self._guard.release(self._client)
            inner.connection_lost(exc)

    # -- from the application --------------------------------------------------------
    def request_started(self, body_done: Callable[[], bool] | None) -> None:
        """Headers are in; ``body_done`` tells whether the body is in too (None: no body
        to wait for)."""
        self._phase = _Phase.ACTIVE
        self._body_done = body_done
        if body_done is None:
            self._deadline = None
        else:
            self._set_deadline(self._guard.limits.body_timeout_s, BODY_TIMEOUT)

    def request_finished(self) -> None:
        self._phase = _Phase.IDLE
        self._body_done = None
        self._deadline = None

    # -- internals -------------------------------------------------------------------
    def _set_deadline(self, delay: float, reason: str) -> None:
        loop = self._loop
        deadline = self._deadline = loop.time() + delay
        self._reason = reason
        timer = self._read_timer
        if timer is not None and timer.when() <= deadline:
            return  # it fires first and re-arms for the new deadline
        if timer is not None:
            timer.cancel()
        self._read_timer = loop.call_at(deadline, self._check_deadline)

    def _check_deadline(self) -> None:
        self._read_timer = None
        deadline = self._deadline
        if deadline is None:
            return
        if self._loop.time() < deadline:
            self._read_timer = self._loop.call_at(deadline, self._check_deadline)
            return
        self._deadline = None
        reason = self._reason
        if reason == BODY_TIMEOUT and (self._body_done is None or self._body_done()):
            return
        self._cut(reason)

    def _cut(self, reason: str) -> None:
        if self._inner is None or self._transport is None:
            return
        self._guard.note_closed(reason, self._client)
        # abort, not close: close would wait for a write buffer the client never drains.
        self._transport.abort()

    def _refuse(self, reason: str) -> None:
        guard = self._guard
        guard.note_refused(reason, self._client)
        transport = self._transport
        assert transport is not None
        transport.write(_refusal(reason))
        # Half-close and linger briefly: closing with the client's request unread would
        # reset the connection, and the client might never read the answer.
        if transport.can_write_eof():
            transport.write_eof()
        linger = min(1.0, guard.limits.header_timeout_s)
        self._loop.call_later(linger, transport.abort)


def fit_file_limit(limits: ConnLimits, name: str, reserve: int = FD_RESERVE) -> ConnLimits:
    """Check the soft file limit against ``limits.max_connections`` at start.

    A soft limit below what the cap needs is raised (up to the hard limit); if the hard
    limit is still too low, the cap is lowered to fit and a warning says so: a refusal at
    the cap is answered and counted, where running out of descriptors drops clients
    silently in accept().
    """
    need = limits.max_connections + reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return limits
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info("%s: raised the open-file limit from %d to %d", name, soft, target)
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("%s: could not raise the open-file limit from %d: %s", name, soft, exc)
    if soft >= need:
        return limits
    fitted = max(1, soft - reserve) if soft > 2 * reserve else max(1, soft // 2)
    log.warning("%s: the open-file limit (%d, hard %s) is below the %d that max_connections "
                "%d needs; serving at most %d connections (raise it with ulimit -n or the "
                "service's LimitNOFILE)", name, soft,
                "unlimited" if hard == resource.RLIM_INFINITY else hard, need,
                limits.max_connections, fitted)
    return replace(limits, max_connections=fitted,
                   max_connections_per_client=min(limits.max_connections_per_client, fitted))


__all__ = ["DEFAULT_LIMITS", "ConnLimits", "ConnectionGuard", "admission", "fit_file_limit"]
