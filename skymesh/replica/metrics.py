"""Prometheus exposition of a replica, under the names vLLM and SGLang use.

Routers written for either engine (the SkyMesh balancer, sglang-router, llm-d, Grafana
dashboards) read these by name, so the names, types and the ``model_name`` label follow
vLLM (v0 and v1 names both, where they differ) and SGLang. Everything is read from the
engine's own counters at scrape time through a custom collector on a private registry: no
second set of counters to keep in step, and no ``_created`` series.

Latency histograms are in wall-clock seconds as the client sees them; under
``--time-scale`` they shrink by the same factor as the emulated GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from skymesh.replica.driver import RealtimeDriver, RequestHandle

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


class ReplicaMetrics:
    """Collector for one replica; :meth:`render` gives the /metrics body."""

    def __init__(self, driver: RealtimeDriver, model_name: str) -> None:
        self.driver = driver
        self.model_name = model_name
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
        label = [self.model_name]
        waiting, running, usage = engine.num_waiting, engine.num_running, engine.kv_usage
        used_tokens = engine.num_used_tokens
        hit_rate = st.prefix_hit_tokens / st.prefix_query_tokens if st.prefix_query_tokens else 0.0

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        # vLLM
        # vLLM publishes its cache configuration as labels of a constant gauge; routers
        # read num_gpu_blocks x block_size as the replica's KV capacity in tokens.
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                 "CacheConfig", labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(engine.block_size), str(engine.kv.num_blocks)], 1.0)
        yield info
        yield gauge("vllm:num_requests_running", "Requests in model execution batches.", running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", waiting)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    usage)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.",
                      st.prefix_query_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.",
                      st.prefix_hit_tokens)
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", st.prompt_tokens)
        yield counter("vllm:generation_tokens", "Generation tokens processed.",
                      st.generation_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.",
                      st.num_preemptions)
        success = CounterMetricFamily("vllm:request_success", "Successfully finished requests.",
                                      labels=["model_name", "finished_reason"])
        for reason, n in sorted(self.finished.items()):
            success.add_metric([self.model_name, reason], n)
        yield success
        yield self._histogram("vllm:time_to_first_token_seconds",
                              "Time to first token in seconds.", self.ttft)
        yield self._histogram("vllm:e2e_request_latency_seconds",
                              "End-to-end request latency in seconds.", self.e2e)
        # SGLang. cache_hit_rate is cumulative here (SGLang reports it per batch).
        yield gauge("sglang:num_running_reqs", "The number of running requests.", running)
        yield gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
                    waiting)
        yield gauge("sglang:token_usage", "The token usage.", usage)
        yield gauge("sglang:num_used_tokens", "The number of used tokens.", used_tokens)
        yield gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV.",
                    engine.profile.kv_capacity_tokens)
        yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate)
        # SkyMesh extras (no standard name exists).
        yield counter("skymesh:requests_aborted", "Requests aborted (client gone).",
                      st.num_aborted)
        yield counter("skymesh:engine_steps", "Engine steps executed.", st.num_steps)

    def _histogram(self, name: str, doc: str, h: _Histogram) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=["model_name"])
        fam.add_metric([self.model_name], h.buckets(), h.total)
        return fam
