"""The balancer's Prometheus metrics, on a private registry (one per balancer instance).

Monotone series are typed as counters (names end in ``_total``), so ``rate()`` is right
for them; the mesh's counts are read from their one owner (the mesh link) at scrape time
by a custom collector rather than copied into a second set of counters.

The request path takes its series from :meth:`BalancerMetrics.model` and
:attr:`BalancerMetrics.client_left`: children resolved once, not a ``labels()`` lookup
(a lock, a tuple of strings, a dict) per observation. Series labelled by a replica are
dropped when it leaves (:meth:`BalancerMetrics.forget_replica`).

The three latency histograms per model (time to first byte, duration, queue wait) are
observed three times per request, and prometheus_client's ``Histogram.observe`` takes a
lock for the sum and one for the bucket (1.3 us on this machine, against 0.2 us for
:class:`LoopHistogram`): they are plain counters, written only by the event loop, read by
a collector at scrape time, and exported exactly as prometheus_client would (buckets,
``_count``, ``_sum``, ``_created``). A scrape from another thread may see a request's sum
without its bucket, as it could see one bucket and not the next with the locks.
The two counters every request adds to (``skymesh_requests_total`` and
``skymesh_routing_decisions_total``) are loop-only the same way (:class:`LoopCounters`:
0.03 us an ``inc`` against prometheus_client's locked 0.25).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import suppress
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.metrics import _get_use_created
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Where a client was found gone while the balancer wrote to it: with the first bytes of a
# stream, between two chunks, at its end.
DISCONNECT_PHASES = ("first_chunk", "mid_stream", "end")


class LoopHistogram:
    """One histogram child observed by the event loop alone: no locks (see the module
    docstring). ``counts[i]`` counts the values in bucket ``i`` only (not cumulative);
    the last is +Inf's."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        self.counts[bisect_left(self.bounds, amount)] += 1  # le: amount <= bound


class LoopHistograms:
    """A histogram family labelled by ``label``, its children :class:`LoopHistogram`s;
    registered as a collector that exports them as prometheus_client's ``Histogram``."""

    def __init__(self, name: str, documentation: str, label: str,
                 buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.bounds = tuple(float(b) for b in buckets)
        self._les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self._children: dict[str, LoopHistogram] = {}
        registry.register(self)

    def labels(self, value: str) -> LoopHistogram:
        h = self._children.get(value)
        if h is None:
            h = self._children[value] = LoopHistogram(self.bounds)
        return h

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=[self.label])]

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        # prometheus_client's own switch (PROMETHEUS_DISABLE_CREATED_SERIES), private but
        # what its Histogram follows: the two exports stay the same.
        created = _get_use_created()
        for value, h in list(self._children.items()):
            counts, total = list(h.counts), h.sum  # one read each: the loop may write on
            cum, buckets = 0, []
            for le, n in zip(self._les, counts, strict=True):
                cum += n
                buckets.append((le, float(cum)))
            fam.add_metric([value], buckets, total)
            if created:
                fam.samples.append(Sample(f"{self.name}_created", {self.label: value},
                                          h.created))
        yield fam


class LoopCounter:
    """One counter child incremented by the event loop alone (see the module docstring)."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopCounters:
    """A counter family of :class:`LoopCounter` children, labelled by ``labelnames``;
    registered as a collector that exports them as prometheus_client's ``Counter``. The
    ``labels`` and ``remove`` of a ``Counter`` with label values given in order."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self._children: dict[tuple[str, ...], LoopCounter] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopCounter:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected")
        key = tuple(map(str, values))
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = LoopCounter()
        return c

    def remove(self, *values: str) -> None:
        del self._children[tuple(map(str, values))]

    def label_sets(self) -> list[tuple[str, ...]]:
        return list(self._children)

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        created = _get_use_created()
        for values, c in list(self._children.items()):
            fam.add_metric(values, c.value, c.created if created else None)
        yield fam


