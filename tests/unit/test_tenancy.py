"""Tenancy's pure parts (skymesh.balancer.tenancy): buckets and limits on a fake clock,
the fair queue's order (VTC within a class, priority with the aging guard), no entry left
behind, and the tenants section of lb.yaml."""

from __future__ import annotations

import hashlib

import pytest

from skymesh.balancer.config import parse_config
from skymesh.balancer.errors import BadRequest, Overloaded
from skymesh.balancer.tenancy import (
    DEFAULT_TENANT,
    FairQueue,
    Tenant,
    Waiter,
    book_of,
    release_into,
)
from skymesh.balancer.tenant_limits import DAY_S, Limiter, TenantLimited, TokenBucket
from skymesh.common.config import ConfigError

CLASSES = ("interactive", "standard", "batch")


def tenant(name: str, **kw: float) -> Tenant:
    return Tenant(name, "standard", CLASSES, **kw)  # type: ignore[arg-type]


# -- buckets and limits ----------------------------------------------------------------


def test_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    b = TokenBucket(rate=2.0, burst=4.0, now=0.0)
    assert b.wait_for(4, 0.0) == 0
    b.debit(4, 0.0)
    assert b.wait_for(1, 0.0) == pytest.approx(0.5)
    assert b.wait_for(1, 0.5) == 0
    assert b.wait_for(4, 100.0) == 0 and b.level == 4  # never above the burst
    b.debit(10, 100.0)  # counted after the fact: below zero, waited out
    assert b.wait_for(1, 100.0) == pytest.approx(3.5)
    assert b.wait_for(100, 200.0) == 0  # a cost above the burst asks for the burst


def test_requests_per_s_admits_the_rate_and_retry_after_is_the_buckets_own() -> None:
    lim = Limiter([tenant("a", requests_per_s=2.0)], share=1, now=0.0)
    now = 0.0
    admitted = 0
    refusals = []
    while now < 10.0:  # 3x the limit for 10 s
        try:
            lim.admit("a", 10, now, 0.0)
            admitted += 1
        except TenantLimited as exc:
            assert exc.reason == "requests" and exc.status == 429
            refusals.append(exc.retry_after_s)
        now += 1 / 6
    assert 20 <= admitted <= 22  # rate x time + one burst
    # One request's refill at 2/s, staggered at most one burst's refill (1 s) further.
    assert refusals and max(refusals) <= 0.5 + 1.0 + 1e-9
    lim.admit("nobody", 10, now, 0.0)  # a tenant with no limits is not counted


def test_clients_refused_together_are_told_to_come_back_in_turn() -> None:
    """Four clients refused at once (2/s, burst 2, empty): each told one refill (0.5 s)
    after the one before, up to the horizon (one burst's refill, 1 s past the earliest);
    each that comes back when told is admitted. Told one moment, all four would come
    back together and one would pass."""
    lim = Limiter([tenant("a", requests_per_s=2.0)], share=1, now=0.0)
    lim.admit("a", 1, 0.0, 0.0)
    lim.admit("a", 1, 0.0, 0.0)  # the burst is spent
    told = []
    for _ in range(4):
        with pytest.raises(TenantLimited) as info:
            lim.admit("a", 1, 0.0, 0.0)
        told.append(info.value.retry_after_s)
    assert told == pytest.approx([0.5, 1.0, 1.5, 1.5])
    for t in told[:3]:
        lim.admit("a", 1, t, 0.0)  # back when told: admitted, no refusal
    with pytest.raises(TenantLimited) as info:  # the one told past the horizon waits on
        lim.admit("a", 1, told[3], 0.0)
    # Later refusals start from the bucket again once the told times have passed.
    assert info.value.retry_after_s == pytest.approx(0.5)


def test_limits_are_shared_by_the_regions_balancers_and_workers() -> None:
    lim = Limiter([tenant("a", requests_per_s=8.0, max_concurrency=5)], share=4, now=0.0)
    st = lim.state["a"]
    assert st.requests is not None and st.requests.rate == 2.0
    assert st.max_concurrency == 2  # ceil(5 / 4)


def test_tokens_per_min_counts_usage_after_the_fact() -> None:
    lim = Limiter([tenant("a", tokens_per_min=600.0)], share=1, now=0.0)  # 10 tokens/s
    lim.admit("a", 100, 0.0, 0.0)
    lim.release("a", 1100, 100, 0.0, 0.0)  # 1000 more than the prompt estimate
    with pytest.raises(TenantLimited) as info:
        lim.admit("a", 100, 0.0, 0.0)
    assert info.value.reason == "tokens"
    # 600 - 1100 = -500; 100 needed: 600 tokens at 10/s.
    assert info.value.retry_after_s == pytest.approx(60.0)
    lim.admit("a", 100, 60.0, 0.0)


