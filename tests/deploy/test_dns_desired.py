"""The pure half of the Route53 manager: which records and checks the zone should hold."""

from __future__ import annotations

from typing import Any

import pytest

from skymesh_controller.dns import DnsConfigError, DnsSettings, desired_records, desired_state

CFG = {"zone": "example.com.", "record": "api.example.com", "ttl": 60}
REGIONS = [
    {"name": "us-east", "latitude": 38.9, "longitude": -77.0, "cloud_region": "us-east-1"},
    {"name": "eu-west", "latitude": 53.3, "longitude": -6.3, "cloud_region": "eu-west-1"},
    {"name": "ap-ne", "latitude": 35.7, "longitude": 139.7, "cloud_region": "ap-northeast-1"},
    {"name": "lab", "latitude": 0.0, "longitude": 0.0, "cloud_region": None},
]


def lb(bid: str, region: str, url: str, state: str = "up") -> dict[str, Any]:
    return {"id": bid, "region": region, "url": url, "state": state, "policy": None}


def test_one_latency_record_per_up_balancer_with_its_check() -> None:
    got = desired_state([lb("lb-us", "us-east", "http://10.0.0.5:8000"),
                         lb("lb-eu", "eu-west", "http://10.1.0.5:8000"),
                         lb("lb-ap", "ap-ne", "http://10.2.0.5")], REGIONS, CFG)
    assert got.errors == ()
    by_id = {r.set_identifier: r for r in got.records}
    assert {k: (r.region, r.type, r.value, r.name, r.ttl) for k, r in by_id.items()} == {
        "lb-us": ("us-east-1", "A", "10.0.0.5", "api.example.com.", 60),
        "lb-eu": ("eu-west-1", "A", "10.1.0.5", "api.example.com.", 60),
        "lb-ap": ("ap-northeast-1", "A", "10.2.0.5", "api.example.com.", 60),
    }
    us = by_id["lb-us"].health_check.config()
    assert us == {"Type": "HTTP", "IPAddress": "10.0.0.5", "Port": 8000,
                  "ResourcePath": "/health", "RequestInterval": 30, "FailureThreshold": 3}
    assert by_id["lb-ap"].health_check.config()["Port"] == 80


def test_hostnames_are_cnames_https_checks_use_sni_ipv6_is_aaaa() -> None:
    got = desired_records([lb("lb-us", "us-east", "https://US-LB.example.net/")], REGIONS, CFG)
    (rec,) = got
    assert (rec.type, rec.value) == ("CNAME", "us-lb.example.net")
    assert rec.health_check.config() == {
        "Type": "HTTPS", "FullyQualifiedDomainName": "us-lb.example.net", "Port": 443,
        "ResourcePath": "/health", "RequestInterval": 30, "FailureThreshold": 3,
        "EnableSNI": True}
    (v6,) = desired_records([lb("lb-eu", "eu-west", "http://[2001:db8::5]:8080")], REGIONS, CFG)
    assert (v6.type, v6.value, v6.health_check.port) == ("AAAA", "2001:db8::5", 8080)


def test_down_is_withdrawn_with_its_check_kept_and_unknown_is_held() -> None:
    got = desired_state([lb("lb-us", "us-east", "http://10.0.0.5:8000", "down"),
                         lb("lb-eu", "eu-west", "http://10.1.0.5:8000", "unknown"),
                         lb("lb-ap", "ap-ne", "http://10.2.0.5:8000")], REGIONS, CFG)
    assert [r.set_identifier for r in got.records] == ["lb-ap"]
    assert [c.balancer_id for c in got.retained_checks] == ["lb-us"]
    assert got.held == frozenset({"lb-eu"})
    assert got.known == {"lb-us", "lb-eu", "lb-ap"}


def test_unroutable_balancers_are_errors_not_crashes() -> None:
    got = desired_state([lb("lb-lab", "lab", "http://10.9.0.1:8000"),
                         lb("lb-x", "nowhere", "http://10.9.0.2:8000"),
                         lb("lb-bad", "us-east", "ftp://10.9.0.3"),
                         lb("lb-us", "us-east", "http://10.0.0.5:8000")], REGIONS, CFG)
    assert [r.set_identifier for r in got.records] == ["lb-us"]
    assert len(got.errors) == 3
    text = " | ".join(got.errors)
    assert "lb-lab: region 'lab' has no cloud_region" in text
    assert "lb-x: region 'nowhere' is not registered" in text
    assert "lb-bad: url 'ftp://10.9.0.3'" in text


def test_a_cloud_region_route53_does_not_know_is_an_error() -> None:
    regions = [{"name": "moon", "latitude": 0, "longitude": 0, "cloud_region": "moon-base-1"}]
    got = desired_state([lb("lb-m", "moon", "http://10.0.0.1")], regions, CFG)
    assert got.records == ()
    assert "moon-base-1" in got.errors[0]


def test_cnames_cannot_share_the_name_with_addresses() -> None:
    got = desired_state([lb("lb-us", "us-east", "http://10.0.0.5:8000"),
                         lb("lb-eu", "eu-west", "http://eu.example.net:8000")], REGIONS, CFG)
    assert [r.set_identifier for r in got.records] == ["lb-us"]
    assert got.errors[0].startswith("lb-eu: ")


def test_objects_with_attributes_work_like_dicts() -> None:
    class Obj:
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    got = desired_records([Obj(id="lb-us", region="us-east", url="http://10.0.0.5", state="up")],
                          [Obj(name="us-east", cloud_region="us-east-1")], CFG)
    assert [(r.set_identifier, r.region) for r in got] == [("lb-us", "us-east-1")]


def test_settings_come_from_the_controllers_dns_config() -> None:
    from skymesh_controller.config import DnsConfig

    s = DnsSettings.of(DnsConfig(zone="example.com.", record="API.example.com", ttl=30))
    assert (s.name, s.ttl, s.health_check_path, s.aws_region) == (
        "api.example.com.", 30, "/health", "us-east-1")


@pytest.mark.parametrize(("cfg", "fragment"), [
    ({"zone": "example.com.", "record": "api.other.org"}, "not inside zone"),
    ({"record": "api.example.com"}, "zone_id"),
    ({"zone": "example.com.", "record": "api.example.com", "health_check_path": "health"},
     "must start with /"),
    ({"zone": "example.com.", "record": "api.example.com", "health_check_interval_s": 20},
     "10 or 30"),
])
def test_bad_settings_name_the_key(cfg: dict[str, Any], fragment: str) -> None:
    with pytest.raises(DnsConfigError, match=fragment):
        DnsSettings.of(cfg)