class ModelSeries:
    """One model's request-path series, resolved once (see :meth:`BalancerMetrics.model`)."""

    __slots__ = ("_outcomes", "_requests", "e2e", "model", "queue_wait", "ttft")

    def __init__(self, m: BalancerMetrics, model: str) -> None:
        self.model = model
        self.ttft = m.ttft.labels(model)
        self.e2e = m.e2e.labels(model)
        self.queue_wait = m.queue_wait.labels(model)
        self._requests = m.requests
        self._outcomes: dict[str, Any] = {}

    def outcome(self, outcome: str) -> Any:
        """The ``skymesh_requests_total`` child for ``outcome`` (a few fixed names)."""
        c = self._outcomes.get(outcome)
        if c is None:
            c = self._outcomes[outcome] = self._requests.labels(self.model, outcome)
        return c


class TenantMetrics:
    """Per tenant and class (label ``priority``) series, registered only with a
    ``tenants`` section. Tenants and classes come from the config, so the label sets
    are bounded."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.admitted = Counter("skymesh_tenant_admitted_total",
                                "Requests let into the queue, by tenant and class",
                                ["tenant", "priority"], registry=r)
        self.limited = Counter("skymesh_tenant_limited_total",
                               "Requests turned away (429) by a tenant limit (reason: "
                               "requests, tokens, concurrency, daily_quota)",
                               ["tenant", "priority", "reason"], registry=r)
        self.queue_wait = Histogram("skymesh_tenant_queue_wait_seconds",
                                    "Time waiting in the tenant fair queue",
                                    ["tenant", "priority"], buckets=_LATENCY_BUCKETS,
                                    registry=r)
        self.tokens = Counter("skymesh_tenant_tokens_total",
                              "Prompt + output tokens served, by tenant and class",
                              ["tenant", "priority"], registry=r)
        self.waiting = Gauge("skymesh_tenant_queue_length",
                             "Requests waiting in the tenant fair queue", registry=r)
        self.reserve_held = Counter("skymesh_tenant_reserve_held_total",
                                    "Releases at which a class with waiters was held back "
                                    "by the slot reserve for better classes",
                                    ["priority"], registry=r)
        # Set when the controller's tenants (and this balancer's part of their limits)
        # are applied: this worker's part, so the balancer's is the sum over ``worker``.
        self.share = Gauge("skymesh_tenant_share",
                           "Part of a tenant's limit this worker holds, as the controller "
                           "split it (limit: requests, tokens)",
                           ["tenant", "limit"], registry=r)
        self.unreported = Counter("skymesh_tenant_demand_unreported_total",
                                  "Tenants left out of a telemetry report's demand (past "
                                  "controller.telemetry_max_tenants): they hold the floor",
                                  registry=r)


class TenantQueueDepth:
    """``skymesh_tenant_queue_waiting{tenant,priority}``: the fair queue's waiters, read from
    the queue at scrape time (no bookkeeping on the request path). Every configured
    (tenant, class) pair is exported, 0 when none wait, so the series stay put; ``pairs``
    is read at each scrape too (the controller's tenants change)."""

    def __init__(self, pairs: Callable[[], Iterable[tuple[str, str]]],
                 depths: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self.pairs = pairs
        self.depths = depths

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily("skymesh_tenant_queue_waiting",
                                "Requests waiting in the tenant fair queue, by tenant and class",
                                labels=["tenant", "priority"])
        now = self.depths()
        for pair in self.pairs():
            fam.add_metric(list(pair), now.get(pair, 0))
        yield fam


class BalancerMetrics:
    tenants: TenantMetrics | None = None

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = LoopCounters("skymesh_requests_total", "Requests by final outcome",
                                     ("model", "outcome"), r)
        self.decisions = LoopCounters("skymesh_routing_decisions_total",
                                      "Requests placed, by policy and target",
                                      ("policy", "target"), r)
        self.retries = Counter("skymesh_retries_total",
                               "Attempts retried on another replica before the first byte",
                               ["target"], registry=r)
        self.queue_length = Gauge("skymesh_queue_length", "Requests waiting in the balancer",
                                  ["model"], registry=r)
        # Batch waiting for quiet capacity or its deadline (tenants.batch_mesh): for hours.
        self.batch_lane_length = Gauge("skymesh_batch_lane_length",
                                       "Batch requests waiting in the batch lane",
                                       ["model"], registry=r)
        self.queue_wait = LoopHistograms("skymesh_queue_wait_seconds",
                                         "Time from arrival to dispatch", "model",
                                         _LATENCY_BUCKETS, r)
        self.ttft = LoopHistograms("skymesh_time_to_first_byte_seconds",
                                   "Arrival to first response byte, at the balancer",
                                   "model", _LATENCY_BUCKETS, r)
        self.e2e = LoopHistograms("skymesh_request_duration_seconds",
                                  "Arrival to end of response, at the balancer", "model",
                                  _LATENCY_BUCKETS, r)
        self.migrations = Counter("skymesh_migrations_total",
                                  "Streaming requests moved to another replica mid-response "
                                  "(GoodServe's migration)", ["source", "target"], registry=r)
        self.client_disconnects = Counter(
            "skymesh_client_disconnects_total",
            "Clients found gone while the balancer wrote a stream to them, by phase "
            "(first_chunk, mid_stream, end); a client that leaves while its request waits "
            "cancels it instead (outcome in skymesh_requests_total)", ["phase"], registry=r)
        self.client_left = {p: self.client_disconnects.labels(p) for p in DISCONNECT_PHASES}
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

        self._models: dict[str, ModelSeries] = {}

    def enable_tenants(self) -> TenantMetrics:
        if self.tenants is None:
            self.tenants = TenantMetrics(self.registry)
        return self.tenants

    def model(self, model: str) -> ModelSeries:
        """``model``'s series. Models are label values only once the balancer accepted
        them (a name a client made up never gets here), so this stays small."""
        s = self._models.get(model)
        if s is None:
            s = self._models[model] = ModelSeries(self, model)
        return s

    def forget_replica(self, url: str) -> None:
        """Drop every series labelled by ``url`` (a replica that left): gauges would show
        its last value forever, and the label sets of departed replicas would pile up."""
        for gauge in (self.replica_healthy, self.replica_waiting, self.replica_running,
                      self.replica_in_flight, self.breaker_state):
            with suppress(KeyError):
                gauge.remove(url)
        for metric in (self.decisions, self.retries, self.migrations, self.replica_limits):
            for labels in _label_sets(metric):
                if url in labels:
                    with suppress(KeyError):
                        metric.remove(*labels)

    def watch_mesh(self, mesh: MeshCounts) -> None:
        """Export the mesh link's forwarding and heartbeat counters."""
        self._mesh.mesh = mesh

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _label_sets(metric: Any) -> list[tuple[str, ...]]:
    """The label values of ``metric``'s children (prometheus_client keeps them in
    ``_metrics``; read under its lock, as ``labels()`` writes it)."""
    if isinstance(metric, LoopCounters):
        return metric.label_sets()
    with metric._lock:
        return list(metric._metrics)


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


class AdmissionLimits:
    """``skymesh_replica_admission_limit{replica, source}``: the admission limit sp-p
    applies per replica (its ``max_num_seqs``; ``source``: ``told``, ``learned``, or
    ``unknown`` while learning), read at scrape time from ``read`` (the prober's, set on
    each probe): a replica that leaves drops out, a changed source replaces the series."""

    def __init__(self, read: Callable[[], Iterable[tuple[str, int, str]]]) -> None:
        self.read = read

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("skymesh_replica_admission_limit",
                              "The admission limit (max_num_seqs) sp-p applies to the "
                              "replica, and where it came from", labels=["replica", "source"])
        for url, limit, source in self.read():
            g.add_metric([url, source], limit)
        yield g
