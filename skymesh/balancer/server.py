"""``skymesh-lb``: the :class:`Balancer` object, which builds the aiohttp app and owns the
lifecycle, and the dispatcher's driver (:meth:`Balancer.pump`).

aiohttp serves and aiohttp's client forwards: measured on this machine with 64
connections and 20 SSE chunks per response, aiohttp server + client proxied 3,006 req/s,
FastAPI + aiohttp client 1,710, FastAPI + httpx 253 (httpx's pool bookkeeping), so httpx
stays off the streaming path.

Where things are (each module opens with the details). The rooms of the request path are
built here, each given only the collaborators it uses, never the ``Balancer``; a request
flows one way through them, handlers -> forwarding -> streaming -> moves, and what they
share lives below them all in ``skymesh.balancer.relay``:

- ``skymesh.balancer.handlers``: the HTTP edge: the generation handler (body, parse,
  checks, queue), ``/health``, ``/ready``, client keys;
- ``skymesh.balancer.forwarding``: waiting for a dispatch, forwarding to a replica or a
  peer region, retries before the first byte;
- ``skymesh.balancer.streaming``: relaying a streamed response, and shutdown's cut-off;
- ``skymesh.balancer.moves``: a stream moved to another replica mid-response (policy
  migration, ``retry.resume_streams``);
- ``skymesh.balancer.health`` (state) and ``skymesh.balancer.probing`` (I/O): replica
  health, the one owner of replica state;
- ``skymesh.balancer.status``: ``/status`` and ``/metrics``;
- ``/v1/models`` (``skymesh.balancer.catalog``), everything the engines serve that the
  balancer does not own (``skymesh.balancer.passthrough``); request ids and the
  OpenAI-shaped 404/405 are ``skymesh.balancer.edge``'s.

The app and its middlewares are built by :func:`build_app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any

import aiohttp
from aiohttp import web

from skymesh.balancer.auth import EdgeFiles, upstream_key
from skymesh.balancer.catalog import ModelCatalog
from skymesh.balancer.config import BalancerConfig, ReplicaConfig, TenantsConfig
from skymesh.balancer.controller_link import ControllerLink, Tally, fetch_resolver
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.edge import OwnedRoutes, request_id, stamp_request_id
from skymesh.balancer.errors import NoHealthyReplica, UpstreamFailed
from skymesh.balancer.forwarding import Forwarder
from skymesh.balancer.handlers import Handlers
from skymesh.balancer.health import HealthTracker
from skymesh.balancer.kv_feed import ExactScorer, KVFeeds
from skymesh.balancer.mesh_link import FORWARDED_HEADER, MeshLink
from skymesh.balancer.metrics import BalancerMetrics, TenantQueueDepth
from skymesh.balancer.moves import Mover
from skymesh.balancer.overload import (
    DrainMeter,
    RetryBook,
    breakers_open,
    can_serve,
    dead_retries,
    may_strand,
    stranded,
    stranded_error,
    stranded_line,
)
from skymesh.balancer.passthrough import Passthrough
from skymesh.balancer.prediction import LivePredictor
from skymesh.balancer.probing import Prober
from skymesh.balancer.relay import (
    FORWARD_HEADERS,
    PolicyFlags,
    RequestCore,
    Switches,
    UpstreamHeaders,
)
from skymesh.balancer.status import Status
from skymesh.balancer.streaming import Streams
from skymesh.balancer.tenant_gate import TenantGate
from skymesh.balancer.tenant_push import described, without_fractions
from skymesh.balancer.upstream import Upstream
from skymesh.balancer.workers import pushing_share
from skymesh.common.health import HealthRule
from skymesh.obs.access import install as install_obs
from skymesh.obs.tracing import from_config as tracing_from_config
from skymesh.policies import build_policy
from skymesh.policies.peers import DEFAULT_FORWARDING_RULE

log = logging.getLogger("skymesh.lb")

# Open streams get this long to finish at shutdown, inside the server's 5 s shutdown
# timeout (skymesh.net.serving), so the rest still get their error event before handlers stop.
STREAM_GRACE_S = 3.5


class Balancer:
    def __init__(self, cfg: BalancerConfig, *, workers: int = 1, worker: int = 0) -> None:
        """``workers``: processes serving this balancer's port, this one included
        (skymesh.balancer.workers); each pushes as one balancer of the region.
        ``worker``: this one's index (its tenant demand reports are told apart by it)."""
        self.cfg = cfg
        self.workers = workers
        self.worker = worker
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
            balancers_per_region=pushing_share(cfg.pushing.balancers(), workers),
            # Per replica from its kind at each probe (ReplicaConfig.prefer_queue).
            prefer_queue=cfg.pushing.prefer_queue or 0,
            hold_queue_max=cfg.pushing.hold_queue_max,
        )
        # The only owner of replica state; it publishes membership and health to the
        # dispatcher (here, at once, and on every change).
        self.health = HealthTracker(
            cfg.replicas, HealthRule(cfg.probe.failure_threshold, cfg.probe.success_threshold),
            models_interval_s=cfg.probe.models_interval_s, clock=self.now,
            sink=self.dispatcher)
        self.edge = EdgeFiles(cfg.auth, cfg.listen.host, cfg.listen.tls)
        key = upstream_key(cfg.upstream.api_key_env)
        self.upstream_auth = {"Authorization": f"Bearer {key}"} if key else {}
        # A client's key is for this balancer: it reaches the replicas only when the
        # balancer checks none and has none of its own (the replicas may check it then).
        self.forward_headers = (
            tuple(h for h in FORWARD_HEADERS if h != "Authorization")
            if self.edge.keys.required or key else FORWARD_HEADERS)
        self.metrics = BalancerMetrics()
        self._decision_counters: dict[str, Any] = {}
        # Targets of the decisions made since the last count (_count_decisions).
        self._uncounted: list[str] = []
        self.predictor = LivePredictor(cfg.prediction)
        self.switches = Switches(PolicyFlags.of(policy, peer_policy, cfg))
        self._policy_params: dict[str, Any] | None = None  # as set_policy last installed
        self.drain = DrainMeter()  # the queue's drain rate, and the promises made
        self.retry_book = RetryBook()  # to the clients it turned away: Retry-After
        self.rng = random.Random()
        self.failfast: dict[str, Ticket] = {}  # queued requests that may fail fast, by key
        self._session: aiohttp.ClientSession | None = None
        self._upstream: Upstream | None = None
        self._prober_task: asyncio.Task[None] | None = None
        self._reloader: asyncio.Task[None] | None = None
        self.mesh: MeshLink | None = (MeshLink(cfg, self.dispatcher, self.pump)
                                      if cfg.mesh is not None else None)
        if self.mesh is not None:
            self.metrics.watch_mesh(self.mesh)
            if self.mesh.node.server.guard is not None:  # the peering port's caps
                self.metrics.registry.register(self.mesh.node.server.guard)
        self.tally = Tally()
        self.controller: ControllerLink | None = (
            ControllerLink(cfg.controller, lambda: self.cfg, self.dispatcher, self.health,
                           self.mesh, self.tally, self.set_replicas, self.set_policy,
                           set_tenants=self.set_tenants, tenant_demand=self.tenant_demand,
                           tenants_unreported=self._tenants_unreported, worker=worker)
            if cfg.controller is not None else None)
        # The rooms (see the module docstring), each given only what it uses; a request
        # flows one way: handlers -> forwarder -> streams -> moves.
        core = self.core = RequestCore(self.dispatcher, self.metrics, self.now, self.pump,
                                       self.switches)
        headers = UpstreamHeaders(self.forward_headers, self.upstream_auth)
        self.moves = Mover(core, cfg.retry, cfg.queue.timeout_s, headers, lambda: self.session)
        self.streams = Streams(core, self.moves)
        self.forwarder = Forwarder(core, cfg, headers, None, self.mesh,
                                   self.streams, self.moves, self.failfast, self.drain_retry_s)
        self.handlers = Handlers(core, cfg, self.edge, self.forwarder, self.health,
                                 self.mesh.secret if self.mesh is not None else None,
                                 self.predictor, self.tally, self.retry_book,
                                 self.drain_retry_s)
        self.prober = Prober(core, cfg, self.health, lambda: self.upstream, self.upstream_auth,
                             lambda: self.cfg.pushing, self.streams.cut_stalled)
        self.kv_feeds = KVFeeds(cfg.kv_events)  # engines' KV-cache events (kv_feed)
        self.metrics.registry.register(self.kv_feeds)
        self.kv_exact = self.handlers.exact = ExactScorer(self.kv_feeds)
        if self.mesh is not None:
            self.mesh.feeds = self.kv_feeds  # the heartbeat's exact prefix summary
        if cfg.tenants is not None:
            self.handlers.gate = self._tenant_gate(cfg.tenants)
            if self.handlers.gate.reserve.stagger:  # the dispatcher's filter and its view
                self.dispatcher.stagger = self.handlers.gate.queue.stagger
            if cfg.tenants.batch_mesh is not None:  # batch across the mesh
                d = self.dispatcher
                d.batch_lane = True
                d.batch_reserve = cfg.tenants.batch_mesh.reserve
                d.batch_urgent_s = cfg.tenants.batch_mesh.urgent_h * 3600.0
                d.batch_max_per_replica = cfg.tenants.batch_mesh.max_per_replica
                d.batch_room_per_replica = cfg.tenants.batch_mesh.room_per_replica
                fair = self.handlers.gate.queue  # batch itself skips it: better classes
                d.better_waiting = lambda model: fair.waiting
        self.status = Status(core, cfg.region, self.health, self.edge, self.handlers,
                             self.predictor, self.moves, self.mesh, self.controller,
                             kv_figures=self.kv_exact.figures)

    # What the rooms read as it is now (a live policy switch, shutdown).
    @property
    def flags(self) -> PolicyFlags:
        return self.switches.flags

    @property
    def closing(self) -> bool:
        return self.switches.closing

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "balancer not started"
        return self._session

    @property
    def upstream(self) -> Upstream:
        assert self._upstream is not None, "balancer not started"
        return self._upstream

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
            headers=self.upstream_auth,
        )
        self._upstream = Upstream(connect_timeout_s=up.connect_timeout_s,
                                  read_timeout_s=up.read_timeout_s, resolver=resolver,
                                  max_header_bytes=up.max_response_header_bytes)
        self.forwarder.upstream = self._upstream  # the request path's, from now on
        await self.prober.probe_all()
        self._prober_task = asyncio.create_task(self.prober.loop(), name="skymesh-prober")
        self.kv_feeds.set_replicas(self.cfg.replicas)
        self.kv_exact.preload()
        if self.edge.watching:
            self._reloader = asyncio.create_task(self._reload_loop(), name="skymesh-reload")
        if self.flags.predicts:
            self.predictor.start()  # loads in a thread; history predicts meanwhile

    async def bound(self, url: str) -> None:
        """The HTTP edge is listening at ``url``: start peering (it replays forwarded
        requests on that edge)."""
        if self.mesh is not None:
            await self.mesh.start(url)
        if self.controller is not None:
            await self.controller.start(url)

    def begin_shutdown(self, grace_s: float) -> None:
        self.switches.closing = True
        self.streams.cut_after(grace_s)

    async def stop(self) -> None:
        if self.controller is not None:
            await self.controller.stop()
        if self.mesh is not None:
            await self.mesh.stop()
        for task in (self._prober_task, self._reloader, self.moves.recheck_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.kv_feeds.stop()
        await self.predictor.stop()
        if self._upstream is not None:
            await self._upstream.close()
        if self._session is not None:
            await self._session.close()

    # The clock itself, not a method that calls it: the request path reads it about six
    # times a request (through ``RequestCore.now`` too), a Python frame each.
    now = staticmethod(time.monotonic)

    async def _reload_loop(self) -> None:
        """A rotated keys file or certificate takes effect without a restart."""
        while True:
            await asyncio.sleep(self.cfg.auth.reload_interval_s)
            # On the loop, not in a thread: the SSL context is not to be changed while a
            # handshake reads it. A stat per file, and a small read when one changed.
            self.edge.check()

    # -- live changes (controller, reload) -----------------------------------------------
    def set_replicas(self, replicas: list[ReplicaConfig]) -> None:
        """Replace the replica set (from the controller). Probe state survives for replicas
        that stay; requests in flight on a removed replica finish there."""
        added, removed = self.health.set_replicas(replicas)
        if self._session is not None:  # started: the feeds need the running loop
            self.kv_feeds.set_replicas(replicas)
        for url in removed:
            self.metrics.forget_replica(url)
            self._decision_counters.pop(url, None)
        if added and self._session is not None:
            asyncio.get_running_loop().create_task(self.prober.probe_all())

    def set_policy(self, name: str, params: dict[str, Any]) -> None:
        """Switch the routing policy live (from the controller)."""
        d = self.dispatcher
        if d.policy.name == name and (self._policy_params or {}) == params:
            return
        policy = build_policy(name, params, rng=random.Random())
        d.policy = policy
        d.hold_s = d.hold_s  # re-evaluates whether the new policy can hold requests
        policy.on_membership(sorted(d.targets))
        self.switches.flags = PolicyFlags.of(policy, d.peer_policy, self.cfg)
        if self.switches.flags.predicts and self._session is not None:
            self.predictor.start()
        self._policy_params = dict(params)
        self._decision_counters.clear()
        log.info("policy is now %s %s", name, params or "")

    def _tenant_gate(self, tenants: TenantsConfig) -> TenantGate:
        gate = TenantGate(
            tenants, share=pushing_share(self.cfg.pushing.balancers(), self.workers),
            capacity=self.cfg.queue.max_length, queued=self.dispatcher.queue_length,
            metrics=self.metrics.enable_tenants(), clock=self.now,
            slots=self.dispatcher.slots, workers=self.workers)
        # Pairs read at scrape time: tenants pushed by the controller come and go.
        self.metrics.registry.register(TenantQueueDepth(
            lambda: [(t.name, c) for t in gate.book.tenants.values() for c in t.classes],
            gate.queue.depths))
        return gate

    def set_tenants(self, pushed: list[dict[str, Any]]) -> None:
        """The controller's tenants and this balancer's shares of their limits
        (skymesh.balancer.tenant_push). Without a ``tenants`` section the gate is made at
        the first tenant pushed, with that section's defaults, and then stays."""
        gate = self.handlers.gate
        if gate is None:
            if not pushed:
                return
            gate = self.handlers.gate = self._tenant_gate(TenantsConfig())
        before = [without_fractions(t) for t in gate.pushed or []]
        if gate.set_pushed(pushed):
            # Fractions follow the traffic at every telemetry report: a line only when
            # the tenants themselves change.
            log.log(logging.INFO if before != [without_fractions(t) for t in pushed]
                    else logging.DEBUG, "tenants from the controller: %s", described(pushed))

    def _tenants_unreported(self, n: int) -> None:
        self.metrics.enable_tenants().unreported.inc(n)

    def tenant_demand(self) -> dict[str, tuple[float, float]]:
        """The smoothed demand offered here per tenant the controller pushed (what the
        controller splits their limits by); lb.yaml's own tenants are not its to split."""
        gate = self.handlers.gate
        if gate is None or not gate.pushed:
            return {}
        mine = {t.get("name") for t in gate.pushed}
        return {name: rate for name, rate in gate.limiter.demand.rates(self.now()).items()
                if name in mine}

    # -- the dispatcher's driver ---------------------------------------------------------
    def pump(self) -> None:
        d = self.dispatcher
        # Tested here: most pumps at a request's end find the queue empty (no call).
        if d.queued:
            self._pump()
        elif self.drain.backlog_since is not None:  # emptied by cancels: the clock stops
            self.drain.observe(self.now(), 0, 0)
        gate = self.handlers.gate
        if gate is not None and gate.queue.waiting:  # the tenants' fair queue, behind it
            gate.release(self.now())
            if gate.queue.waiting:
                d, now = self.dispatcher, self.now()
                gate.fail_stranded(
                    lambda m: can_serve(d, m) and breakers_open(d, m, now) is None,
                    lambda m: stranded_error(d, m, now, self.rng.random()))

    def _pump(self) -> None:
        """:meth:`pump`'s pass over a queue that holds requests."""
        d = self.dispatcher
        loop = self.core.loop
        now = self.now()
        sent = d.pump(now)
        if sent or not d.queued or self.drain.backlog_since is None:
            # A pass that sends nothing out of a standing backlog changes no reading of
            # the meter (its weights compose: aging to now and later equals aging to
            # later), so most pumps under a standing queue skip it.
            self.drain.observe(now, len(sent), d.queued)
        if sent:
            # Counted once the loop comes round, after the request is on its way to the
            # replica: at low rates every step before that write is TTFT. One callback
            # counts every decision made until it runs (a handle per request cost more).
            uncounted = self._uncounted
            if not uncounted:
                loop.call_soon(self._count_decisions)
            for ticket in sent:
                fut: asyncio.Future[None] = ticket.payload
                if not fut.done():
                    fut.set_result(None)
                uncounted.append(ticket.target or "")
        if d.queued and self.failfast and may_strand(d):
            self._fail_stranded()

    def _fail_stranded(self) -> None:
        """Queued requests that nothing up can serve any more (the last replica of their
        model went down, or the breaker of the last one up opened) get their 503 now, not
        at the queue timeout; queued retries with no replica left but those behind an
        open breaker, their 502."""
        d, now = self.dispatcher, self.now()
        failed: dict[str, tuple[list[str], NoHealthyReplica]] = {}
        for ticket in list(stranded(d, self.failfast, now)):
            d.cancel(ticket)
            fut: asyncio.Future[None] = ticket.payload
            if not fut.done():
                route = ticket.route
                error = stranded_error(d, route.model, now, self.rng.random())
                fut.set_exception(error)
                failed.setdefault(route.model, ([], error))[0].append(route.request_id)
        for model, (ids, error) in failed.items():  # the access log has the 503s: why
            log.warning("%s", stranded_line(model, ids, error))
        # Retries whose other replicas' breakers opened while they waited: they would
        # take each breaker's trial and fail it (overload.can_retry).
        for ticket in list(dead_retries(d, self.failfast, self.now())):
            d.cancel(ticket)
            fut = ticket.payload
            if not fut.done():
                fut.set_exception(UpstreamFailed(
                    f"the request failed on {ticket.attempts} replica(s) before any "
                    "response, and the breakers of the others are open"))

    def drain_retry_s(self, model: str) -> float:
        """Retry-After for a request turned away from the queue (full, or its timeout):
        when the queue will have room for it (``skymesh.balancer.overload.RetryBook``).
        The queue is one for all models (``queue.max_length``): so is its drain rate."""
        d = self.dispatcher
        return self.retry_book.promise(self.now(), d.queued, d.max_queue, self.drain,
                                       self.rng.random())

    def _count_decisions(self) -> None:
        # Taken first: a count that raised leaves no targets behind without a callback.
        targets, self._uncounted = self._uncounted, []
        counters = self._decision_counters
        for target in targets:
            c = counters.get(target)
            if c is None:
                c = counters[target] = self.metrics.decisions.labels(
                    self.dispatcher.policy.name, target)
            c.inc()


BALANCER = web.AppKey("balancer", Balancer)


def build_app(cfg: BalancerConfig, *, workers: int = 1, worker: int = 0) -> web.Application:
    """The aiohttp app: its routes, the request-id stamp (``on_response_prepare``), the
    access log and tracing middleware (``skymesh.obs.access``) and the lifecycle hooks.
    ``workers``, ``worker``: see :class:`Balancer`."""
    # The body limit is enforced by Handlers.read_body (a clean 413 in the OpenAI shape);
    # the server's own cap only stops abuse of the other endpoints.
    app = web.Application(client_max_size=cfg.limits.max_body_bytes + 1,
                          handler_args={"max_field_size": 16384})
    lb = Balancer(cfg, workers=workers, worker=worker)
    app[BALANCER] = lb
    edge, status = lb.handlers, lb.status
    catalog = ModelCatalog(lb.dispatcher, lambda: lb.session, cfg.probe.timeout_s, edge.refused)
    app.router.add_post("/v1/chat/completions", edge.handle_generate)
    app.router.add_post("/v1/completions", edge.handle_generate)
    app.router.add_get("/v1/models", catalog.handle_list)
    app.router.add_get("/v1/models/{model:.+}", catalog.handle_one)
    app.router.add_get("/health", edge.handle_health)
    app.router.add_get("/ready", edge.handle_ready)
    app.router.add_get("/metrics", status.handle_metrics)
    app.router.add_get("/status", status.handle_status)
    # Last: everything else (skymesh.balancer.passthrough); the owned paths answer 405.
    proxy = Passthrough(lb.dispatcher, lambda: lb.session,
                        max_body_bytes=cfg.limits.max_body_bytes,
                        forward_client_auth="Authorization" in lb.forward_headers,
                        refused=edge.refused, owned=OwnedRoutes(app),
                        hidden_headers=frozenset({FORWARDED_HEADER}), clock=lb.now)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    app.on_response_prepare.append(stamp_request_id)
    # One skymesh.access line and one span per request (docs/operations-logs.md).
    install_obs(app, access_log=cfg.logging.access_log, request_id=request_id,
                tracing=tracing_from_config(cfg.tracing, "skymesh-lb"),
                max_backlog=cfg.logging.access_log_backlog)

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
    return app[BALANCER]


__all__ = ["Balancer", "PolicyFlags", "balancer_of", "build_app"]
