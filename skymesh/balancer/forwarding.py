"""Forwarding a generation request: wait for a dispatch, send the original bytes to the
chosen replica (or peer region), retry elsewhere on a failure before the first byte.

A connect error, timeout or 5xx before the first byte is the replica's fault
(:class:`ReplicaFault`): the attempt counts against its breaker and the request goes to
the head of the queue for another replica, at most ``retry.max_attempts`` attempts in all
(then 502). A non-streamed response, or an error status, is read whole and returned, up
to ``upstream.max_response_body_bytes`` (over it: 502, the connection dropped); a
stream is relayed by ``skymesh.balancer.streaming`` (or ``skymesh.balancer.moves`` when the
policy may move it). The upstream request's headers are
``skymesh.balancer.relay.UpstreamHeaders``'; the pieces of a response every room shares
(the coalesced stream, the hop-by-hop filter, the SSE error event) are that module's too.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from skymesh.balancer.config import BalancerConfig
from skymesh.balancer.dispatch import Ticket
from skymesh.balancer.errors import BadRequest, NoCapacity, UpstreamFailed
from skymesh.balancer.intake import Intake
from skymesh.balancer.metrics import ModelSeries
from skymesh.balancer.migration import migratable
from skymesh.balancer.moves import Mover
from skymesh.balancer.output_text import (
    OutputCapture,
    parse_json,
    reply_record,
    sse_output_text,
)
from skymesh.balancer.overload import can_retry
from skymesh.balancer.relay import (
    OUTPUT_TOKENS_KEY,
    CoalescedStream,
    ReplicaFault,
    RequestCore,
    UpstreamHeaders,
    broken,
    reply_response,
)
from skymesh.balancer.streaming import Streams
from skymesh.balancer.upstream import (
    Reply,
    ReplyTooLarge,
    Upstream,
    read_capped,
    read_head,
    whole_capped,
)
from skymesh.net.jsonbody import NOT_DECODED, fast_usage
from skymesh.obs.access import note_target, note_usage, upstream_span
from skymesh.policies.base import RequestTiming

if TYPE_CHECKING:
    from skymesh.balancer.mesh_link import MeshLink

log = logging.getLogger("skymesh.lb")
# The span of an untraced attempt: a shared one that does nothing.
_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()

# How early the sweep may take a queue timeout: the event loop's timers have millisecond
# resolution, so a sweep can run a hair before the deadline it was armed for (asyncio's
# own loop takes its timers this far ahead for the same reason).
SWEEP_SLACK_S = 0.001
# A waiter's deadline, its sequence number (equal deadlines leave in arrival order), and
# what its timeout needs: the ticket, its future, the timeout it was given.
_Deadline = tuple[float, int, Ticket, "asyncio.Future[None]", float]


def usage(reply: Any) -> tuple[int, int, int | None]:
    """(prompt tokens, completion tokens, cached prompt tokens or None) from a parsed
    non-streamed response's ``usage``; zeros when it has none."""
    try:
        return usage_of(reply.get("usage"))
    except AttributeError:  # not a JSON object
        return 0, 0, None


def usage_of(u: Any) -> tuple[int, int, int | None]:
    """:func:`usage` of the ``usage`` member itself (None or anything else: zeros)."""
    try:
        u = u or {}
        details = u.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return (int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0),
                int(cached) if cached is not None else None)
    except (ValueError, AttributeError, TypeError):
        return 0, 0, None


def reply_usage(body: bytes, decoded: Any = NOT_DECODED) -> tuple[int, int, int | None]:
    """:func:`usage` of a non-streamed response body, decoding only its ``usage`` where
    msgspec can (the rest of the reply is not needed unless a policy records it);
    ``decoded``: that member already decoded (``fast_usage(body)``)."""
    u = fast_usage(body) if decoded is NOT_DECODED else decoded
    return usage(parse_json(body)) if u is NOT_DECODED else usage_of(u)


