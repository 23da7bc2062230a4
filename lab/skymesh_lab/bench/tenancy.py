"""What the balancer's tenancy (skymesh.balancer.tenancy, docs/tenancy.md) does, in the
simulator with the live balancer's ``FairQueue`` and release rule (``SimBalancer.tenancy``)
and, for the limits, with the pure buckets on a fake clock:

- ``flood``: an interactive tenant at a steady rate beside a batch tenant that floods the
  region at once; the interactive TTFT with first come first served, with the fair queue,
  and with no flood at all; the batch tenant's completions; the batch class's longest wait.
- ``share``: two tenants of equal weight in one class, one sending 10x the other, both
  backlogged from the start; the service (prompt + output tokens finished) each received
  per window while both were backlogged, FCFS against the fair queue.
- ``limits``: a tenant at 3x its ``requests_per_s`` through two balancers (each holds half
  the limit), spread evenly and all to one; the admitted rate against the limit.

    python -m skymesh_lab.bench.tenancy --json out.json [--seeds 0,1,2,3,4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from skymesh.balancer.tenancy import FairQueue, Limiter, Tenant, TenantLimited, Waiter
from skymesh_lab.sim.cluster import RequestRecord, SimTenancy
from skymesh_lab.sim.runner import SimConfig, Simulation
from skymesh_lab.sim.workload import Arrival, WorkItem, Workload
from skymesh_replica.engine.hashing import BLOCK_SIZE, hash_token_blocks

CLASSES = ("interactive", "standard", "batch")
MAX_WAIT_S = {"standard": 10.0, "batch": 60.0}  # the configuration's defaults
FLOOD, STEADY, RATE = 600, 60, 2.0
HEAVY, LIGHT, WINDOW_S = 1000, 100, 5.0
LIMIT_RPS, OFFERED_X, LIMIT_RUN_S = 10.0, 3.0, 60.0


def _item(rng: random.Random, rid: str, prompt: int, output: int) -> WorkItem:
    toks = [rng.randrange(150_000) for _ in range(prompt)]
    return WorkItem(rid, "us", len(toks), output, hash_token_blocks(toks, BLOCK_SIZE))


class _Arrivals(Workload):
    def __init__(self, arrivals: list[Arrival]) -> None:
        self.arrivals = sorted(arrivals, key=lambda a: a[0])

    def initial(self) -> Iterator[Arrival]:
        yield from self.arrivals


class _WatchedQueue(FairQueue):
    """The fair queue, noting per class the longest wait from arrival to release and the
    longest time the class went unserved while it had a waiter (what the aging guard
    bounds: its head's wait, not the wait behind its own backlog)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.longest: dict[str, float] = {}
        self.head: dict[str, float] = {}
        self._served: dict[str, float] = {}

    def pop(self, model: str, now: float) -> Waiter | None:
        w = super().pop(model, now)
        if w is not None:
            self.longest[w.cls] = max(self.longest.get(w.cls, 0.0), now - w.since)
            became_head = max(w.since, self._served.get(w.cls, 0.0))
            self.head[w.cls] = max(self.head.get(w.cls, 0.0), now - became_head)
            self._served[w.cls] = now
        return w


def _sim(arrivals: list[Arrival], classify: Any, fair: bool,
         seed: int) -> tuple[Simulation, _WatchedQueue | None]:
    cfg = SimConfig(regions=["us"], replicas={"us": 2}, policy="least-load",
                    push_mode="sp-p", forwarding=False, seed=seed)
    sim = Simulation(cfg, _Arrivals(arrivals))
    queue = None
    if fair:
        queue = _WatchedQueue(CLASSES, max_wait_s=MAX_WAIT_S, capacity=100_000)
        sim.balancers["us"].tenancy = SimTenancy(queue, classify)
    sim.run()
    return sim, queue


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _tenant_of_id(rec: RequestRecord) -> str:
    return rec.item.request_id.split("-")[0]


def flood_run(seed: int, arm: str) -> dict[str, Any]:
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    if arm != "no_flood":
        arrivals += [(0.001 * i, _item(rng, f"bulk-{i}", 400, 200)) for i in range(FLOOD)]
    t = 0.5
    for i in range(STEADY):
        arrivals.append((t, _item(rng, f"web-{i}", 200, 50)))
        t += rng.expovariate(RATE)

    def classify(rec: RequestRecord) -> tuple[str, str]:
        return ("web", "interactive") if _tenant_of_id(rec) == "web" else ("bulk", "batch")

    sim, queue = _sim(arrivals, classify, arm == "fair", seed)
    web = [r for r in sim.records if _tenant_of_id(r) == "web"]
    bulk = [r for r in sim.records if _tenant_of_id(r) == "bulk"]
    ttft = [r.t_first - r.t_arrival for r in web if r.ok]
    done = [r for r in bulk if r.ok]
    end = max((r.t_done for r in done), default=0.0)
    out: dict[str, Any] = {
        "seed": seed, "arm": arm, "interactive_sent": len(web),
        "interactive_ok": len(ttft), "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": _pct(ttft, 0.99), "batch_sent": FLOOD if arm != "no_flood" else 0,
        "batch_completed": len(done), "batch_last_done_s": end,
        "batch_tokens_per_s": (sum(r.item.prompt_len + r.item.output_len for r in done) / end
                               if end else None)}
    if queue is not None:
        out["batch_longest_wait_s"] = queue.longest.get("batch", 0.0)
        out["batch_longest_unserved_s"] = queue.head.get("batch", 0.0)
    return out


def share_run(seed: int, fair: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    arrivals: list[Arrival] = [(0.001 * i, _item(rng, f"heavy-{i}", 300, 100))
                               for i in range(HEAVY)]
    arrivals += [(0.01 * i + 0.0005, _item(rng, f"light-{i}", 300, 100)) for i in range(LIGHT)]
    sim, _ = _sim(arrivals, lambda rec: (_tenant_of_id(rec), "standard"), fair, seed)
    ok = [r for r in sim.records if r.ok]
    # Both backlogged until the light tenant's last request finished (it has the fewer).
    until = max(r.t_done for r in ok if _tenant_of_id(r) == "light")
    windows: dict[int, dict[str, float]] = {}
    for r in ok:
        if r.t_done <= until:
            w = windows.setdefault(int(r.t_done // WINDOW_S), {"heavy": 0.0, "light": 0.0})
            w[_tenant_of_id(r)] += r.item.prompt_len + r.item.output_len
    full = [w for k, w in sorted(windows.items()) if (k + 1) * WINDOW_S <= until]
    shares = [w["light"] / (w["heavy"] + w["light"]) for w in full if w["heavy"] + w["light"]]
    light = sum(w["light"] for w in full)
    total = sum(w["heavy"] + w["light"] for w in full)
    return {"seed": seed, "arm": "fair" if fair else "fcfs", "both_backlogged_s": until,
            "windows": len(full), "light_share": light / total if total else None,
            "light_share_window_min": min(shares, default=None),
            "light_share_window_max": max(shares, default=None)}


def limit_run(seed: int, spread: str) -> dict[str, Any]:
    rng = random.Random(seed)
    tenant = Tenant("a", "standard", CLASSES, requests_per_s=LIMIT_RPS)
    lbs = [Limiter([tenant], share=2, now=0.0) for _ in range(2)]
    offered = admitted = 0
    now = rng.expovariate(LIMIT_RPS * OFFERED_X)
    while now < LIMIT_RUN_S:
        lb = lbs[offered % 2] if spread == "even" else lbs[0]
        offered += 1
        try:
            lb.admit("a", 1, now, 0.0)
            admitted += 1
        except TenantLimited:
            pass
        now += rng.expovariate(LIMIT_RPS * OFFERED_X)
    return {"seed": seed, "spread": spread, "offered_per_s": offered / LIMIT_RUN_S,
            "admitted_per_s": admitted / LIMIT_RUN_S, "limit_per_s": LIMIT_RPS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.monotonic()
    doc: dict[str, Any] = {
        "setup": {"replicas": 2, "policy": "least-load", "push_mode": "sp-p",
                  "flood": FLOOD, "steady": STEADY, "steady_rate_per_s": RATE,
                  "max_wait_s": MAX_WAIT_S, "heavy": HEAVY, "light": LIGHT,
                  "window_s": WINDOW_S, "limit_per_s": LIMIT_RPS, "offered_x": OFFERED_X,
                  "limit_run_s": LIMIT_RUN_S, "seeds": seeds},
        "flood": [flood_run(s, arm) for s in seeds for arm in ("no_flood", "fcfs", "fair")],
        "share": [share_run(s, fair) for s in seeds for fair in (False, True)],
        "limits": [limit_run(s, spread) for s in seeds for spread in ("even", "one")],
    }
    doc["wall_seconds"] = round(time.monotonic() - t0, 1)
    doc["date"] = datetime.now(UTC).strftime("%Y-%m-%d")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("flood", "share", "limits")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
