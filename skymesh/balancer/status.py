"""``/status`` (JSON, for operators and tests) and ``/metrics`` (Prometheus text).

Gauges that mirror dispatcher state (in flight, breaker, queue length, peers) are set at
scrape time, off the request path. A replica's probe figures in ``/status`` are the health
tracker's (``skymesh.balancer.health``): null after a failed probe, with the age of the
last good one and the error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from skymesh.balancer.server import Balancer


class Status:
    def __init__(self, lb: Balancer) -> None:
        self.lb = lb

    async def handle_metrics(self, request: web.Request) -> web.Response:
        self._refresh_gauges()
        return web.Response(body=self.lb.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    def _refresh_gauges(self) -> None:
        """Dispatcher state into gauges, at scrape time: off the request path."""
        lb = self.lb
        d, m = lb.dispatcher, lb.metrics
        for tid, t in d.targets.items():
            m.replica_in_flight.labels(tid).set(t.load.in_flight)
            m.breaker_state.labels(tid).set(int(t.breaker.state))
        for model, q in d.queues.items():
            m.queue_length.labels(model).set(len(q))
        if lb.mesh is not None:
            states = {"alive": 0, "suspected": 1, "down": 2}
            for v in lb.mesh.peer_views():
                m.peer_state.labels(v["id"]).set(states.get(v["liveness"], 2))
                if v["rtt_s"] is not None:
                    m.peer_rtt.labels(v["id"]).set(v["rtt_s"])

    async def handle_status(self, request: web.Request) -> web.Response:
        lb = self.lb
        if (refused := lb.handlers.refused(request)) is not None:
            return refused
        d, moves = lb.dispatcher, lb.moves
        mesh = None
        if lb.mesh is not None:
            mesh = {"id": lb.mesh.mesh.id, "address": lb.mesh.node.address,
                    "forwarding": d.forwarding, "forwarded_out": lb.mesh.forwarded_out,
                    "forwarded_in": lb.mesh.forwarded_in, "peers": lb.mesh.peer_views(),
                    "outlook": None if d.outlook is None else d.outlook.status()}
        ctl = lb.controller
        return web.json_response({
            "region": lb.cfg.region,
            "mesh": mesh,
            "controller": None if ctl is None else {
                "url": ctl.cfg.url, "balancer_id": ctl.balancer_id,
                "registered": ctl.registered, "revision": ctl.revision,
                "error": ctl.last_error},
            "auth": {"keys": len(lb.edge.keys.digests),
                     "keys_in_flight": len(lb.handlers.in_flight_by_key),
                     "reloads": lb.edge.reloads, "reload_errors": lb.edge.errors},
            "policy": d.policy.name,
            "pushing": d.mode.value,
            "balancers_per_region": d.balancers_per_region,  # sp-p's n x margin
            "queued": d.queue_length(),
            "prediction": {**lb.predictor.status(), "in_use": lb.flags.predicts},
            "migrations": {"total": moves.migrations, "open_streams": len(moves.live),
                           "recent": list(moves.recent_migrations),
                           "resumed": moves.resumed_streams,
                           "recent_resumes": list(moves.recent_resumes)},
            "replicas": {
                tid: {"healthy": lb.health.is_healthy(tid), "models": sorted(t.models),
                      **self.replica_figures(tid),
                      "in_flight": t.load.in_flight, "breaker": t.breaker.state.name.lower()}
                for tid, t in d.targets.items()},
        })

    def replica_figures(self, url: str) -> dict[str, Any]:
        """One replica's probe figures (the health tracker's) and pushing state (the
        dispatcher's load)."""
        load = self.lb.dispatcher.targets[url].load
        return {**self.lb.health.figures(url),
                "unadmitted": load.unadmitted, "max_num_seqs": load.max_num_seqs,
                "engine_queue": load.engine_queue,
                "prefer_queue": self.lb.dispatcher.prefer_queue_of(load),
                "metrics_lag_s": load.metrics_lag_s}


__all__ = ["Status"]
