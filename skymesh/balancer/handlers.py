"""The HTTP edge: the generation handler, ``/health``, ``/ready`` and the client keys.

A generation request's path: check the client's key (401) and its in-flight cap (429),
read the body under the size limit (413), parse it (400), check the model (404; a 503 at
once when nothing up serves it, ``skymesh.balancer.overload``), offer it to the
:class:`~skymesh.balancer.dispatch.Dispatcher` (429 when the queue is full), then hand it
to ``skymesh.balancer.forwarding`` (503 after the queue timeout, or as soon as the
model's last replica goes down; Retry-After from the queue's drain rate). One ``finally``
settles the dispatcher's counters whatever happens, including a client that goes away
(aiohttp cancels the handler; closing the upstream response aborts the request on the
replica). Every error the balancer answers itself is an OpenAI-shaped body
(``skymesh.balancer.edge.error_response``).

With a ``tenants`` section (``skymesh.balancer.tenant_gate``), the request is given a
tenant and class, checked against the tenant's limits (429) and waits its turn in the
fair queue before it is offered to the dispatcher.

The request's deadline (``X-SkyMesh-Deadline-Ms`` or its SLO class, ``slo`` in the
config) reaches every policy as ``RouteRequest.deadline_s``. The rest is for predictive
policies (``goodserve``, ``preserve``), and only they pay for it: a predicted output length
(``skymesh.balancer.prediction``) is computed only for policies with
``uses_length_prediction``; ``Policy.on_timing`` is called at the first byte and at the
end only for policies that override it; and for a policy with ``wants_migration`` a
periodic re-check may move a streaming request mid-response (``skymesh.balancer.moves``).
"""

from __future__ import annotations

import asyncio
import hmac
import random
from collections.abc import Callable
from dataclasses import replace

from aiohttp import web

from skymesh.balancer.auth import EdgeFiles
from skymesh.balancer.batch_routing import BATCH_DEADLINE_HEADER, deadline_of, lane_timeout
from skymesh.balancer.config import BalancerConfig
from skymesh.balancer.controller_link import Tally
from skymesh.balancer.dispatch import Ticket
from skymesh.balancer.edge import error_response, request_id
from skymesh.balancer.errors import (
    BadRequest,
    KeyAtCap,
    NoCapacity,
    Overloaded,
    PayloadTooLarge,
    SkyMeshError,
    Unauthorized,
)
from skymesh.balancer.forwarding import Forwarder
from skymesh.balancer.health import HealthTracker
from skymesh.balancer.intake import parse_request, prediction_input, request_deadline, route_request
from skymesh.balancer.kv_feed import ExactScorer
from skymesh.balancer.mesh_link import FORWARDED_HEADER
from skymesh.balancer.metrics import ModelSeries
from skymesh.balancer.migration import max_output
from skymesh.balancer.overload import RetryBook, check_servable
from skymesh.balancer.prediction import LivePredictor
from skymesh.balancer.relay import OUTPUT_TOKENS_KEY, TICKET_KEY, RequestCore
from skymesh.balancer.tenant_gate import Admission, TenantGate
from skymesh.obs.access import note, note_model

# The OpenAI SDKs' (Python, Node) count of the retries a request is on: 0 on the first try.
RETRY_COUNT_HEADER = "x-stainless-retry-count"


