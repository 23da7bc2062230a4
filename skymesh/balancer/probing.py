"""Probing the replicas: the I/O half of health (the state is ``skymesh.balancer.health``'s).

Every ``probe.interval_s`` each replica is asked for its load (vLLM: ``/metrics``,
parsed by ``skymesh.common.probe``; SGLang: ``/get_load``) and, every
``probe.models_interval_s`` when the config does not name them, its models. The outcome
goes to the health tracker; a good probe's figures go to the dispatcher (its pushing
decisions) and to the replica gauges, which a failed probe removes. Probes use the request
path's own keep-alive pool (``skymesh.balancer.upstream``), within ``probe.timeout_s``.

What a replica can make a probe cost is bounded: a body over ``probe.max_metrics_bytes``
is refused unread, and /metrics is parsed in a worker thread within a CPU budget
(``probe.max_parse_s``; :class:`ParseGate`). Either failing is a failed probe, so a
replica that keeps failing them goes down like one that does not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from skymesh.balancer.config import BalancerConfig, PushingConfig
from skymesh.balancer.health import HealthTracker, ReplicaHealth
from skymesh.balancer.metrics import AdmissionLimits
from skymesh.balancer.relay import RequestCore
from skymesh.balancer.seqcap import Source, admission_limit, cap_news
from skymesh.balancer.upstream import ReplyTooLarge, Upstream, read_capped
from skymesh.common.probe import (
    ProbeParseError,
    ProbeResult,
    ProbeStatusError,
    parse_metrics,
    parse_sglang_load,
)
from skymesh.obs.ratelog import RateLimitedLog
from skymesh.policies.load import UNAVAILABLE, PushMode, availability

log = logging.getLogger("skymesh.lb")


class Prober:
    def __init__(self, core: RequestCore, cfg: BalancerConfig, health: HealthTracker,
                 upstream: Callable[[], Upstream], auth: dict[str, str],
                 pushing: Callable[[], PushingConfig],
                 on_down: Callable[[set[str], float, float], object]) -> None:
        self.core = core
        self.cfg = cfg
        self.health = health  # the one owner of replica state: probes report to it
        self.upstream = upstream  # the request path's client, once the balancer started
        self.auth = auth  # the replicas' key, when the balancer has one
        self.pushing = pushing  # read at each probe: a reload changes it live
        # Streams on replicas marked down that have sent nothing for a while: ended there.
        self.on_down = on_down
        self.gates: dict[str, ParseGate] = {}  # /metrics parsing, per replica URL
        # Every probe of a replica over a limit fails the same way: a line per LOG_EVERY_S.
        self._log = RateLimitedLog(log, LOG_EVERY_S, health.clock)
        # The limit sp-p applies per replica, as the last good probe set it: a gauge.
        self.limits: dict[str, tuple[int, Source]] = {}
        core.metrics.registry.register(AdmissionLimits(
            lambda: [(url, n, src) for url, (n, src) in list(self.limits.items())]))

    async def loop(self) -> None:
        interval = self.cfg.probe.interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.probe_all()
            except Exception:  # a bug here must not stop probing for good
                log.exception("probe round failed")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(h) for h in self.health.replicas.values()))
        self.core.pump()
        replicas = self.health.replicas
        for url in [u for u in self.gates if u not in replicas]:
            del self.gates[url]
        for url in [u for u in self.limits if u not in replicas]:
            del self.limits[url]
        self._log.forget(lambda url: url in replicas)
        # Streams on a replica now marked down that have stalled end (or resume) here,
        # not after upstream.read_timeout_s.
        down = {url for url, h in replicas.items() if not h.healthy}
        if down:
            self.on_down(down, self.core.now(), self.cfg.upstream.stalled_stream_s)

    async def probe(self, h: ReplicaHealth) -> None:
        health, url = self.health, h.url
        sent = health.clock()  # the probe shows state as of about now: pushes after it count
        # Ours running there (started, not ended) as the probe leaves count as running, as
        # do those when it answers, up to a second later on a loaded engine.
        target = self.core.dispatcher.targets.get(url)
        started_at_sent = target.load.started if target is not None else 0
        try:
            if h.cfg.kind == "sglang":
                res: ProbeResult = parse_sglang_load(json.loads(await self.fetch(url,
                                                                                 "/get_load")))
            else:
                # Never logged: 55 KB per probe from vLLM.
                res = await self.parse(url, await self.fetch(url, "/metrics", "metrics"))
            if health.wants_models(h, sent):
                data = json.loads(await self.fetch(url, "/v1/models"))
                health.models_listed(h, {m["id"] for m in data.get("data", []) if "id" in m},
                                     sent)
        except (aiohttp.ClientError, TimeoutError, ProbeParseError, ProbeStatusError,
                ValueError, KeyError, AttributeError) as exc:
            if isinstance(exc, ReplyTooLarge | ParseOverBudget):
                self.over_limit(url, exc)
            health.probe_failed(h, str(exc) or type(exc).__name__)
            for gauge in (self.core.metrics.replica_waiting, self.core.metrics.replica_running):
                with contextlib.suppress(KeyError):
                    gauge.remove(url)
            self.core.metrics.replica_healthy.labels(url).set(1 if h.healthy else 0)
            return
        health.probe_ok(h, res, sent)
        # Read at each probe: pushing is one of the sections a reload changes live.
        told, lag = h.cfg.pushing_limits(self.pushing(), res.max_num_seqs)
        engine_queue = h.cfg.engine_queue(self.pushing())
        # Not told (vLLM does not publish it): learned from the probes, conservatively.
        # Ours that have started run there now, whatever its (lagging) gauges show; and
        # ours it took at once with none left unstarted, whatever its gauges show either.
        target = self.core.dispatcher.targets.get(url)
        running = peak = 0
        held = unstarted = False
        n = self.core.dispatcher.balancers_per_region
        if target is not None:
            load = target.load
            running, peak = max(load.started, started_at_sent), load.peak_in_flight
            held = (self.core.dispatcher.queued > 0
                    and availability(load, PushMode.SP_P, balancers=n) == UNAVAILABLE)
            unstarted = (oldest := load.oldest_unstarted) is not None and oldest < sent
        learned = h.cap.learned
        seqs, h.seqs_source = admission_limit(
            told, h.cap, max(res.running, running), res.waiting, engine_queue, peak, held,
            unstarted, balancers=n, late=health.clock() - sent > self.cfg.probe.interval_s)
        self.limits[url] = seqs, h.seqs_source
        if (news := cap_news(learned, h.cap)) is not None:
            log.info("replica %s: %s", url, news)
        if target is not None:  # read by sp-p when this probe reaches the dispatcher
            target.load.takes_all = h.cap.takes_all and h.seqs_source != "told"
        self.core.dispatcher.on_probe(url, sent, res.waiting, res.running, res.kv_usage,
                                      res.kv_capacity_tokens, max_num_seqs=seqs,
                                      metrics_lag_s=lag, engine_queue=engine_queue,
                                      prefer_queue=h.cfg.prefer_queue(self.pushing()))
        m = self.core.metrics
        m.replica_waiting.labels(url).set(res.waiting)
        m.replica_running.labels(url).set(res.running)
        m.replica_healthy.labels(url).set(1 if h.healthy else 0)

    async def fetch(self, url: str, path: str, what: str = "body") -> bytes:
        """A probe's GET, whole, within the probe timeout, on the request path's own lean
        keep-alive pool (aiohttp's client costs several times its CPU per exchange); a
        body over ``probe.max_metrics_bytes`` is refused and its connection dropped."""
        async with asyncio.timeout(self.cfg.probe.timeout_s):
            reply = await self.upstream().get(url, path, self.auth)
            try:
                if not 200 <= reply.status < 300:
                    raise ProbeStatusError(f"{path} answered HTTP {reply.status}")
                return await read_capped(reply, self.cfg.probe.max_metrics_bytes, what)
            finally:
                reply.release()

    async def parse(self, url: str, body: bytes) -> ProbeResult:
        """``parse_metrics`` of ``body`` in a worker thread, so a large /metrics never
        stalls the event loop; waited for up to ``probe.timeout_s``. A parse that costs
        over ``probe.max_parse_s`` of CPU fails the probe, and that replica's /metrics is
        not parsed again until ``QUIET_FACTOR`` times that cost has passed (one parse at
        a time per replica), so a replica serving costly text gets at most about a
        tenth of a core, however often it is probed."""
        now = self.health.clock()
        gate = self.gates.setdefault(url, ParseGate())
        if (why := gate.refuses(now)) is not None:
            raise ParseOverBudget(why)
        task = asyncio.get_running_loop().run_in_executor(None, _timed_parse, body)
        gate.running = task
        budget = self.cfg.probe.max_parse_s

        def settle(t: asyncio.Future[tuple[ProbeResult | Exception, float]]) -> None:
            if not t.cancelled() and t.exception() is None:
                gate.finished(t.result()[1], budget, self.health.clock())

        task.add_done_callback(settle)
        done, _ = await asyncio.wait({task}, timeout=self.cfg.probe.timeout_s)
        if not done:
            raise ParseOverBudget(f"/metrics takes over {self.cfg.probe.timeout_s:g} s to "
                                  "parse")
        res, cpu = task.result()
        if cpu > budget:
            raise ParseOverBudget(f"/metrics took {cpu:.3f} s of CPU to parse, over "
                                  f"probe.max_parse_s ({budget:g} s)")
        if isinstance(res, Exception):
            raise res
        return res

    def over_limit(self, url: str, exc: Exception) -> None:
        what = exc.what if isinstance(exc, ReplyTooLarge) else "metrics_parse"
        self.core.metrics.replica_limits.labels(url, what).inc()
        self._log(logging.WARNING, url, f"probe of {url} over a limit: {exc}")


LOG_EVERY_S = 10.0
# After a parse over budget, a replica's /metrics waits this many times that parse's cost
# before the next parse: its share of a core stays under 1 / (1 + QUIET_FACTOR).
QUIET_FACTOR = 10.0


class ParseOverBudget(ValueError):
    """A replica's /metrics costs more to parse than ``probe.max_parse_s``."""


@dataclass(slots=True)
class ParseGate:
    """One replica's /metrics parsing: the parse in progress, and after one over budget,
    until when no other is started (pure: time is passed in)."""

    running: asyncio.Future[Any] | None = None
    quiet_until: float = -math.inf
    last_cost: float = 0.0

    def refuses(self, now: float) -> str | None:
        """Why no parse may start at ``now``, or None when one may."""
        if self.running is not None and not self.running.done():
            return "its previous /metrics parse is still running"
        if now < self.quiet_until:
            return (f"its last /metrics took {self.last_cost:.3f} s of CPU to parse; not "
                    f"parsed again for {self.quiet_until - now:.1f} s")
        return None

    def finished(self, cost: float, budget: float, now: float) -> None:
        """A parse ended at ``now`` having cost ``cost`` seconds of CPU."""
        self.last_cost = cost
        if cost > budget:
            self.quiet_until = now + QUIET_FACTOR * cost


def _timed_parse(body: bytes) -> tuple[ProbeResult | Exception, float]:
    """(the parse's result or its error, the CPU seconds it took), in a worker thread."""
    t = time.thread_time()
    try:
        res: ProbeResult | Exception = parse_metrics(body.decode(errors="replace"))
    except ProbeParseError as exc:
        res = exc
    return res, time.thread_time() - t


__all__ = ["QUIET_FACTOR", "ParseGate", "ParseOverBudget", "Prober"]
