"""The balancer's side of shares that follow the traffic: the demand it reports per
tenant (``tenant_limits.Demand``, counted by the limiter: admitted and refused), the fractions
the controller answers with (``tenant_push``), each divided among the balancer's workers,
and the controller link that carries both. Fake clock; no network."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from skymesh.balancer.config import TenantsConfig, parse_config
from skymesh.balancer.server import Balancer
from skymesh.balancer.tenancy import Tenant
from skymesh.balancer.tenant_limits import Demand, Limiter, TenantLimited
from skymesh.balancer.tenant_push import limiter_of, merge
from skymesh_controller.config import ControllerConfig
from skymesh_controller.models import TelemetryIn
from skymesh_controller.refusals import Refusals
from skymesh_controller.store import MemoryStore
from skymesh_controller.telemetry import Telemetry


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenant(name: str, **limits: Any) -> Tenant:
    return Tenant(name, "standard", ("standard",), **limits)


def test_demand_smooths_toward_the_offered_rate_and_forgets_an_idle_tenant() -> None:
    d = Demand(now=0.0, half_life_s=5.0)
    now = 0.0
    for _ in range(8):  # 10 requests/s of 30 tokens each, reported every 5 s
        for _ in range(50):
            d.add("acme", 1.0, 30.0)
        now += 5.0
        r, t = d.rates(now)["acme"]
    assert r == pytest.approx(10.0, rel=0.01) and t == pytest.approx(18_000.0, rel=0.01)
    now += 5.0
    assert d.rates(now)["acme"][0] == pytest.approx(5.0, rel=0.01)  # one half-life
    for _ in range(20):
        now += 5.0
        rates = d.rates(now)
    assert rates == {}  # faded below the threshold: dropped, memory back


def test_tokens_given_back_in_a_later_window_never_report_a_negative_demand() -> None:
    d = Demand(now=0.0)
    d.add("acme", 1.0, 1000.0)  # the prompt estimate at admission
    d.rates(1.0)
    d.add("acme", 0.0, -990.0)  # usage far below the estimate, seen at the end
    r, t = d.rates(5.0)["acme"]
    assert r >= 0 and t == 0.0


def test_a_push_keeps_the_times_told_to_refused_clients() -> None:
    pushed = [{"name": "acme", "requests_per_s": 2.0, "share": 1, "fraction": 0.5}]
    old = limiter_of(merge(TenantsConfig(), pushed), 1, now=0.0)
    old.admit("acme", 1, 0.0, 0.0)  # 1/s, a burst of 1: the next waits
    told = []
    for _ in range(2):
        with pytest.raises(TenantLimited) as e:
            old.admit("acme", 1, 0.0, 0.0)
        told.append(e.value.retry_after_s)
    new = limiter_of(merge(TenantsConfig(), pushed), 1, now=0.0, old=old)
    with pytest.raises(TenantLimited) as e:
        new.admit("acme", 1, 0.0, 0.0)
    assert told == pytest.approx([1.0, 2.0])
    # After the others (up to the stagger's horizon), not with the first of them.
    assert e.value.retry_after_s == pytest.approx(2.0)


def test_the_limiter_counts_what_was_offered_admitted_or_not() -> None:
    lim = Limiter([tenant("acme", requests_per_s=2.0)], share=1, now=0.0)
    refused = 0
    for _ in range(10):
        try:
            lim.admit("acme", 100, 0.0, 0.0)
            lim.release("acme", 150.0, 100, 0.0, 0.0)  # 50 output tokens
        except TenantLimited:
            refused += 1
    assert refused == 8
    assert lim.demand.counts["acme"] == [10.0, 10 * 100 + 2 * 50]
    lim.admit("nobody", 1, 0.0, 0.0)  # a tenant without limits: not counted
    assert "nobody" not in lim.demand.counts


def test_fractions_size_each_limit_of_a_tenant() -> None:
    t = tenant("acme", requests_per_s=10.0, tokens_per_min=6000.0, max_concurrency=10,
               tokens_per_day=1000.0)
    lim = Limiter([t, tenant("even", requests_per_s=10.0)], share=2, now=0.0,
                  fractions={"acme": (0.75, 0.2)})
    st = lim.state["acme"]
    assert st.requests is not None and st.requests.rate == pytest.approx(7.5)
    assert st.tokens is not None and st.tokens.rate == pytest.approx(6000 * 0.2 / 60)
    assert st.max_concurrency == 8 and st.tokens_per_day == pytest.approx(200.0)
    even = lim.state["even"].requests
    assert even is not None and even.rate == pytest.approx(5.0)  # 1/share


def test_merge_takes_the_pushed_fractions_or_the_even_share() -> None:
    m = merge(TenantsConfig(), [
        {"name": "a", "requests_per_s": 10.0, "share": 2, "fraction": 0.9,
         "tokens_fraction": 0.6},
        {"name": "b", "requests_per_s": 10.0, "share": 4},  # an older controller
        {"name": "c", "requests_per_s": 10.0, "share": 2, "fraction": 1.5,
         "tokens_fraction": "x"}])  # out of range: the even share
    assert m.fractions == {"a": (0.9, 0.6), "b": (0.25, 0.25), "c": (0.5, 0.5)}
    lim = limiter_of(m, 1, now=0.0, workers=3)  # and each worker holds a third
    rates = {n: s.requests.rate for n, s in lim.state.items() if s.requests is not None}
    assert rates == pytest.approx({"a": 3.0, "b": 10 / 12, "c": 10 / 6})


def test_a_push_keeps_the_demand_counted_so_far() -> None:
    pushed = [{"name": "acme", "requests_per_s": 4.0, "share": 2, "fraction": 0.5}]
    old = limiter_of(merge(TenantsConfig(), pushed), 1, now=0.0)
    old.admit("acme", 10, 0.0, 0.0)
    new = limiter_of(merge(TenantsConfig(), [{**pushed[0], "fraction": 0.8}]), 1,
                     now=1.0, old=old)
    assert new.demand is old.demand and new.demand.counts["acme"] == [1.0, 10.0]


# -- the live balancer ------------------------------------------------------------------


def balancer(workers: int = 1, **kw: int) -> Balancer:
    return Balancer(parse_config({"region": "us", "controller": {
        "url": "http://127.0.0.1:9", "balancer_id": "lb-us"}}), workers=workers, **kw)


async def test_a_pushed_share_is_divided_among_the_balancers_workers() -> None:
    """Each worker of a balancer holds its part of what the controller gave the balancer:
    two workers behind one balancer id, with half of a 4/s limit, hold 1/s each (they
    held 2/s each, the balancer 4/s: twice its share)."""
    lb = balancer(workers=2)
    assert lb.controller is not None
    acme = {"name": "acme", "keys_sha256": [sha("k")], "requests_per_s": 4.0,
            "max_concurrency": 4, "share": 2}
    await lb.controller.apply({"revision": 1, "replicas": [], "peers": [],
                               "tenants": [acme]})
    gate = lb.handlers.gate
    assert gate is not None
    st = gate.limiter.state["acme"]
    assert st.requests is not None and st.requests.rate == pytest.approx(1.0)
    assert st.max_concurrency == 1


async def test_telemetry_reports_demand_and_its_answer_sets_the_fractions() -> None:
    lb = balancer(workers=2, worker=1)
    link = lb.controller
    assert link is not None
    acme = {"name": "acme", "keys_sha256": [sha("k")], "requests_per_s": 8.0, "share": 2}
    await link.apply({"revision": 3, "replicas": [], "peers": [], "tenants": [acme]})
    gate = lb.handlers.gate
    assert gate is not None
    for _ in range(3):
        with contextlib.suppress(TenantLimited):
            gate.admit("acme", "standard", "m", 7)
    report = link.telemetry()
    assert report["worker"] == 1 and set(report["tenants"]) == {"acme"}
    assert report["tenants"]["acme"]["requests_per_s"] > 0

    def rate() -> float:
        bucket = lb.handlers.gate.limiter.state["acme"].requests  # type: ignore[union-attr]
        assert bucket is not None
        return bucket.rate

    link.apply_shares({"revision": 3, "tenants": [{**acme, "fraction": 0.75}]})
    assert rate() == pytest.approx(8.0 * 0.75 / 2)
    # An answer read before the membership this balancer has applied: ignored.
    link.apply_shares({"revision": 2, "tenants": []})
    assert rate() == pytest.approx(8.0 * 0.75 / 2)
    link.apply_shares(None)  # an older controller's 204
    assert rate() == pytest.approx(8.0 * 0.75 / 2)


def share_series(lb: Balancer) -> dict[tuple[str, str], float]:
    got = {}
    for fam in text_string_to_metric_families(generate_latest(lb.metrics.registry).decode()):
        if fam.name == "skymesh_tenant_share":
            got |= {(s.labels["tenant"], s.labels["limit"]): s.value for s in fam.samples}
    return got


async def test_the_share_a_worker_holds_is_a_gauge_set_at_each_push() -> None:
    """``skymesh_tenant_share{tenant,limit}``: this worker's part of each pushed tenant's
    limits (the balancer's fraction over its two workers), changed by the fractions a
    telemetry answer brings, gone with the tenant."""
    lb = balancer(workers=2)
    link = lb.controller
    assert link is not None
    acme = {"name": "acme", "keys_sha256": [sha("k")], "requests_per_s": 8.0, "share": 2,
            "fraction": 0.8, "tokens_fraction": 0.6}
    beta = {"name": "beta", "requests_per_s": 8.0, "share": 4}  # an older controller
    await link.apply({"revision": 1, "replicas": [], "peers": [], "tenants": [acme, beta]})
    assert share_series(lb) == pytest.approx({
        ("acme", "requests"): 0.4, ("acme", "tokens"): 0.3,
        ("beta", "requests"): 0.125, ("beta", "tokens"): 0.125})
    link.apply_shares({"revision": 1, "tenants": [{**acme, "fraction": 0.5}]})
    assert share_series(lb) == pytest.approx({("acme", "requests"): 0.25,
                                              ("acme", "tokens"): 0.3})


async def test_a_report_carries_the_busiest_tenants_and_the_controller_takes_it_whole(
        caplog: pytest.LogCaptureFixture) -> None:
    """3000 tenants active at one balancer: the report carries the busiest 200
    (controller.telemetry_max_tenants), so it stays under the controller's 64 KB cap and
    is stored, its load and health with it (it was refused whole, 413); the rest are
    counted and told once."""
    lb = balancer()
    link = lb.controller
    assert link is not None
    names = [f"tenant-with-a-rather-long-name-{i:05d}" for i in range(3000)]
    demand = {n: (float(i), 60.0 * i) for i, n in enumerate(names)}
    link.tenant_demand = lambda: demand
    with caplog.at_level(logging.WARNING, logger="skymesh.balancer.controller"):
        report = link.telemetry()
        link.telemetry()
    assert set(report["tenants"]) == set(names[-200:])  # the busiest
    assert [r.getMessage() for r in caplog.records if "telemetry_max_tenants" in
            r.getMessage()] == [
        "3000 tenants are active here: the telemetry report carries the demand of the "
        "busiest 200 (controller.telemetry_max_tenants); the others hold the floor of "
        "their limits here"]
    assert lb.metrics.registry.get_sample_value(
        "skymesh_tenant_demand_unreported_total") == 2 * 2800
    store = MemoryStore()
    await store.commit([("balancers", "lb-us", {"id": "lb-us", "region": "us"})])
    await Telemetry(ControllerConfig(), store, Refusals()).report(
        "lb-us", TelemetryIn.model_validate(report))
    stored = await store.tail("balancer:lb-us", 1)
    assert len(json.dumps(stored[0])) < ControllerConfig().telemetry_max_bytes
    assert stored[0]["replicas"] == report["replicas"] and len(stored[0]["tenants"]) == 200
