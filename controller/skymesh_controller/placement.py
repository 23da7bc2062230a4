"""Which balancer serves which replica: pure functions of the stored state.

A replica has a home balancer. While the home is live it serves the replica; when it is
down, the geographically nearest live balancer does (SkyLB's recovery), and the replica
goes home as soon as its balancer is back.

Failover and planner moves respect ownership (:class:`Trust`, :func:`may_serve`): a
replica goes only behind a balancer of its own owner or of its home balancer's owner,
unless an admin allowed more (the replica is admin-owned, or the balancer's owner is a
shared pool in the config). Otherwise an agent could register a dead balancer, home its
replica there and let failover put it into another owner's live balancer, which would
then send that owner's clients' prompts to it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Obj = Mapping[str, Any]
EARTH_RADIUS_KM = 6371.0


def distance_km(a: Obj, b: Obj) -> float:
    """Great-circle (haversine) distance between two regions."""
    la1, lo1, la2, lo2 = map(math.radians, (a["latitude"], a["longitude"],
                                            b["latitude"], b["longitude"]))
    h = (math.sin((la2 - la1) / 2) ** 2
         + math.cos(la1) * math.cos(la2) * math.sin((lo2 - lo1) / 2) ** 2)
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def live(balancer: Obj) -> bool:
    # A registered balancer not yet probed counts as live: it just told us it exists.
    return balancer.get("state", "unknown") != "down"


@dataclass(frozen=True)
class Trust:
    """What an admin allowed beyond same-owner placement (token names, from the config).

    ``admins``: replicas these own may go behind any balancer (an admin registered them);
    ``shared``: balancers these own take any owner's replicas (an explicit shared pool).
    """

    admins: frozenset[str] = frozenset()
    shared: frozenset[str] = frozenset()


def may_serve(replica: Obj, bid: str, balancers: Mapping[str, Obj], trust: Trust) -> bool:
    """Whether balancer ``bid`` may serve ``replica`` in its membership."""
    b = balancers.get(bid)
    if b is None:
        return False
    owner = replica.get("owner")
    if owner in trust.admins or b.get("owner") in trust.shared:
        return True
    home = balancers.get(replica.get("balancer") or "")
    # The home's owner was allowed to serve it (an agent homes only at its own balancers,
    # an admin anywhere): its other balancers may too.
    return b.get("owner") in (owner, home.get("owner") if home is not None else owner)


def nearest_live(home: str, balancers: Mapping[str, Obj], regions: Mapping[str, Obj],
                 replica: Obj | None = None, trust: Trust = Trust()) -> str | None:
    """The live balancer closest to ``home``'s region (same region first, then by id)
    that may serve ``replica`` (by default one homed at ``home`` with its owner)."""
    if replica is None:
        replica = {"balancer": home, "owner": (balancers.get(home) or {}).get("owner")}
    origin = regions.get(balancers[home]["region"]) if home in balancers else None
    best: tuple[float, str] | None = None
    for bid, b in balancers.items():
        if bid == home or not live(b) or not may_serve(replica, bid, balancers, trust):
            continue
        region = regions.get(b["region"])
        if origin is None or region is None:
            d = math.inf
        else:
            d = 0.0 if b["region"] == origin["name"] else distance_km(origin, region)
        if best is None or (d, bid) < best:
            best = (d, bid)
    return best[1] if best else None


def assignments(balancers: Mapping[str, Obj], replicas: Mapping[str, Obj],
                regions: Mapping[str, Obj], trust: Trust = Trust()
                ) -> dict[str, str | None]:
    """replica id -> the balancer that should serve it now (None: no live balancer that
    may serve it)."""
    out: dict[str, str | None] = {}
    fallback: dict[tuple[str, Any], str | None] = {}
    for rid, rep in replicas.items():
        home = rep.get("balancer")
        if home is None or home not in balancers:
            out[rid] = None
        elif live(balancers[home]):
            out[rid] = home
        else:
            key = (home, rep.get("owner"))
            if key not in fallback:
                fallback[key] = nearest_live(home, balancers, regions, rep, trust)
            out[rid] = fallback[key]
    return out


def serving(replica: Obj) -> bool:
    """Whether a replica belongs in its balancer's membership."""
    return replica.get("state", "unknown") in ("unknown", "healthy")


def home_for(region: str, balancers: Mapping[str, Obj], replica: Obj | None = None,
             trust: Trust = Trust()) -> str | None:
    """A default home for a new replica: a balancer in its region (live first, then by id);
    with ``replica``, one that may serve it (a planner move keeps the replica's owner)."""
    here = sorted((not live(b), bid) for bid, b in balancers.items() if b["region"] == region
                  and (replica is None or may_serve(replica, bid, balancers, trust)))
    return here[0][1] if here else None


def shares(bid: str, assigned: str | None, balancers: Mapping[str, Obj]) -> bool:
    """Whether balancer ``bid`` serves a replica assigned to ``assigned``: every balancer
    of the assigned one's region with the same owner does (several balancers per region,
    for availability, share its replicas; each sees the others' admitted requests in the
    replica's load). The owner check keeps another agent from pulling a region's traffic
    onto a replica it homes at its own balancer there."""
    a, me = balancers.get(assigned or ""), balancers.get(bid)
    return (a is not None and me is not None and a["region"] == me["region"]
            and a.get("owner") == me.get("owner"))
