"""The balancer's Prometheus metrics, on a private registry (one per balancer instance).

Monotone series are typed as counters (names end in ``_total``), so ``rate()`` is right
for them; the mesh's counts are read from their one owner (the mesh link) at scrape time
by a custom collector rather than copied into a second set of counters.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class BalancerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("skymesh_requests_total", "Requests by final outcome",
                                ["model", "outcome"], registry=r)
        self.decisions = Counter("skymesh_routing_decisions_total",
                                 "Requests placed, by policy and target",
                                 ["policy", "target"], registry=r)
        self.retries = Counter("skymesh_retries_total",
                               "Attempts retried on another replica before the first byte",
                               ["target"], registry=r)
        self.queue_length = Gauge("skymesh_queue_length", "Requests waiting in the balancer",
                                  ["model"], registry=r)
        self.queue_wait = Histogram("skymesh_queue_wait_seconds",
                                    "Time from arrival to dispatch", ["model"],
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("skymesh_time_to_first_byte_seconds",
                              "Arrival to first response byte, at the balancer", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("skymesh_request_duration_seconds",
                             "Arrival to end of response, at the balancer", ["model"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.migrations = Counter("skymesh_migrations_total",
                                  "Streaming requests moved to another replica mid-response "
                                  "(GoodServe's migration)", ["source", "target"], registry=r)
        self.booked_admits = Counter(
            "skymesh_booked_retries_admitted_total",
            "Clients back when their Retry-After said, queued past a full queue's cap",
            registry=r)
        self.replica_waiting = Gauge("skymesh_replica_pending_requests",
                                     "Waiting requests reported by the replica's last probe",
                                     ["replica"], registry=r)
        self.replica_running = Gauge("skymesh_replica_running_requests",
                                     "Running requests reported by the replica's last probe",
                                     ["replica"], registry=r)
        self.replica_in_flight = Gauge("skymesh_replica_in_flight_requests",
                                       "Requests this balancer has on the replica",
                                       ["replica"], registry=r)
        self.replica_healthy = Gauge("skymesh_replica_healthy", "1 if the replica is healthy",
                                     ["replica"], registry=r)
        self.breaker_state = Gauge("skymesh_replica_breaker_state",
                                   "0 closed, 1 half-open, 2 open", ["replica"], registry=r)
        self.replica_limits = Counter(
            "skymesh_replica_limit_hits_total",
            "Replies and probes cut off by a cap on what a replica sends (limit: headers, "
            "body, metrics, metrics_parse) and streams ended on a replica marked down "
            "(stalled_stream)", ["replica", "limit"], registry=r)

        self.peer_state = Gauge("skymesh_peer_state", "0 alive, 1 suspected, 2 down",
                                ["peer"], registry=r)
        self.peer_rtt = Gauge("skymesh_peer_rtt_seconds",
                              "Round-trip time to the peer, from heartbeats", ["peer"],
                              registry=r)
        # Registered without a mesh too: a region-local balancer forwards nothing (0).
        self._mesh = _MeshCollector()
        r.register(self._mesh)

    def watch_mesh(self, mesh: MeshCounts) -> None:
        """Export the mesh link's forwarding and heartbeat counters."""
        self._mesh.mesh = mesh

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MeshCounts(Protocol):
    """What the collector reads from the balancer's mesh link."""

    forwarded_out: int
    forwarded_in: int

    def peer_views(self) -> list[dict[str, Any]]: ...


class _MeshCollector:
    def __init__(self) -> None:
        self.mesh: MeshCounts | None = None

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration; names are fixed below

    def collect(self) -> Iterator[Metric]:
        m = self.mesh
        yield CounterMetricFamily("skymesh_forwarded_out",
                                  "Requests this balancer forwarded to a peer",
                                  value=m.forwarded_out if m is not None else 0)
        yield CounterMetricFamily("skymesh_forwarded_in",
                                  "Requests peers forwarded to this balancer",
                                  value=m.forwarded_in if m is not None else 0)
        # Per heartbeat stream: it restarts from 0 when the pair's stream is re-opened,
        # which rate() reads as a counter reset.
        hb = CounterMetricFamily("skymesh_peer_heartbeat_bytes",
                                 "Heartbeat payload bytes exchanged with the peer",
                                 labels=["peer", "direction"])
        for v in m.peer_views() if m is not None else []:
            hb.add_metric([v["id"], "sent"], v["heartbeat_bytes_sent"])
            hb.add_metric([v["id"], "received"], v["heartbeat_bytes_received"])
        yield hb