def test_concurrency_and_release() -> None:
    lim = Limiter([tenant("a", max_concurrency=2)], share=1, now=0.0)
    lim.admit("a", 1, 0.0, 0.0)
    lim.admit("a", 1, 0.0, 0.0)
    with pytest.raises(TenantLimited, match="in flight") as info:
        lim.admit("a", 1, 0.0, 0.0)
    assert info.value.reason == "concurrency"
    lim.release("a", 0, 1, 0.0, 0.0)
    lim.admit("a", 1, 0.0, 0.0)


def test_daily_quota_renews_at_utc_midnight() -> None:
    lim = Limiter([tenant("a", tokens_per_day=1000.0)], share=1, now=0.0)
    wall = 10 * DAY_S + 3600.0  # 01:00 UTC
    lim.admit("a", 10, 0.0, wall)
    lim.release("a", 1000, 10, 0.0, wall)
    with pytest.raises(TenantLimited) as info:
        lim.admit("a", 10, 0.0, wall)
    assert info.value.reason == "daily_quota"
    assert info.value.retry_after_s == pytest.approx(23 * 3600.0)
    lim.admit("a", 10, 0.0, 11 * DAY_S)  # the next day


# -- the fair queue -----------------------------------------------------------------------


def w(tenant_: str, cls: str = "standard", cost: float = 100, since: float = 0.0,
      model: str = "m") -> Waiter:
    return Waiter(model, tenant_, cls, cost, since)


def test_vtc_gives_equal_service_to_a_tenant_sending_ten_times_more() -> None:
    """Two tenants of equal weight, one sending 10x the other: while both are backlogged,
    each receives within 10% of half the service."""
    q = FairQueue(CLASSES, capacity=100_000)
    for i in range(1000):
        q.push(w("heavy"))
        if i % 10 == 0:
            q.push(w("light"))
    served = {"heavy": 0.0, "light": 0.0}
    lights_left = 100
    while lights_left:
        got = q.pop("m", 0.0)
        assert got is not None
        served[got.tenant] += got.cost
        q.charge(got.tenant, 50)  # its output, as the response ends
        lights_left -= got.tenant == "light"
    share = served["light"] / (served["light"] + served["heavy"])
    assert abs(share - 0.5) <= 0.05


def test_vtc_lifts_a_newly_backlogged_tenant_to_the_least_backlogged_counter() -> None:
    q = FairQueue(CLASSES)
    for _ in range(20):
        q.push(w("busy"))
    for _ in range(10):
        q.pop("m", 0.0)  # busy's counter is 1000 now
    q.push(w("idle"))
    assert q.counters["idle"] == q.counters["busy"] == 1000
    # Not a backlog of credit: the two alternate from here.
    order = [q.pop("m", 0.0).tenant for _ in range(4)]  # type: ignore[union-attr]
    assert sorted(order[:2]) == ["busy", "idle"]


def test_a_newcomer_to_an_empty_queue_gets_no_credit_for_others_past_service() -> None:
    q = FairQueue(CLASSES)
    for _ in range(50):  # busy alone, served, the queue empties
        q.push(w("busy"))
    while q.pop("m", 0.0) is not None:
        pass
    q.push(w("new"))  # arrives at an empty queue: lifted to what was served last
    for _ in range(5):
        q.push(w("busy"))
        q.push(w("new"))
    got = [q.pop("m", 0.0).tenant for _ in range(8)]  # type: ignore[union-attr]
    assert got.count("new") <= 5  # alternating, not six in a row for the newcomer


def test_weights_divide_the_counter() -> None:
    q = FairQueue(CLASSES, weights={"gold": 3.0})
    for _ in range(40):
        q.push(w("gold"))
        q.push(w("base"))
    got = [q.pop("m", 0.0).tenant for _ in range(40)]  # type: ignore[union-attr]
    assert got.count("gold") == 30


def test_strict_priority_between_classes() -> None:
    q = FairQueue(CLASSES)
    q.push(w("b", "batch"))
    q.push(w("s", "standard"))
    q.push(w("i", "interactive"))
    assert [q.pop("m", 1.0).cls for _ in range(3)] == [  # type: ignore[union-attr]
        "interactive", "standard", "batch"]


def test_aging_guard_serves_a_class_past_its_bound_first() -> None:
    q = FairQueue(CLASSES, max_wait_s={"batch": 60.0})
    q.push(w("b", "batch", since=0.0))
    for t in range(100):
        q.push(w("i", "interactive", since=float(t)))
    assert q.pop("m", 59.9).cls == "interactive"  # type: ignore[union-attr]
    assert q.pop("m", 60.0).cls == "batch"  # type: ignore[union-attr]  # waited its bound
    assert q.pop("m", 61.0).cls == "interactive"  # type: ignore[union-attr]


