"""DNS through the real controller: ``POST /v1/dns/sync`` and the automatic withdrawal when
the controller's probes find a balancer down (moto's Route53 on loopback)."""

from __future__ import annotations

from typing import Any

import pytest
from controller_support import auth, token_config
from fastapi.testclient import TestClient

from skymesh_controller.api import build_app
from skymesh_controller.config import parse_config


def records(route53: Any, zone_id: str) -> dict[str, Any]:
    rrs = route53.list_resource_record_sets(HostedZoneId=zone_id)["ResourceRecordSets"]
    return {r["SetIdentifier"]: r for r in rrs if "SetIdentifier" in r}


def test_sync_endpoint_and_automatic_withdrawal(
        moto_url: str, zone: tuple[str, str], route53: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    name, zone_id = zone
    cfg = parse_config({
        "tokens": token_config(),
        "probe": {"interval_s": 0.1, "timeout_s": 0.2, "failure_threshold": 1},
        "dns": {"zone": name, "record": f"api.{name}", "endpoint_url": moto_url},
        # The balancers below sit on documentation addresses (TEST-NET-2).
        "url_policy": {"allow_networks": ["198.51.100.0/24"]}})
    from skymesh_controller.dns_hook import dns_hook

    app = build_app(cfg, dns=dns_hook(cfg), probe=False)
    with TestClient(app) as c:
        for region, lat, lon, cloud in (("us-east", 38.9, -77.0, "us-east-1"),
                                        ("eu-west", 53.3, -6.3, "eu-west-1")):
            c.post("/v1/regions", headers=auth(), json={
                "name": region, "latitude": lat, "longitude": lon, "cloud_region": cloud})
        for bid, region, ip in (("lb-us", "us-east", "198.51.100.7"),
                                ("lb-eu", "eu-west", "198.51.100.8")):
            c.post("/v1/balancers", headers=auth(), json={
                "id": bid, "region": region, "url": f"http://{ip}:8080"})
        ctl = app.state.controller
        for bid in ("lb-us", "lb-eu"):  # as if the probes had found them up
            c.portal.call(_set_state, ctl, bid, "up")
        dry = c.post("/v1/dns/sync", json={"dry_run": True}, headers=auth()).json()
        assert sorted(dry["created"]) == ["lb-eu", "lb-us"] and dry["dry_run"] is True
        assert records(route53, zone_id) == {}
        done = c.post("/v1/dns/sync", json={}, headers=auth()).json()
        assert sorted(done["created"]) == ["lb-eu", "lb-us"]
        assert {k: r["Region"] for k, r in records(route53, zone_id).items()} == {
            "lb-us": "us-east-1", "lb-eu": "eu-west-1"}
        # These addresses do not answer: one probe round marks both down, and the
        # controller withdraws their records on its own.
        c.portal.call(ctl.probe_once)
        c.portal.call(_dns_settled, ctl)
        assert records(route53, zone_id) == {}
        assert c.get("/v1/status", headers=auth()).json()["dns"]["deleted"]


async def _set_state(ctl: Any, bid: str, state: str) -> None:
    obj = await ctl.store.get("balancers", bid)
    obj["state"] = state
    await ctl.store.commit([("balancers", bid, obj)])


async def _dns_settled(ctl: Any) -> None:
    task = ctl._dns_task
    assert task is not None, "no automatic DNS sync was scheduled"
    await task
