"""Failover placement: a down balancer's replicas go to the nearest live one, and back."""

from __future__ import annotations

from skymesh_controller import placement

REGIONS = {
    "us-east": {"name": "us-east", "latitude": 38.9, "longitude": -77.0},
    "us-west": {"name": "us-west", "latitude": 45.5, "longitude": -122.7},
    "eu-west": {"name": "eu-west", "latitude": 53.3, "longitude": -6.3},
    "ap-northeast": {"name": "ap-northeast", "latitude": 35.7, "longitude": 139.7},
}


def bal(region: str, state: str = "up") -> dict[str, str]:
    return {"region": region, "state": state}


def test_distance_matches_known_great_circles() -> None:
    # Washington DC to Dublin is about 5,460 km; to Tokyo about 10,900 km.
    assert 5300 < placement.distance_km(REGIONS["us-east"], REGIONS["eu-west"]) < 5600
    assert 10700 < placement.distance_km(REGIONS["us-east"], REGIONS["ap-northeast"]) < 11100
    assert placement.distance_km(REGIONS["eu-west"], REGIONS["eu-west"]) == 0


def test_nearest_live_prefers_same_region_then_distance() -> None:
    balancers = {"a": bal("us-east", "down"), "b": bal("eu-west"), "c": bal("us-west"),
                 "d": bal("ap-northeast")}
    assert placement.nearest_live("a", balancers, REGIONS) == "c"
    balancers["c"]["state"] = "down"
    assert placement.nearest_live("a", balancers, REGIONS) == "b"
    balancers["a2"] = bal("us-east")
    assert placement.nearest_live("a", balancers, REGIONS) == "a2"
    for b in balancers.values():
        b["state"] = "down"
    assert placement.nearest_live("a", balancers, REGIONS) is None


def test_assignments_follow_home_state() -> None:
    balancers = {"us": bal("us-east"), "eu": bal("eu-west"), "asia": bal("ap-northeast")}
    replicas = {"r1": {"balancer": "us"}, "r2": {"balancer": "us"}, "r3": {"balancer": "asia"},
                "r4": {"balancer": "gone"}, "r5": {"balancer": None}}
    assert placement.assignments(balancers, replicas, REGIONS) == {
        "r1": "us", "r2": "us", "r3": "asia", "r4": None, "r5": None}
    balancers["us"]["state"] = "down"
    moved = placement.assignments(balancers, replicas, REGIONS)
    assert moved["r1"] == moved["r2"] == "eu"  # Dublin is nearer DC than Tokyo
    balancers["us"]["state"] = "unknown"  # re-registered, not yet probed: home again
    assert placement.assignments(balancers, replicas, REGIONS)["r1"] == "us"


def test_serving_and_default_home() -> None:
    assert placement.serving({"state": "healthy"}) and placement.serving({})
    assert not placement.serving({"state": "draining"})
    assert not placement.serving({"state": "unhealthy"})
    balancers = {"b2": bal("us-east", "down"), "b1": bal("us-east", "down"),
                 "b3": bal("us-east")}
    assert placement.home_for("us-east", balancers) == "b3"
    assert placement.home_for("eu-west", balancers) is None
