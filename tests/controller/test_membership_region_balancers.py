"""The membership's ``region_balancers``: sp-p's n for ``pushing.balancers_per_region: auto``."""

from __future__ import annotations

from controller_support import AGENT, auth, token_config
from fastapi.testclient import TestClient

from skymesh_controller.api import build_app
from skymesh_controller.config import parse_config


def test_region_balancers_counts_live_same_owner_siblings() -> None:
    cfg = parse_config({"store": "memory", "tokens": token_config(),
                        "url_policy": {"allow_loopback": True}})
    with TestClient(build_app(cfg, probe=False)) as c:
        for name, lat in (("us", 38.9), ("eu", 53.3)):
            assert c.post("/v1/regions", headers=auth(), json={
                "name": name, "latitude": lat, "longitude": 0.0}).status_code == 201
        # Two of the agent's in us, one in eu, and one in us that another owner (the
        # admin) registered: it shares none of the agent's replicas.
        for bid, region, token in (("us-a", "us", AGENT), ("us-b", "us", AGENT),
                                   ("eu-a", "eu", AGENT), ("us-x", "us", None)):
            r = c.post("/v1/balancers", headers=auth(token) if token else auth(), json={
                "id": bid, "region": region, "url": f"http://127.0.0.1:{len(bid)}"})
            assert r.status_code == 201, r.text

        def count(bid: str) -> int:
            m = c.get(f"/v1/balancers/{bid}/membership", headers=auth(AGENT)).json()
            return int(m["region_balancers"])

        assert (count("us-a"), count("us-b"), count("eu-a")) == (2, 2, 1)
        assert c.delete("/v1/balancers/us-b", headers=auth()).status_code == 204
        assert count("us-a") == 1
