"""How close controller-pushed shares hold a tenant's limit across balancers and regions
(issue #37 item 2; docs/tenancy.md, "With a controller"). Pure, on a fake clock.

Three balancers, two in ``us`` and one in ``eu``; a tenant with a global
``requests_per_s`` limit, offered 3x the limit (Poisson), spread over the balancers
evenly (round-robin), unevenly, 90/10, all to one, or shifting from even to all to one
halfway. Two ways to split the limit, each run on the same arrivals:

- ``equal``: each live balancer holds ``1/n`` (the controller's ``share``);
- ``weighted``: every ``REPORT_S`` (the balancer's ``telemetry_interval_s``) each balancer
  reports the demand its limiter counted (``Demand``: admitted and refused, smoothed)
  and the controller answers with its fraction (``tenants.pushed`` over the reports, with
  the default floor), which the balancer builds into its limiter (``merge``,
  ``limiter_of``): the controller's and the balancer's own code, only the HTTP left out.

In the ``dies`` arm one ``us`` balancer dies halfway: its clients move to the other, and
from the next push (``PUSH_S`` later) the live ones split the limit. Figures: admitted /
limit over the run and after the split converged, per report window, and how many
reports it takes for every later window to be within 10% of the limit; for equal shares
the ideal too (each balancer admits at most its share, and at most what reaches it).

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
from skymesh.balancer.tenant_limits import Limiter, TenantLimited
from skymesh.balancer.tenant_push import limiter_of, merge
from skymesh_controller.tenants import DEFAULT_FLOOR, pushed

LIMIT_RPS, OFFERED_X, RUN_S, PUSH_S, REPORT_S = 30.0, 3.0, 120.0, 1.0, 5.0
TOLERANCE = 0.10
BALANCERS = (("us-a", "us"), ("us-b", "us"), ("eu-a", "eu"))
EVEN = (1 / 3, 1 / 3, 1 / 3)
SPREADS: dict[str, tuple[float, ...]] = {
    "even": EVEN, "uneven": (0.5, 0.3, 0.2), "90/10": (0.9, 0.1, 0.0),
    "skewed": (0.8, 0.15, 0.05), "one": (1.0, 0.0, 0.0), "shift": EVEN,
    "dies": (0.5, 0.3, 0.2)}
SHIFT_TO = (1.0, 0.0, 0.0)  # the shift arm's spread from halfway
SPLITS = ("equal", "weighted")
TENANT = {"name": "acme", "requests_per_s": LIMIT_RPS, "scope": "global",
          "keys_sha256": [], "weight": 1.0}


def _limiters(live: set[str], now: float, old: dict[str, Limiter],
              demand: dict[str, dict[str, tuple[float, float]]] | None) -> dict[str, Limiter]:
    records = {bid: {"id": bid, "region": region, "state": "up" if bid in live else "down"}
               for bid, region in BALANCERS}
    out = {}
    for bid in live:
        merged = merge(TenantsConfig(), pushed({"acme": TENANT}, records[bid], records,
                                               demand, DEFAULT_FLOOR))
        out[bid] = limiter_of(merged, 1, now, old.get(bid))
    return out


def _converged_after(windows: list[float], start: int) -> int | None:
    """Reports after window ``start`` until every later window is within the tolerance."""
    for k in range(start, len(windows)):
        if all(abs(w - 1.0) <= TOLERANCE for w in windows[k:]):
            return k - start
    return None


def run(seed: int, spread: str, split: str) -> dict[str, Any]:
    rng = random.Random(seed)
    ids = [bid for bid, _ in BALANCERS]
    live = set(ids)
    weighted = split == "weighted"
    reports: dict[str, dict[str, tuple[float, float]]] | None = {} if weighted else None
    lims = _limiters(live, 0.0, {}, reports)
    half = RUN_S / 2
    dead_at = half if spread == "dies" else None
    offered = dict.fromkeys(ids, 0)
    admitted = dict.fromkeys(ids, 0)
    windows = [0] * int(RUN_S / REPORT_S)
    phase_admitted = [0, 0]  # before and after halfway
    pushed_after = False
    next_report = REPORT_S
    now = rng.expovariate(LIMIT_RPS * OFFERED_X)
    while now < RUN_S:
        while weighted and now >= next_report:  # the telemetry round trip
            reports = {b: lims[b].demand.rates(next_report) for b in live}
            lims = _limiters(live, next_report, lims, reports)
            next_report += REPORT_S
        weights = SHIFT_TO if spread == "shift" and now >= half else SPREADS[spread]
        bid = rng.choices(ids, weights)[0]
        if dead_at is not None and now >= dead_at:
            if bid == "us-b":
                bid = "us-a"  # its clients reconnect to the other us balancer
            if not pushed_after and now >= dead_at + PUSH_S:
                live.discard("us-b")
                lims = _limiters(live, now, lims, reports)  # the reports stored so far
                pushed_after = True
        offered[bid] += 1
        try:
            lims[bid].admit("acme", 1, now, 0.0)
            admitted[bid] += 1
            phase_admitted[int(now >= half)] += 1
            windows[int(now / REPORT_S)] += 1
        except TenantLimited:
            pass
        now += rng.expovariate(LIMIT_RPS * OFFERED_X)
    total = sum(admitted.values())
    # Equal shares admit at most min(what reaches a balancer, its share) at each.
    share = LIMIT_RPS / len(ids)
    ideal = (sum(min(offered[b] / RUN_S, share) for b in ids) / LIMIT_RPS
             if split == "equal" and spread not in ("dies", "shift") else None)
    per_window = [w / REPORT_S / LIMIT_RPS for w in windows]
    settle = _converged_after(per_window, 0)
    out: dict[str, Any] = {
        "seed": seed, "spread": spread, "split": split, "limit_per_s": LIMIT_RPS,
        "offered_per_s": sum(offered.values()) / RUN_S, "admitted_per_s": total / RUN_S,
        "admitted_over_limit": total / RUN_S / LIMIT_RPS, "ideal_over_limit": ideal,
        "per_balancer_admitted_per_s": {b: admitted[b] / RUN_S for b in ids},
        "window_over_limit": per_window,
        "reports_to_converge": settle,
        "converged_over_limit": (sum(per_window[settle:]) / len(per_window[settle:])
                                 if settle is not None else None),
        "worst_window_after": (max(abs(w - 1.0) for w in per_window[settle:])
                               if settle is not None else None)}
    if spread in ("dies", "shift"):
        out["before_over_limit"] = phase_admitted[0] / half / LIMIT_RPS
        out["after_over_limit"] = phase_admitted[1] / (RUN_S - half) / LIMIT_RPS
        out["reports_to_converge_after"] = _converged_after(per_window, int(half / REPORT_S))
    return out


def doc_of(seeds: list[int]) -> dict[str, Any]:
    started = time.monotonic()
    runs = [run(s, spread, split) for s in seeds for spread in SPREADS for split in SPLITS]
    return {"setup": {"balancers": [list(b) for b in BALANCERS], "limit_per_s": LIMIT_RPS,
                      "offered_x": OFFERED_X, "run_s": RUN_S, "push_s": PUSH_S,
                      "report_s": REPORT_S, "floor": DEFAULT_FLOOR, "tolerance": TOLERANCE,
                      "spreads": {k: list(v) for k, v in SPREADS.items()},
                      "shift_to": list(SHIFT_TO), "seeds": seeds},
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
    for r in doc["runs"]:
        print(f"{r['spread']:>7} {r['split']:>8} seed {r['seed']}: "
              f"{r['admitted_over_limit']:.1%} of the limit, converged after "
              f"{r['reports_to_converge']} reports")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
