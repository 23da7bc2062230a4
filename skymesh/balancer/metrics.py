"""The balancer's Prometheus metrics, on a private registry (one per balancer instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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

        self.peer_state = Gauge("skymesh_peer_state", "0 alive, 1 suspected, 2 down",
                                ["peer"], registry=r)
        self.peer_rtt = Gauge("skymesh_peer_rtt_seconds",
                              "Round-trip time to the peer, from heartbeats", ["peer"],
                              registry=r)
        self.peer_heartbeat_bytes = Gauge(
            "skymesh_peer_heartbeat_bytes", "Heartbeat payload bytes on the pair's current "
            "stream (rate() of it is bytes per second)", ["peer", "direction"], registry=r)
        self.forwarded_out = Gauge("skymesh_forwarded_out_total",
                                   "Requests this balancer forwarded to a peer", registry=r)
        self.forwarded_in = Gauge("skymesh_forwarded_in_total",
                                  "Requests peers forwarded to this balancer", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
