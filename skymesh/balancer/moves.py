"""Moving a streaming request to another replica mid-response.

Two reasons, one mechanism:

- **Migration** (policies with ``wants_migration``: goodserve). While migratable streams
  are open, :meth:`Mover.recheck` runs every ``policy.migration_interval_s`` and asks the
  policy about each stream that has produced a token; a stream it wants elsewhere moves.
- **Resume** (``retry.resume_streams``): the replica broke mid-stream; the request
  continues on another one instead of ending with an error event.

A move (:meth:`Mover._begin_move`) ends the old attempt, queues a ticket for the rest of
the request at the head of the queue (never back to the source), and closes the old
upstream, which aborts it on the replica and wakes the relay. The relay
(:meth:`Mover.live_loop`) passes whole SSE events one by one, so it can cut over between
two events: it tokenises prompt + generated text on the new replica and sends the
continuation (``skymesh.balancer.migration`` builds it); the client sees one stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
from aiohttp import web

from skymesh.balancer.config import RetryConfig
from skymesh.balancer.dispatch import Ticket
from skymesh.balancer.intake import Intake
from skymesh.balancer.migration import (
    RESUME_ANYWHERE,
    LiveStream,
    SSEFramer,
    continuation_body,
    given_prompt_ids,
    max_output,
    migrated_route,
    sse,
    tokenize_requests,
)
from skymesh.balancer.relay import (
    OUTPUT_TOKENS_KEY,
    TICKET_KEY,
    CoalescedStream,
    ReplicaFault,
    RequestCore,
    UpstreamHeaders,
    broken,
    copy_headers,
    first_chunk,
)
from skymesh.balancer.upstream import Reply, read_head

log = logging.getLogger("skymesh.lb")


class Mover:
    def __init__(self, core: RequestCore, retry: RetryConfig, queue_timeout_s: float,
                 headers: UpstreamHeaders, session: Callable[[], aiohttp.ClientSession]
                 ) -> None:
        self.core = core
        self.retry = retry
        self.queue_timeout_s = queue_timeout_s
        self.headers = headers
        self.session = session  # the balancer's client session, once it has started
        self.live: dict[str, LiveStream] = {}  # migratable streams, by first ticket
        self.recheck_task: asyncio.Task[None] | None = None
        self.migrations = 0
        self.resumed_streams = 0  # continued elsewhere after their replica broke
        self.recent_migrations: deque[dict[str, Any]] = deque(maxlen=32)
        self.recent_resumes: deque[dict[str, Any]] = deque(maxlen=32)

    def upstreams(self) -> Iterator[Reply]:
        """The upstream responses of the open migratable streams."""
        return (st.upstream for st in self.live.values() if st.upstream is not None)

    async def stream_live(self, request: web.Request, ticket: Ticket,
                          up: Reply, t0: float, sent: float, intake: Intake
                          ) -> tuple[web.StreamResponse, str]:
        """``Streams.stream`` for a request the policy may move: whole SSE events are
        relayed one by one, so the periodic re-check (:meth:`recheck`) can cut the stream
        over to another replica between two events."""
        chunks, first = await first_chunk(up)
        now = self.core.now()
        resp = CoalescedStream(status=up.status, headers=copy_headers(up))
        await resp.prepare(request)
        self.core.started(ticket, now, t0)
        st = LiveStream(ticket, intake.kind, intake.body, sent, first_at=now, upstream=up)
        self.core.dispatcher.policy.on_timing(ticket.route, ticket.target or "", st.timing(now))
        if self.recheck_task is None or self.recheck_task.done():
            self.recheck_task = asyncio.get_running_loop().create_task(
                self._recheck_loop(), name="skymesh-migration-recheck")
        framer = SSEFramer()
        return await self.live_loop(request, resp, st, up, chunks, framer, framer.feed(first))

    async def live_loop(self, request: web.Request, resp: web.StreamResponse,
                        st: LiveStream, up: Reply, chunks: AsyncIterator[bytes],
                        framer: SSEFramer, pending: list[bytes]
                        ) -> tuple[web.StreamResponse, str]:
        """Relay ``st`` event by event, cutting over whenever a move (the re-check's) or a
        resume (its replica broke) begins, until it ends; then settle it. A stream that
        arrives with a resume begun (``Streams.stream``'s) starts at the cut-over."""
        key = st.ticket.key
        self.live[key] = st
        ok = True
        try:
            while True:
                if st.moving_to is None:
                    try:
                        await self._relay(resp, st, chunks, framer, pending)
                    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError,
                            TimeoutError) as exc:
                        if not self.resume(st, exc):
                            raise
                    if st.moving_to is None:
                        break
                nxt = await self._cut_over(request, resp, st)
                if not isinstance(nxt, tuple):
                    ok = nxt
                    break
                chunks, first = nxt
                framer = SSEFramer()
                pending = framer.feed(first)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            ok = False
            await resp.write(self.core.broken_stream(st.ticket.target, exc))
        finally:
            self.live.pop(key, None)
            # Whatever ends the relay (the client leaving included), the request's current
            # ticket is the one to settle: a move may have replaced it at any await.
            request[TICKET_KEY] = st.ticket
            if st.upstream is not None and st.upstream is not up:
                if st.done:
                    st.upstream.release()
                else:
                    st.upstream.close()  # client gone: abort the continuation upstream
        request[OUTPUT_TOKENS_KEY] = st.tokens
        cur = st.ticket
        if ok and cur.target is not None:
            self.core.dispatcher.policy.on_timing(cur.route, cur.target,
                                           st.timing(self.core.now(), finished=True))
        self.core.dispatcher.complete(cur, self.core.now(), ok=ok,
                                      replica_fault=not ok and not self.core.switches.closing)
        await resp.write_eof()
        return resp, "ok" if ok else "upstream_broken"

    def resumable(self, ticket: Ticket, intake: Intake, sent: float, first_at: float,
                  up: Reply, relayed: bytes, exc: BaseException) -> LiveStream | None:
        """A stream ``Streams.stream`` relayed as it came, its replica now broken: rebuilt
        from the bytes the client has, with its resume begun. None when it cannot resume:
        the client holds part of an event (nothing can complete it), or resuming is refused
        (it had finished, no attempt or replica left...)."""
        if not relayed.endswith(b"\n\n"):
            return None
        st = LiveStream(ticket, intake.kind, intake.body, sent, first_at=first_at,
                        upstream=up)
        for event in SSEFramer().feed(relayed):
            st.accept(event)
        return st if self.resume(st, exc) else None

    @staticmethod
    async def _relay(resp: web.StreamResponse, st: LiveStream, chunks: AsyncIterator[bytes],
                     framer: SSEFramer, pending: list[bytes]) -> None:
        """Write ``st``'s upstream events to the client until the upstream ends or the
        re-check decides to move the request (it closes the upstream to wake us)."""
        while True:
            for event in pending:
                if st.moving_to is not None:
                    return  # read but not sent: the continuation regenerates it
                out = st.accept(event)
                if out is not None:
                    await resp.write(out)
            if st.moving_to is not None:
                return
            try:
                data = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
                if st.moving_to is not None:
                    return
                raise
            pending = framer.feed(data)

    async def _cut_over(self, request: web.Request, resp: web.StreamResponse, st: LiveStream
                        ) -> tuple[AsyncIterator[bytes], bytes] | bool:
        """Continue ``st`` on the replica the re-check chose: wait for its ticket's
        dispatch, tokenise prompt + generated text there, send the continuation. A target
        that fails before the continuation's first byte is retried like a request's first
        attempt: another replica, at most ``retry.max_attempts`` in all. Returns the chunk
        iterator and first chunk, or whether the stream ended cleanly (True: nothing was
        left to generate; False: an error event went to the client)."""
        attempts = 0
        while True:
            new = st.ticket
            fut: asyncio.Future[None] = new.payload
            if not fut.done():
                try:
                    await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
                except TimeoutError:
                    self.core.dispatcher.cancel(new)
                    await resp.write(broken("no replica could take the migrated request",
                                            "no_capacity"))
                    return False
            target = new.target
            assert target is not None
            attempts += 1
            try:
                return await self._continue_on(request, resp, st, target)
            except (ReplicaFault, aiohttp.ClientError, TimeoutError, StopAsyncIteration,
                    ValueError) as exc:
                detail = str(exc) or type(exc).__name__
                log.warning("migrating %s to %s failed: %s", new.route.request_id, target,
                            detail)
                self.core.dispatcher.complete(new, self.core.now(), ok=False,
                                              replica_fault=True)
                if st.upstream is not None:
                    st.upstream.close()
                    st.upstream = None
                if not self._retry_move(st, target, attempts):
                    await resp.write(broken(f"moving the request to a faster replica "
                                            f"failed: {detail}"))
                    return False

    async def _continue_on(self, request: web.Request, resp: web.StreamResponse,
                           st: LiveStream, target: str
                           ) -> tuple[AsyncIterator[bytes], bytes] | bool:
        """One attempt of :meth:`_cut_over` on ``target`` (its ticket is dispatched)."""
        new = st.ticket
        headers = self.headers.for_request(request)
        headers["Content-Type"] = "application/json"
        prompt_req, gen_req = tokenize_requests(st.body, st.kind, st.generated_text)
        if st.prompt_ids is None:
            st.prompt_ids = (given_prompt_ids(st.body) if prompt_req is None
                             else await self._tokenize(target, prompt_req, headers))
        gen_ids = await self._tokenize(target, gen_req, headers) if st.texts else []
        body = continuation_body(st.body, st.kind, st.prompt_ids, gen_ids)
        if body is None:  # every token the request may have is with the client
            self.core.dispatcher.complete(new, self.core.now(), ok=False)
            await resp.write(sse(st.client_chunk("", "length")) + b"data: [DONE]\n\n")
            st.finished = st.done = True
            return True
        sent = self.core.now()  # the replica's time to first token counts from here
        up = await self.session().post(target + "/v1/completions", json=body, headers=headers)
        st.upstream = up
        if up.status != 200:
            detail = (await read_head(up, 200)).decode(errors="replace")
            raise ReplicaFault(f"HTTP {up.status}: {detail}")
        chunks: AsyncIterator[bytes] = up.content.iter_any()
        first = await chunks.__anext__()
        now = self.core.now()
        st.spliced = True
        st.generated_ids = len(gen_ids)
        st.attempt_tokens = 0
        st.dispatched_at = sent
        st.first_at = now
        st.moving_to = None
        self.core.dispatcher.first_byte(new)
        self.core.pump()
        self.core.dispatcher.policy.on_timing(new.route, target, st.timing(now))
        return chunks, first

    def _retry_move(self, st: LiveStream, failed: str, attempts: int) -> bool:
        """Re-offer a continuation whose target failed, never to that target again; False
        when no attempt or replica is left (or the balancer is closing)."""
        old = st.ticket
        excluded = old.excluded | {failed}
        if (self.core.switches.closing or attempts >= self.retry.max_attempts
                or not self.core.dispatcher.serves_beyond(old.route.model, excluded)):
            return False
        now = self.core.now()
        new = Ticket(old.route_at(now), now)
        new.excluded = excluded
        new.payload = asyncio.get_running_loop().create_future()
        self.core.dispatcher.offer(new, now, front=True)
        st.ticket = new
        self.core.metrics.retries.labels(failed).inc()
        self.core.pump()
        return True

    async def _tokenize(self, target: str, body: dict[str, Any], headers: dict[str, str]
                        ) -> list[int]:
        async with self.session().post(target + "/tokenize", json=body,
                                        headers=headers) as r:
            if r.status != 200:
                detail = (await read_head(r, 200)).decode(errors="replace")
                raise ReplicaFault(f"/tokenize: HTTP {r.status}: {detail}")
            data = await r.json(content_type=None)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ReplicaFault("/tokenize: no token list in the response")
        return tokens

    async def _recheck_loop(self) -> None:
        """GoodServe's periodic re-check; runs while migratable streams are open."""
        while self.live:
            await asyncio.sleep(self.core.dispatcher.policy.migration_interval_s)
            try:
                self.recheck(self.core.now())
            except Exception:  # a bug here must not stop re-checking for good
                log.exception("migration re-check failed")

    def recheck(self, now: float) -> int:
        """Ask the policy about every open migratable stream that has produced a token;
        start moving those it wants elsewhere. Returns how many move."""
        d = self.core.dispatcher
        policy = d.policy
        if not policy.wants_migration:
            return 0
        moved = 0
        for st in list(self.live.values()):
            t = st.ticket
            source = t.target
            if (source is None or t.to_peer or st.moving_to is not None or st.finished
                    or st.first_at is None or st.attempt_tokens < 1):
                continue
            cap = max_output(st.body, st.kind)
            if cap is not None and st.tokens >= cap:
                continue  # its last token is on the way
            dest = policy.migrate(t.route, source, st.timing(now), d.candidates(t, now), d)
            if dest is None or dest == source or dest not in d.targets:
                continue
            self._begin_move(st, source, dest, now)
            moved += 1
        if moved:
            self.core.pump()  # dispatches the re-offered tickets (the policy picks ``dest``)
        return moved

    def resume(self, st: LiveStream, exc: BaseException) -> bool:
        """``retry.resume_streams``: the replica broke mid-stream; start continuing the
        request elsewhere (False: the stream ends with an error event instead)."""
        source = st.ticket.target
        if (not self.retry.resume_streams or self.core.switches.closing or source is None
                or st.ticket.to_peer or st.finished or st.moving_to is not None
                or st.resumes + 1 >= self.retry.max_attempts):
            return False
        if not self.core.dispatcher.serves_beyond(st.ticket.route.model,
                                           st.ticket.excluded | {source}):
            return False
        log.warning("upstream %s broke mid-stream after %d tokens (%s): resuming %s on "
                    "another replica", source, st.tokens, str(exc) or type(exc).__name__,
                    st.ticket.route.request_id)
        st.resumes += 1
        self.resumed_streams += 1
        self.recent_resumes.append({"request_id": st.ticket.route.request_id,
                                    "source": source, "tokens_streamed": st.tokens})
        self.core.metrics.retries.labels(source).inc()
        self._begin_move(st, source, RESUME_ANYWHERE, self.core.now(), fault=True)
        self.core.pump()
        return True

    def _begin_move(self, st: LiveStream, source: str, dest: str, now: float, *,
                    fault: bool = False) -> None:
        """The dispatcher's side of a move, all before the next await: the old attempt
        ends (its slot is free at once), a ticket for the rest of the request goes to the
        head of the queue (never back to ``source``), and the old upstream is closed,
        which aborts it on the replica and wakes the relay. ``fault``: ``source`` broke
        (a resumed stream, not a migration): it counts against its breaker."""
        d = self.core.dispatcher
        old = st.ticket
        route = migrated_route(old.route, st.attempt_tokens, now - st.dispatched_at)
        d.complete(old, now, ok=False, replica_fault=fault)
        new = Ticket(route, now)
        new.excluded = set(old.excluded) | {source}
        new.payload = asyncio.get_running_loop().create_future()
        d.offer(new, now, front=True)
        st.ticket = new
        st.moving_to = dest
        st.moved_from = source
        if st.upstream is not None:
            st.upstream.close()
        if fault:
            return
        st.migrations += 1
        self.migrations += 1
        self.core.metrics.migrations.labels(source, dest).inc()
        self.recent_migrations.append({
            "request_id": route.request_id, "source": source, "target": dest,
            "tokens_streamed": st.tokens, "after_s": round(now - st.dispatched_at, 4)})
        log.info("migrating %s from %s to %s after %d tokens", route.request_id, source,
                 dest, st.tokens)


__all__ = ["Mover"]