def test_no_class_waits_past_its_bound_while_requests_are_released() -> None:
    """Under a flood of interactive work, one release per second: every batch request
    leaves within its bound plus the release interval."""
    q = FairQueue(CLASSES, max_wait_s={"batch": 5.0}, capacity=100_000)
    waits = []
    for now in range(200):
        for _ in range(3):
            q.push(w("i", "interactive", since=float(now)))
        if now % 10 == 0:
            q.push(w("b", "batch", since=float(now)))
        got = q.pop("m", float(now))
        if got is not None and got.cls == "batch":
            waits.append(now - got.since)
    assert len(waits) >= 15 and max(waits) <= 5.0 + 1.0


def test_remove_leaves_nothing_behind_and_full_queue_refuses() -> None:
    q = FairQueue(CLASSES, capacity=3)
    a, b, c = w("a"), w("b", "batch"), w("a", model="n")
    for x in (a, b, c):
        q.push(x)
    with pytest.raises(Overloaded):
        q.push(w("z"))
    assert q.remove(b) and not q.remove(b)  # twice: the second finds nothing
    assert q.remove(a) and q.remove(c)
    assert len(q) == 0 and q.models() == [] and q._q == {}
    assert q.pop("m", 0.0) is None


def test_release_into_keeps_the_dispatcher_queue_short_per_model() -> None:
    q = FairQueue(CLASSES)
    for _ in range(5):
        q.push(w("a"))
        q.push(w("a", model="n"))
    out = release_into(q, {"m": 1, "n": 0}.__getitem__, {"n": 1}, 3, 0.0)
    assert [x.model for x in out].count("m") == 2  # 3 - 1 queued
    assert [x.model for x in out].count("n") == 2  # 3 - 1 woken, not yet offered
    assert len(q) == 6


# -- the tenants section ------------------------------------------------------------------


def digest_hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def cfg(**tenants: object) -> dict[str, object]:
    return {"tenants": tenants}


def test_without_a_tenants_section_there_is_none() -> None:
    assert parse_config({}).tenants is None


def test_keys_trusted_header_and_classes_resolve() -> None:
    c = parse_config(cfg(header="X-Tenant", trusted_sources=["10.0.0.0/8"], members=[
        {"name": "acme", "keys_sha256": [digest_hex("k1")], "classes": ["standard", "batch"],
         "default_class": "batch"},
        {"name": "web", "default_class": "interactive"}])).tenants
    assert c is not None
    book = book_of(c)
    k1 = hashlib.sha256(b"k1").digest()
    acme = book.tenant_of(k1, {}, "127.0.0.1")
    assert acme.name == "acme" and book.class_of(acme, {}) == "batch"
    # Asking better than allowed: the best it may use at or below the asked rank.
    assert book.class_of(acme, {"X-SkyMesh-Priority": "interactive"}) == "standard"
    assert book.class_of(acme, {"X-SkyMesh-Priority": "batch"}) == "batch"
    with pytest.raises(BadRequest):
        book.class_of(acme, {"X-SkyMesh-Priority": "urgent"})
    # The header only from a trusted source.
    assert book.tenant_of(k1, {"X-Tenant": "web"}, "10.1.2.3").name == "web"
    assert book.tenant_of(k1, {"X-Tenant": "web"}, "192.168.0.1").name == "acme"
    assert book.tenant_of(None, {}, None).name == DEFAULT_TENANT
    with pytest.raises(BadRequest):
        book.tenant_of(None, {"X-Tenant": "nope"}, "10.0.0.1")


@pytest.mark.parametrize(("tenants", "match"), [
    ({"classes": ["a", "a"]}, "distinct"),
    ({"default_class": "gold"}, "default_class"),
    ({"max_wait_s": {"gold": 1}}, "max_wait_s"),
    ({"members": [{"name": "x"}, {"name": "x"}]}, "twice"),
    ({"members": [{"name": "x", "classes": ["batch"]}]}, "default_class"),
    ({"members": [{"name": "x", "keys_sha256": ["abc"]}]}, "SHA-256"),
    ({"members": [{"name": "x", "keys_sha256": [digest_hex("k")]},
                  {"name": "y", "keys_sha256": [digest_hex("k")]}]}, "another tenant"),
    ({"fallback": "nobody"}, "fallback"),
    ({"trusted_sources": ["not-an-ip"]}, "CIDR"),
    ({"header": "X-Tenant"}, "trusted_sources"),
])
def test_bad_tenants_config_names_the_culprit(tenants: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config({"tenants": tenants})


def test_two_balancers_hold_the_regions_rate_within_ten_percent() -> None:
    """A tenant at 3x its limit, its requests spread over two balancers (each with half
    the limit): the region admits the limit, within 10% over a minute."""
    lbs = [Limiter([tenant("a", requests_per_s=10.0)], share=2, now=0.0) for _ in range(2)]
    admitted, now, i = 0, 0.0, 0
    while now < 60.0:
        try:
            lbs[i % 2].admit("a", 1, now, 0.0)
            admitted += 1
        except TenantLimited:
            pass
        i += 1
        now = i / 30.0  # 30 requests/s, 3x the limit
    assert abs(admitted / 60.0 - 10.0) <= 1.0
