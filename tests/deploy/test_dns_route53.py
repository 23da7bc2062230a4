"""The Route53 manager against moto's Route53 server on loopback (real boto3 calls)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from skymesh_controller.dns import Route53Manager, desired_state, make_hook

REGIONS = [
    {"name": "us-east", "latitude": 38.9, "longitude": -77.0, "cloud_region": "us-east-1"},
    {"name": "eu-west", "latitude": 53.3, "longitude": -6.3, "cloud_region": "eu-west-1"},
    {"name": "ap-ne", "latitude": 35.7, "longitude": 139.7, "cloud_region": "ap-northeast-1"},
]
ADDRS = {"lb-us": "54.0.0.5", "lb-eu": "34.1.0.5", "lb-ap": "13.2.0.5"}
HOME = {"lb-us": "us-east", "lb-eu": "eu-west", "lb-ap": "ap-ne"}


def balancers(**states: str) -> list[dict[str, Any]]:
    return [{"id": bid, "region": HOME[bid], "url": f"http://{ip}:8000",
             "state": states.get(bid, "up")} for bid, ip in ADDRS.items()]


def cfg_for(zone: tuple[str, str]) -> dict[str, Any]:
    return {"zone": zone[0], "record": "api." + zone[0], "ttl": 60}


def sync(route53: Any, zone: tuple[str, str], lbs: list[dict[str, Any]],
         dry_run: bool = False) -> dict[str, Any]:
    cfg = cfg_for(zone)
    return Route53Manager(route53, cfg).sync(desired_state(lbs, REGIONS, cfg),
                                             dry_run=dry_run).to_dict()


def latency_records(route53: Any, zone: tuple[str, str]) -> dict[str, dict[str, Any]]:
    rrs = route53.list_resource_record_sets(HostedZoneId=zone[1])["ResourceRecordSets"]
    return {r["SetIdentifier"]: r for r in rrs
            if r["Name"] == "api." + zone[0] and "SetIdentifier" in r}


def all_records(route53: Any, zone: tuple[str, str]) -> list[dict[str, Any]]:
    return route53.list_resource_record_sets(HostedZoneId=zone[1])["ResourceRecordSets"]


def checks(route53: Any) -> dict[str, dict[str, Any]]:
    return {h["Id"]: h for h in route53.list_health_checks()["HealthChecks"]}


def test_three_regions_get_latency_records_guarded_by_health_checks(
        route53: Any, zone: tuple[str, str]) -> None:
    report = sync(route53, zone, balancers())
    assert sorted(report["created"]) == ["lb-ap", "lb-eu", "lb-us"]
    assert sorted(report["health_checks_created"]) == ["lb-ap", "lb-eu", "lb-us"]
    assert report["errors"] == [] and report["dry_run"] is False
    recs = latency_records(route53, zone)
    assert {k: (r["Type"], r["Region"], r["TTL"], r["ResourceRecords"][0]["Value"])
            for k, r in recs.items()} == {
        "lb-us": ("A", "us-east-1", 60, "54.0.0.5"),
        "lb-eu": ("A", "eu-west-1", 60, "34.1.0.5"),
        "lb-ap": ("A", "ap-northeast-1", 60, "13.2.0.5")}
    hcs = checks(route53)
    for bid, rec in recs.items():
        hc = hcs[rec["HealthCheckId"]]["HealthCheckConfig"]
        assert (hc["IPAddress"], hc["Port"], hc["ResourcePath"], hc["Type"]) == (
            ADDRS[bid], 8000, "/health", "HTTP")
        tags = route53.list_tags_for_resource(ResourceType="healthcheck",
                                              ResourceId=rec["HealthCheckId"])
        got = {t["Key"]: t["Value"] for t in tags["ResourceTagSet"]["Tags"]}
        assert got["skymesh:balancer"] == bid and got["skymesh:record"] == "api." + zone[0]


def test_a_second_sync_changes_nothing(route53: Any, zone: tuple[str, str]) -> None:
    sync(route53, zone, balancers())
    before, hcs_before = all_records(route53, zone), checks(route53)
    report = sync(route53, zone, balancers())
    assert sorted(report["unchanged"]) == ["lb-ap", "lb-eu", "lb-us"]
    assert report["created"] == report["updated"] == report["deleted"] == []
    assert report["health_checks_created"] == report["health_checks_deleted"] == []
    assert all_records(route53, zone) == before
    assert checks(route53) == hcs_before


def test_a_moved_balancer_is_updated_and_its_old_check_replaced(
        route53: Any, zone: tuple[str, str]) -> None:
    sync(route53, zone, balancers())
    old_check = latency_records(route53, zone)["lb-eu"]["HealthCheckId"]
    lbs = balancers()
    lbs[1]["url"] = "http://34.1.0.99:9000"
    report = sync(route53, zone, lbs)
    assert report["updated"] == ["lb-eu"]
    assert report["health_checks_created"] == ["lb-eu"]
    assert report["health_checks_deleted"] == ["lb-eu"]
    rec = latency_records(route53, zone)["lb-eu"]
    assert rec["ResourceRecords"] == [{"Value": "34.1.0.99"}]
    hcs = checks(route53)
    assert old_check not in hcs
    assert hcs[rec["HealthCheckId"]]["HealthCheckConfig"]["Port"] == 9000


def test_failover_withdraws_the_dead_balancer_and_restores_it(
        route53: Any, zone: tuple[str, str]) -> None:
    sync(route53, zone, balancers())
    check_us = latency_records(route53, zone)["lb-us"]["HealthCheckId"]

    report = sync(route53, zone, balancers(**{"lb-us": "down"}))
    assert report["deleted"] == ["lb-us"]
    recs = latency_records(route53, zone)
    assert "lb-us" not in recs
    assert {r["Region"] for r in recs.values()} == {"eu-west-1", "ap-northeast-1"}
    assert report["health_checks_deleted"] == []
    assert check_us in checks(route53)   # kept while down (see skymesh_controller/dns.py)

    report = sync(route53, zone, balancers())
    assert report["created"] == ["lb-us"]
    assert report["health_checks_created"] == []
    recs = latency_records(route53, zone)
    assert set(recs) == {"lb-us", "lb-eu", "lb-ap"}
    assert recs["lb-us"]["HealthCheckId"] == check_us


def test_unknown_state_is_held_and_a_deregistered_balancer_is_removed(
        route53: Any, zone: tuple[str, str]) -> None:
    sync(route53, zone, balancers())
    before = latency_records(route53, zone)
    report = sync(route53, zone, balancers(**{"lb-ap": "unknown"}))
    assert "lb-ap" in report["unchanged"] and report["deleted"] == []
    assert latency_records(route53, zone)["lb-ap"] == before["lb-ap"]

    gone = before["lb-ap"]["HealthCheckId"]
    report = sync(route53, zone, [b for b in balancers() if b["id"] != "lb-ap"])
    assert report["deleted"] == ["lb-ap"] and report["health_checks_deleted"] == ["lb-ap"]
    assert "lb-ap" not in latency_records(route53, zone)
    assert gone not in checks(route53)


def test_records_and_checks_of_others_are_never_touched(
        route53: Any, zone: tuple[str, str]) -> None:
    foreign_hc = route53.create_health_check(
        CallerReference=uuid.uuid4().hex,
        HealthCheckConfig={"IPAddress": "52.9.9.9", "Port": 80, "Type": "HTTP",
                           "ResourcePath": "/"})["HealthCheck"]["Id"]
    name = "api." + zone[0]
    foreign = [
        {"Name": "www." + zone[0], "Type": "A", "TTL": 300,
         "ResourceRecords": [{"Value": "52.1.1.1"}]},
        # Someone else's latency record under the very same name.
        {"Name": name, "Type": "A", "TTL": 60, "SetIdentifier": "legacy-sa", "Region":
         "sa-east-1", "ResourceRecords": [{"Value": "52.9.9.9"}], "HealthCheckId": foreign_hc},
    ]
    route53.change_resource_record_sets(HostedZoneId=zone[1], ChangeBatch={"Changes": [
        {"Action": "CREATE", "ResourceRecordSet": r} for r in foreign]})

    sync(route53, zone, balancers())
    sync(route53, zone, balancers(**{"lb-us": "down", "lb-eu": "down"}))
    report = sync(route53, zone, [])
    assert sorted(report["deleted"]) == ["lb-ap"]

    left = all_records(route53, zone)
    for r in foreign:
        assert any(x["Name"] == r["Name"] and x.get("SetIdentifier") == r.get("SetIdentifier")
                   and x["ResourceRecords"] == r["ResourceRecords"] for x in left), r
    assert set(latency_records(route53, zone)) == {"legacy-sa"}
    assert foreign_hc in checks(route53)


def test_dry_run_reports_without_changing_anything(route53: Any,
                                                   zone: tuple[str, str]) -> None:
    before, hcs_before = all_records(route53, zone), checks(route53)
    report = sync(route53, zone, balancers(), dry_run=True)
    assert report["dry_run"] is True
    assert sorted(report["created"]) == ["lb-ap", "lb-eu", "lb-us"]
    assert sorted(report["health_checks_created"]) == ["lb-ap", "lb-eu", "lb-us"]
    assert all_records(route53, zone) == before
    assert checks(route53) == hcs_before

    sync(route53, zone, balancers())
    before, hcs_before = all_records(route53, zone), checks(route53)
    report = sync(route53, zone, balancers(**{"lb-eu": "down"}), dry_run=True)
    assert report["deleted"] == ["lb-eu"]
    assert all_records(route53, zone) == before and checks(route53) == hcs_before


def test_errors_are_reported_not_raised(route53: Any, zone: tuple[str, str]) -> None:
    regions = [*REGIONS, {"name": "lab", "latitude": 0, "longitude": 0, "cloud_region": None}]
    cfg = cfg_for(zone)
    lbs = [*balancers(), {"id": "lb-lab", "region": "lab", "url": "http://54.9.0.1",
                          "state": "up"}]
    report = Route53Manager(route53, cfg).sync(desired_state(lbs, regions, cfg)).to_dict()
    assert sorted(report["created"]) == ["lb-ap", "lb-eu", "lb-us"]
    assert len(report["errors"]) == 1 and "lb-lab" in report["errors"][0]

    missing = {"zone": "nope-" + zone[0], "record": "api.nope-" + zone[0]}
    report = Route53Manager(route53, missing).sync(
        desired_state(balancers(), REGIONS, missing)).to_dict()
    assert report["created"] == []
    assert report["errors"] == [f"no hosted zone named nope-{zone[0]}"]


async def test_the_controller_hook_syncs_through_a_worker_thread(
        moto_url: str, zone: tuple[str, str], route53: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The hook builds its own client from the default credential chain.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    hook = make_hook({**cfg_for(zone), "endpoint_url": moto_url})
    report = await hook(balancers(), REGIONS, False)
    assert sorted(report["created"]) == ["lb-ap", "lb-eu", "lb-us"]
    assert set(latency_records(route53, zone)) == {"lb-us", "lb-eu", "lb-ap"}


def test_a_weighted_record_of_a_known_balancer_becomes_a_latency_record(
        route53: Any, zone: tuple[str, str]) -> None:
    sync(route53, zone, [b for b in balancers() if b["id"] != "lb-us"])
    legacy = {"Name": "api." + zone[0], "Type": "A", "TTL": 300, "SetIdentifier": "lb-us",
              "Weight": 10, "ResourceRecords": [{"Value": "54.0.0.5"}]}
    route53.change_resource_record_sets(HostedZoneId=zone[1], ChangeBatch={"Changes": [
        {"Action": "UPSERT", "ResourceRecordSet": legacy}]})
    report = sync(route53, zone, balancers())
    assert report["updated"] == ["lb-us"] and report["errors"] == []
    rec = latency_records(route53, zone)["lb-us"]
    assert (rec["Region"], rec["TTL"], "Weight" in rec) == ("us-east-1", 60, False)


async def test_the_controllers_dns_hook_keeps_unknown_and_down_semantics(
        moto_url: str, zone: tuple[str, str], route53: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from skymesh_controller.config import ControllerConfig
    from skymesh_controller.dns_hook import dns_hook

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    hook = dns_hook(ControllerConfig.model_validate(
        {"dns": {**cfg_for(zone), "endpoint_url": moto_url}}))
    assert hook is not None
    assert sorted((await hook(balancers(), REGIONS, False))["created"]) == [
        "lb-ap", "lb-eu", "lb-us"]
    check_us = latency_records(route53, zone)["lb-us"]["HealthCheckId"]
    report = await hook(balancers(**{"lb-eu": "unknown", "lb-us": "down"}), REGIONS, False)
    assert report["deleted"] == ["lb-us"] and "lb-eu" in report["unchanged"]
    assert set(latency_records(route53, zone)) == {"lb-eu", "lb-ap"}
    assert check_us in checks(route53)
