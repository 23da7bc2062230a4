"""``/v1/tenants`` on both stores: round trip, validation (4xx in the admin shape), the
``tenants`` token scope, and the tenants in each balancer's membership with its share."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from controller_support import AGENT, READER, auth, token_config
from fastapi.testclient import TestClient

from skymesh_controller.api import build_app
from skymesh_controller.auth import digest
from skymesh_controller.config import parse_config

TENANTER = "tenants-token-for-tests"
KEY = hashlib.sha256(b"sk-acme-1").hexdigest()
ACME = {"keys_sha256": [KEY], "requests_per_s": 10.0, "tokens_per_min": 6000.0,
        "classes": ["interactive", "standard"], "default_class": "standard"}


@contextmanager
def client(store: str, **extra: Any) -> Iterator[TestClient]:
    tokens = [*token_config(), {"name": "billing", "sha256": digest(TENANTER),
                                "role": "tenants"}]
    cfg = parse_config({"store": store, "tokens": tokens,
                        "url_policy": {"allow_loopback": True}, **extra})
    with TestClient(build_app(cfg, probe=False)) as c:
        yield c


def error(r: Any, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and {"type", "message"} <= set(body["error"])
    return str(body["error"]["message"])


def test_tenants_round_trip(store_spec: str) -> None:
    with client(store_spec) as c:
        r = c.put("/v1/tenants/acme", json=ACME, headers=auth())
        assert r.status_code == 200, r.text
        saved = r.json()
        assert saved["name"] == "acme" and saved["scope"] == "global"
        assert saved["keys_sha256"] == [KEY] and saved["requests_per_s"] == 10.0
        assert c.get("/v1/tenants/acme", headers=auth(READER)).json() == saved
        assert c.get("/v1/tenants", headers=auth(READER)).json() == [saved]
        # PUT replaces whole: a limit left out is no limit.
        r = c.put("/v1/tenants/acme", json={"name": "acme", "max_concurrency": 4,
                                            "scope": "region"}, headers=auth())
        assert r.status_code == 200, r.text
        got = c.get("/v1/tenants/acme", headers=auth()).json()
        assert got["requests_per_s"] is None and got["max_concurrency"] == 4
        assert got["scope"] == "region" and got["keys_sha256"] == []
        assert c.delete("/v1/tenants/acme", headers=auth()).status_code == 204
        error(c.get("/v1/tenants/acme", headers=auth()), 404)
        error(c.delete("/v1/tenants/acme", headers=auth()), 404)
        assert c.get("/v1/tenants", headers=auth()).json() == []


@pytest.mark.parametrize("body, field", [
    ({"keys_sha256": ["sk-live-plaintext-key"]}, "keys_sha256"),
    ({"keys": ["sk-live-plaintext-key"]}, "keys"),
    ({"requests_per_s": 0}, "requests_per_s"),
    ({"requests_per_s": "10"}, "requests_per_s"),
    ({"max_concurrency": 1.5}, "max_concurrency"),
    ({"scope": "planet"}, "scope"),
    ({"classes": ["Gold"]}, "Gold"),
    ({"classes": ["batch"], "default_class": "interactive"}, "default_class"),
    ({"keys_sha256": [KEY, KEY]}, "twice"),
    ({"name": "other"}, "name"),
])
def test_bad_tenant_is_a_422_naming_the_field(body: dict[str, Any], field: str) -> None:
    with client("memory") as c:
        msg = error(c.put("/v1/tenants/acme", json=body, headers=auth()), 422)
        assert field in msg
        assert "plaintext-key" not in msg  # a key pasted by mistake is never echoed
        assert c.get("/v1/tenants", headers=auth()).json() == []


def test_bad_tenant_names_and_shared_keys_are_refused() -> None:
    with client("memory") as c:
        error(c.put("/v1/tenants/-bad", json={}, headers=auth()), 422)
        error(c.put("/v1/tenants/" + "x" * 70, json={}, headers=auth()), 422)
        assert c.put("/v1/tenants/acme", json=ACME, headers=auth()).status_code == 200
        msg = error(c.put("/v1/tenants/other", json={"keys_sha256": [KEY.upper()]},
                          headers=auth()), 409)
        assert "acme" in msg
        # Its own key again is no conflict.
        assert c.put("/v1/tenants/acme", json=ACME, headers=auth()).status_code == 200


def test_max_tenants_bounds_what_every_balancer_is_sent() -> None:
    with client("memory", max_tenants=2) as c:
        for name in ("a", "b"):
            assert c.put(f"/v1/tenants/{name}", json={}, headers=auth()).status_code == 200
        msg = error(c.put("/v1/tenants/c", json={}, headers=auth()), 403)
        assert "max_tenants" in msg
        assert c.put("/v1/tenants/a", json={"weight": 2.0},  # replacing one is no new one
                     headers=auth()).status_code == 200
        metrics = c.get("/metrics", headers=auth()).text
        assert 'skymesh_controller_refused_total{reason="tenant_quota"} 1.0' in metrics


def test_tenants_scope_is_least_privilege() -> None:
    with client("memory") as c:
        for token in (READER, AGENT):
            msg = error(c.put("/v1/tenants/acme", json=ACME, headers=auth(token)), 403)
            assert "tenants" in msg
        error(c.put("/v1/tenants/acme", json=ACME), 401)
        assert c.put("/v1/tenants/acme", json=ACME, headers=auth(TENANTER)).status_code == 200
        assert c.get("/v1/tenants", headers=auth(TENANTER)).status_code == 200
        assert c.delete("/v1/tenants/acme", headers=auth(READER)).status_code == 403
        # The tenants scope administers nothing else.
        region = {"name": "us", "latitude": 1.0, "longitude": 2.0}
        error(c.post("/v1/regions", json=region, headers=auth(TENANTER)), 403)
        error(c.post("/v1/balancers", json={"id": "b", "region": "us",
                                            "url": "http://127.0.0.1:1"},
                     headers=auth(TENANTER)), 403)
        assert c.delete("/v1/tenants/acme", headers=auth(TENANTER)).status_code == 204


def test_membership_carries_tenants_with_each_balancers_share(store_spec: str) -> None:
    with client(store_spec) as c:
        for name, lat in (("us", 38.9), ("eu", 53.3)):
            assert c.post("/v1/regions", headers=auth(), json={
                "name": name, "latitude": lat, "longitude": 0.0}).status_code == 201
        for bid, region in (("us-a", "us"), ("us-b", "us"), ("eu-a", "eu")):
            r = c.post("/v1/balancers", headers=auth(AGENT), json={
                "id": bid, "region": region, "url": f"http://127.0.0.1:{len(bid) + 1}"})
            assert r.status_code == 201, r.text
        assert c.put("/v1/tenants/acme", json=ACME, headers=auth()).status_code == 200
        assert c.put("/v1/tenants/local", json={"requests_per_s": 4.0, "scope": "region"},
                     headers=auth()).status_code == 200

        def pushed(bid: str) -> dict[str, Any]:
            m = c.get(f"/v1/balancers/{bid}/membership", headers=auth(AGENT)).json()
            return {t["name"]: t for t in m["tenants"]}

        us = pushed("us-a")
        assert us["acme"]["share"] == 3 and us["local"]["share"] == 2
        assert us["acme"]["keys_sha256"] == [KEY] and us["acme"]["requests_per_s"] == 10.0
        eu = pushed("eu-a")
        assert eu["acme"]["share"] == 3 and eu["local"]["share"] == 1

        # A balancer that dies is left out: the others' shares grow at the next push.
        ctl = c.app.state.controller  # type: ignore[attr-defined]
        dead = {**c.get("/v1/balancers/us-b", headers=auth()).json(), "state": "down"}
        before = c.get("/v1/balancers/us-a/membership", headers=auth(AGENT)).json()
        c.portal.call(ctl.changes.commit, [("balancers", "us-b", dead)])  # type: ignore[union-attr]
        after = c.get("/v1/balancers/us-a/membership", headers=auth(AGENT)).json()
        assert after["revision"] > before["revision"]  # wakes the long polls
        us = {t["name"]: t for t in after["tenants"]}
        assert us["acme"]["share"] == 2 and us["local"]["share"] == 1

        assert c.delete("/v1/tenants/acme", headers=auth()).status_code == 204
        assert set(pushed("us-a")) == {"local"}


def test_telemetry_demand_moves_the_fractions_and_its_answer_carries_them(
        store_spec: str) -> None:
    with client(store_spec, tenant_share_floor=0.2) as c:
        assert c.post("/v1/regions", headers=auth(), json={
            "name": "us", "latitude": 38.9, "longitude": 0.0}).status_code == 201
        for bid in ("us-a", "us-b"):
            r = c.post("/v1/balancers", headers=auth(AGENT), json={
                "id": bid, "region": "us", "url": f"http://127.0.0.1:{len(bid) + 1}"})
            assert r.status_code == 201, r.text
        assert c.put("/v1/tenants/acme", json=ACME, headers=auth()).status_code == 200

        def report(bid: str, rps: float, worker: int = 0) -> Any:
            return c.post(f"/v1/balancers/{bid}/telemetry", headers=auth(AGENT), json={
                "window_s": 5, "worker": worker,
                "tenants": {"acme": {"requests_per_s": rps, "tokens_per_min": 0.0}}})

        def fraction(bid: str) -> float:
            m = c.get(f"/v1/balancers/{bid}/membership", headers=auth(AGENT)).json()
            return float(m["tenants"][0]["fraction"])

        assert fraction("us-a") == 0.5  # nothing reported yet: even
        # A report without tenants (an older balancer) is answered as before.
        assert c.post("/v1/balancers/us-a/telemetry", headers=auth(AGENT),
                      json={"window_s": 5}).status_code == 204
        r = report("us-a", 30.0)
        assert r.status_code == 200, r.text
        (acme,) = r.json()["tenants"]
        assert r.json()["revision"] >= 0 and acme["name"] == "acme"
        # All traffic at us-a: us-b (no report) holds the floor, 0.2 / 2.
        assert acme["fraction"] == pytest.approx(0.9) and acme["share"] == 2
        assert fraction("us-b") == pytest.approx(0.1)
        # us-b's two workers report 10/s each: 30 against 20.
        assert report("us-b", 10.0, worker=0).status_code == 200
        got = report("us-b", 10.0, worker=1).json()["tenants"][0]
        assert got["fraction"] == pytest.approx(0.4)
        assert fraction("us-a") == pytest.approx(0.6)
        bad = c.post("/v1/balancers/us-a/telemetry", headers=auth(AGENT), json={
            "window_s": 5, "tenants": {"acme": {"requests_per_s": -1}}})
        assert "requests_per_s" in error(bad, 422)
