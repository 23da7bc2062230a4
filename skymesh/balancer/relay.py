"""What the rooms of the request path share, below all of them.

The request flows one way: the edge (``handlers``) offers it to the dispatcher, the
forwarder (``forwarding``) sends it to a replica or a peer region, the relay
(``streaming``) passes a stream on, and the mover (``moves``) continues a stream
elsewhere. Each room gets only the collaborators it uses; what several of them need
lives here: :class:`RequestCore` (the dispatcher, the metrics, the clock, the pump, and
the steps every room takes the same way), :class:`Switches` (what changes while the
balancer runs: the running policy's flags, shutdown), :class:`UpstreamHeaders`, and the
pieces of a response to the client (the coalesced stream, the hop-by-hop filter, the SSE
error event, the replica's first bytes).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import NoneType
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, istr

from skymesh.balancer.config import BalancerConfig
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.edge import REQUEST_ID_HEADER, request_id
from skymesh.balancer.intake import Intake
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.output_text import single_choice
from skymesh.balancer.upstream import Reply, ReplyTooLarge, UpstreamReply, header_lines
from skymesh.obs.access import inject_trace
from skymesh.policies.base import Policy, RouteRequest
from skymesh.prefix.keys import reply_keys

log = logging.getLogger("skymesh.lb")

FORWARD_HEADERS = ("Authorization", "Content-Type", "Accept", "X-Request-Id")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive",
                "content-encoding", "date", "server"}
# Shapes of client headers whose upstream header lines are kept (UpstreamHeaders.lines_for):
# one per client key and content type in practice.
MAX_HEADER_SHAPES = 256
_REQUEST_ID_NAME = REQUEST_ID_HEADER.encode("ascii")
_REQUEST_ID_KEY = istr(REQUEST_ID_HEADER)
# Typed keys (web.RequestKey): a plain string key makes aiohttp warn once per key.
OUTPUT_TOKENS_KEY = web.RequestKey("skymesh.output_tokens", int)  # output count, for telemetry
# the request's current ticket, once a migration replaced it
TICKET_KEY = web.RequestKey("skymesh.ticket", Ticket)


class ReplicaFault(Exception):
    """The attempt failed in a way that is the replica's fault (retry elsewhere)."""


class CoalescedStream(web.StreamResponse):
    """A streamed response whose headers leave with its first chunk, in one write.

    aiohttp's StreamResponse sends headers on ``prepare``; we prepare only once the
    upstream's first bytes are here, so a separate send would cost a system call and a
    wake-up of the client for nothing. aiohttp's own ``Response`` buffers them this way
    (the same class attribute); if a later aiohttp drops it, headers go out on
    ``prepare`` again, which is only slower."""

    _send_headers_immediately = False


def copy_headers(up: Reply) -> dict[str, str]:
    """The replica's reply headers the client gets: all but the hop-by-hop ones (and
    those the balancer's server sets itself), in order, the last of a repeated name."""
    # Our client's reply keeps its header pairs as they came: the same pairs as its
    # ``headers`` multidict gives, without making one.
    pairs = up.raw_headers if type(up) is UpstreamReply else up.headers.items()
    return {k: v for k, v in pairs if k.lower() not in _HOP_HEADERS}


def _response_template() -> dict[str, Any] | None:
    """The attributes of ``web.Response(body=b"")`` (status 200) when every one but its
    item dict and headers is an immutable value, so that a copy of them is a new
    response's; None when this aiohttp keeps anything else per response (or no ``__dict__``)."""
    probe = web.Response(body=b"")
    attrs = getattr(probe, "__dict__", None)
    if attrs is None or type(attrs.get("_state")) is not dict \
            or type(attrs.get("_headers")) is not CIMultiDict or "_body" not in attrs:
        return None
    if any(not isinstance(v, bool | int | float | str | bytes | NoneType)
           for k, v in attrs.items() if k not in ("_state", "_headers")):
        return None
    return dict(attrs)


_RESPONSE_200 = _response_template()
_new_object = object.__new__


