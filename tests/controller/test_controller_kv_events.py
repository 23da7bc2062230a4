"""A replica's KV-event endpoint at the controller (issue #36): stored with the replica,
changed by PUT and PATCH, returned in its balancer's membership; anything the balancer's
KVEventsEndpoint would refuse is a 422 in the admin error shape, naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from controller_support import AGENT, auth, token_config
from fastapi.testclient import TestClient

from skymesh_controller.api import build_app
from skymesh_controller.config import parse_config
from skymesh_controller.models import MAX_ENDPOINT_CHARS

KV = {"endpoint": "tcp://10.0.0.5:5557", "replay_endpoint": "tcp://10.0.0.5:5558"}
REPLICA = {"url": "http://127.0.0.1:9001", "model": "llama", "region": "us-east",
           "gpu": "L4"}


@contextmanager
def client(store: str) -> Iterator[TestClient]:
    cfg = parse_config({"store": store, "tokens": token_config(),
                        "url_policy": {"allow_loopback": True}})
    with TestClient(build_app(cfg, probe=False)) as c:
        assert c.post("/v1/regions", headers=auth(), json={
            "name": "us-east", "latitude": 38.9, "longitude": -77.0}).status_code == 201
        assert c.post("/v1/balancers", headers=auth(AGENT), json={
            "id": "lb-us", "region": "us-east", "url": "http://127.0.0.1:1"}).status_code == 201
        yield c


def member(c: TestClient) -> dict[str, Any]:
    (rep,) = c.get("/v1/balancers/lb-us/membership", headers=auth(AGENT)).json()["replicas"]
    return rep


def test_kv_events_round_trip_through_put_patch_and_membership(store_spec: str) -> None:
    with client(store_spec) as c:
        r = c.post("/v1/replicas", headers=auth(AGENT), json={**REPLICA, "kv_events": KV})
        assert r.status_code == 201, r.text
        rid = r.json()["id"]
        assert r.json()["kv_events"] == KV
        assert c.get(f"/v1/replicas/{rid}", headers=auth()).json()["kv_events"] == KV
        assert member(c)["kv_events"] == KV
        # PATCH without the field keeps it; with one, replaces it; null removes it
        c.patch(f"/v1/replicas/{rid}", headers=auth(), json={"gpu": "H100"})
        assert member(c)["kv_events"] == KV
        ipc = {"endpoint": "ipc:///run/kv.sock", "replay_endpoint": None}
        assert c.patch(f"/v1/replicas/{rid}", headers=auth(),
                       json={"kv_events": ipc}).status_code == 200
        assert member(c)["kv_events"] == ipc
        assert c.patch(f"/v1/replicas/{rid}", headers=auth(),
                       json={"kv_events": None}).status_code == 200
        assert member(c)["kv_events"] is None
        # PUT is every field: leaving it out removes it
        assert c.put(f"/v1/replicas/{rid}", headers=auth(),
                     json={**REPLICA, "kv_events": KV}).json()["kv_events"] == KV
        assert c.put(f"/v1/replicas/{rid}", headers=auth(),
                     json=REPLICA).json()["kv_events"] is None


def test_a_replica_without_kv_events_says_none(store_spec: str) -> None:
    with client(store_spec) as c:
        assert c.post("/v1/replicas", headers=auth(), json=REPLICA).status_code == 201
        assert member(c)["kv_events"] is None


@pytest.mark.parametrize("kv", [
    {"endpoint": "http://10.0.0.5:5557"},                 # not a ZeroMQ transport
    {"endpoint": "tcp://*:5557"},                         # the publisher's bind address
    {"endpoint": "tcp://10.0.0.5:5557", "replay_endpoint": "udp://10.0.0.5:1"},
    {"endpoint": "tcp://10.0.0.5:5557\n"},                # control characters
    {"endpoint": "tcp://" + "a" * MAX_ENDPOINT_CHARS},    # over the bound
    {"endpoint": "tcp://10.0.0.5:5557", "colour": "red"},  # unknown key
    {"replay_endpoint": "tcp://10.0.0.5:5558"},           # no endpoint
    {"endpoint": 5557},                                   # not a string
])
def test_a_bad_endpoint_is_a_422_naming_the_field(kv: dict[str, Any]) -> None:
    with client("memory") as c:
        r = c.post("/v1/replicas", headers=auth(), json={**REPLICA, "kv_events": kv})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["type"] and all(f["field"].startswith("kv_events")
                                   for f in err["fields"])
        assert c.get("/v1/replicas", headers=auth()).json() == []  # nothing was written
        c.post("/v1/replicas", headers=auth(), json=REPLICA)
        rid = c.get("/v1/replicas", headers=auth()).json()[0]["id"]
        assert c.patch(f"/v1/replicas/{rid}", headers=auth(),
                       json={"kv_events": kv}).status_code == 422
