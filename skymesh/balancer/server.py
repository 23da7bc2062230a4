"""``skymesh-lb``'s HTTP edge: the OpenAI API in front of a region's replicas.

aiohttp serves and aiohttp's client forwards: measured on this machine with 64
connections and 20 SSE chunks per response, aiohttp server + client proxied 3,006 req/s,
FastAPI + aiohttp client 1,710, FastAPI + httpx 253 (httpx's pool bookkeeping), so httpx
stays off the streaming path.

A request's path: read the body under the size limit (413), parse it (400), check the
model (404; a 503 at once when nothing up serves it, ``skymesh.balancer.overload``), offer
it to the :class:`~skymesh.balancer.dispatch.Dispatcher` (429 when the queue is full),
wait for a dispatch (503 after the queue timeout, or as soon as the model's last replica
goes down; Retry-After from the queue's drain rate), forward the original
bytes to the chosen replica and pass the response through chunk by chunk. A connect
error, timeout or 5xx before the first byte is retried on another replica (at most
``retry.max_attempts`` attempts in all); after the first byte the client gets an SSE error
event and a clean end. One ``finally`` settles the dispatcher's counters whatever happens,
including a client that goes away (aiohttp cancels the handler; closing the upstream
response aborts the request on the replica).

The other routes: ``/v1/models`` (``skymesh.balancer.catalog``), everything the engines
serve that the balancer does not own (``skymesh.balancer.passthrough``); request ids and
the OpenAI-shaped 404/405 are ``skymesh.balancer.edge``'s.

The request's deadline (``X-SkyMesh-Deadline-Ms`` or its SLO class, ``slo`` in the
config) reaches every policy as ``RouteRequest.deadline_s``. The rest is for predictive
policies (``goodserve``, ``preserve``), and only they pay for it: a predicted output length
(``skymesh.balancer.prediction``) is computed only for policies with
``uses_length_prediction``; ``Policy.on_timing`` is called at the first byte and at the
end (dispatch, first-byte and end times, output tokens from the streamed events or
``usage.completion_tokens``) only for policies that override it; and for a policy with
``wants_migration`` a periodic re-check may move a streaming request to another replica
mid-response (``skymesh.balancer.migration``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web

from skymesh.balancer.auth import EdgeFiles, upstream_key
from skymesh.balancer.catalog import ModelCatalog
from skymesh.balancer.config import BalancerConfig, ReplicaConfig
from skymesh.balancer.controller_link import ControllerLink, Tally, fetch_resolver
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.edge import OwnedRoutes, error_response, request_id, stamp_request_id
from skymesh.balancer.errors import (
    BadRequest,
    KeyAtCap,
    NoCapacity,
    Overloaded,
    PayloadTooLarge,
    SkyMeshError,
    Unauthorized,
    UpstreamFailed,
)
from skymesh.balancer.intake import (
    Intake,
    parse_request,
    prediction_input,
    request_deadline,
    route_request,
)
from skymesh.balancer.mesh_link import FORWARDED_HEADER, MeshLink
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.migration import (
    RESUME_ANYWHERE,
    LiveStream,
    SSEFramer,
    continuation_body,
    given_prompt_ids,
    max_output,
    migratable,
    migrated_route,
    sse,
    tokenize_requests,
)
from skymesh.balancer.output_text import (
    OutputCapture,
    cached_text,
    parse_json,
    reply_text,
    sse_output_text,
)
from skymesh.balancer.overload import (
    DrainMeter,
    can_serve,
    check_servable,
    outage,
    retry_after_s,
    stranded,
)
from skymesh.balancer.passthrough import Passthrough
from skymesh.balancer.prediction import LivePredictor
from skymesh.balancer.probe import (
    ProbeParseError,
    ProbeResult,
    ProbeStatusError,
    parse_metrics,
    parse_sglang_load,
)
from skymesh.balancer.upstream import Reply, Upstream
from skymesh.policies import build_policy
from skymesh.policies.base import Policy, RequestTiming, RouteRequest
from skymesh.policies.load import ReplicaLoad
from skymesh.policies.peers import DEFAULT_FORWARDING_RULE
from skymesh.prefix.keys import text_prefix_keys

log = logging.getLogger("skymesh.lb")
# retry.resume_streams: the most bytes of one stream kept to resume it (a 4,096-token
# vLLM stream is about 1 MB).
RESUME_BYTES = 2 << 20

_FORWARD_HEADERS = ("Authorization", "Content-Type", "Accept", "X-Request-Id")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive",
                "content-encoding", "date", "server"}


# Open streams get this long to finish at shutdown, inside the server's 5 s shutdown
# timeout (skymesh.net.serving), so the rest still get their error event before handlers stop.
STREAM_GRACE_S = 3.5
OUTPUT_TOKENS_KEY = "skymesh.output_tokens"  # per-request output count, for telemetry
TICKET_KEY = "skymesh.ticket"  # the request's current ticket, once a migration replaced it


class _ReplicaFault(Exception):
    """The attempt failed in a way that is the replica's fault (retry elsewhere)."""


class ReplicaHealth:
    """Consecutive probe failure/success counting for one replica, and what its last
    probe read (None once a probe failed: /status shows no stale figures)."""

    def __init__(self, cfg: ReplicaConfig) -> None:
        self.cfg = cfg
        self.failures = 0
        self.successes = 0
        self.healthy = False
        self.models: set[str] = set(cfg.models or ())
        self.models_at = -1e18
        self.last: ProbeResult | None = None
        self.last_ok_at: float | None = None  # when the last good probe was sent
        self.error: str | None = None  # why the last probe failed


