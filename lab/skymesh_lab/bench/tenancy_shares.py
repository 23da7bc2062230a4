"""How close controller-pushed shares hold a tenant's limit across balancers and regions
(issue #37 item 2; docs/tenancy.md, "With a controller"). Pure, on a fake clock.

Three balancers, two in ``us`` and one in ``eu``; a tenant with a global
``requests_per_s`` limit, offered 3x the limit (Poisson), spread over the balancers
evenly, unevenly or skewed. The shares are the controller's own (``tenants.pushed`` over
the balancer records), merged and built into each balancer's limiter exactly as the live
balancer does (``tenant_push.merge``, ``limiter_of``). In the ``dies`` arm one ``us``
balancer dies halfway: its clients move to the other, and from the next push (``PUSH_S``
later) the live ones hold 1/2 each. Figures: admitted / limit, against the ideal under
equal shares (each balancer admits at most its share, and at most what reaches it).

    python -m skymesh_lab.bench.tenancy_shares --json out.json [--seeds 0,1,2,3,4]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.tenancy import Limiter, TenantLimited
from skymesh.balancer.tenant_push import limiter_of, merge
from skymesh_controller.tenants import pushed

LIMIT_RPS, OFFERED_X, RUN_S, PUSH_S = 30.0, 3.0, 120.0, 1.0
BALANCERS = (("us-a", "us"), ("us-b", "us"), ("eu-a", "eu"))
SPREADS: dict[str, tuple[float, ...]] = {
    "even": (1 / 3, 1 / 3, 1 / 3), "uneven": (0.5, 0.3, 0.2), "skewed": (0.8, 0.15, 0.05),
    "dies": (0.5, 0.3, 0.2)}
TENANT = {"name": "acme", "requests_per_s": LIMIT_RPS, "scope": "global",
          "keys_sha256": [], "weight": 1.0}


def _limiters(live: set[str], now: float, old: dict[str, Limiter]) -> dict[str, Limiter]:
    records = {bid: {"id": bid, "region": region, "state": "up" if bid in live else "down"}
               for bid, region in BALANCERS}
    out = {}
    for bid in live:
        merged = merge(TenantsConfig(), pushed({"acme": TENANT}, records[bid], records))
        out[bid] = limiter_of(merged, 1, now, old.get(bid))
    return out


def run(seed: int, spread: str) -> dict[str, Any]:
    rng = random.Random(seed)
    weights = SPREADS[spread]
    ids = [bid for bid, _ in BALANCERS]
    live = set(ids)
    lims = _limiters(live, 0.0, {})
    dead_at = RUN_S / 2 if spread == "dies" else None
    offered = dict.fromkeys(ids, 0)
    admitted = dict.fromkeys(ids, 0)
    phase_admitted = [0, 0]  # before and after the death (one phase without it)
    pushed_after = False
    now = rng.expovariate(LIMIT_RPS * OFFERED_X)
    while now < RUN_S:
        bid = rng.choices(ids, weights)[0]
        if dead_at is not None and now >= dead_at:
            if bid == "us-b":
                bid = "us-a"  # its clients reconnect to the other us balancer
            if not pushed_after and now >= dead_at + PUSH_S:
                live.discard("us-b")
                lims = _limiters(live, now, lims)
                pushed_after = True
        offered[bid] += 1
        try:
            lims[bid].admit("acme", 1, now, 0.0)
            admitted[bid] += 1
            phase_admitted[int(dead_at is not None and now >= dead_at)] += 1
        except TenantLimited:
            pass
        now += rng.expovariate(LIMIT_RPS * OFFERED_X)
    total = sum(admitted.values())
    # Equal shares admit at most min(what reaches a balancer, its share) at each.
    share = LIMIT_RPS / len(ids)
    ideal = sum(min(offered[b] / RUN_S, share) for b in ids) if dead_at is None else None
    out: dict[str, Any] = {
        "seed": seed, "spread": spread, "limit_per_s": LIMIT_RPS,
        "offered_per_s": sum(offered.values()) / RUN_S, "admitted_per_s": total / RUN_S,
        "admitted_over_limit": total / RUN_S / LIMIT_RPS,
        "ideal_over_limit": None if ideal is None else ideal / LIMIT_RPS,
        "per_balancer_admitted_per_s": {b: admitted[b] / RUN_S for b in ids}}
    if dead_at is not None:
        out["before_death_over_limit"] = phase_admitted[0] / dead_at / LIMIT_RPS
        out["after_death_over_limit"] = phase_admitted[1] / (RUN_S - dead_at) / LIMIT_RPS
    return out


def doc_of(seeds: list[int]) -> dict[str, Any]:
    started = time.monotonic()
    runs = [run(s, spread) for s in seeds for spread in SPREADS]
    return {"setup": {"balancers": [list(b) for b in BALANCERS], "limit_per_s": LIMIT_RPS,
                      "offered_x": OFFERED_X, "run_s": RUN_S, "push_s": PUSH_S,
                      "spreads": {k: list(v) for k, v in SPREADS.items()}, "seeds": seeds},
            "runs": runs, "wall_seconds": round(time.monotonic() - started, 1),
            "date": datetime.now(UTC).strftime("%Y-%m-%d")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    args = ap.parse_args(argv)
    doc = doc_of([int(s) for s in args.seeds.split(",")])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc["runs"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