def reply_response(status: int, body: bytes, up: Reply) -> web.Response:
    """``web.Response(status=status, body=body, headers=copy_headers(up))``: a replica's
    whole reply as the client's. A 200's is made from :func:`_response_template`'s copy,
    without ``web.Response.__init__``'s checks (0.6 us per request with its keyword
    arguments, the headers' and the body's setters); the same object (a test compares
    their attributes)."""
    headers = copy_headers(up)
    if status != 200 or _RESPONSE_200 is None:
        return web.Response(status=status, body=body, headers=headers)
    resp: web.Response = _new_object(web.Response)
    attrs = resp.__dict__
    attrs.update(_RESPONSE_200)
    attrs["_state"] = {}
    attrs["_headers"] = CIMultiDict(headers)
    attrs["_body"] = body
    return resp


def broken(message: str, code: str = "upstream_failed") -> bytes:
    """The SSE error event and end a client gets after its first byte."""
    err = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


async def first_chunk(up: Reply) -> tuple[AsyncIterator[bytes], bytes]:
    """The upstream's first bytes (a failure before them is the replica's: retry)."""
    chunks: AsyncIterator[bytes] = up.content.iter_any()
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        raise ReplicaFault("empty response") from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ReplicaFault(str(exc) or type(exc).__name__) from exc
    return chunks, first


def _records_output(policy: Policy) -> bool:
    return type(policy).on_cached is not Policy.on_cached


@dataclass(frozen=True, slots=True)
class PolicyFlags:
    """What the request path does for the running policy, decided once per policy: the
    request path of a policy that uses none of these pays one attribute test for each."""

    predicts: bool  # a predicted output length (uses_length_prediction)
    timed: bool  # Policy.on_timing is overridden
    migrates: bool  # wants_migration
    resumes: bool  # retry.resume_streams
    keys: bool  # uses_prefix_keys
    # Policies that record what a replica caches after a request get its output too (the
    # reply is kept while relayed, and keyed after the client has it).
    records: bool
    records_peer: bool

    @classmethod
    def of(cls, policy: Policy, peer: Policy | None, cfg: BalancerConfig) -> PolicyFlags:
        keys = policy.uses_prefix_keys
        return cls(
            predicts=policy.uses_length_prediction and cfg.prediction.predictor != "none",
            timed=type(policy).on_timing is not Policy.on_timing,
            migrates=policy.wants_migration,
            resumes=cfg.retry.resume_streams,
            keys=keys,
            records=keys and _records_output(policy),
            records_peer=keys and peer is not None and _records_output(peer),
        )


@dataclass(slots=True)
class Switches:
    """What changes while the balancer runs, read by the rooms when they act: the running
    policy's flags (a live policy switch replaces them) and whether it is shutting down."""

    flags: PolicyFlags
    closing: bool = False


