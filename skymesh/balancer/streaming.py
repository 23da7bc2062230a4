"""Relaying a streamed response to the client, chunk by chunk, and ending open streams
cleanly at shutdown.

The client's response is prepared only when the replica's first bytes are here (a failure
before them is retried elsewhere by ``skymesh.balancer.forwarding``); from then on the
client has bytes and a break upstream ends the stream with an SSE error event and
``[DONE]``, unless ``retry.resume_streams`` lets ``skymesh.balancer.moves`` continue it on
another replica from the bytes the client has. Output tokens are counted from the SSE
events (one per token in vLLM's and SGLang's streams), for telemetry and policies.

A client can be gone when a write to it fails rather than by cancelling the handler: its
connection closed in the same turn of the loop as the replica's bytes came in. That ends
the relay quietly (a debug line, ``skymesh_client_disconnects_total{phase}``, the access
line's ``disconnected``), not as a broken upstream nor with aiohttp's ERROR traceback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import aiohttp
from aiohttp import web

from skymesh.balancer.dispatch import Ticket
from skymesh.balancer.intake import Intake
from skymesh.balancer.migration import SSEFramer, migratable
from skymesh.balancer.moves import Mover
from skymesh.balancer.output_text import OutputCapture, sse_output_text
from skymesh.balancer.relay import (
    OUTPUT_TOKENS_KEY,
    CoalescedStream,
    RequestCore,
    copy_headers,
    first_chunk,
)
from skymesh.balancer.upstream import Reply, UpstreamReply
from skymesh.obs.access import note
from skymesh.policies.base import RequestTiming

log = logging.getLogger("skymesh.lb")
# retry.resume_streams: the most bytes of one stream kept to resume it (a 4,096-token
# vLLM stream is about 1 MB).
RESUME_BYTES = 2 << 20


class Streams:
    def __init__(self, core: RequestCore, mover: Mover) -> None:
        self.core = core
        self.mover = mover  # continues a stream whose replica broke (resume_streams)
        # Open streams that are not migratable, and the replica each is on.
        self.open: dict[Reply, str] = {}
        self._shutdown_task: asyncio.Task[None] | None = None

    async def _open_stream(self, request: web.Request, ticket: Ticket,
                             resp: web.StreamResponse, first: bytes, first_at: float,
                             t0: float) -> None:
        """Answer the client with the upstream's status, headers and first bytes, then
        count the request as started. From here on the client has bytes: no more retries.

        The bookkeeping comes after the write: it is not needed to relay the first token,
        and at low request rates every step before that write is TTFT (each costs several
        times its warm-cache time when the balancer wakes from idle)."""
        await resp.prepare(request)
        await resp.write(first)
        self.core.started(ticket, first_at, t0)

    def _client_gone(self, request: web.Request, ticket: Ticket, phase: str,
                     exc: ConnectionResetError) -> str:
        """A write to the client failed: it left. Not the replica's fault, not an error
        of ours; the handler ends normally (aiohttp's own end of the response then fails
        quietly)."""
        log.debug("client left during a stream from %s (%s): %s", ticket.target, phase, exc)
        self.core.metrics.client_left[phase].inc()
        note(request, left=True)
        self.core.dispatcher.complete(ticket, self.core.now(), ok=False)
        return "client_disconnected"

    async def stream(self, request: web.Request, ticket: Ticket, up: Reply,
                     t0: float, sent: float, intake: Intake
                     ) -> tuple[web.StreamResponse, str]:
        flags = self.core.switches.flags
        chunks, first = await first_chunk(up)
        first_at = self.core.now()
        resp = CoalescedStream(status=up.status, headers=copy_headers(up))
        try:
            await self._open_stream(request, ticket, resp, first, first_at, t0)
        except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError too
            return resp, self._client_gone(request, ticket, "first_chunk", exc)
        target = ticket.target or ""
        if flags.timed:
            self.core.dispatcher.policy.on_timing(ticket.route, target, RequestTiming(
                first_at, sent, first_at, 0, False, ticket.route.prompt_len))
        ok = True
        # One SSE event per generated token in vLLM's and SGLang's streams (bar the role
        # chunk and [DONE]): a count good enough for demand telemetry, and cheap.
        events = first.count(b"data: ")
        cap = (OutputCapture.for_request(intake.prompt_text, intake.body)
               if flags.records else None)
        if cap is not None:
            cap.add(first)
        # retry.resume_streams: what the client has, to rebuild the stream if the replica
        # breaks (up to RESUME_BYTES; a longer stream is not resumed). Nothing is parsed
        # unless that happens.
        relayed = bytearray(first) if flags.resumes and migratable(intake.body) else None
        self.open[up] = target
        try:
            async for chunk in chunks:
                events += chunk.count(b"data: ")
                try:
                    await resp.write(chunk)
                except ConnectionResetError as exc:  # a ClientConnectionError: not upstream
                    return resp, self._client_gone(request, ticket, "mid_stream", exc)
                if cap is not None:
                    cap.add(chunk)
                if relayed is not None:
                    relayed += chunk
                    if len(relayed) > RESUME_BYTES:
                        relayed = None
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            st = None if relayed is None else self.mover.resumable(
                ticket, intake, sent, first_at, up, bytes(relayed), exc)
            if st is not None:
                self.open.pop(up, None)
                return await self.mover.live_loop(request, resp, st, up, chunks, SSEFramer(), [])
            ok = False
            try:
                await resp.write(self.core.broken_stream(ticket.target, exc))
            except ConnectionResetError as gone:
                return resp, self._client_gone(request, ticket, "mid_stream", gone)
        finally:
            self.open.pop(up, None)
        # Events that carry no token: [DONE], the chat role chunk, the usage chunk.
        opts = intake.body.get("stream_options")
        extra = 1 + (intake.kind == "chat") + (isinstance(opts, dict)
                                                and bool(opts.get("include_usage")))
        tokens = max(0, events - extra)
        request[OUTPUT_TOKENS_KEY] = tokens
        if ok and flags.timed:
            self.core.dispatcher.policy.on_timing(ticket.route, target, RequestTiming(
                self.core.now(), sent, first_at, tokens, True, ticket.route.prompt_len))
        self.core.dispatcher.complete(ticket, self.core.now(), ok=ok,
                               replica_fault=not ok and not self.core.switches.closing)
        try:
            await resp.write_eof()
        except ConnectionResetError as exc:  # every byte was relayed: only the end is lost
            self._client_gone(request, ticket, "end", exc)  # (already completed)
        if ok and cap is not None:
            self.core.record_cached(ticket.route, target, intake,
                                       sse_output_text(cap.raw(), intake.kind))
        return resp, "ok" if ok else "upstream_broken"

    def cut_stalled(self, down: set[str], now: float, idle_s: float) -> int:
        """End the open streams (plain and migratable) on the replicas in ``down`` that
        have had no bytes for ``idle_s``: closing the upstream wakes the relay, which
        sends the error event or resumes elsewhere. Returns how many were cut."""
        on = [*self.open.items(),
              *((st.upstream, st.ticket.target or "") for st in self.mover.live.values()
                if st.upstream is not None)]
        cut = stalled(((up, target, _last_bytes(up, now)) for up, target in on),
                      down, now, idle_s)
        why = f"the replica is marked down and sent nothing for {idle_s:g} s"
        for up, target in cut:
            log.warning("ending a stream on %s: %s", target, why)
            self.core.metrics.replica_limits.labels(target, "stalled_stream").inc()
            if isinstance(up, UpstreamReply):
                up.close(why)
            else:
                up.close()
        return len(cut)

    def cut_after(self, grace_s: float) -> None:
        """Streams still running ``grace_s`` from now end with an SSE error and [DONE]
        (closing their upstream wakes the relay) before the server cancels handlers: a
        client must never see a stream cut short without being told."""

        async def cut() -> None:
            await asyncio.sleep(grace_s)
            ups = [*self.open, *self.mover.upstreams()]
            if ups:
                log.warning("shutting down: ending %d open stream(s)", len(ups))
            for up in ups:
                up.close()

        self._shutdown_task = asyncio.get_running_loop().create_task(cut())


def _last_bytes(up: Reply, now: float) -> float | None:
    """When ``up`` last had bytes from its replica; ``now`` while its reading is paused
    (the client is the slow one); None when the reply does not say (aiohttp's)."""
    if not isinstance(up, UpstreamReply):
        return None
    return now if up.reading_paused else up.last_data_at


def stalled(streams: Iterable[tuple[Reply, str, float | None]], down: set[str], now: float,
            idle_s: float) -> list[tuple[Reply, str]]:
    """The streams, each (upstream, its replica, when it last had bytes or None when not
    known), that are on a replica in ``down`` and idle for ``idle_s`` at ``now``. One still
    sending bytes goes on: its replica is evidently alive, whatever its probes say."""
    return [(up, target) for up, target, last in streams
            if target in down and (last is None or now - last >= idle_s)]


__all__ = ["RESUME_BYTES", "Streams", "stalled"]