class Forwarder:
    def __init__(self, core: RequestCore, cfg: BalancerConfig, headers: UpstreamHeaders,
                 upstream: Upstream | None, mesh: MeshLink | None, streams: Streams,
                 mover: Mover, failfast: dict[str, Ticket],
                 drain_retry_s: Callable[[str], float]) -> None:
        self.core = core
        self.cfg = cfg
        # Tracing on (or a configuration without the setting): each attempt opens a span
        # and its request carries the trace. Off, neither has anything to do, per request.
        tracing = getattr(cfg, "tracing", None)
        self.traced = tracing is None or tracing.enabled
        if headers is not None and not self.traced:
            headers = replace(headers, traced=False)
        self.headers = headers
        # The request path's client: the balancer sets its own when it starts (None
        # before). An attribute, not a function that returns it: two Python calls fewer
        # per request (a lambda and a property, 75 ns).
        self.upstream = upstream
        self.mesh = mesh
        self.streams = streams
        self.mover = mover
        self.failfast = failfast  # queued requests that may fail fast (the pump's), by key
        self.drain_retry_s = drain_retry_s  # Retry-After for a model's queue
        self._loop: asyncio.AbstractEventLoop | None = None  # the one the state below is on
        # The queue timeouts of the waiting requests, earliest first, swept by one timer:
        # a loop timer per waiter cost 1.8 us to arm and cancel under uvloop (a libuv
        # handle each), a heap entry 0.2 us. Entries of requests that were dispatched
        # (or left) stay until their deadline or a compaction; ``_waiting`` counts the
        # live ones, which bound the heap (``_forget``).
        self._deadlines: list[_Deadline] = []
        self._seq = itertools.count()
        self._waiting = 0
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_at = float("inf")
        # Offered to the pump in place of a future: done already, so the pump resolves
        # nothing, and a request a replica takes at once makes no future of its own.
        self._at_once: asyncio.Future[None] | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self.core.loop
        if loop is not self._loop:
            self._renew(loop)
        return loop

    def _renew(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A new loop: what was kept on the old one goes; the new resolved future."""
        self._loop = loop
        self._deadlines, self._waiting, self._sweep = [], 0, None  # the old loop's
        self._sweep_at = float("inf")
        at_once = self._at_once = loop.create_future()
        at_once.set_result(None)
        return at_once

    async def wait_dispatch(self, ticket: Ticket, timeout: float) -> str:
        """The replica (or peer) the queued ``ticket`` went to, within ``timeout``.
        ``serve`` takes the same steps inline, so that a request dispatched at once
        creates no coroutine for it."""
        fut = self.offer_wait(ticket)
        if not fut.done():
            await self.wait_queued(ticket, fut, timeout)
        return self.dispatched(ticket, fut)

    def offer_wait(self, ticket: Ticket) -> asyncio.Future[None]:
        """The ticket's dispatch as a future, after a pump: done already when a replica
        took it at once (then the shared, resolved one)."""
        # Not ``self.loop`` (the running loop asked through two properties) for a request
        # dispatched at once: a resolved future serves on any loop; a waiter below asks
        # it, which renews what was kept on an old loop.
        at_once = self._at_once
        if at_once is None:
            at_once = self._renew(self.core.loop)
        ticket.payload = at_once
        # Nothing fails the ticket in this pump: the pump fails only the waiters in
        # ``failfast``, which it joins in ``wait_queued``.
        self.core.pump()
        if ticket.target is not None and not ticket.queued:
            return at_once
        fut: asyncio.Future[None] = self.loop.create_future()
        ticket.payload = fut
        return fut

    async def wait_queued(self, ticket: Ticket, fut: asyncio.Future[None],
                          timeout: float) -> None:
        """``fut`` awaited bare, its timeout in the shared sweep: wait_for(shield(fut))
        cost two more futures, a task and its timer each (and the getpid()s of asking for
        the loop). A client that leaves cancels ``fut`` with it; nothing resolves a
        cancelled future (the pump and the sweep check done()), and the handler's
        ``finally`` takes the ticket out of the queue. ``serve`` takes the same steps
        inline (a coroutine fewer on a waiting request's chain)."""
        self._expect(ticket, fut, timeout)
        try:
            await fut
        finally:
            self._left(ticket)

    def _expect(self, ticket: Ticket, fut: asyncio.Future[None], timeout: float) -> None:
        """The queued ``ticket`` waits on ``fut`` from now, for at most ``timeout``: it
        may fail fast (the pump's), and its deadline joins the sweep's heap."""
        self.failfast[ticket.key] = ticket
        when = self.loop.time() + timeout
        heapq.heappush(self._deadlines, (when, next(self._seq), ticket, fut, timeout))
        self._waiting += 1
        if when < self._sweep_at:
            self._arm(when)

    def _left(self, ticket: Ticket) -> None:
        """The waiter of :meth:`_expect` is done waiting (dispatched, timed out or gone)."""
        self.failfast.pop(ticket.key, None)
        self._forget()

    def _arm(self, when: float) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
        self._sweep = self.loop.call_at(when, self._sweep_due)
        self._sweep_at = when

    def _forget(self) -> None:
        """A waiter is done: its heap entry is dead. With none left waiting the heap and
        its timer go; a heap of mostly dead entries is rebuilt (bounded by the waiters)."""
        self._waiting -= 1
        h = self._deadlines
        if not self._waiting:
            h.clear()
            if self._sweep is not None:
                self._sweep.cancel()
                self._sweep, self._sweep_at = None, float("inf")
        elif len(h) > 2 * self._waiting + 64:
            h[:] = [e for e in h if not e[3].done()]
            heapq.heapify(h)

    def _sweep_due(self) -> None:
        """The earliest deadlines have come: time those requests out, arm for the next."""
        self._sweep, self._sweep_at = None, float("inf")
        h = self._deadlines
        due = self.loop.time() + SWEEP_SLACK_S
        try:
            while h and (h[0][0] <= due or h[0][3].done()):
                _, _, ticket, fut, timeout = heapq.heappop(h)
                self._time_out(ticket, fut, timeout)
        finally:  # one timeout that raised must not leave the others without a timer
            if h and self._sweep is None:
                self._arm(h[0][0])

    @staticmethod
    def dispatched(ticket: Ticket, fut: asyncio.Future[None]) -> str:
        fut.result()  # NoCapacity (timeout) or Balancer._fail_stranded's NoHealthyReplica
        assert ticket.target is not None
        return ticket.target

    def _time_out(self, ticket: Ticket, fut: asyncio.Future[None], timeout: float) -> None:
        """The queue timeout: a ticket still queued leaves with a 503 and Retry-After;
        one dispatched in the meantime goes on to its target."""
        if fut.done():
            return
        if self.core.dispatcher.cancel(ticket):
            fut.set_exception(NoCapacity(
                f"no replica could take the request within {timeout:.1f} s",
                retry_after_s=self.drain_retry_s(ticket.route.model),
            ))
        else:
            fut.set_result(None)

    async def serve(self, request: web.Request, ticket: Ticket, raw: bytes, intake: Intake,
                    t0: float, timeout: float, series: ModelSeries
                    ) -> tuple[web.StreamResponse, str]:
        """Wait for the ticket's dispatch, send the request to its target (a replica: the
        upstream client's POST, awaited in this frame; a peer: :meth:`forward_peer`) and
        answer from the reply; a replica's fault before the first byte sends it to the
        head of the queue for another, up to ``retry.max_attempts`` attempts in all.

        The replica's attempt is not a coroutine of its own: every resume of the request
        (the reply's headers arriving) passes through each frame of the chain from the
        connection's task down, and each frame left is torn down on the way back.
        ``series``: the request's model's metrics, looked up once by the handler."""
        max_attempts = self.cfg.retry.max_attempts
        model = ticket.route.model
        while True:
            fut = self.offer_wait(ticket)  # wait_dispatch, inline
            if not fut.done():  # wait_queued, inline: no coroutine of its own
                self._expect(ticket, fut, max(0.0, t0 + timeout - self.core.now()))
                try:
                    await fut
                finally:
                    self._left(ticket)
            target = self.dispatched(ticket, fut)
            sent = self.core.now()
            if ticket.attempts == 1:
                # Observed here, before the write: a loop callback to observe it after
                # (call_soon, a handle per request) cost more than the observation.
                series.queue_wait.observe(sent - t0)
            note_target(request, target, ticket.to_peer)
            try:
                if ticket.to_peer:
                    with upstream_span(request, target, attempt=ticket.attempts, peer=True):
                        return await self.forward_peer(request, ticket, target, raw, intake,
                                                       t0)
                # No span to open without tracing: a shared one that does nothing.
                with upstream_span(request, target, attempt=ticket.attempts) \
                        if self.traced else _NO_SPAN:
                    try:
                        # In the try: a header with a line break is refused here
                        # (ValueError: a 400, never sent upstream).
                        client = self.upstream
                        assert client is not None, "the balancer is not started"
                        up: Reply = await client.post(
                            target, request.path, raw, self.headers.lines_for(request))
                    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                        failure = self.post_failed(target, exc)
                        raise failure from (exc if isinstance(failure, ReplicaFault) else None)
                    try:
                        if up.status < 400 and intake.stream:
                            return await self.relay(request, ticket, target, up, intake,
                                                    t0, sent)
                        body = self.whole_body(target, up)
                        if body is None:  # still arriving: read it as it comes
                            body = await self.read_body(target, up)
                        return self.answer(request, ticket, target, up, body, intake, t0,
                                           sent, series)
                    finally:
                        up.release()
            except ReplicaFault as exc:
                log.warning("attempt %d on %s failed before the first byte: %s",
                            ticket.attempts, target, exc)
                self.core.dispatcher.complete(ticket, self.core.now(), ok=False, replica_fault=True)
                self.core.metrics.retries.labels(target).inc()
                # A new set: tickets share the empty one they start with (Ticket.excluded).
                ticket.excluded = ticket.excluded | {target}
                if (ticket.attempts >= max_attempts
                        or not can_retry(self.core.dispatcher, model, ticket.excluded,
                                         self.core.now(), forwarded=ticket.route.forwarded)):
                    raise UpstreamFailed(
                        f"the request failed on {ticket.attempts} replica(s) before any "
                        f"response: {exc}"
                    ) from None
                self.core.dispatcher.offer(ticket, self.core.now(), front=True)

    def post_failed(self, target: str, exc: Exception) -> Exception:
        """What the upstream POST's ``exc`` is to the client: a reply over the header cap
        or a connection's failure, the replica's fault (another replica is tried); a
        header with a line break (ValueError), the client's 400."""
        if isinstance(exc, ReplyTooLarge):  # its headers: that replica's fault
            self.core.refused(target, exc)
            return ReplicaFault(str(exc))
        if isinstance(exc, aiohttp.ClientError | TimeoutError):
            return ReplicaFault(str(exc) or type(exc).__name__)
        return BadRequest(str(exc))

    def whole_body(self, target: str, up: Reply) -> bytes | None:
        """A whole reply's body when all of it is in hand (a small reply comes with its
        headers: no coroutine), else None; an error status over 500 is the replica's
        fault (its start is the detail: :meth:`read_body` reads it)."""
        if up.status >= 500:
            return None
        try:
            return whole_capped(up, self.cfg.upstream.max_response_body_bytes)
        except ReplyTooLarge as exc:
            raise self._too_large(target, exc) from None

    def _too_large(self, target: str, exc: ReplyTooLarge) -> UpstreamFailed:
        # Not retried: the same request would be as large elsewhere.
        self.core.refused(target, exc)
        return UpstreamFailed(f"{exc} (upstream.max_response_body_bytes)")

    async def read_body(self, target: str, up: Reply) -> bytes:
        """A whole reply's body as it arrives, capped; a 5xx's start as the replica's fault."""
        if up.status >= 500:
            try:  # the start is the detail; the rest is dropped with the connection
                detail = (await read_head(up, 200)).decode(errors="replace")
            except (aiohttp.ClientError, TimeoutError):
                detail = ""
            raise ReplicaFault(f"HTTP {up.status}: {detail}")
        try:
            return await read_capped(up, self.cfg.upstream.max_response_body_bytes)
        except ReplyTooLarge as exc:
            raise self._too_large(target, exc) from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ReplicaFault(str(exc) or type(exc).__name__) from exc

    def answer(self, request: web.Request, ticket: Ticket, target: str, up: Reply,
               body: bytes, intake: Intake, t0: float, sent: float, series: ModelSeries
               ) -> tuple[web.Response, str]:
        """The client's response to a whole reply (an error status, or not streamed), and
        the request's outcome; the dispatcher, the metrics, the policy told."""
        core = self.core
        d = core.dispatcher
        d.first_byte(ticket)
        series.ttft.observe(core.now() - t0)
        ok = up.status < 400
        flags = core.switches.flags  # the running policy's, read once
        records = ok and flags.records
        got_usage, text = reply_record(body, intake.kind) if records else (None, "")
        if ok:
            if records:
                prompt, out, hits = usage_of(None if got_usage is NOT_DECODED else got_usage)
                # The access log's counts too, or it decodes the body again.
                note_usage(request, got_usage)
            else:  # decoded once: the access log's line takes its counts too
                decoded = fast_usage(body)
                note_usage(request, decoded)
                prompt, out, hits = reply_usage(body, decoded)
            request._state[OUTPUT_TOKENS_KEY] = out  # not request[...]: a call fewer
            if flags.timed:
                # No first-token time is observable without streaming: the end only
                # (policies learn TTFT and TPOT from streams).
                d.policy.on_timing(ticket.route, target, RequestTiming(
                    core.now(), sent, None, out, True,
                    prompt or ticket.route.prompt_len, hits))
        d.complete(ticket, core.now(), ok=ok)
        if records:
            core.record_later(ticket.route, target, intake, text)
        resp = reply_response(up.status, body, up)
        return resp, "ok" if ok else f"upstream_{up.status}"

    async def relay(self, request: web.Request, ticket: Ticket, target: str, up: Reply,
                    intake: Intake, t0: float, sent: float
                    ) -> tuple[web.StreamResponse, str]:
        """A streamed reply, relayed (moved elsewhere mid-stream when the policy may)."""
        if self.core.switches.flags.migrates and migratable(intake.body):
            return await self.mover.stream_live(request, ticket, up, t0, sent, intake)
        return await self.streams.stream(request, ticket, up, t0, sent, intake)

    async def forward_peer(self, request: web.Request, ticket: Ticket, peer: str, raw: bytes,
                           intake: Intake, t0: float) -> tuple[web.StreamResponse, str]:
        from skymesh.mesh import PeerError

        assert self.mesh is not None
        route = ticket.route
        stream = intake.stream
        priority, left_ms = "", 0
        batch = self.cfg.tenants.batch_mesh if self.cfg.tenants else None
        if ticket.batch and batch is not None:  # the peer admits it as batch too
            priority = batch.batch_class
            if ticket.batch_due is not None:
                left_ms = max(1, int((ticket.batch_due - self.core.now()) * 1000))
        try:
            call = self.mesh.forward(peer, route.request_id, route.model, request.path, raw,
                                     stream, route.affinity_key,
                                     self.cfg.upstream.read_timeout_s, priority=priority,
                                     batch_deadline_ms=left_ms)
        except PeerError as exc:  # the peer went down after the dispatcher chose it
            raise ReplicaFault(str(exc)) from exc
        async with call:
            try:
                first = await call.__anext__()
            except StopAsyncIteration:
                raise ReplicaFault(f"peer {peer} sent no response") from None
            except PeerError as exc:
                raise ReplicaFault(str(exc)) from exc
            if first.HasField("error") or not first.HasField("head"):
                raise ReplicaFault(f"peer {peer}: {first.error.message or 'bad response'}")
            status, ctype = first.head.status, first.head.content_type
            self.core.dispatcher.first_byte(ticket)
            self.core.metrics.model(route.model).ttft.observe(self.core.now() - t0)
            headers = {"Content-Type": ctype} if ctype else {}
            if (status >= 500 and status != 503) or (status >= 400 or not stream):
                body = bytearray()
                limit = self.cfg.upstream.max_response_body_bytes
                try:
                    async for chunk in call:
                        body += chunk.data
                        if len(body) > limit:  # leaving the block cancels the call
                            self.core.refused(peer, ReplyTooLarge(
                                "body", f"peer {peer}'s response exceeds the {limit}-byte "
                                "cap (upstream.max_response_body_bytes)"))
                            raise UpstreamFailed(f"the peer region's response exceeds "
                                                 f"{limit} bytes")
                except PeerError as exc:
                    raise ReplicaFault(str(exc)) from exc
                if status >= 500:  # the peer could not serve it: try elsewhere
                    raise ReplicaFault(f"peer {peer}: HTTP {status}")
                ok = status < 400
                self.core.dispatcher.complete(ticket, self.core.now(), ok=ok)
                if ok and self.core.switches.flags.records_peer:
                    self.core.record_later(route, peer, intake,
                                      reply_record(bytes(body), intake.kind)[1])
                return (web.Response(status=status, body=bytes(body), headers=headers),
                        "ok" if ok else f"upstream_{status}")
            resp = CoalescedStream(status=status, headers=headers)
            await resp.prepare(request)
            ok = True
            cap = (OutputCapture.for_request(intake.prompt_text, intake.body)
                   if self.core.switches.flags.records_peer else None)
            try:
                async for chunk in call:
                    if chunk.HasField("error"):
                        raise PeerError(peer, chunk.error.message)
                    await resp.write(chunk.data)
                    if cap is not None:
                        cap.add(chunk.data)
            except PeerError as exc:
                ok = False
                await resp.write(broken(f"the peer region failed mid-response: {exc}"))
            self.core.dispatcher.complete(ticket, self.core.now(), ok=ok)
            await resp.write_eof()
            if ok and cap is not None:
                self.core.record_cached(route, peer, intake,
                                        sse_output_text(cap.raw(), intake.kind))
            return resp, "ok" if ok else "upstream_broken"


__all__ = ["Forwarder", "reply_usage", "usage"]
