"""skymesh.balancer.metrics: children resolved once, and a departed replica's series gone."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from skymesh.balancer.metrics import BalancerMetrics


def samples(m: BalancerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(m.render().decode())
            for s in fam.samples}


def test_a_models_series_are_the_labelled_children_once() -> None:
    m = BalancerMetrics()
    s = m.model("llama")
    assert m.model("llama") is s and s.outcome("ok") is s.outcome("ok")
    s.outcome("ok").inc()
    s.outcome("ok").inc()
    s.ttft.observe(0.2)
    m.client_left["first_chunk"].inc()
    got = samples(m)
    assert got[("skymesh_requests_total", (("model", "llama"), ("outcome", "ok")))] == 2
    assert got[("skymesh_time_to_first_byte_seconds_count", (("model", "llama"),))] == 1
    assert got[("skymesh_client_disconnects_total", (("phase", "first_chunk"),))] == 1
    assert got[("skymesh_client_disconnects_total", (("phase", "mid_stream"),))] == 0


def test_a_replica_that_leaves_takes_all_its_series_with_it() -> None:
    m = BalancerMetrics()
    gone, stays = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    for url in (gone, stays):
        m.decisions.labels("round-robin", url).inc()
        m.retries.labels(url).inc()
        m.replica_limits.labels(url, "body").inc()
        m.replica_healthy.labels(url).set(1)
        m.breaker_state.labels(url).set(0)
    m.migrations.labels(gone, stays).inc()
    m.migrations.labels(stays, gone).inc()
    m.forget_replica(gone)
    assert gone not in m.render().decode()
    kept = {name for name, labels in samples(m) if (stays in dict(labels).values())}
    assert kept >= {"skymesh_routing_decisions_total", "skymesh_retries_total",
                    "skymesh_replica_limit_hits_total", "skymesh_replica_healthy",
                    "skymesh_replica_breaker_state"}


def test_the_loop_histograms_export_what_prometheus_clients_would() -> None:
    """The request path's lock-free histograms read, at a scrape, as prometheus_client's
    Histogram with the same observations: buckets (edges included), count, sum, created."""
    from prometheus_client import CollectorRegistry, Histogram

    from skymesh.balancer.metrics import _LATENCY_BUCKETS, LoopHistograms

    ours_reg, ref_reg = CollectorRegistry(), CollectorRegistry()
    ours = LoopHistograms("x_seconds", "doc", "model", _LATENCY_BUCKETS, ours_reg)
    ref = Histogram("x_seconds", "doc", ["model"], buckets=_LATENCY_BUCKETS, registry=ref_reg)
    for model, values in (("a", [0.0, 0.005, 0.0051, 1, 120, 121, 3e9]), ("b", [0.3])):
        for v in values:
            ours.labels(model).observe(v)
            ref.labels(model).observe(v)

    def exported(r: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, 0.0 if s.name.endswith("_created") else s.value)
                for fam in r.collect() for s in fam.samples]

    assert exported(ours_reg) == exported(ref_reg)
    assert [m.name for m in ours_reg.collect()] == [m.name for m in ref_reg.collect()]


def test_the_loop_counters_export_what_prometheus_clients_would() -> None:
    """The per-request counters (lock-free, loop-only) read, at a scrape, as
    prometheus_client's Counter with the same increments, and lose a child as it does."""
    from prometheus_client import CollectorRegistry, Counter

    from skymesh.balancer.metrics import LoopCounters

    ours_reg, ref_reg = CollectorRegistry(), CollectorRegistry()
    ours = LoopCounters("x_total", "doc", ("model", "outcome"), ours_reg)
    ref = Counter("x_total", "doc", ["model", "outcome"], registry=ref_reg)
    for labels, n in ((("a", "ok"), 3), (("a", "error"), 1), (("b", "ok"), 2)):
        for _ in range(n):
            ours.labels(*labels).inc()
            ref.labels(*labels).inc()
    ours.labels("c", "ok").inc(2.5)
    ref.labels("c", "ok").inc(2.5)
    ours.remove("a", "error")
    ref.remove("a", "error")

    def exported(r: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, 0.0 if s.name.endswith("_created") else s.value)
                for fam in r.collect() for s in fam.samples]

    assert exported(ours_reg) == exported(ref_reg)
    assert [(m.name, m.type) for m in ours_reg.collect()] == \
        [(m.name, m.type) for m in ref_reg.collect()]
    assert ours.label_sets() == [("a", "ok"), ("b", "ok"), ("c", "ok")]
