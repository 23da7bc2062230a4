"""Probing the replicas: the I/O half of health (the state is ``skymesh.balancer.health``'s).

Every ``probe.interval_s`` each replica is asked for its load (vLLM: ``/metrics``,
parsed by ``skymesh.common.probe``; SGLang: ``/get_load``) and, every
``probe.models_interval_s`` when the config does not name them, its models. The outcome
goes to the health tracker; a good probe's figures go to the dispatcher (its pushing
decisions) and to the replica gauges, which a failed probe removes. Probes use the request
path's own keep-alive pool (``skymesh.balancer.upstream``), within ``probe.timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING

import aiohttp

from skymesh.balancer.health import ReplicaHealth
from skymesh.common.probe import (
    ProbeParseError,
    ProbeResult,
    ProbeStatusError,
    parse_metrics,
    parse_sglang_load,
)

if TYPE_CHECKING:
    from skymesh.balancer.server import Balancer

log = logging.getLogger("skymesh.lb")


class Prober:
    def __init__(self, lb: Balancer) -> None:
        self.lb = lb

    async def loop(self) -> None:
        interval = self.lb.cfg.probe.interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.probe_all()
            except Exception:  # a bug here must not stop probing for good
                log.exception("probe round failed")

    async def probe_all(self) -> None:
        lb = self.lb
        await asyncio.gather(*(self.probe(h) for h in lb.health.replicas.values()))
        lb.pump()

    async def probe(self, h: ReplicaHealth) -> None:
        lb = self.lb
        health, url = lb.health, h.url
        sent = health.clock()  # the probe shows state as of about now: pushes after it count
        try:
            if h.cfg.kind == "sglang":
                res: ProbeResult = parse_sglang_load(json.loads(await self.fetch(url,
                                                                                 "/get_load")))
            else:
                # Never logged: 55 KB per probe from vLLM.
                res = parse_metrics((await self.fetch(url, "/metrics")).decode(
                    errors="replace"))
            if health.wants_models(h, sent):
                data = json.loads(await self.fetch(url, "/v1/models"))
                health.models_listed(h, {m["id"] for m in data.get("data", []) if "id" in m},
                                     sent)
        except (aiohttp.ClientError, TimeoutError, ProbeParseError, ProbeStatusError,
                ValueError, KeyError, AttributeError) as exc:
            health.probe_failed(h, str(exc) or type(exc).__name__)
            for gauge in (lb.metrics.replica_waiting, lb.metrics.replica_running):
                with contextlib.suppress(KeyError):
                    gauge.remove(url)
            lb.metrics.replica_healthy.labels(url).set(1 if h.healthy else 0)
            return
        health.probe_ok(h, res, sent)
        # Read at each probe: pushing is one of the sections a reload changes live.
        seqs, lag = h.cfg.pushing_limits(lb.cfg.pushing, res.max_num_seqs)
        lb.dispatcher.on_probe(url, sent, res.waiting, res.running, res.kv_usage,
                               res.kv_capacity_tokens, max_num_seqs=seqs, metrics_lag_s=lag,
                               engine_queue=h.cfg.engine_queue(lb.cfg.pushing),
                               prefer_queue=h.cfg.prefer_queue(lb.cfg.pushing))
        m = lb.metrics
        m.replica_waiting.labels(url).set(res.waiting)
        m.replica_running.labels(url).set(res.running)
        m.replica_healthy.labels(url).set(1 if h.healthy else 0)

    async def fetch(self, url: str, path: str) -> bytes:
        """A probe's GET, whole, within the probe timeout, on the request path's own lean
        keep-alive pool (aiohttp's client costs several times its CPU per exchange)."""
        lb = self.lb
        async with asyncio.timeout(lb.cfg.probe.timeout_s):
            reply = await lb.upstream.get(url, path, lb.upstream_auth)
            try:
                if not 200 <= reply.status < 300:
                    raise ProbeStatusError(f"{path} answered HTTP {reply.status}")
                return await reply.read()
            finally:
                reply.release()


__all__ = ["Prober"]