@dataclass(frozen=True, slots=True)
class UpstreamHeaders:
    """What a request to a replica carries from the client's, plus our own key."""

    forwarded: tuple[str, ...]  # client headers passed on
    auth: dict[str, str]  # the replicas' key, when the balancer has one
    # Whether a request may carry a trace (``tracing.enabled``): off, no request has a
    # span to inject, and :meth:`lines_for` reuses the lines it made for the same shape.
    traced: bool = True
    # lines_for's lines by shape: the client's values of ``forwarded`` but X-Request-Id,
    # and whether it sent one -> the lines up to the request id's value (its name
    # included) and from the end of its line.
    _lines: dict[tuple[str | bool | None, ...], tuple[bytes, bytes]] = field(
        default_factory=dict, compare=False, repr=False)
    # ``forwarded`` but X-Request-Id as multidict's case-folded keys (a lookup without
    # folding the name): the shape's values.
    _shape_keys: tuple[istr, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_shape_keys", tuple(
            istr(k) for k in self.forwarded if k != REQUEST_ID_HEADER))

    def for_request(self, request: web.Request) -> dict[str, str]:
        headers = {k: v for k in self.forwarded if (v := request.headers.get(k))}
        headers[REQUEST_ID_HEADER] = request_id(request)
        headers.update(self.auth)
        inject_trace(request, headers)  # the attempt's traceparent, when tracing
        return headers

    def lines_for(self, request: web.Request) -> bytes:
        """:meth:`for_request`'s headers with ``Content-Type`` defaulted to JSON (a
        generation request's), as the upstream request's header lines
        (:func:`~skymesh.balancer.upstream.header_lines`: ValueError for a line break).
        Without tracing the lines around the request id are made once per shape of the
        client's headers: the same bytes, without a dict and a format per header."""
        if self.traced:
            return header_lines(self._generation_headers(request))
        get = request.headers.get
        # The client's X-Request-Id is replaced by ours: only whether it came (where the
        # line goes, when it is forwarded) shapes the lines, not its value.
        shape = (*map(get, self._shape_keys), bool(get(_REQUEST_ID_KEY)))
        parts = self._lines.get(shape)
        if parts is None:
            parts = self._make_lines(request)
            if len(self._lines) >= MAX_HEADER_SHAPES:  # client keys and types: bounded
                self._lines.clear()
            self._lines[shape] = parts
        # request_id() is 32 hex digits or a client's printable ASCII: no line break.
        return parts[0] + request_id(request).encode("ascii") + parts[1]

    def _generation_headers(self, request: web.Request) -> dict[str, str]:
        headers = self.for_request(request)
        headers.setdefault("Content-Type", "application/json")
        return headers

    def _make_lines(self, request: web.Request) -> tuple[bytes, bytes]:
        headers = self._generation_headers(request)
        names = list(headers)
        at = names.index(REQUEST_ID_HEADER)
        return (header_lines({k: headers[k] for k in names[:at]}) + _REQUEST_ID_NAME + b": ",
                b"\r\n" + header_lines({k: headers[k] for k in names[at + 1:]}))


class RequestCore:
    """The dispatcher, the metrics, the clock and the pump, which every room of the
    request path uses, and the steps they all take the same way."""

    def __init__(self, dispatcher: Dispatcher, metrics: BalancerMetrics,
                 now: Callable[[], float], pump: Callable[[], None],
                 switches: Switches) -> None:
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.now = now
        self.pump = pump
        self.switches = switches
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, asked once per loop: on Python 3.11 each ask is a getpid()
        system call, and the request path needs it several times per request."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def started(self, ticket: Ticket, first_at: float, t0: float) -> None:
        """The replica has answered: the request no longer waits to be admitted there."""
        self.dispatcher.first_byte(ticket)
        self.pump()  # a no-op unless requests wait for exactly this
        self.metrics.model(ticket.route.model).ttft.observe(first_at - t0)

    def broken_stream(self, target: str | None, exc: BaseException) -> bytes:
        """The error event of a stream whose upstream broke after the client's first byte."""
        if self.switches.closing:
            return broken("the balancer is shutting down; retry the request", "shutting_down")
        log.warning("upstream %s broke mid-stream: %s", target, exc)
        return broken(f"the replica failed mid-response: {exc}")

    def refused(self, target: str, exc: ReplyTooLarge) -> None:
        """A reply from ``target`` went over a cap: counted, logged, not read further."""
        log.warning("refused a reply from %s: %s", target, exc)
        self.metrics.replica_limits.labels(target, exc.what).inc()

    def record_cached(self, route: RouteRequest, target: str, intake: Intake,
                      output: str) -> None:
        """``target`` now caches the request's prompt and ``output`` (the text the next
        turn resends, ``output_text.cached_text``, keyed without being built): tell the
        policy. The prompt's keys are the route's."""
        if output and single_choice(intake.body):
            self.dispatcher.cached(route, target, reply_keys(intake.prompt_text,
                                                             route.prefix_keys, output))

    def record_later(self, route: RouteRequest, target: str, intake: Intake,
                     output: str) -> None:
        """:meth:`record_cached` once the response in hand has been written: keying the
        text is not the client's wait."""
        self.loop.call_soon(self.record_cached, route, target, intake, output)



__all__ = ["FORWARD_HEADERS", "OUTPUT_TOKENS_KEY", "TICKET_KEY", "CoalescedStream",
           "PolicyFlags", "ReplicaFault", "RequestCore", "Switches", "UpstreamHeaders",
           "broken", "copy_headers", "first_chunk", "reply_response"]
