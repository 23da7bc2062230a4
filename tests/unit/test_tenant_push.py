"""Tenants pushed by the controller (skymesh.balancer.tenant_push, TenantGate.set_pushed):
the merge rule with lb.yaml's section, each tenant's limits divided by its share, what the
limiter counted carried across a push, and the gate applying a push between requests."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.tenancy import DEFAULT_TENANT
from skymesh.balancer.tenant_gate import TenantGate
from skymesh.balancer.tenant_limits import TenantLimited
from skymesh.balancer.tenant_push import limiter_of, merge


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


BASE = TenantsConfig(classes=["gold", "bronze"], default_class="bronze", members=[
    {"name": "acme", "keys_sha256": [sha("k-acme")], "requests_per_s": 100.0},
    {"name": "yaml-only", "keys_sha256": [sha("k-yaml"), sha("k-moved")],
     "max_concurrency": 8}])


def test_controller_wins_for_its_tenants_and_lb_yaml_keeps_the_rest() -> None:
    m = merge(BASE, [
        {"name": "acme", "keys_sha256": [sha("k-acme2")], "requests_per_s": 6.0, "share": 3,
         "scope": "global"},
        {"name": "new", "keys_sha256": [sha("k-moved")], "classes": ["gold", "platinum"],
         "default_class": "platinum", "share": 2},
    ])
    by = {t.name: t for t in m.cfg.members}
    assert by["acme"].requests_per_s == 6.0 and by["acme"].keys_sha256 == [sha("k-acme2")]
    # The key the controller gave "new" is no longer yaml-only's.
    assert by["yaml-only"].keys_sha256 == [sha("k-yaml")]
    assert by["yaml-only"].max_concurrency == 8
    # A class this balancer lacks is dropped; the default falls back to one it may use.
    assert by["new"].classes == ["gold"] and by["new"].default_class == "gold"
    assert m.cfg.classes == ["gold", "bronze"]  # lb.yaml keeps its classes
    assert m.shares == {"acme": 3, "new": 2}


def test_bad_records_are_skipped_not_fatal() -> None:
    m = merge(BASE, [{"name": "", "share": 2}, {"keys_sha256": ["nope"], "name": "x"},
                     {"name": "ok", "share": "many"}, {"name": "fine", "share": 2}])
    assert m.shares == {"fine": 2}


def test_each_tenant_is_divided_by_its_own_share() -> None:
    m = merge(BASE, [{"name": "acme", "requests_per_s": 6.0, "max_concurrency": 5,
                      "share": 3}])
    lim = limiter_of(m, local_share=2, now=0.0)
    assert lim.state["acme"].requests is not None
    assert lim.state["acme"].requests.rate == pytest.approx(2.0)  # 6 / 3 balancers
    assert lim.state["acme"].max_concurrency == 2  # ceil(5 / 3)
    assert lim.state["yaml-only"].max_concurrency == 4  # lb.yaml's: 8 / local share 2
    assert DEFAULT_TENANT in lim.state


def test_a_push_carries_over_what_the_limiter_counted() -> None:
    pushed = [{"name": "acme", "requests_per_s": 4.0, "max_concurrency": 4, "share": 2}]
    old = limiter_of(merge(BASE, pushed), 1, now=0.0)
    old.admit("acme", 1, 0.0, 0.0)
    old.admit("acme", 1, 0.0, 0.0)  # the bucket (burst 2) is empty, concurrency full
    with pytest.raises(TenantLimited):
        old.admit("acme", 1, 0.0, 0.0)
    # A balancer died: the share grows from 1/2 to the whole limit. In flight stays,
    # and the bucket is as empty as it was: a push is no fresh burst.
    new = limiter_of(merge(BASE, [{**pushed[0], "share": 1}]), 1, now=0.0, old=old)
    assert new.state["acme"].in_flight == 2
    assert new.state["acme"].max_concurrency == 4
    assert new.state["acme"].requests is not None
    assert new.state["acme"].requests.level == pytest.approx(0.0)
    assert new.state["acme"].requests.rate == pytest.approx(4.0)


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def gate(cfg: TenantsConfig) -> tuple[TenantGate, Clock]:
    clock = Clock()
    return TenantGate(cfg, share=1, capacity=10, queued=lambda m: 0,
                      metrics=BalancerMetrics().enable_tenants(), clock=clock,
                      wall=lambda: 0.0), clock


def admitted(g: TenantGate, key: str, n: int) -> int:
    tenant, cls = g.classify(bytes.fromhex(sha(key)), {}, None)
    ok = 0
    for _ in range(n):
        try:
            g.admit(tenant, cls, "m", 1)
            ok += 1
        except TenantLimited:
            pass
    return ok


def test_gate_applies_a_push_and_a_delete_reverts() -> None:
    g, clock = gate(TenantsConfig())
    push: list[dict[str, Any]] = [{"name": "acme", "keys_sha256": [sha("k-acme")],
                                   "requests_per_s": 2.0, "share": 2}]
    assert g.classify(bytes.fromhex(sha("k-acme")), {}, None)[0] == DEFAULT_TENANT
    assert g.set_pushed(push)
    assert not g.set_pushed(push)  # the same again: nothing rebuilt
    assert g.classify(bytes.fromhex(sha("k-acme")), {}, None) == ("acme", "standard")
    assert admitted(g, "k-acme", 5) == 1  # 2/s over 2 balancers: a burst of 1 here
    clock.t += 1.0
    assert admitted(g, "k-acme", 5) == 1
    assert g.set_pushed([])  # deleted at the controller: the key is nobody's again
    assert g.classify(bytes.fromhex(sha("k-acme")), {}, None)[0] == DEFAULT_TENANT
    assert admitted(g, "k-acme", 5) == 5


def test_a_tenant_in_flight_through_a_push_is_released_on_the_new_limiter() -> None:
    g, _ = gate(TenantsConfig())
    g.set_pushed([{"name": "acme", "keys_sha256": [sha("k")], "max_concurrency": 1,
                   "share": 1}])
    adm = g.admit("acme", "standard", "m", 1)
    g.set_pushed([{"name": "acme", "keys_sha256": [sha("k")], "max_concurrency": 1,
                   "share": 1, "weight": 2.0}])
    with pytest.raises(TenantLimited):  # its request is still counted after the push
        g.admit("acme", "standard", "m", 1)
    g.leave(adm, 0)
    g.admit("acme", "standard", "m", 1)
    assert g.queue.weights["acme"] == 2.0


async def test_membership_tenants_reach_the_balancer_and_an_old_controller_changes_nothing(
        ) -> None:
    from skymesh.balancer.config import parse_config
    from skymesh.balancer.server import Balancer

    lb = Balancer(parse_config({"region": "us", "controller": {
        "url": "http://127.0.0.1:9", "balancer_id": "lb-us"}}))
    link = lb.controller
    assert link is not None and lb.handlers.gate is None
    m: dict[str, Any] = {"revision": 1, "replicas": [], "peers": [], "tenants": []}
    await link.apply(m)
    assert lb.handlers.gate is None  # nothing pushed: no gate on the request path
    acme = {"name": "acme", "keys_sha256": [sha("k")], "requests_per_s": 2.0, "share": 2}
    await link.apply({**m, "revision": 2, "tenants": [acme]})
    gate = lb.handlers.gate
    assert gate is not None and gate.book.keys[bytes.fromhex(sha("k"))] == "acme"
    assert gate.limiter.state["acme"].requests is not None
    assert gate.limiter.state["acme"].requests.rate == pytest.approx(1.0)
    # An older controller sends no tenants: what was applied stays.
    await link.apply({"revision": 3, "replicas": [], "peers": []})
    assert lb.handlers.gate is gate and "acme" in gate.book.tenants
