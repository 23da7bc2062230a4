"""The controller's ``GET /metrics``: open, parsed with prometheus_client's own parser,
inventory by state from the store, probe results, API requests by route template, and a
store outage reported as a value rather than an error."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from controller_support import ADMIN, AGENT, RedisServer, auth, free_port, token_config
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from skymesh_controller.api import build_app
from skymesh_controller.config import parse_config

Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@contextmanager
def client(store: str = "memory") -> Iterator[TestClient]:
    cfg = parse_config({"store": store, "tokens": token_config(),
                        "url_policy": {"allow_loopback": True}})
    with TestClient(build_app(cfg, probe=False)) as c:
        yield c


def scrape(c: TestClient) -> tuple[Sample, dict[str, str]]:
    """Every sample by (name, sorted labels), and each family's type."""
    r = c.get("/metrics")  # no token: Prometheus scrapes it like /health
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    samples: Sample = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(r.text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def seed(c: TestClient) -> list[str]:
    for name in ("us-east", "eu-west"):
        r = c.post("/v1/regions", headers=auth(),
                   json={"name": name, "latitude": 1.0, "longitude": 2.0})
        assert r.status_code == 201, r.text
    # Closed ports: every probe of them fails.
    for bid, region in (("lb-us", "us-east"), ("lb-eu", "eu-west")):
        r = c.post("/v1/balancers", headers=auth(AGENT), json={
            "id": bid, "region": region, "url": f"http://127.0.0.1:{free_port()}"})
        assert r.status_code == 201, r.text
    ids = []
    for model in ("llama", "llama", "qwen"):
        r = c.post("/v1/replicas", headers=auth(), json={
            "url": f"http://127.0.0.1:{free_port()}", "model": model, "region": "us-east",
            "gpu": "L4"})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    return ids


def test_inventory_by_state_probes_and_routes() -> None:
    with client() as c:
        ids = seed(c)
        assert c.post(f"/v1/replicas/{ids[0]}/drain", headers=auth()).status_code == 200
        ctl = c.app.state.controller  # type: ignore[attr-defined]
        c.portal.call(ctl.probe_once)  # type: ignore[union-attr]
        for n in range(5):  # five raw paths, one route template
            assert c.get(f"/v1/replicas/r-missing{n}", headers=auth()).status_code == 404
        assert c.get("/no/such/path").status_code == 404
        samples, types = scrape(c)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("skymesh_controller_store_up") == 1
    assert value("skymesh_controller_regions") == 2
    assert value("skymesh_controller_balancers", region="us-east", state="unknown") == 1
    assert value("skymesh_controller_balancers", region="us-east", state="up") == 0
    # Every state is listed, so "no healthy replica" is a 0, not a missing series.
    assert value("skymesh_controller_replicas", region="us-east", model="llama",
                 state="draining") == 1
    assert value("skymesh_controller_replicas", region="us-east", model="qwen",
                 state="healthy") == 0
    assert sum(v for (n, _), v in samples.items() if n == "skymesh_controller_replicas") == 3
    # One round: two balancers and three replicas probed, none answered.
    assert value("skymesh_controller_probes_total", kind="balancer", result="failed") == 2
    assert value("skymesh_controller_probes_total", kind="replica", result="failed") == 3
    assert value("skymesh_controller_probes_total", kind="replica", result="ok") == 0
    assert types["skymesh_controller_probes"] == "counter"
    assert types["skymesh_controller_http_requests"] == "counter"
    assert types["skymesh_controller_http_request_duration_seconds"] == "histogram"
    req = "skymesh_controller_http_requests_total"
    assert value(req, method="GET", route="/v1/replicas/{rid}", status="404") == 5
    assert value(req, method="GET", route="(unmatched)", status="404") == 1
    assert value(req, method="POST", route="/v1/regions", status="201") == 2
    routes = {dict(lbl).get("route") for (n, lbl), _ in samples.items() if n == req}
    assert not any("missing" in str(r) for r in routes)
    assert value("skymesh_controller_http_request_duration_seconds_count",
                 route="/v1/replicas/{rid}") == 5


def test_metrics_needs_no_token_but_the_api_still_does() -> None:
    with client() as c:
        assert c.get("/v1/regions").status_code == 401
        assert c.get("/metrics").status_code == 200
        assert c.get("/v1/regions", headers=auth(ADMIN)).status_code == 200


def test_a_store_outage_is_a_value_not_a_failed_scrape(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path)
    srv.start()
    try:
        with client(srv.url) as c:
            seed(c)
            samples, _ = scrape(c)
            assert samples[("skymesh_controller_store_up", ())] == 1
            srv.stop()
            samples, _ = scrape(c)
            assert samples[("skymesh_controller_store_up", ())] == 0
            assert not any(n == "skymesh_controller_replicas" for n, _ in samples)
    finally:
        srv.stop()
