"""Which balancer serves which replica: pure functions of the stored state.

A replica has a home balancer. While the home is live it serves the replica; when it is
down, the geographically nearest live balancer does (SkyLB's recovery), and the replica
goes home as soon as its balancer is back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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


def nearest_live(home: str, balancers: Mapping[str, Obj], regions: Mapping[str, Obj]
                 ) -> str | None:
    """The live balancer closest to ``home``'s region (same region first, then by id)."""
    origin = regions.get(balancers[home]["region"]) if home in balancers else None
    best: tuple[float, str] | None = None
    for bid, b in balancers.items():
        if bid == home or not live(b):
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
                regions: Mapping[str, Obj]) -> dict[str, str | None]:
    """replica id -> the balancer that should serve it now (None: no live balancer)."""
    out: dict[str, str | None] = {}
    fallback: dict[str, str | None] = {}
    for rid, rep in replicas.items():
        home = rep.get("balancer")
        if home is None or home not in balancers:
            out[rid] = None
        elif live(balancers[home]):
            out[rid] = home
        else:
            if home not in fallback:
                fallback[home] = nearest_live(home, balancers, regions)
            out[rid] = fallback[home]
    return out


def serving(replica: Obj) -> bool:
    """Whether a replica belongs in its balancer's membership."""
    return replica.get("state", "unknown") in ("unknown", "healthy")


def home_for(region: str, balancers: Mapping[str, Obj]) -> str | None:
    """A default home for a new replica: a balancer in its region (live first, then by id)."""
    here = sorted((not live(b), bid) for bid, b in balancers.items() if b["region"] == region)
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
