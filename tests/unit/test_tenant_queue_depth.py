"""``skymesh_tenant_queue_waiting{tenant,priority}``: the fair queue's waiters per tenant
and class, read at scrape time, every configured pair exported (issue #37's dashboard)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from skymesh.balancer.metrics import TenantQueueDepth
from skymesh.balancer.tenancy import FairQueue, Waiter


def waiter(tenant: str, cls: str, model: str = "m") -> Waiter:
    return Waiter(model, tenant, cls, 1.0, 0.0)


def scrape(reg: CollectorRegistry) -> dict[tuple[str, str], float]:
    fams = text_string_to_metric_families(generate_latest(reg).decode())
    fam = next(f for f in fams if f.name == "skymesh_tenant_queue_waiting")
    assert fam.type == "gauge"
    return {(s.labels["tenant"], s.labels["priority"]): s.value for s in fam.samples}


def test_depths_count_waiters_per_tenant_and_class_over_models() -> None:
    q = FairQueue(["interactive", "batch"])
    ws = [waiter("web", "interactive"), waiter("web", "interactive", model="other"),
          waiter("bulk", "batch"), waiter("web", "batch")]
    for w in ws:
        q.push(w)
    assert q.depths() == {("web", "interactive"): 2, ("bulk", "batch"): 1, ("web", "batch"): 1}
    q.remove(ws[0])
    q.drain("m")  # the rest of model m: nothing can serve it
    assert q.depths() == {("web", "interactive"): 1}
    q.remove(ws[1])
    assert q.depths() == {}


def test_every_configured_pair_is_exported_and_follows_the_queue() -> None:
    q = FairQueue(["interactive", "batch"])
    reg = CollectorRegistry()
    pairs = [("web", "interactive"), ("web", "batch"), ("bulk", "batch")]
    reg.register(TenantQueueDepth(lambda: pairs, q.depths))
    assert scrape(reg) == dict.fromkeys(pairs, 0.0)
    w = waiter("bulk", "batch")
    q.push(w)
    q.push(waiter("bulk", "batch"))
    assert scrape(reg) == {("web", "interactive"): 0.0, ("web", "batch"): 0.0,
                           ("bulk", "batch"): 2.0}
    q.remove(w)
    assert scrape(reg)[("bulk", "batch")] == 1.0