class Balancer:
    def __init__(self, cfg: BalancerConfig) -> None:
        self.cfg = cfg
        policy = build_policy(cfg.policy.name, cfg.policy.params, rng=random.Random())
        peer_policy = None
        if cfg.mesh is not None and cfg.mesh.forwarding:
            peer_policy = build_policy(cfg.mesh.peer_policy, rng=random.Random())
            if hasattr(peer_policy, "trie"):
                from skymesh.mesh import PeerSnapshot

                # The peer layer's prefix trie is SkyLB's snapshot of what we forwarded to
                # each peer, merged with the prefixes each peer gossips it holds.
                peer_policy.trie = PeerSnapshot()
        self.dispatcher = Dispatcher(
            policy, cfg.pushing.mode, max_outstanding=cfg.pushing.max_outstanding,
            kv_headroom=cfg.pushing.kv_headroom, step_tokens=cfg.pushing.step_tokens,
            hold_s=cfg.pushing.hold_s, window=cfg.pushing.window,
            max_queue=cfg.queue.max_length, breaker_threshold=cfg.breaker.failure_threshold,
            breaker_open_s=cfg.breaker.open_s, peer_policy=peer_policy,
            tau=cfg.mesh.tau if cfg.mesh is not None else 2,
            forwarding_rule=(cfg.mesh.forwarding_rule if cfg.mesh is not None
                             else DEFAULT_FORWARDING_RULE),
            balancing=cfg.mesh.balancing() if cfg.mesh is not None else None,
        )
        self.replicas = {r.url: ReplicaHealth(r) for r in cfg.replicas}
        self.edge = EdgeFiles(cfg.auth, cfg.listen.host, cfg.listen.tls)
        self._in_flight_by_key: dict[bytes, int] = {}  # key digest -> requests here
        key = upstream_key(cfg.upstream.api_key_env)
        self._upstream_auth = {"Authorization": f"Bearer {key}"} if key else {}
        # A client's key is for this balancer: it reaches the replicas only when the
        # balancer checks none and has none of its own (the replicas may check it then).
        self._forward_headers = (
            tuple(h for h in _FORWARD_HEADERS if h != "Authorization")
            if self.edge.keys.required or key else _FORWARD_HEADERS)
        self.metrics = BalancerMetrics()
        self._decision_counters: dict[str, Any] = {}
        self.predictor = LivePredictor(cfg.prediction)
        self._streams: dict[str, LiveStream] = {}  # migratable streams, by first ticket
        self._open_streams: set[Reply] = set()  # the other streams
        self.closing = False
        self._shutdown_task: asyncio.Task[None] | None = None
        self._recheck_task: asyncio.Task[None] | None = None
        self.migrations = 0
        self.resumed_streams = 0  # continued elsewhere after their replica broke
        self.recent_migrations: deque[dict[str, Any]] = deque(maxlen=32)
        self.recent_resumes: deque[dict[str, Any]] = deque(maxlen=32)
        self._policy_flags(policy)
        self.drain = DrainMeter(self.now())  # completions per model: Retry-After
        self._rng = random.Random()
        self._failfast: dict[str, Ticket] = {}  # queued in _wait_dispatch, by ticket key
        self._session: aiohttp.ClientSession | None = None
        self._upstream: Upstream | None = None
        self._prober: asyncio.Task[None] | None = None
        self._reloader: asyncio.Task[None] | None = None
        self.mesh: MeshLink | None = (MeshLink(cfg, self.dispatcher, self._pump)
                                      if cfg.mesh is not None else None)
        if self.mesh is not None:
            self.metrics.watch_mesh(self.mesh)
        self.tally = Tally()
        self.controller: ControllerLink | None = (ControllerLink(cfg.controller, self)
                                                  if cfg.controller is not None else None)
        self._apply_membership()

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "balancer not started"
        return self._session

    async def start(self) -> None:
        up = self.cfg.upstream
        resolver = (None if self.controller is None
                    else fetch_resolver(self.cfg, self.controller.resolver))
        self._session = aiohttp.ClientSession(
            # With a controller, replica names are resolved through its URL policy
            # (fetch_resolver); without one, aiohttp's default resolver as before.
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, resolver=resolver),
            # One session carries every client's requests: a cookie a replica sets for
            # one client must not ride along on the next client's request (and the jar's
            # per-request bookkeeping is on the hot path for nothing).
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=up.connect_timeout_s,
                                          sock_read=up.read_timeout_s),
            auto_decompress=False,
            headers=self._upstream_auth,
        )
        self._upstream = Upstream(connect_timeout_s=up.connect_timeout_s,
                                  read_timeout_s=up.read_timeout_s, resolver=resolver)
        await self.probe_all()
        self._prober = asyncio.create_task(self._probe_loop(), name="skymesh-prober")
        if self.edge.watching:
            self._reloader = asyncio.create_task(self._reload_loop(), name="skymesh-reload")
        if self._predicts:
            self.predictor.start()  # loads in a thread; history predicts meanwhile

    async def bound(self, url: str) -> None:
        """The HTTP edge is listening at ``url``: start peering (it replays forwarded
        requests on that edge)."""
        if self.mesh is not None:
            await self.mesh.start(url)
        if self.controller is not None:
            await self.controller.start(url)

    async def stop(self) -> None:
        if self.controller is not None:
            await self.controller.stop()
        if self.mesh is not None:
            await self.mesh.stop()
        for task in (self._prober, self._reloader, self._recheck_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.predictor.stop()
        if self._upstream is not None:
            await self._upstream.close()
        if self._session is not None:
            await self._session.close()

    def now(self) -> float:
        return time.monotonic()

    # -- membership and probing ----------------------------------------------------------
    def set_replicas(self, replicas: list[ReplicaConfig]) -> None:
        """Replace the replica set (from the controller). Probe state survives for replicas
        that stay; requests in flight on a removed replica finish there."""
        old = self.replicas
        self.replicas = {}
        for rc in replicas:
            h = old.get(rc.url)
            if h is None:
                h = ReplicaHealth(rc)
            elif h.cfg != rc:
                h.cfg = rc
                if rc.models is not None:
                    h.models = set(rc.models)
            self.replicas[rc.url] = h
        added, removed = set(self.replicas) - set(old), set(old) - set(self.replicas)
        if added or removed:
            log.info("membership: +%s -%s", sorted(added), sorted(removed))
        m = self.metrics
        for url in removed:
            for gauge in (m.replica_healthy, m.replica_waiting, m.replica_running,
                          m.replica_in_flight, m.breaker_state):
                with contextlib.suppress(KeyError):
                    gauge.remove(url)
        self._apply_membership()
        if added and self._session is not None:
            asyncio.get_running_loop().create_task(self.probe_all())

    def set_policy(self, name: str, params: dict[str, Any]) -> None:
        """Switch the routing policy live (from the controller)."""
        d = self.dispatcher
        if d.policy.name == name and getattr(self, "_policy_params", {}) == params:
            return
        policy = build_policy(name, params, rng=random.Random())
        d.policy = policy
        d.hold_s = d.hold_s  # re-evaluates whether the new policy can hold requests
        policy.on_membership(sorted(d.targets))
        self._policy_flags(policy)
        if self._predicts and self._session is not None:
            self.predictor.start()
        self._policy_params = dict(params)
        self._decision_counters.clear()
        log.info("policy is now %s %s", name, params or "")

    def _policy_flags(self, policy: Policy) -> None:
        # Decided once per policy: the request path of a policy that uses none of these
        # pays one attribute test for each.
        self._predicts = (policy.uses_length_prediction
                          and self.cfg.prediction.predictor != "none")
        self._timed = type(policy).on_timing is not Policy.on_timing
        self._migrates = policy.wants_migration
        self._resumes = self.cfg.retry.resume_streams
        self._keys = policy.uses_prefix_keys
        # Policies that record what a replica caches after a request get its output too
        # (the reply is kept while relayed, and keyed after the client has it).
        self._records = self._keys and _records_output(policy)
        peer = self.dispatcher.peer_policy
        self._records_peer = self._keys and peer is not None and _records_output(peer)

    def _apply_membership(self) -> None:
        self.dispatcher.set_targets({url: h.models for url, h in self.replicas.items()})
        for url, h in self.replicas.items():
            self.dispatcher.set_healthy(url, h.healthy)

    async def _reload_loop(self) -> None:
        """A rotated keys file or certificate takes effect without a restart."""
        while True:
            await asyncio.sleep(self.cfg.auth.reload_interval_s)
            # On the loop, not in a thread: the SSL context is not to be changed while a
            # handshake reads it. A stat per file, and a small read when one changed.
            self.edge.check()

    async def _probe_loop(self) -> None:
        interval = self.cfg.probe.interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.probe_all()
            except Exception:  # a bug here must not stop probing for good
                log.exception("probe round failed")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(h) for h in self.replicas.values()))
        self._pump()

    async def _probe(self, h: ReplicaHealth) -> None:
        url = h.cfg.url
        sent = self.now()  # the probe shows state as of about now: pushes after it count
        try:
            if h.cfg.kind == "sglang":
                res: ProbeResult = parse_sglang_load(json.loads(await self._fetch(url,
                                                                                  "/get_load")))
            else:
                # Never logged: 55 KB per probe from vLLM.
                res = parse_metrics((await self._fetch(url, "/metrics")).decode(
                    errors="replace"))
            if h.cfg.models is None and sent - h.models_at >= self.cfg.probe.models_interval_s:
                data = json.loads(await self._fetch(url, "/v1/models"))
                h.models = {m["id"] for m in data.get("data", []) if "id" in m}
                h.models_at = sent
                self.dispatcher.set_models(url, h.models)
        except (aiohttp.ClientError, TimeoutError, ProbeParseError, ProbeStatusError,
                ValueError, KeyError, AttributeError) as exc:
            h.successes = 0
            h.failures += 1
            h.last = None
            h.error = str(exc) or type(exc).__name__
            for gauge in (self.metrics.replica_waiting, self.metrics.replica_running):
                with contextlib.suppress(KeyError):
                    gauge.remove(url)
            if h.healthy and h.failures >= self.cfg.probe.failure_threshold:
                h.healthy = False
                log.warning("replica %s unhealthy: %s", url, exc or type(exc).__name__)
                self.dispatcher.set_healthy(url, False)
            self.metrics.replica_healthy.labels(url).set(1 if h.healthy else 0)
            return
        h.failures = 0
        h.successes += 1
        h.last, h.last_ok_at, h.error = res, sent, None
        if not h.healthy and (h.successes >= self.cfg.probe.success_threshold
                              or h.models_at == sent):
            # First contact (models just listed) counts as healthy at once: start-up must
            # not wait for several probe rounds.
            h.healthy = True
            log.info("replica %s healthy", url)
            self.dispatcher.set_healthy(url, True)
        seqs, lag = h.cfg.pushing_limits(self.cfg.pushing, res.max_num_seqs)
        self.dispatcher.on_probe(url, sent, res.waiting, res.running, res.kv_usage,
                                 res.kv_capacity_tokens, max_num_seqs=seqs, metrics_lag_s=lag)
        m = self.metrics
        m.replica_waiting.labels(url).set(res.waiting)
        m.replica_running.labels(url).set(res.running)
        m.replica_healthy.labels(url).set(1 if h.healthy else 0)

    def _probe_status(self, url: str, load: ReplicaLoad) -> dict[str, Any]:
        """/status's probe figures for one replica: null figures after a failed probe, with
        the age of the last good one and the error."""
        h = self.replicas.get(url)
        res = h.last if h is not None else None
        ok_at = h.last_ok_at if h is not None else None
        return {
            "waiting": res.waiting if res is not None else None,
            "running": res.running if res is not None else None,
            "kv_usage": res.kv_usage if res is not None else None,
            "probe_age_s": None if ok_at is None else round(self.now() - ok_at, 3),
            "probe_error": h.error if h is not None else None,
            "unadmitted": load.unadmitted, "max_num_seqs": load.max_num_seqs,
            "metrics_lag_s": load.metrics_lag_s,
        }

    async def _fetch(self, url: str, path: str) -> bytes:
        """A probe's GET, whole, within the probe timeout, on the request path's own lean
        keep-alive pool (aiohttp's client costs several times its CPU per exchange)."""
        assert self._upstream is not None, "balancer not started"
        async with asyncio.timeout(self.cfg.probe.timeout_s):
            reply = await self._upstream.get(url, path, self._upstream_auth)
            try:
                if not 200 <= reply.status < 300:
                    raise ProbeStatusError(f"{path} answered HTTP {reply.status}")
                return await reply.read()
            finally:
                reply.release()

    # -- dispatch ------------------------------------------------------------------------
    def _pump(self) -> None:
        d = self.dispatcher
        if not d.queued:
            return
        loop = asyncio.get_running_loop()
        for ticket in d.pump(self.now()):
            fut: asyncio.Future[None] = ticket.payload
            if not fut.done():
                fut.set_result(None)
            # Counted once the loop comes round, after the request is on its way to the
            # replica: at low rates every step before that write is TTFT.
            loop.call_soon(self._count_decision, ticket.target or "")
        if d.queued and self._failfast:
            self._fail_stranded()

    def _fail_stranded(self) -> None:
        """Queued requests that nothing up can serve any more (the last replica of their
        model went down) get their 503 now, not at the queue timeout."""
        d = self.dispatcher
        for ticket in list(stranded(d, self._failfast)):
            d.cancel(ticket)
            fut: asyncio.Future[None] = ticket.payload
            if not fut.done():
                fut.set_exception(outage(d, ticket.route.model, self._rng.random()))

    def _drain_retry_s(self, model: str) -> float:
        """Retry-After for a request turned away from ``model``'s queue: how long the
        queue takes to drain at its measured rate, jittered."""
        now = self.now()
        return retry_after_s(self.dispatcher.queue_length(model), self.drain.rate(model, now),
                             self._rng.random())

    def _observe_wait(self, model: str, seconds: float) -> None:
        self.metrics.queue_wait.labels(model).observe(seconds)

    def _count_decision(self, target: str) -> None:
        c = self._decision_counters.get(target)
        if c is None:
            c = self._decision_counters[target] = self.metrics.decisions.labels(
                self.dispatcher.policy.name, target)
        c.inc()

    def _refresh_gauges(self) -> None:
        """Dispatcher state into gauges, at scrape time: off the request path."""
        d, m = self.dispatcher, self.metrics
        for tid, t in d.targets.items():
            m.replica_in_flight.labels(tid).set(t.load.in_flight)
            m.breaker_state.labels(tid).set(int(t.breaker.state))
        for model, q in d.queues.items():
            m.queue_length.labels(model).set(len(q))
        if self.mesh is not None:
            states = {"alive": 0, "suspected": 1, "down": 2}
            for v in self.mesh.peer_views():
                m.peer_state.labels(v["id"]).set(states.get(v["liveness"], 2))
                if v["rtt_s"] is not None:
                    m.peer_rtt.labels(v["id"]).set(v["rtt_s"])

    async def _wait_dispatch(self, ticket: Ticket, timeout: float) -> str:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket.payload = fut
        self._pump()
        if not fut.done():
            self._failfast[ticket.key] = ticket
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout)
            except TimeoutError:
                if self.dispatcher.cancel(ticket):
                    raise NoCapacity(
                        f"no replica could take the request within {timeout:.1f} s",
                        retry_after_s=self._drain_retry_s(ticket.route.model),
                    ) from None
            finally:
                self._failfast.pop(ticket.key, None)
        if fut.done():
            fut.result()  # raises the NoHealthyReplica of _fail_stranded
        assert ticket.target is not None
        return ticket.target

    # -- the request path ----------------------------------------------------------------
    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        kind = "chat" if request.path.endswith("/chat/completions") else "completion"
        t0 = self.now()
        model = "?"
        outcome = "error"
        ticket: Ticket | None = None
        holder: bytes | None = None
        forwarded = self._forwarded_by_peer(request)
        try:
            self._authorize(request, forwarded)
            holder = self._hold_key_slot(request, forwarded)
            raw = await self._read_body(request)
            intake = parse_request(kind, raw, request.headers)
            check_servable(self.dispatcher, intake.model, self._rng.random(),
                           forwarded=forwarded)
            # Only now a metric label: a name a client made up would be a new time
            # series per request (unbounded /metrics and memory).
            model = intake.model
            rid = request_id(request)
            slo = self.cfg.slo
            deadline_s = request_deadline(intake, request.headers, slo.header, slo.classes,
                                          slo.default)
            timeout = self.cfg.queue.timeout_s
            if deadline_s is not None:
                timeout = min(timeout, deadline_s)
            route = route_request(rid, intake, prefix_keys=self._keys, deadline_s=deadline_s)
            if self._predicts:
                text, turn, history = prediction_input(intake, route.prompt_len)
                route = replace(route, predicted_output_tokens=self.predictor.predict(
                    text, turn, history, route.prompt_len, max_output(intake.body, kind)))
            if forwarded:
                route = replace(route, forwarded=True)
            ticket = Ticket(route, t0)
            try:
                self.dispatcher.offer(ticket, t0)
            except Overloaded as exc:  # the queue is full: back when it has drained
                raise Overloaded(str(exc), retry_after_s=self._drain_retry_s(model)) from None
            resp, outcome = await self._serve(request, ticket, raw, intake, t0, timeout)
            return resp
        except SkyMeshError as exc:
            outcome = type(exc).__name__
            return error_response(exc)
        finally:
            if holder is not None:
                left = self._in_flight_by_key[holder] - 1
                if left:
                    self._in_flight_by_key[holder] = left
                else:
                    del self._in_flight_by_key[holder]
            if ticket is not None:
                cur: Ticket = request.get(TICKET_KEY, ticket)  # a migration replaces it
                if self.dispatcher.cancel(cur):
                    outcome = "cancelled"
                if cur.target is not None:  # still attributed: client went away
                    self.dispatcher.complete(cur, self.now(), ok=False)
                if cur.attempts:  # it left the queue: the drain rate counts it
                    self.drain.record(model, self.now())
                self._pump()
            self.metrics.requests.labels(model, outcome).inc()
            self.metrics.e2e.labels(model).observe(self.now() - t0)
            if ticket is not None:
                out_tokens = request.get(OUTPUT_TOKENS_KEY, 0)
                self.tally.add(model, ticket.route.prompt_len, out_tokens)
                if self._predicts and outcome == "ok":
                    self.predictor.observe(ticket.route.prompt_len, out_tokens)

    def _forwarded_by_peer(self, request: web.Request) -> bool:
        """Replayed by our own mesh link (it carries this process's random secret): such
        a request skips the client key check, so the comparison takes constant time."""
        if self.mesh is None:
            return False
        given = request.headers.get(FORWARDED_HEADER)
        return given is not None and hmac.compare_digest(
            given.encode("utf-8", "surrogateescape"), self.mesh.secret.encode())

    def _authorize(self, request: web.Request, forwarded: bool) -> None:
        keys = self.edge.keys
        if keys.required and not forwarded and \
                not keys.allows(request.headers.get("Authorization")):
            raise Unauthorized("a valid API key is required: send it as "
                               "'Authorization: Bearer KEY'")

    def _refused(self, request: web.Request) -> web.Response | None:
        """The 401 for a request to a guarded route other than generation, or None."""
        try:
            self._authorize(request, self._forwarded_by_peer(request))
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
        n = self._in_flight_by_key.get(digest, 0)
        if n >= cap:
            raise KeyAtCap(f"this API key already has {n} requests in flight here "
                             f"(auth.max_in_flight_per_key); retry when one ends",
                             retry_after_s=1.0)
        self._in_flight_by_key[digest] = n + 1
        return digest

    def _upstream_headers(self, request: web.Request) -> dict[str, str]:
        """What a request to a replica carries from the client's, plus our own key."""
        headers = {k: v for k in self._forward_headers if (v := request.headers.get(k))}
        headers["X-Request-Id"] = request_id(request)
        headers.update(self._upstream_auth)
        return headers

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.cfg.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        content = request.content
        if content.is_eof():
            # The whole body came with the headers (small JSON bodies do): take it without
            # the async iteration, which is TTFT at low request rates.
            raw = content.read_nowait()
        else:
            buf = bytearray()
            async for chunk in content.iter_any():
                buf += chunk
                if len(buf) > limit:
                    raise PayloadTooLarge(f"request body exceeds {limit} bytes")
            raw = bytes(buf)
        if len(raw) > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        if not raw:
            raise BadRequest("request body is empty")
        return raw

    async def _serve(self, request: web.Request, ticket: Ticket, raw: bytes, intake: Intake,
                     t0: float, timeout: float) -> tuple[web.StreamResponse, str]:
        max_attempts = self.cfg.retry.max_attempts
        model = ticket.route.model
        while True:
            target = await self._wait_dispatch(ticket, max(0.0, t0 + timeout - self.now()))
            sent = self.now()
            if ticket.attempts == 1:  # recorded after the write to the replica, as above
                asyncio.get_running_loop().call_soon(self._observe_wait, model, sent - t0)
            try:
                if ticket.to_peer:
                    return await self._forward_peer(request, ticket, target, raw, intake, t0)
                return await self._forward(request, ticket, target, raw, intake, t0, sent)
            except _ReplicaFault as exc:
                log.warning("attempt %d on %s failed before the first byte: %s",
                            ticket.attempts, target, exc)
                self.dispatcher.complete(ticket, self.now(), ok=False, replica_fault=True)
                self.metrics.retries.labels(target).inc()
                ticket.excluded.add(target)
                if (ticket.attempts >= max_attempts
                        or not can_serve(self.dispatcher, model, ticket.excluded,
                                         forwarded=ticket.route.forwarded)):
                    raise UpstreamFailed(
                        f"the request failed on {ticket.attempts} replica(s) before any "
                        f"response: {exc}"
                    ) from None
                self.dispatcher.offer(ticket, self.now(), front=True)

    async def _forward(self, request: web.Request, ticket: Ticket, target: str, raw: bytes,
                       intake: Intake, t0: float, sent: float
                       ) -> tuple[web.StreamResponse, str]:
        stream = intake.stream
        headers = self._upstream_headers(request)
        headers.setdefault("Content-Type", "application/json")
        assert self._upstream is not None, "balancer not started"
        try:
            up: Reply = await self._upstream.post(target, request.path, raw, headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _ReplicaFault(str(exc) or type(exc).__name__) from exc
        except ValueError as exc:  # a header with a line break: never sent upstream
            raise BadRequest(str(exc)) from None
        try:
            if up.status >= 500:
                detail = (await up.read())[:200].decode(errors="replace")
                raise _ReplicaFault(f"HTTP {up.status}: {detail}")
            model = ticket.route.model
            if up.status >= 400 or not stream:
                try:
                    body = await up.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise _ReplicaFault(str(exc) or type(exc).__name__) from exc
                self.dispatcher.first_byte(ticket)
                self.metrics.ttft.labels(model).observe(self.now() - t0)
                ok = up.status < 400
                reply = parse_json(body) if ok else None
                if ok:
                    prompt, out, hits = _usage(reply)
                    request[OUTPUT_TOKENS_KEY] = out
                    if self._timed:
                        # No first-token time is observable without streaming: the end
                        # only (policies learn TTFT and TPOT from streams).
                        self.dispatcher.policy.on_timing(ticket.route, target, RequestTiming(
                            self.now(), sent, None, out, True,
                            prompt or ticket.route.prompt_len, hits))
                self.dispatcher.complete(ticket, self.now(), ok=ok)
                if ok and self._records:
                    self._record_later(ticket.route, target, intake,
                                       reply_text(reply, intake.kind))
                resp = web.Response(status=up.status, body=body, headers=_copy_headers(up))
                return resp, "ok" if ok else f"upstream_{up.status}"
            if self._migrates and migratable(intake.body):
                return await self._stream_live(request, ticket, up, t0, sent, intake)
            return await self._stream(request, ticket, up, t0, sent, intake)
        finally:
            up.release()

    async def _forward_peer(self, request: web.Request, ticket: Ticket, peer: str, raw: bytes,
                            intake: Intake, t0: float) -> tuple[web.StreamResponse, str]:
        from skymesh.mesh import PeerError

        assert self.mesh is not None
        route = ticket.route
        stream = intake.stream
        try:
            call = self.mesh.forward(peer, route.request_id, route.model, request.path, raw,
                                     stream, route.affinity_key,
                                     self.cfg.upstream.read_timeout_s)
        except PeerError as exc:  # the peer went down after the dispatcher chose it
            raise _ReplicaFault(str(exc)) from exc
        async with call:
            try:
                first = await call.__anext__()
            except StopAsyncIteration:
                raise _ReplicaFault(f"peer {peer} sent no response") from None
            except PeerError as exc:
                raise _ReplicaFault(str(exc)) from exc
            if first.HasField("error") or not first.HasField("head"):
                raise _ReplicaFault(f"peer {peer}: {first.error.message or 'bad response'}")
            status, ctype = first.head.status, first.head.content_type
            self.dispatcher.first_byte(ticket)
            self.metrics.ttft.labels(route.model).observe(self.now() - t0)
            headers = {"Content-Type": ctype} if ctype else {}
            if (status >= 500 and status != 503) or (status >= 400 or not stream):
                body = bytearray()
                try:
                    async for chunk in call:
                        body += chunk.data
                except PeerError as exc:
                    raise _ReplicaFault(str(exc)) from exc
                if status >= 500:  # the peer could not serve it: try elsewhere
                    raise _ReplicaFault(f"peer {peer}: HTTP {status}")
                ok = status < 400
                self.dispatcher.complete(ticket, self.now(), ok=ok)
                if ok and self._records_peer:
                    self._record_later(route, peer, intake,
                                       reply_text(parse_json(bytes(body)), intake.kind))
                return (web.Response(status=status, body=bytes(body), headers=headers),
                        "ok" if ok else f"upstream_{status}")
            resp = _CoalescedStream(status=status, headers=headers)
            await resp.prepare(request)
            ok = True
            cap = (OutputCapture.for_request(intake.prompt_text, intake.body)
                   if self._records_peer else None)
            try:
                async for chunk in call:
                    if chunk.HasField("error"):
                        raise PeerError(peer, chunk.error.message)
                    await resp.write(chunk.data)
                    if cap is not None:
                        cap.add(chunk.data)
            except PeerError as exc:
                ok = False
                err = {"error": {"message": f"the peer region failed mid-response: {exc}",
                                 "type": "server_error", "param": None,
                                 "code": "upstream_failed"}}
                await resp.write(f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode())
            self.dispatcher.complete(ticket, self.now(), ok=ok)
            await resp.write_eof()
            if ok and cap is not None:
                self._record_cached(route, peer, intake, sse_output_text(cap.raw(), intake.kind))
            return resp, "ok" if ok else "upstream_broken"

    async def _first_chunk(self, up: Reply
                           ) -> tuple[AsyncIterator[bytes], bytes, float]:
        """The upstream's first bytes (a failure before them is the replica's: retry), and
        when they came."""
        chunks: AsyncIterator[bytes] = up.content.iter_any()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            raise _ReplicaFault("empty response") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _ReplicaFault(str(exc) or type(exc).__name__) from exc
        return chunks, first, self.now()

    async def _open_stream(self, request: web.Request, ticket: Ticket,
                           up: Reply, first: bytes, first_at: float, t0: float
                           ) -> web.StreamResponse:
        """Answer the client with the upstream's status, headers and first bytes, then
        count the request as started. From here on the client has bytes: no more retries.

        The bookkeeping comes after the write: it is not needed to relay the first token,
        and at low request rates every step before that write is TTFT (each costs several
        times its warm-cache time when the balancer wakes from idle)."""
        resp = _CoalescedStream(status=up.status, headers=_copy_headers(up))
        await resp.prepare(request)
        await resp.write(first)
        self._started(ticket, first_at, t0)
        return resp

    def _started(self, ticket: Ticket, first_at: float, t0: float) -> None:
        """The replica has answered: the request no longer waits to be admitted there."""
        self.dispatcher.first_byte(ticket)
        self._pump()  # a no-op unless requests wait for exactly this
        self.metrics.ttft.labels(ticket.route.model).observe(first_at - t0)

    async def _stream(self, request: web.Request, ticket: Ticket, up: Reply,
                      t0: float, sent: float, intake: Intake
                      ) -> tuple[web.StreamResponse, str]:
        chunks, first, first_at = await self._first_chunk(up)
        resp = await self._open_stream(request, ticket, up, first, first_at, t0)
        target = ticket.target or ""
        if self._timed:
            self.dispatcher.policy.on_timing(ticket.route, target, RequestTiming(
                first_at, sent, first_at, 0, False, ticket.route.prompt_len))
        ok = True
        # One SSE event per generated token in vLLM's and SGLang's streams (bar the role
        # chunk and [DONE]): a count good enough for demand telemetry, and cheap.
        events = first.count(b"data: ")
        cap = (OutputCapture.for_request(intake.prompt_text, intake.body)
               if self._records else None)
        if cap is not None:
            cap.add(first)
        # retry.resume_streams: what the client has, to rebuild the stream if the replica
        # breaks (up to RESUME_BYTES; a longer stream is not resumed). Nothing is parsed
        # unless that happens.
        relayed = bytearray(first) if self._resumes and migratable(intake.body) else None
        self._open_streams.add(up)
        try:
            async for chunk in chunks:
                events += chunk.count(b"data: ")
                await resp.write(chunk)
                if cap is not None:
                    cap.add(chunk)
                if relayed is not None:
                    relayed += chunk
                    if len(relayed) > RESUME_BYTES:
                        relayed = None
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            st = None if relayed is None else self._resumable(
                ticket, intake, sent, first_at, up, bytes(relayed), exc)
            if st is not None:
                self._open_streams.discard(up)
                return await self._live_loop(request, resp, st, up, chunks, SSEFramer(), [])
            ok = False
            await resp.write(self._broken_stream(ticket.target, exc))
        finally:
            self._open_streams.discard(up)
        # Events that carry no token: [DONE], the chat role chunk, the usage chunk.
        opts = intake.body.get("stream_options")
        extra = 1 + (intake.kind == "chat") + (isinstance(opts, dict)
                                                and bool(opts.get("include_usage")))
        tokens = max(0, events - extra)
        request[OUTPUT_TOKENS_KEY] = tokens
        if ok and self._timed:
            self.dispatcher.policy.on_timing(ticket.route, target, RequestTiming(
                self.now(), sent, first_at, tokens, True, ticket.route.prompt_len))
        self.dispatcher.complete(ticket, self.now(), ok=ok,
                                 replica_fault=not ok and not self.closing)
        await resp.write_eof()
        if ok and cap is not None:
            self._record_cached(ticket.route, target, intake,
                                sse_output_text(cap.raw(), intake.kind))
        return resp, "ok" if ok else "upstream_broken"

    def _record_cached(self, route: RouteRequest, target: str, intake: Intake,
                       output: str) -> None:
        """``target`` now caches the request's prompt and ``output``: tell the policy."""
        text = cached_text(intake.prompt_text, intake.body, output)
        if text is not None:
            self.dispatcher.cached(route, target, text_prefix_keys(text))

    def _record_later(self, route: RouteRequest, target: str, intake: Intake,
                      output: str) -> None:
        """:meth:`_record_cached` once the response in hand has been written: keying the
        text is not the client's wait."""
        asyncio.get_running_loop().call_soon(self._record_cached, route, target, intake,
                                             output)

    # -- migration (policies with wants_migration: goodserve) ------------------------------
    async def _stream_live(self, request: web.Request, ticket: Ticket,
                           up: Reply, t0: float, sent: float, intake: Intake
                           ) -> tuple[web.StreamResponse, str]:
        """``_stream`` for a request the policy may move: whole SSE events are relayed
        one by one, so the periodic re-check (:meth:`recheck`) can cut the stream over to
        another replica between two events."""
        chunks, first, now = await self._first_chunk(up)
        resp = _CoalescedStream(status=up.status, headers=_copy_headers(up))
        await resp.prepare(request)
        self._started(ticket, now, t0)
        st = LiveStream(ticket, intake.kind, intake.body, sent, first_at=now, upstream=up)
        self.dispatcher.policy.on_timing(ticket.route, ticket.target or "", st.timing(now))
        if self._recheck_task is None or self._recheck_task.done():
            self._recheck_task = asyncio.get_running_loop().create_task(
                self._recheck_loop(), name="skymesh-migration-recheck")
        framer = SSEFramer()
        return await self._live_loop(request, resp, st, up, chunks, framer, framer.feed(first))

    async def _live_loop(self, request: web.Request, resp: web.StreamResponse,
                         st: LiveStream, up: Reply, chunks: AsyncIterator[bytes],
                         framer: SSEFramer, pending: list[bytes]
                         ) -> tuple[web.StreamResponse, str]:
        """Relay ``st`` event by event, cutting over whenever a move (the re-check's) or a
        resume (its replica broke) begins, until it ends; then settle it. A stream that
        arrives with a resume begun (``_stream``'s) starts at the cut-over."""
        key = st.ticket.key
        self._streams[key] = st
        ok = True
        try:
            while True:
                if st.moving_to is None:
                    try:
                        await self._relay(resp, st, chunks, framer, pending)
                    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError,
                            TimeoutError) as exc:
                        if not self._resume(st, exc):
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
            await resp.write(self._broken_stream(st.ticket.target, exc))
        finally:
            self._streams.pop(key, None)
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
            self.dispatcher.policy.on_timing(cur.route, cur.target,
                                             st.timing(self.now(), finished=True))
        self.dispatcher.complete(cur, self.now(), ok=ok, replica_fault=not ok and not self.closing)
        await resp.write_eof()
        return resp, "ok" if ok else "upstream_broken"

    def _resumable(self, ticket: Ticket, intake: Intake, sent: float, first_at: float,
                   up: Reply, relayed: bytes, exc: BaseException) -> LiveStream | None:
        """A stream ``_stream`` relayed as it came, its replica now broken: rebuilt from
        the bytes the client has, with its resume begun. None when it cannot resume: the
        client holds part of an event (nothing can complete it), or resuming is refused
        (it had finished, no attempt or replica left...)."""
        if not relayed.endswith(b"\n\n"):
            return None
        st = LiveStream(ticket, intake.kind, intake.body, sent, first_at=first_at,
                        upstream=up)
        for event in SSEFramer().feed(relayed):
            st.accept(event)
        return st if self._resume(st, exc) else None

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
                    await asyncio.wait_for(asyncio.shield(fut), self.cfg.queue.timeout_s)
                except TimeoutError:
                    self.dispatcher.cancel(new)
                    await resp.write(_broken("no replica could take the migrated request",
                                             "no_capacity"))
                    return False
            target = new.target
            assert target is not None
            attempts += 1
            try:
                return await self._continue_on(request, resp, st, target)
            except (_ReplicaFault, aiohttp.ClientError, TimeoutError, StopAsyncIteration,
                    ValueError) as exc:
                detail = str(exc) or type(exc).__name__
                log.warning("migrating %s to %s failed: %s", new.route.request_id, target,
                            detail)
                self.dispatcher.complete(new, self.now(), ok=False, replica_fault=True)
                if st.upstream is not None:
                    st.upstream.close()
                    st.upstream = None
                if not self._retry_move(st, target, attempts):
                    await resp.write(_broken(f"moving the request to a faster replica "
                                             f"failed: {detail}"))
                    return False

    async def _continue_on(self, request: web.Request, resp: web.StreamResponse,
                           st: LiveStream, target: str
                           ) -> tuple[AsyncIterator[bytes], bytes] | bool:
        """One attempt of :meth:`_cut_over` on ``target`` (its ticket is dispatched)."""
        new = st.ticket
        headers = self._upstream_headers(request)
        headers["Content-Type"] = "application/json"
        prompt_req, gen_req = tokenize_requests(st.body, st.kind, st.generated_text)
        if st.prompt_ids is None:
            st.prompt_ids = (given_prompt_ids(st.body) if prompt_req is None
                             else await self._tokenize(target, prompt_req, headers))
        gen_ids = await self._tokenize(target, gen_req, headers) if st.texts else []
        body = continuation_body(st.body, st.kind, st.prompt_ids, gen_ids)
        if body is None:  # every token the request may have is with the client
            self.dispatcher.complete(new, self.now(), ok=False)
            await resp.write(sse(st.client_chunk("", "length")) + b"data: [DONE]\n\n")
            st.finished = st.done = True
            return True
        sent = self.now()  # the replica's time to first token counts from here
        up = await self.session.post(target + "/v1/completions", json=body, headers=headers)
        st.upstream = up
        if up.status != 200:
            detail = (await up.read())[:200].decode(errors="replace")
            raise _ReplicaFault(f"HTTP {up.status}: {detail}")
        chunks: AsyncIterator[bytes] = up.content.iter_any()
        first = await chunks.__anext__()
        now = self.now()
        st.spliced = True
        st.generated_ids = len(gen_ids)
        st.attempt_tokens = 0
        st.dispatched_at = sent
        st.first_at = now
        st.moving_to = None
        self.dispatcher.first_byte(new)
        self._pump()
        self.dispatcher.policy.on_timing(new.route, target, st.timing(now))
        return chunks, first

    def _retry_move(self, st: LiveStream, failed: str, attempts: int) -> bool:
        """Re-offer a continuation whose target failed, never to that target again; False
        when no attempt or replica is left (or the balancer is closing)."""
        old = st.ticket
        excluded = old.excluded | {failed}
        if (self.closing or attempts >= self.cfg.retry.max_attempts
                or not self.dispatcher.serves_beyond(old.route.model, excluded)):
            return False
        now = self.now()
        new = Ticket(old.route_at(now), now)
        new.excluded = excluded
        new.payload = asyncio.get_running_loop().create_future()
        self.dispatcher.offer(new, now, front=True)
        st.ticket = new
        self.metrics.retries.labels(failed).inc()
        self._pump()
        return True

    async def _tokenize(self, target: str, body: dict[str, Any], headers: dict[str, str]
                        ) -> list[int]:
        async with self.session.post(target + "/tokenize", json=body, headers=headers) as r:
            if r.status != 200:
                detail = (await r.read())[:200].decode(errors="replace")
                raise _ReplicaFault(f"/tokenize: HTTP {r.status}: {detail}")
            data = await r.json(content_type=None)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise _ReplicaFault("/tokenize: no token list in the response")
        return tokens

    async def _recheck_loop(self) -> None:
        """GoodServe's periodic re-check; runs while migratable streams are open."""
        while self._streams:
            await asyncio.sleep(self.dispatcher.policy.migration_interval_s)
            try:
                self.recheck(self.now())
            except Exception:  # a bug here must not stop re-checking for good
                log.exception("migration re-check failed")

    def recheck(self, now: float) -> int:
        """Ask the policy about every open migratable stream that has produced a token;
        start moving those it wants elsewhere. Returns how many move."""
        d = self.dispatcher
        policy = d.policy
        if not policy.wants_migration:
            return 0
        moved = 0
        for st in list(self._streams.values()):
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
            self._pump()  # dispatches the re-offered tickets (the policy picks ``dest``)
        return moved

    def _resume(self, st: LiveStream, exc: BaseException) -> bool:
        """``retry.resume_streams``: the replica broke mid-stream; start continuing the
        request elsewhere (False: the stream ends with an error event instead)."""
        source = st.ticket.target
        if (not self.cfg.retry.resume_streams or self.closing or source is None
                or st.ticket.to_peer or st.finished or st.moving_to is not None
                or st.resumes + 1 >= self.cfg.retry.max_attempts):
            return False
        if not self.dispatcher.serves_beyond(st.ticket.route.model,
                                             st.ticket.excluded | {source}):
            return False
        log.warning("upstream %s broke mid-stream after %d tokens (%s): resuming %s on "
                    "another replica", source, st.tokens, str(exc) or type(exc).__name__,
                    st.ticket.route.request_id)
        st.resumes += 1
        self.resumed_streams += 1
        self.recent_resumes.append({"request_id": st.ticket.route.request_id,
                                    "source": source, "tokens_streamed": st.tokens})
        self.metrics.retries.labels(source).inc()
        self._begin_move(st, source, RESUME_ANYWHERE, self.now(), fault=True)
        self._pump()
        return True

    def _begin_move(self, st: LiveStream, source: str, dest: str, now: float, *,
                    fault: bool = False) -> None:
        """The dispatcher's side of a move, all before the next await: the old attempt
        ends (its slot is free at once), a ticket for the rest of the request goes to the
        head of the queue (never back to ``source``), and the old upstream is closed,
        which aborts it on the replica and wakes the relay. ``fault``: ``source`` broke
        (a resumed stream, not a migration): it counts against its breaker."""
        d = self.dispatcher
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
        self.metrics.migrations.labels(source, dest).inc()
        self.recent_migrations.append({
            "request_id": route.request_id, "source": source, "target": dest,
            "tokens_streamed": st.tokens, "after_s": round(now - st.dispatched_at, 4)})
        log.info("migrating %s from %s to %s after %d tokens", route.request_id, source,
                 dest, st.tokens)

    def _broken_stream(self, target: str | None, exc: BaseException) -> bytes:
        if self.closing:
            return _broken("the balancer is shutting down; retry the request", "shutting_down")
        log.warning("upstream %s broke mid-stream: %s", target, exc)
        return _broken(f"the replica failed mid-response: {exc}")

    def begin_shutdown(self, grace_s: float) -> None:
        """Streams still running ``grace_s`` from now end with an SSE error and [DONE]
        (closing their upstream wakes the relay) before the server cancels handlers: a
        client must never see a stream cut short without being told."""
        self.closing = True

        async def cut() -> None:
            await asyncio.sleep(grace_s)
            ups = [*self._open_streams,
                   *(st.upstream for st in self._streams.values() if st.upstream is not None)]
            if ups:
                log.warning("shutting down: ending %d open stream(s)", len(ups))
            for up in ups:
                up.close()

        self._shutdown_task = asyncio.get_running_loop().create_task(cut())

    # -- the rest of the API ---------------------------------------------------------------
    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "region": self.cfg.region})

    async def handle_ready(self, request: web.Request) -> web.Response:
        healthy = sum(1 for h in self.replicas.values() if h.healthy)
        status = 200 if healthy else 503
        return web.json_response({"ready": bool(healthy), "healthy_replicas": healthy,
                                  "replicas": len(self.replicas)}, status=status)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        self._refresh_gauges()
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    async def handle_status(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        d = self.dispatcher
        mesh = None
        if self.mesh is not None:
            mesh = {"id": self.mesh.mesh.id, "address": self.mesh.node.address,
                    "forwarding": d.forwarding, "forwarded_out": self.mesh.forwarded_out,
                    "forwarded_in": self.mesh.forwarded_in, "peers": self.mesh.peer_views()}
        return web.json_response({
            "region": self.cfg.region,
            "mesh": mesh,
            "controller": None if self.controller is None else {
                "url": self.controller.cfg.url, "balancer_id": self.controller.balancer_id,
                "registered": self.controller.registered,
                "revision": self.controller.revision, "error": self.controller.last_error},
            "auth": {"keys": len(self.edge.keys.digests),
                     "keys_in_flight": len(self._in_flight_by_key),
                     "reloads": self.edge.reloads, "reload_errors": self.edge.errors},
            "policy": d.policy.name,
            "pushing": d.mode.value,
            "queued": d.queue_length(),
            "prediction": {**self.predictor.status(), "in_use": self._predicts},
            "migrations": {"total": self.migrations, "open_streams": len(self._streams),
                           "recent": list(self.recent_migrations),
                           "resumed": self.resumed_streams,
                           "recent_resumes": list(self.recent_resumes)},
            "replicas": {
                tid: {"healthy": t.healthy, "models": sorted(t.models),
                      **self._probe_status(tid, t.load),
                      "in_flight": t.load.in_flight, "breaker": t.breaker.state.name.lower()}
                for tid, t in d.targets.items()},
        })


def _records_output(policy: Policy) -> bool:
    return type(policy).on_cached is not Policy.on_cached


def _usage(reply: Any) -> tuple[int, int, int | None]:
    """(prompt tokens, completion tokens, cached prompt tokens or None) from a parsed
    non-streamed response's ``usage``; zeros when it has none."""
    try:
        usage = reply.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                int(cached) if cached is not None else None)
    except (ValueError, AttributeError, TypeError):
        return 0, 0, None