class Handlers:
    def __init__(self, core: RequestCore, cfg: BalancerConfig, edge: EdgeFiles,
                 forwarder: Forwarder, health: HealthTracker, peer_secret: str | None,
                 predictor: LivePredictor, tally: Tally, retry_book: RetryBook,
                 drain_retry_s: Callable[[str], float]) -> None:
        self.core = core
        self.cfg = cfg
        self.edge = edge  # client keys (and the TLS files they come with)
        self.forwarder = forwarder
        self.health = health  # /ready
        # Our mesh link's secret, on the requests it replays (None: no mesh).
        self.peer_secret = peer_secret
        self.predictor = predictor
        self.tally = tally  # requests and tokens per model, for the controller
        self.retry_book = retry_book  # the times promised to clients turned away
        self.drain_retry_s = drain_retry_s
        self.rng = random.Random()
        self.in_flight_by_key: dict[bytes, int] = {}  # key digest -> requests here
        # Exact prefix state from KV-cache events (kv_feed.ExactScorer), set by the server.
        self.exact: ExactScorer | None = None
        # Tenants, limits and the fair queue (tenancy), set by the server with ``tenants``.
        self.gate: TenantGate | None = None

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        core = self.core
        d = core.dispatcher
        kind = "chat" if request.path.endswith("/chat/completions") else "completion"
        t0 = core.now()
        model = "?"
        series: ModelSeries | None = None  # the model's metrics, once it is known
        outcome = "error"
        ticket: Ticket | None = None
        holder: bytes | None = None
        gate = self.gate
        admission: Admission | None = None
        # Each step below that a configuration without it skips is tested here, not in
        # a call that returns at once: a call per request each (mesh, keys, SLO, batch).
        forwarded = self.peer_secret is not None and self.forwarded_by_peer(request)
        # The request's items, not request[...]: a Python call fewer each on the lean
        # server's request (its and aiohttp's keep them in ``_state``).
        items = request._state
        try:
            if self.edge.keys.required:  # client keys (they reload): checked, maybe capped
                self.authorize(request, forwarded)
                holder = self._hold_key_slot(request, forwarded)
            raw = self.body_in_hand(request)
            if raw is None:  # still arriving: not a coroutine for the usual small body
                raw = await self.read_body(request)
            intake = parse_request(kind, raw, request.headers)
            check_servable(d, intake.model, self.rng.random(), forwarded=forwarded,
                           now=t0)
            # Only now a metric label: a name a client made up would be a new time
            # series per request (unbounded /metrics and memory).
            model = intake.model
            # Looked up once, carried to the forwarder and the ``finally``.
            series = core.metrics.model(model)
            rid = request_id(request)
            note_model(request, model, rid)  # the access log's
            slo = self.cfg.slo
            deadline_s = None if intake.deadline_ms is None and not slo.classes else \
                request_deadline(intake, request.headers, slo.header, slo.classes,
                                 slo.default)
            timeout = self.cfg.queue.timeout_s
            if deadline_s is not None:
                timeout = min(timeout, deadline_s)
            flags = core.switches.flags
            route = route_request(rid, intake, prefix_keys=flags.keys, deadline_s=deadline_s)
            exact = self.exact
            # No feed configured (the usual case): no coroutine made to find that out.
            if flags.keys and exact is not None and exact.feeds.groups:
                route = await exact.annotate(route, intake)
            if flags.predicts:
                text, turn, history = prediction_input(intake, route.prompt_len)
                route = replace(route, predicted_output_tokens=self.predictor.predict(
                    text, turn, history, route.prompt_len, max_output(intake.body, kind)))
            if forwarded:
                route = replace(route, forwarded=True)
            if gate is not None and not forwarded:  # counted where the client came
                admission = await self._wait_turn(gate, request, model, route.prompt_len, t0,
                                                  timeout)
            ticket = Ticket(route, t0)
            # Set now, so that the ``finally`` reads a key that is there.
            items[TICKET_KEY] = ticket  # a migration replaces it (moves)
            if admission is not None:  # the stagger's (tenants.reserve_stagger)
                ticket.tenant_class = admission.cls
            if self.cfg.tenants is not None:
                self._mark_batch(request, ticket, admission, forwarded, t0)
            if ticket.batch:  # it may wait for the trough, up to its deadline
                timeout = self._lane_timeout(ticket, t0, deadline_s)
            try:
                d.offer(ticket, t0)
            except Overloaded as exc:  # the queue is full: back when it has drained
                if not self._booked_back(request, ticket, t0):
                    raise Overloaded(str(exc), retry_after_s=self.drain_retry_s(model)
                                     ) from None
            finally:
                if gate is not None and admission is not None:
                    gate.settle(admission)
            resp, outcome = await self.forwarder.serve(request, ticket, raw, intake, t0,
                                                       timeout, series)
            return resp
        except SkyMeshError as exc:
            outcome = type(exc).__name__
            return error_response(exc)
        except asyncio.CancelledError:
            # The client left (aiohttp's handler_cancellation): its loss, not our error.
            outcome = "client_disconnected"
            raise
        finally:
            if holder is not None:
                left = self.in_flight_by_key[holder] - 1
                if left:
                    self.in_flight_by_key[holder] = left
                else:
                    del self.in_flight_by_key[holder]
            if ticket is not None:
                cur: Ticket = items[TICKET_KEY]
                # Tested here: a request that completed is out of the queue (no call).
                if cur.queued and d.cancel(cur):
                    outcome = "cancelled"
                if cur.target is not None:  # still attributed: client went away
                    d.complete(cur, core.now(), ok=False)
                core.pump()
            if series is None:  # refused before its model was known (or checked)
                series = core.metrics.model(model)
            series.outcome(outcome).inc()
            series.e2e.observe(core.now() - t0)
            out_tokens = items.get(OUTPUT_TOKENS_KEY, 0) if ticket is not None else 0
            if gate is not None and admission is not None:
                gate.leave(admission, admission.prompt_tokens + out_tokens)
            if ticket is not None:
                self.tally.add(model, ticket.route.prompt_len, out_tokens)
                if core.switches.flags.predicts and outcome == "ok":
                    self.predictor.observe(ticket.route.prompt_len, out_tokens)

    async def _wait_turn(self, gate: TenantGate, request: web.Request, model: str,
                         prompt_tokens: int, t0: float, timeout: float) -> Admission:
        """The request's tenant and class, its limits (429), and its turn in the fair
        queue (503 at the queue timeout, as in the dispatcher's queue)."""
        digest = self.edge.keys.digest_of(request.headers.get("Authorization"))
        tenant, cls = gate.classify(digest, request.headers, request.remote)
        note(request, tenant=tenant, priority=cls)  # the access log's, refused or not
        adm = gate.admit(tenant, cls, model, prompt_tokens, request_id(request))
        batch = self.cfg.tenants.batch_mesh if self.cfg.tenants else None
        if batch is not None and cls == batch.batch_class:
            return adm  # it waits in the dispatcher's batch lane instead (_mark_batch)
        try:
            if not await gate.wait_turn(adm, max(0.0, t0 + timeout - self.core.now())):
                raise NoCapacity(f"no replica could take the request within {timeout:.1f} s",
                                 retry_after_s=self.drain_retry_s(model))
        except BaseException:
            gate.leave(adm, 0)
            raise
        return adm

    def _mark_batch(self, request: web.Request, ticket: Ticket, adm: Admission | None,
                    forwarded: bool, t0: float) -> None:
        """Batch across the mesh: a request of the batch class (a forwarded one: as its
        origin said) waits in the dispatcher's batch lane, with its deadline."""
        ten = self.cfg.tenants
        if ten is None or ten.batch_mesh is None:
            return
        batch = ten.batch_mesh
        if forwarded:
            cls = (request.headers.get(ten.priority_header) or "").strip().lower()
            if cls == batch.batch_class:
                # The access log's: batch here too (its tenant is counted at its origin).
                note(request, tenant="-", priority=cls)
        else:
            cls = adm.cls if adm is not None else ""
        if cls != batch.batch_class:
            return
        default = batch.deadline_h * 3600.0 if batch.deadline_h is not None else None
        try:
            deadline = deadline_of(request.headers.get(BATCH_DEADLINE_HEADER), default)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        ticket.batch = True
        ticket.batch_due = None if deadline is None else t0 + deadline

    def _lane_timeout(self, ticket: Ticket, t0: float, slo_deadline_s: float | None) -> float:
        batch = self.cfg.tenants.batch_mesh if self.cfg.tenants is not None else None
        assert batch is not None  # a ticket is batch only with a batch lane
        due = None if ticket.batch_due is None else ticket.batch_due - t0
        timeout = lane_timeout(due, self.cfg.queue.timeout_s, batch.max_wait_h * 3600.0)
        return timeout if slo_deadline_s is None else min(timeout, slo_deadline_s)

    def _booked_back(self, request: web.Request, ticket: Ticket, now: float) -> bool:
        """Queue, past the queue's cap (by at most the cap again), a retry that found it
        full when a client booked to come back is due (``overload.RetryBook``): the
        Retry-After it was given is kept even when the drain rate was read high.

        A retry is what the OpenAI SDKs mark as one (``x-stainless-retry-count`` >= 1), so
        that new requests under sustained overload do not take the places booked for the
        clients told to come back. A client can claim to be a retry; it then takes at most
        a place booked for another, never more than the bookings."""
        d = self.core.dispatcher
        if not _is_retry(request) or d.queued >= 2 * d.max_queue \
                or not self.retry_book.claim(now):
            return False
        d.offer(ticket, now, beyond=d.max_queue)
        self.core.metrics.booked_admits.inc()
        return True

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "region": self.cfg.region})

    async def handle_ready(self, request: web.Request) -> web.Response:
        health = self.health
        healthy = health.healthy_count()
        status = 200 if healthy else 503
        return web.json_response({"ready": bool(healthy), "healthy_replicas": healthy,
                                  "replicas": len(health.replicas)}, status=status)

    # -- client keys ---------------------------------------------------------------------
    def forwarded_by_peer(self, request: web.Request) -> bool:
        """Replayed by our own mesh link (it carries this process's random secret): such
        a request skips the client key check, so the comparison takes constant time."""
        if self.peer_secret is None:
            return False
        given = request.headers.get(FORWARDED_HEADER)
        return given is not None and hmac.compare_digest(
            given.encode("utf-8", "surrogateescape"), self.peer_secret.encode())

    def authorize(self, request: web.Request, forwarded: bool) -> None:
        keys = self.edge.keys
        if keys.required and not forwarded and \
                not keys.allows(request.headers.get("Authorization")):
            raise Unauthorized("a valid API key is required: send it as "
                               "'Authorization: Bearer KEY'")

    def refused(self, request: web.Request) -> web.Response | None:
        """The 401 for a request to a guarded route other than generation, or None."""
        try:
            self.authorize(request, self.forwarded_by_peer(request))
        except Unauthorized as exc:
            return error_response(exc)
        return None

    def _hold_key_slot(self, request: web.Request, forwarded: bool) -> bytes | None:
        """Count the request against its key's ``auth.max_in_flight_per_key``; returns the
        key's digest to release, or None when nothing is counted. A peer's forwarded
        requests were counted at the balancer their client reached."""
        cap = self.cfg.auth.max_in_flight_per_key
        if cap is None or not self.edge.keys.required or forwarded:
            return None
        digest = self.edge.keys.digest_of(request.headers.get("Authorization"))
        if digest is None:
            return None
        n = self.in_flight_by_key.get(digest, 0)
        if n >= cap:
            raise KeyAtCap(f"this API key already has {n} requests in flight here "
                           f"(auth.max_in_flight_per_key); retry when one ends",
                           retry_after_s=1.0)
        self.in_flight_by_key[digest] = n + 1
        return digest

    def body_in_hand(self, request: web.Request) -> bytes | None:
        """The body when the whole of it came with the headers (small JSON bodies do),
        checked as :meth:`read_body` checks it; None when more is to come."""
        limit = self.cfg.limits.max_body_bytes
        length = request.content_length  # aiohttp's parses the header on each read
        if length is not None and length > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        content = request.content
        if not content.is_eof():
            return None
        # Taken without the async iteration, which is TTFT at low request rates.
        return _checked_body(content.read_nowait(), limit)

    async def read_body(self, request: web.Request) -> bytes:
        raw = self.body_in_hand(request)
        if raw is not None:
            return raw
        limit = self.cfg.limits.max_body_bytes
        buf = bytearray()
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        return _checked_body(bytes(buf), limit)


def _checked_body(raw: bytes, limit: int) -> bytes:
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    if not raw:
        raise BadRequest("request body is empty")
    return raw


def _is_retry(request: web.Request) -> bool:
    count = request.headers.get(RETRY_COUNT_HEADER, "")
    return count.isascii() and count.isdigit() and count.lstrip("0") != ""  # >= 1


__all__ = ["Handlers"]
