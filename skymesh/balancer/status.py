"""``/status`` (JSON, for operators and tests) and ``/metrics`` (Prometheus text).

Gauges that mirror dispatcher state (in flight, breaker, queue length, peers) are set at
scrape time, off the request path. A replica's probe figures in ``/status`` are the health
tracker's (``skymesh.balancer.health``): null after a failed probe, with the age of the
last good one and the error.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from skymesh.balancer.auth import EdgeFiles
from skymesh.balancer.controller_link import ControllerLink
from skymesh.balancer.handlers import Handlers
from skymesh.balancer.health import HealthTracker
from skymesh.balancer.mesh_link import MeshLink
from skymesh.balancer.moves import Mover
from skymesh.balancer.prediction import LivePredictor
from skymesh.balancer.relay import RequestCore

if TYPE_CHECKING:
    from skymesh.balancer.siblings import Siblings


class Status:
    """Reads every room's state; nothing reads this one's."""

    def __init__(self, core: RequestCore, region: str, health: HealthTracker,
                 edge: EdgeFiles, handlers: Handlers, predictor: LivePredictor,
                 mover: Mover, mesh: MeshLink | None, controller: ControllerLink | None,
                 kv_figures: Callable[[str], dict[str, Any]] | None = None) -> None:
        self.core = core
        self.region = region
        self.health = health
        self.edge = edge
        self.handlers = handlers  # the 401 of a guarded route, and keys in flight
        self.predictor = predictor
        self.mover = mover
        self.mesh = mesh
        self.controller = controller
        # A replica's KV-cache events: "kv_events" live, stale or off, and its index.
        self.kv_figures = kv_figures or (lambda url: {"kv_events": "off"})
        # One of several workers (skymesh.balancer.workers): the view covers them all.
        self.siblings: Siblings | None = None

    async def handle_metrics(self, request: web.Request) -> web.Response:
        body = (self.local_metrics() if self.siblings is None
                else await self.siblings.metrics())
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    def local_metrics(self) -> bytes:
        """This process's exposition (one worker's, when there are several)."""
        self._refresh_gauges()
        return self.core.metrics.render()

    def worker_summary(self) -> dict[str, Any]:
        """This worker's line in ``/status``'s ``workers``."""
        d = self.core.dispatcher
        return {"pid": os.getpid(), "queued": d.queue_length(),
                "in_flight": sum(t.load.in_flight for t in d.targets.values())}

    def _refresh_gauges(self) -> None:
        """Dispatcher state into gauges, at scrape time: off the request path."""
        d, m = self.core.dispatcher, self.core.metrics
        for tid, t in d.targets.items():
            m.replica_in_flight.labels(tid).set(t.load.in_flight)
            m.breaker_state.labels(tid).set(int(t.breaker.state))
        for model, q in d.queues.items():
            m.queue_length.labels(model).set(len(q))
        for model, q in d.lanes.items():
            m.batch_lane_length.labels(model).set(len(q))
        if self.mesh is not None:
            states = {"alive": 0, "suspected": 1, "down": 2}
            for v in self.mesh.peer_views():
                m.peer_state.labels(v["id"]).set(states.get(v["liveness"], 2))
                if v["rtt_s"] is not None:
                    m.peer_rtt.labels(v["id"]).set(v["rtt_s"])

    async def handle_status(self, request: web.Request) -> web.Response:
        if (refused := self.handlers.refused(request)) is not None:
            return refused
        d, moves = self.core.dispatcher, self.mover
        mesh = None
        if self.mesh is not None:
            mesh = {"id": self.mesh.mesh.id, "address": self.mesh.node.address,
                    "forwarding": d.forwarding, "forwarded_out": self.mesh.forwarded_out,
                    "forwarded_in": self.mesh.forwarded_in, "peers": self.mesh.peer_views(),
                    "outlook": None if d.outlook is None else d.outlook.status()}
        ctl = self.controller
        return web.json_response({
            "region": self.region,
            # Several workers: each one's pid, queue and requests in flight (the rest of
            # this answer is the answering worker's own). null: a single process.
            "workers": None if self.siblings is None else await self.siblings.statuses(),
            "mesh": mesh,
            "controller": None if ctl is None else {
                "url": ctl.cfg.url, "balancer_id": ctl.balancer_id,
                "registered": ctl.registered, "revision": ctl.revision,
                "error": ctl.last_error},
            "auth": {"keys": len(self.edge.keys.digests),
                     "keys_in_flight": len(self.handlers.in_flight_by_key),
                     "reloads": self.edge.reloads, "reload_errors": self.edge.errors},
            "policy": d.policy.name,
            "pushing": d.mode.value,
            "balancers_per_region": d.balancers_per_region,  # sp-p's n x margin
            "queued": d.queue_length(),
            "prediction": {**self.predictor.status(), "in_use": self.core.switches.flags.predicts},
            "migrations": {"total": moves.migrations, "open_streams": len(moves.live),
                           "recent": list(moves.recent_migrations),
                           "resumed": moves.resumed_streams,
                           "recent_resumes": list(moves.recent_resumes)},
            "replicas": {
                tid: {"healthy": self.health.is_healthy(tid), "models": sorted(t.models),
                      **self.replica_figures(tid),
                      "in_flight": t.load.in_flight, "breaker": t.breaker.state.name.lower()}
                for tid, t in d.targets.items()},
        })

    def replica_figures(self, url: str) -> dict[str, Any]:
        """One replica's probe figures (the health tracker's) and pushing state (the
        dispatcher's load)."""
        load = self.core.dispatcher.targets[url].load
        return {**self.health.figures(url),
                "unadmitted": load.unadmitted, "max_num_seqs": load.max_num_seqs,
                "engine_queue": load.engine_queue,
                "prefer_queue": self.core.dispatcher.prefer_queue_of(load),
                "metrics_lag_s": load.metrics_lag_s, **self.kv_figures(url)}


__all__ = ["Status"]