def _broken(message: str, code: str = "upstream_failed") -> bytes:
    """The SSE error event and end a client gets after its first byte."""
    err = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


class _CoalescedStream(web.StreamResponse):
    """A streamed response whose headers leave with its first chunk, in one write.

    aiohttp's StreamResponse sends headers on ``prepare``; we prepare only once the
    upstream's first bytes are here, so a separate send would cost a system call and a
    wake-up of the client for nothing. aiohttp's own ``Response`` buffers them this way
    (the same class attribute); if a later aiohttp drops it, headers go out on
    ``prepare`` again, which is only slower."""

    _send_headers_immediately = False


def _copy_headers(up: Reply) -> dict[str, str]:
    return {k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS}


def build_app(cfg: BalancerConfig) -> web.Application:
    # The body limit is enforced by _read_body (a clean 413 in the OpenAI shape); the
    # server's own cap only stops abuse of the other endpoints.
    app = web.Application(client_max_size=cfg.limits.max_body_bytes + 1,
                          handler_args={"max_field_size": 16384})
    lb = Balancer(cfg)
    app["balancer"] = lb
    catalog = ModelCatalog(lb.dispatcher, lambda: lb.session, cfg.probe.timeout_s, lb._refused)
    app.router.add_post("/v1/chat/completions", lb.handle_generate)
    app.router.add_post("/v1/completions", lb.handle_generate)
    app.router.add_get("/v1/models", catalog.handle_list)
    app.router.add_get("/v1/models/{model:.+}", catalog.handle_one)
    app.router.add_get("/health", lb.handle_health)
    app.router.add_get("/ready", lb.handle_ready)
    app.router.add_get("/metrics", lb.handle_metrics)
    app.router.add_get("/status", lb.handle_status)
    # Last: everything else (skymesh.balancer.passthrough); the owned paths answer 405.
    proxy = Passthrough(lb.dispatcher, lambda: lb.session,
                        max_body_bytes=cfg.limits.max_body_bytes,
                        forward_client_auth="Authorization" in lb._forward_headers,
                        refused=lb._refused, owned=OwnedRoutes(app),
                        hidden_headers=frozenset({FORWARDED_HEADER}))
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    app.on_response_prepare.append(stamp_request_id)

    async def on_startup(app: web.Application) -> None:
        await lb.start()

    async def on_shutdown(app: web.Application) -> None:
        lb.begin_shutdown(STREAM_GRACE_S)

    async def on_cleanup(app: web.Application) -> None:
        await lb.stop()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


def balancer_of(app: web.Application) -> Balancer:
    lb: Balancer = app["balancer"]
    return lb


__all__ = ["Balancer", "balancer_of", "build_app"]
