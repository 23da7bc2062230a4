"""Every admin endpoint on both stores: happy paths, validation errors, auth, durability."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from controller_support import ADMIN, AGENT, READER, RedisServer, auth, token_config
from fastapi.testclient import TestClient

from skymesh_controller.api import build_app
from skymesh_controller.config import parse_config

US = {"name": "us-east", "latitude": 38.9, "longitude": -77.0, "cloud_region": "us-east-1"}
EU = {"name": "eu-west", "latitude": 53.3, "longitude": -6.3}
ASIA = {"name": "ap-northeast", "latitude": 35.7, "longitude": 139.7}


@contextmanager
def client(store: str) -> Iterator[TestClient]:
    cfg = parse_config({"store": store, "tokens": token_config(),
                        "url_policy": {"allow_loopback": True}})
    with TestClient(build_app(cfg, probe=False)) as c:
        yield c


def seed(c: TestClient) -> dict[str, Any]:
    for region in (US, EU, ASIA):
        assert c.post("/v1/regions", json=region, headers=auth()).status_code == 201
    for bid, region, port in (("lb-us", "us-east", 1), ("lb-eu", "eu-west", 2),
                              ("lb-asia", "ap-northeast", 3)):
        r = c.post("/v1/balancers", headers=auth(AGENT), json={
            "id": bid, "region": region, "url": f"http://127.0.0.1:{port}",
            "peer_address": f"127.0.0.1:{port + 100}"})
        assert r.status_code == 201, r.text
    r = c.post("/v1/replicas", headers=auth(), json={
        "url": "http://127.0.0.1:9001", "model": "llama", "region": "us-east", "gpu": "L4"})
    assert r.status_code == 201, r.text
    return r.json()


def test_health_is_open_and_everything_else_needs_a_token(store_spec: str) -> None:
    with client(store_spec) as c:
        assert c.get("/health").json() == {"status": "ok"}
        for path in ("/v1/regions", "/v1/balancers", "/v1/replicas", "/v1/models",
                     "/v1/status", "/v1/telemetry"):
            r = c.get(path)
            assert r.status_code == 401, path
            assert r.headers["www-authenticate"] == "Bearer"
            assert c.get(path, headers=auth("wrong")).status_code == 401
            assert c.get(path, headers=auth(READER)).status_code == 200


def test_read_token_cannot_write_and_agent_cannot_administer(store_spec: str) -> None:
    with client(store_spec) as c:
        r = c.post("/v1/regions", json=US, headers=auth(READER))
        assert r.status_code == 403
        assert "admin" in r.json()["error"]["message"]
        assert c.post("/v1/regions", json=US, headers=auth(AGENT)).status_code == 403
        assert c.get("/v1/regions", headers=auth()).json() == []  # nothing was written
        assert c.post("/v1/regions", json=US, headers=auth(ADMIN)).status_code == 201


def test_regions_crud_and_validation_names_the_field(store_spec: str) -> None:
    with client(store_spec) as c:
        assert c.post("/v1/regions", json=US, headers=auth()).json() == US
        listed = c.get("/v1/regions", headers=auth()).json()
        assert listed == [US]
        bad = c.post("/v1/regions", json={**EU, "latitude": 123}, headers=auth())
        assert bad.status_code == 422
        assert bad.json()["error"]["fields"][0]["field"] == "latitude"
        assert "latitude" in bad.json()["error"]["message"]
        missing = c.post("/v1/regions", json={"name": "x"}, headers=auth())
        assert {f["field"] for f in missing.json()["error"]["fields"]} == {"latitude",
                                                                          "longitude"}
        extra = c.post("/v1/regions", json={**EU, "colour": "red"}, headers=auth())
        assert extra.status_code == 422 and "colour" in extra.json()["error"]["message"]
        assert c.post("/v1/regions", json={**EU, "name": "bad name!"},
                      headers=auth()).status_code == 422
        assert c.get("/v1/regions/us-east", headers=auth()).json()["latitude"] == 38.9
        assert c.get("/v1/regions/nowhere", headers=auth()).status_code == 404
        assert c.delete("/v1/regions/us-east", headers=auth()).status_code == 204
        assert c.get("/v1/regions", headers=auth()).json() == []


def test_balancers_replicas_models_and_membership(store_spec: str) -> None:
    with client(store_spec) as c:
        rep = seed(c)
        assert rep["balancer"] == "lb-us" and rep["assigned"] == "lb-us"
        assert rep["state"] == "unknown" and rep["gpu"] == "L4"
        # a replica in a region with no such region, or an unknown home: 422 naming it
        r = c.post("/v1/replicas", headers=auth(), json={
            "url": "http://127.0.0.1:9002", "model": "m", "region": "mars", "gpu": "L4"})
        assert r.status_code == 422 and "region" in r.json()["error"]["message"]
        r = c.post("/v1/replicas", headers=auth(), json={
            "url": "ftp://x", "model": "m", "region": "us-east", "gpu": "L4"})
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "url"
        r = c.post("/v1/replicas", headers=auth(), json={
            "url": "http://127.0.0.1:9001", "model": "llama", "region": "us-east",
            "gpu": "L4", "id": "other-id"})
        assert r.status_code == 409  # the same URL under a second id
        m = c.get("/v1/balancers/lb-us/membership", headers=auth(AGENT)).json()
        assert [x["url"] for x in m["replicas"]] == ["http://127.0.0.1:9001"]
        assert {p["id"] for p in m["peers"]} == {"lb-eu", "lb-asia"}
        assert c.get("/v1/balancers/lb-eu/membership", headers=auth()).json()["replicas"] == []
        models = c.get("/v1/models", headers=auth()).json()
        assert models[0]["name"] == "llama" and models[0]["replicas"] == 1
        assert c.post("/v1/models", headers=auth(), json={
            "name": "llama", "min_replicas": 2, "max_replicas": 1}).status_code == 422
        assert c.post("/v1/models", headers=auth(), json={
            "name": "qwen", "min_replicas": 1, "ttft_slo_s": 2.0}).status_code == 201
        names = {m["name"]: m for m in c.get("/v1/models", headers=auth()).json()}
        assert names["qwen"]["declared"] and names["qwen"]["replicas"] == 0
        assert c.delete("/v1/models/qwen", headers=auth()).status_code == 204
        # a region or balancer still in use cannot be deleted
        assert c.delete("/v1/regions/us-east", headers=auth()).status_code == 409
        assert c.delete("/v1/balancers/lb-us", headers=auth()).status_code == 409
        # drain takes the replica out of its balancer's membership; undrain brings it back
        rid = rep["id"]
        assert c.post(f"/v1/replicas/{rid}/drain", headers=auth()).json()["state"] == "draining"
        assert c.get("/v1/balancers/lb-us/membership", headers=auth()).json()["replicas"] == []
        c.post(f"/v1/replicas/{rid}/undrain", headers=auth())
        assert len(c.get("/v1/balancers/lb-us/membership",
                         headers=auth()).json()["replicas"]) == 1
        assert c.delete(f"/v1/replicas/{rid}", headers=auth()).status_code == 204
        assert c.get(f"/v1/replicas/{rid}", headers=auth()).status_code == 404
        assert c.delete("/v1/balancers/lb-us", headers=auth()).status_code == 204


def test_policy_switch_is_validated_and_reaches_membership(store_spec: str) -> None:
    with client(store_spec) as c:
        seed(c)
        r = c.put("/v1/balancers/lb-us/policy", headers=auth(), json={"policy": "nope"})
        assert r.status_code == 422 and "nope" in r.json()["error"]["message"]
        r = c.put("/v1/balancers/lb-us/policy", headers=auth(),
                  json={"policy": "consistent-hash", "params": {"bogus": 1}})
        assert r.status_code == 422
        before = c.get("/v1/balancers/lb-us/membership", headers=auth()).json()["revision"]
        r = c.put("/v1/balancers/lb-us/policy", headers=auth(), json={"policy": "least-load"})
        assert r.status_code == 200
        m = c.get("/v1/balancers/lb-us/membership",
                  params={"after": before, "wait": 5}, headers=auth()).json()
        assert m["policy"] == "least-load" and m["revision"] > before
        # re-registration (a balancer restart) keeps the policy set by the operator
        c.post("/v1/balancers", headers=auth(AGENT), json={
            "id": "lb-us", "region": "us-east", "url": "http://127.0.0.1:1"})
        assert c.get("/v1/balancers/lb-us", headers=auth()).json()["policy"] == "least-load"
        assert c.put("/v1/balancers/ghost/policy", headers=auth(),
                     json={"policy": "least-load"}).status_code == 404


def test_long_poll_returns_at_once_when_behind_and_waits_when_current(
        store_spec: str) -> None:
    with client(store_spec) as c:
        seed(c)
        now = c.get("/v1/balancers/lb-us/membership", headers=auth()).json()["revision"]
        behind = c.get("/v1/balancers/lb-us/membership", params={"after": now - 1, "wait": 30},
                       headers=auth())
        assert behind.json()["revision"] == now
        current = c.get("/v1/balancers/lb-us/membership", params={"after": now, "wait": 0.2},
                        headers=auth())
        assert current.json()["revision"] == now  # timed out with no change


def test_telemetry_and_status(store_spec: str) -> None:
    with client(store_spec) as c:
        seed(c)
        sample = {"window_s": 5, "models": {"llama": {"requests": 50, "prompt_tokens": 5000,
                                                      "output_tokens": 2000}},
                  "queue_length": 4, "in_flight": 7}
        assert c.post("/v1/balancers/lb-us/telemetry", json=sample,
                      headers=auth(AGENT)).status_code == 204
        bad = c.post("/v1/balancers/lb-us/telemetry", headers=auth(AGENT),
                     json={**sample, "queue_length": -1})
        assert bad.status_code == 422 and "queue_length" in bad.json()["error"]["message"]
        assert c.post("/v1/balancers/ghost/telemetry", json=sample,
                      headers=auth(AGENT)).status_code == 404
        tel = c.get("/v1/telemetry", params={"region": "us-east"}, headers=auth()).json()
        assert len(tel) == 1 and tel[0]["balancer"] == "lb-us"
        assert tel[0]["models"]["llama"]["prompt_tokens"] == 5000
        st = c.get("/v1/status", headers=auth()).json()
        assert st["regions"] == 3 and st["balancers"] == {"unknown": 3}
        us = st["per_region"]["us-east"]
        assert us["queue_length"] == 4 and us["requests_per_s"] == pytest.approx(10.0)


def test_oversized_body_is_refused(store_spec: str) -> None:
    with client(store_spec) as c:
        r = c.post("/v1/regions", content=b"{" + b" " * (2 * 1024 * 1024) + b"}",
                   headers={**auth(), "Content-Type": "application/json"})
        assert r.status_code == 413


def test_state_survives_a_controller_restart(redis_server: RedisServer) -> None:
    with client(redis_server.url) as c:
        rep = seed(c)
        c.put("/v1/balancers/lb-eu/policy", headers=auth(), json={"policy": "least-load"})
    with client(redis_server.url) as c:
        assert len(c.get("/v1/regions", headers=auth()).json()) == 3
        assert c.get(f"/v1/replicas/{rep['id']}", headers=auth()).json()["assigned"] == "lb-us"
        assert c.get("/v1/balancers/lb-eu", headers=auth()).json()["policy"] == "least-load"


def test_state_survives_a_redis_crash_through_the_aof(redis_server: RedisServer) -> None:
    with client(redis_server.url) as c:
        rep = seed(c)
        rev = c.get("/v1/status", headers=auth()).json()["revision"]
    redis_server.restart(kill=True)  # SIGKILL: only what the AOF holds comes back
    with client(redis_server.url) as c:
        assert c.get(f"/v1/replicas/{rep['id']}", headers=auth()).status_code == 200
        assert c.get("/v1/status", headers=auth()).json()["revision"] == rev


def test_redis_restart_costs_no_request(redis_server: RedisServer) -> None:
    # Regression: the first request after a clean Redis restart used the pool's dead
    # connection and got a 503; redis-py's retry policy now reconnects and retries.
    with client(redis_server.url) as c:
        seed(c)
        for _ in range(2):
            redis_server.restart()
            r = c.get("/v1/regions", headers=auth())
            assert r.status_code == 200, r.text
            assert c.post("/v1/models", headers=auth(), json={"name": "m"}).status_code == 201


def test_redis_outage_gives_503_not_a_crash(redis_server: RedisServer) -> None:
    with client(redis_server.url) as c:
        seed(c)
        redis_server.stop(kill=True)
        r = c.get("/v1/regions", headers=auth())
        assert r.status_code == 503 and r.json()["error"]["type"] == "store_unavailable"
        redis_server.start()
        assert c.get("/v1/regions", headers=auth()).status_code == 200


def test_telemetry_series_endpoint(store_spec: str) -> None:
    with client(store_spec) as c:
        seed(c)
        sample = {"window_s": 5, "models": {"llama": {"requests": 3, "prompt_tokens": 300,
                                                      "output_tokens": 90}}}
        for _ in range(2):
            c.post("/v1/balancers/lb-us/telemetry", json=sample, headers=auth(AGENT))
        s = c.get("/v1/telemetry/series", params={"model": "llama", "window": 3600},
                  headers=auth()).json()
        assert sum(s["requests"]) == 6 and sum(s["prompt_tokens"]) == 600
        csv = c.get("/v1/telemetry/series", params={"format": "csv", "window": 3600},
                    headers=auth())
        assert csv.headers["content-type"].startswith("text/csv")
        assert csv.text.splitlines()[0] == "t_seconds,requests,prompt_tokens,output_tokens"
        bad = c.get("/v1/telemetry/series", params={"window": 0}, headers=auth())
        assert bad.status_code == 422 and "window" in bad.json()["error"]["message"]


def test_forecast_versus_actual(store_spec: str) -> None:
    with client(store_spec) as c:
        seed(c)
        assert c.get("/v1/forecast", headers=auth()).json() == {"series": []}
        sample = {"window_s": 5, "models": {"llama": {"requests": 3, "prompt_tokens": 300,
                                                      "output_tokens": 90}}}
        c.post("/v1/balancers/lb-us/telemetry", json=sample, headers=auth(AGENT))
        r = c.get("/v1/forecast", params={"window": 60, "horizon": 3}, headers=auth())
        (s,) = r.json()["series"]
        assert (s["model"], s["region"], s["metric"]) == ("llama", "us-east", "prompt_tokens")
        assert s["forecaster"].startswith("persistence")
        assert s["points"][0]["actual"] == 300
        assert [p["forecast"] for p in s["points"][1:]] == [300.0] * 3
        bad = c.get("/v1/forecast", params={"forecaster": "prophet"}, headers=auth())
        assert bad.status_code == 422 and "forecaster" in bad.json()["error"]["message"]
