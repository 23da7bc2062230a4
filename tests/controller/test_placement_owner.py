"""Placement by ownership (issue #33, item 1): failover and planner moves put a replica
only behind a balancer of its owner (or of its home's owner), unless an admin allowed it."""

from __future__ import annotations

from typing import Any

import pytest

from skymesh_controller import placement
from skymesh_controller.placement import Trust

REGIONS = {"us": {"name": "us", "latitude": 38.9, "longitude": -77.0},
           "eu": {"name": "eu", "latitude": 53.3, "longitude": -6.3}}


def bal(region: str, owner: str | None, state: str = "up") -> dict[str, Any]:
    return {"region": region, "owner": owner, "state": state}


def rep(home: str | None, owner: str | None) -> dict[str, Any]:
    return {"balancer": home, "owner": owner}


# The attack: A's dead balancer in us homes A's replica; B's live balancer is in us too.
HIJACK = {"a-dead": bal("us", "A", "down"), "b-live": bal("us", "B")}


@pytest.mark.parametrize(("balancers", "replica", "trust", "want"), [
    # Another owner's live balancer never takes it, however near.
    (HIJACK, rep("a-dead", "A"), Trust(), None),
    # Its owner's own live balancer does, even one region away.
    ({**HIJACK, "a-eu": bal("eu", "A")}, rep("a-dead", "A"), Trust(), "a-eu"),
    # An admin-owned replica may go anywhere (an admin registered it).
    (HIJACK, rep("a-dead", "ops"), Trust(admins=frozenset({"ops"})), "b-live"),
    # B's balancers are a shared pool the admin named in the config.
    (HIJACK, rep("a-dead", "A"), Trust(shared=frozenset({"B"})), "b-live"),
    # An admin homed A's replica at B's (now dead) balancer: B's other balancers may serve.
    ({"b-dead": bal("us", "B", "down"), "b-eu": bal("eu", "B"), "c": bal("us", "C")},
     rep("b-dead", "A"), Trust(), "b-eu"),
    # Records from before owners existed (no owner anywhere) fail over as they always did.
    ({"x": bal("us", None, "down"), "y": bal("us", None)}, rep("x", None), Trust(), "y"),
])
def test_failover_target_respects_owner(balancers: dict[str, Any], replica: dict[str, Any],
                                        trust: Trust, want: str | None) -> None:
    assert placement.assignments(balancers, {"r": replica}, REGIONS, trust) == {"r": want}


def test_failover_decides_per_replica_owner_not_per_home() -> None:
    # Two replicas share a dead home, owned by different tokens: each gets its own answer.
    balancers = {"home": bal("us", "A", "down"), "a2": bal("eu", "A"), "b": bal("us", "B")}
    replicas = {"mine": rep("home", "A"), "admins": rep("home", "ops")}
    got = placement.assignments(balancers, replicas, REGIONS, Trust(admins=frozenset({"ops"})))
    assert got == {"mine": "a2", "admins": "b"}


def test_move_home_keeps_the_replica_owner() -> None:
    balancers = {"b-us": bal("us", "B"), "a-us": bal("us", "A", "down")}
    moving = rep(None, "A")
    # Down but A's own beats B's live one; without A's balancer there is no home at all.
    assert placement.home_for("us", balancers, moving) == "a-us"
    del balancers["a-us"]
    assert placement.home_for("us", balancers, moving) is None
    assert placement.home_for("us", balancers, moving, Trust(shared=frozenset({"B"}))) == "b-us"
    assert placement.home_for("us", balancers) == "b-us"  # no replica named: any, as before
